"""The draft-model proposer: a smaller model that shares the tokenizer guesses greedily.

The draft keeps its own KV cache beside the target's: the same block size and as many blocks
as the target pool (a request that fits the target fits the draft), in tensors shaped for the
draft's layers, with a plain block pool of its own (no prefix caching: a draft's KV is cheap to
recompute). Per request it remembers how far its cache is valid; tokens never change under a
request, so the cache stays valid across steps and preemptions except for guesses the target
rejected, which are recomputed. Each step runs ``1 + (k - 1)`` draft forwards for the whole
batch: one that catches every request up to its newest token and yields guess 0, then one per
further guess. Guesses are the draft's argmax (point masses; see ``engine/sampler.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from engine.attention import AttentionMetadata
from engine.block_pool import BlockPool, KVBlock
from engine.model_loader import LoadedModel
from engine.request import Request


@dataclass
class _DraftSequence:
    """What the draft cache holds of one request: KV of ``tokens[:num_computed]``, where the
    positions from ``guess_start`` on hold the draft's own last guesses."""

    blocks: list[KVBlock] = field(default_factory=list)
    num_computed: int = 0
    guess_start: int = 0
    guess: list[int] = field(default_factory=list)


class DraftModelProposer:
    """Greedy guesses from a draft model with its own paged KV cache. Engine thread only."""

    def __init__(
        self, draft: LoadedModel, target: LoadedModel, block_size: int, num_blocks: int
    ) -> None:
        if draft.tokenizer.get_vocab() != target.tokenizer.get_vocab():
            raise ValueError(
                f"--speculative-config: the draft model {draft.name!r} does not share the "
                f"target's tokenizer"
            )
        self.model = draft.model
        self.device = draft.device
        self.block_size = block_size
        self.vocab_size = min(draft.config.vocab_size, target.config.vocab_size)
        self.max_len = draft.config.max_position_embeddings
        cfg = draft.config
        shape = (2, num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
        self.kv_caches = [
            torch.zeros(shape, dtype=draft.dtype, device=draft.device)
            for _ in range(cfg.num_hidden_layers)
        ]
        self.pool = BlockPool(num_blocks, enable_caching=False)
        self._seqs: dict[str, _DraftSequence] = {}

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_used

    def forget(self, request_id: str) -> None:
        seq = self._seqs.pop(request_id, None)
        if seq is not None and seq.blocks:
            self.pool.free_blocks(seq.blocks)

    def propose(self, requests: Sequence[Request], num_tokens: Sequence[int]) -> list[list[int]]:
        guesses: list[list[int]] = [[] for _ in requests]
        live = [i for i, req in enumerate(requests) if self._prepare(req, num_tokens[i])]
        if not live:
            return guesses
        # Forward 1: catch each request up to its newest token; its last row gives guess 0.
        feeds = []
        for i in live:
            req, seq = requests[i], self._seqs[requests[i].request_id]
            feeds.append((seq, req.all_token_ids[seq.num_computed :], seq.num_computed))
        while live:
            still = []
            for i, token in zip(live, self._forward(feeds), strict=True):
                if token >= self.vocab_size:  # outside the target's vocabulary: stop guessing
                    continue
                guesses[i].append(token)
                if len(guesses[i]) < num_tokens[i]:
                    still.append(i)
            live = still
            # Forwards 2..k: feed each request's newest guess to get the next one.
            feeds = []
            for i in live:
                seq = self._seqs[requests[i].request_id]
                feeds.append((seq, [guesses[i][-1]], seq.num_computed))
        for req, guess in zip(requests, guesses, strict=True):
            state = self._seqs.get(req.request_id)
            if state is not None:
                state.guess_start, state.guess = req.num_tokens, guess
        return guesses

    def _prepare(self, req: Request, k: int) -> bool:
        """Reconcile the request's draft cache with its tokens and give it slots for ``k``
        guesses; False (no guess this step) if the draft pool or context is short."""
        seq = self._seqs.get(req.request_id)
        if seq is None:
            seq = self._seqs[req.request_id] = _DraftSequence()
        if seq.guess:  # keep the KV of the guesses the target accepted, drop the rest
            tokens = req.all_token_ids
            valid = seq.guess_start
            for token in seq.guess:
                if valid >= len(tokens) - 1 or tokens[valid] != token:
                    break
                valid += 1
            seq.num_computed = min(seq.num_computed, valid)
            seq.guess = []
        seq.num_computed = min(seq.num_computed, req.num_tokens - 1)
        last_position = req.num_tokens - 1 + k - 1
        if last_position >= self.max_len:
            return False
        num_blocks = last_position // self.block_size + 1 - len(seq.blocks)
        if num_blocks > self.pool.num_free:
            return False
        if num_blocks > 0:
            seq.blocks.extend(self.pool.get_new_blocks(num_blocks))
        return True

    def _forward(self, feeds: list[tuple[_DraftSequence, list[int], int]]) -> list[int]:
        """Run each (sequence, new tokens, first position) through the draft; return the
        argmax after each one's last token and advance its ``num_computed``."""
        token_ids: list[int] = []
        positions: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        for seq, tokens, start in feeds:
            token_ids.extend(tokens)
            positions.extend(range(start, start + len(tokens)))
            query_lens.append(len(tokens))
            seq_lens.append(start + len(tokens))
            tables.append([b.block_id for b in seq.blocks])
            seq.num_computed = start + len(tokens)
        meta = AttentionMetadata.build(query_lens, seq_lens, tables, self.block_size, self.device)
        input_ids = torch.tensor(token_ids, dtype=torch.int64, device=self.device)
        pos = torch.tensor(positions, dtype=torch.int64, device=self.device)
        last_rows = torch.cumsum(torch.tensor(query_lens, device=self.device), 0) - 1
        with torch.inference_mode():
            hidden = self.model(input_ids, pos, self.kv_caches, meta)
            logits = self.model.compute_logits(hidden.index_select(0, last_rows))
        return logits.argmax(dim=-1).tolist()
