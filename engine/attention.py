"""Attention over the paged KV cache, and the per-step metadata every layer receives.

The model runner builds one :class:`AttentionMetadata` per step and passes it explicitly down
to every attention layer (no module-level "context"). :func:`attend_paged` attends each
request's queries to its whole context, whose new K/V rows the layer has already written
(:func:`engine.kernels.rope_write_kv`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine import kernels

# Steps of at most this many tokens build their slot mapping in plain Python.
_SMALL_STEP = 64


@dataclass
class AttentionMetadata:
    """Where this step's tokens go in the paged cache and which context each request sees.

    Tokens are flattened request by request: request ``i`` owns rows
    ``query_start_loc[i]:query_start_loc[i+1]``, which are the LAST ``query_lens_cpu[i]``
    positions of its ``seq_lens_cpu[i]`` context tokens. Block tables are padded with 0.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot for each new token
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32: cumulative new-token counts
    seq_lens: torch.Tensor  # [num_reqs] int32: context length after this step
    block_tables: torch.Tensor  # [num_reqs, max_blocks] int32, padded with 0
    max_query_len: int
    max_seq_len: int
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens_cpu)

    @classmethod
    def build(
        cls,
        query_lens: Sequence[int],
        seq_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """Metadata for requests with the given new-token counts, context lengths and tables.

        The slot of each new token follows the cache layout contract:
        ``block_table[p // block_size] * block_size + p % block_size``.
        """
        if not (len(query_lens) == len(seq_lens) == len(block_tables)):
            raise ValueError("query_lens, seq_lens and block_tables need one entry per request")
        for q_len, s_len, table in zip(query_lens, seq_lens, block_tables, strict=True):
            if q_len < 1 or q_len > s_len:
                raise ValueError(f"query length {q_len} must be in [1, seq_len={s_len}]")
            if len(table) * block_size < s_len:
                raise ValueError(f"block table of {len(table)} blocks cannot hold {s_len} tokens")
        width = max((len(t) for t in block_tables), default=0)
        padded = [list(t) + [0] * (width - len(t)) for t in block_tables]
        tables = torch.tensor(padded, dtype=torch.int32).view(-1, width)
        num_tokens = sum(query_lens)
        if num_tokens <= _SMALL_STEP:
            # Decode-sized steps: plain Python beats a dozen small tensor ops (every step of
            # one stream pays this).
            start_list, slot_list = [0], []
            for q_len, s_len, table in zip(query_lens, seq_lens, block_tables, strict=True):
                start_list.append(start_list[-1] + q_len)
                for p in range(s_len - q_len, s_len):
                    slot_list.append(table[p // block_size] * block_size + p % block_size)
            starts = torch.tensor(start_list, dtype=torch.int32)
            slots = torch.tensor(slot_list, dtype=torch.int64)
            s_lens = torch.tensor(list(seq_lens), dtype=torch.int32)
        else:
            q_lens = torch.tensor(list(query_lens), dtype=torch.int64)
            s_lens = torch.tensor(list(seq_lens), dtype=torch.int64)
            starts = torch.zeros(len(query_lens) + 1, dtype=torch.int64)
            torch.cumsum(q_lens, 0, out=starts[1:])
            # Slot of every new token, vectorized: its request, its absolute position, its block.
            owner = torch.repeat_interleave(torch.arange(len(query_lens)), q_lens)
            pos = torch.arange(num_tokens) - starts[owner] + (s_lens - q_lens)[owner]
            slots = tables[owner, pos // block_size].to(torch.int64) * block_size + pos % block_size
        return cls(
            slot_mapping=slots.to(device),
            query_start_loc=starts.to(device=device, dtype=torch.int32),
            seq_lens=s_lens.to(device=device, dtype=torch.int32),
            block_tables=tables.to(device),
            max_query_len=max(query_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
            query_lens_cpu=list(query_lens),
            seq_lens_cpu=list(seq_lens),
        )


def attend_paged(
    query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Attend ``query`` ([T, heads, d]) to each request's context, already in ``kv_cache``."""
    return kernels.paged_attention(
        query,
        kv_cache,
        meta.block_tables,
        meta.query_start_loc,
        meta.seq_lens,
        scale,
        meta.query_lens_cpu,
        meta.seq_lens_cpu,
    )
