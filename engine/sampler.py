"""Batched sampling: one call turns the ``[N, vocab]`` logits of a step into N token ids.

The order of processing for each row (the same as vLLM's):

0. a row with a grammar (structured outputs) keeps only the tokens its bitmask allows;
1. ``logit_bias`` is added; while fewer than ``min_tokens`` tokens were produced, EOS and
   ``stop_token_ids`` are forbidden;
2. penalties: ``repetition_penalty`` over prompt + output tokens (divide positive logits,
   multiply negative ones, as Hugging Face and vLLM do), ``frequency_penalty`` (times the count)
   and ``presence_penalty`` (once) over output tokens only;
3. temperature (greedy rows keep their logits);
4. **logprobs** are read here: the log-softmax of this processed distribution, before the
   truncation masks (what vLLM calls processed logprobs);
5. top-k, top-p and min-p masks, then sampling.

Greedy rows take the argmax of the processed logits. Random rows use the exponential race
(``argmax(p / q)`` with ``q ~ Exp(1)``, equivalent to sampling from ``p``). A row with a
``seed`` draws its ``q`` from its own generator seeded with ``(seed, output position)``, so its
text does not depend on what else is in the batch, nor on preemption and recompute. When every
row is greedy with nothing to process, the whole step is one ``argmax``.

Speculative decoding (:meth:`Sampler.verify`): a request that fed ``k`` guesses has ``k + 1``
logits rows; row ``j`` is sampled exactly as the plain path would sample output position
``len(output) + j`` had the guesses before it been generated (same processing, same seeded
draw), and the guesses are accepted while they equal those samples. The proposers' guesses are
point masses (``q(d) = 1``), for which the standard rule "accept ``d`` with probability
``min(1, p(d) / q(d))``, else resample from ``normalize(max(0, p - q))``" is: accept with
probability ``p(d)``, else draw from ``p`` without ``d``. Drawing ``t ~ p`` and accepting iff
``t == d`` is that rule (``P(t = d) = p(d)``; given ``t != d``, ``t`` follows ``p`` without
``d``), so every emitted token follows the target's distribution, and greedy and seeded rows
emit exactly what they would have emitted without speculation.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from engine.outputs import TokenLogprob

_GREEDY_EPS = 1e-5


class SamplingRow(Protocol):
    """What the sampler reads of a request (``engine.request.Request`` satisfies it)."""

    sampling_params: Any
    prompt_token_ids: list[int]
    output_token_ids: list[int]


@dataclass(slots=True)
class _GuessRow:
    """Row ``j`` of a request verifying guesses: its output as if guesses[:j] were generated."""

    sampling_params: Any
    prompt_token_ids: list[int]
    output_token_ids: list[int]


@dataclass
class VerifyOutput:
    """Per request: the tokens to append (accepted guesses, then the target's own token), their
    logprobs where asked for, and how many guesses were accepted."""

    token_ids: list[list[int]]
    logprobs: list[list[TokenLogprob | None]]
    num_accepted: list[int]


@dataclass
class SamplerOutput:
    """The sampled token of each row, and its logprobs where the row asked for them."""

    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


def is_greedy(params: Any) -> bool:
    return float(params.temperature) < _GREEDY_EPS


def _needs_processing(params: Any, num_output_tokens: int) -> bool:
    return bool(
        params.logit_bias
        or num_output_tokens < params.min_tokens
        or params.repetition_penalty != 1.0
        or params.frequency_penalty != 0.0
        or params.presence_penalty != 0.0
    )


def seeded_generator(seed: int, position: int, device: torch.device) -> torch.Generator:
    """A generator whose draws depend only on the request's seed and the output position."""
    gen = torch.Generator(device=device)
    gen.manual_seed(hash((int(seed), int(position))) & 0x7FFF_FFFF_FFFF_FFFF)
    return gen


class Sampler:
    """Samples one token per row; stateless across steps except the unseeded generator.

    ``eos_token_ids`` are what ``min_tokens`` forbids (along with each row's stop tokens).
    ``seed`` fixes the generator used by rows without their own seed (tests, benchmarks).
    """

    def __init__(self, eos_token_ids: Iterable[int], seed: int | None = None) -> None:
        self.eos_token_ids = sorted(set(eos_token_ids))
        self._generator: torch.Generator | None = None
        self._seed = seed

    def _shared_generator(self, device: torch.device) -> torch.Generator:
        if self._generator is None or self._generator.device != device:
            self._generator = torch.Generator(device=device)
            if self._seed is None:
                self._generator.seed()
            else:
                self._generator.manual_seed(self._seed)
        return self._generator

    @torch.inference_mode()
    def sample(
        self,
        logits: torch.Tensor,
        rows: Sequence[SamplingRow],
        grammar_mask: tuple[torch.Tensor, list[int]] | None = None,
    ) -> SamplerOutput:
        """Sample from ``logits`` (``[N, vocab]`` float, modified in place) for ``rows``.

        ``grammar_mask`` is ``(bitmask, constrained_rows)`` from the structured-output
        manager: one packed int32 bitmask for the batch; only the listed rows are masked.
        """
        if grammar_mask is not None and grammar_mask[1]:
            apply_grammar_mask(logits, *grammar_mask)
        params = [r.sampling_params for r in rows]
        greedy = [is_greedy(p) for p in params]
        want_logprobs = any(p.logprobs is not None for p in params)
        process = [_needs_processing(r.sampling_params, len(r.output_token_ids)) for r in rows]
        if all(greedy) and not any(process) and not want_logprobs:
            # max().indices: the first maximum, like argmax, and faster on CPU.
            return SamplerOutput(logits.max(dim=-1).indices.tolist(), [None] * len(rows))

        logits = logits.float()
        for i, row in enumerate(rows):
            if process[i]:
                self._process_row(logits[i], row)
        temps = [1.0 if g else float(p.temperature) for g, p in zip(greedy, params, strict=True)]
        if any(t != 1.0 for t in temps):
            logits.div_(torch.tensor(temps, device=logits.device).unsqueeze(1))

        logprobs_out: list[TokenLogprob | None] = [None] * len(rows)
        logprobs = logits.log_softmax(dim=-1) if want_logprobs else None

        token_ids = logits.max(dim=-1).indices
        random_idx = [i for i, g in enumerate(greedy) if not g]
        if random_idx:
            idx = torch.tensor(random_idx, device=logits.device)
            sub = apply_truncation(logits.index_select(0, idx), [params[i] for i in random_idx])
            chosen = self._race(sub.softmax(dim=-1), [rows[i] for i in random_idx])
            token_ids.index_copy_(0, idx, chosen)
        tokens = token_ids.tolist()

        if logprobs is not None:
            for i, p in enumerate(params):
                if p.logprobs is not None:
                    logprobs_out[i] = _token_logprob(logprobs[i], tokens[i], int(p.logprobs))
        return SamplerOutput(tokens, logprobs_out)

    def verify(
        self,
        logits: torch.Tensor,
        rows: Sequence[SamplingRow],
        guesses: Sequence[Sequence[int]],
        grammar_mask: tuple[torch.Tensor, list[int]] | None = None,
    ) -> VerifyOutput:
        """Accept or reject each request's guesses (see the module docstring).

        ``logits`` holds ``1 + len(guesses[i])`` consecutive rows per request ``i``;
        ``grammar_mask`` rows index those expanded rows (a request with a grammar has none).
        """
        expanded: list[SamplingRow] = []
        for row, guess in zip(rows, guesses, strict=True):
            expanded.append(row)
            for j in range(1, len(guess) + 1):
                output = [*row.output_token_ids, *guess[:j]]
                expanded.append(_GuessRow(row.sampling_params, row.prompt_token_ids, output))
        result = self.sample(logits, expanded, grammar_mask)
        out = VerifyOutput([], [], [])
        start = 0
        for guess in guesses:
            targets = result.token_ids[start : start + len(guess) + 1]
            num_accepted = 0
            while num_accepted < len(guess) and targets[num_accepted] == guess[num_accepted]:
                num_accepted += 1
            end = start + num_accepted + 1
            out.token_ids.append(targets[: num_accepted + 1])
            out.logprobs.append(result.logprobs[start:end])
            out.num_accepted.append(num_accepted)
            start += len(guess) + 1
        return out

    def _process_row(self, row_logits: torch.Tensor, row: SamplingRow) -> None:
        p = row.sampling_params
        device = row_logits.device
        if p.logit_bias:
            ids = torch.tensor([int(k) for k in p.logit_bias], device=device)
            vals = torch.tensor([float(v) for v in p.logit_bias.values()], device=device)
            row_logits.index_add_(0, ids, vals)
        if len(row.output_token_ids) < p.min_tokens:
            banned = set(self.eos_token_ids) | set(p.stop_token_ids)
            if banned:
                row_logits[torch.tensor(sorted(banned), device=device)] = float("-inf")
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(
                list(set(row.prompt_token_ids) | set(row.output_token_ids)),
                dtype=torch.long,
                device=device,
            )
            vals = row_logits[seen]
            rp = float(p.repetition_penalty)
            row_logits[seen] = torch.where(vals > 0, vals / rp, vals * rp)
        if (p.frequency_penalty != 0.0 or p.presence_penalty != 0.0) and row.output_token_ids:
            out = torch.tensor(row.output_token_ids, dtype=torch.long, device=device)
            counts = torch.zeros_like(row_logits).index_add_(
                0, out, torch.ones(len(out), device=device)
            )
            row_logits -= float(p.frequency_penalty) * counts
            row_logits -= float(p.presence_penalty) * (counts > 0).float()

    def _race(self, probs: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """Exponential race per row: seeded rows draw from their own generator."""
        q = torch.empty_like(probs)
        unseeded = [i for i, r in enumerate(rows) if r.sampling_params.seed is None]
        if unseeded:
            shared = self._shared_generator(probs.device)
            draws = torch.empty(len(unseeded), probs.shape[1], device=probs.device)
            draws.exponential_(generator=shared)
            q[torch.tensor(unseeded, device=probs.device)] = draws
        for i, r in enumerate(rows):
            seed = r.sampling_params.seed
            if seed is not None:
                gen = seeded_generator(seed, len(r.output_token_ids), probs.device)
                q[i].exponential_(generator=gen)
        return (probs / q).argmax(dim=-1)


def apply_grammar_mask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set to -inf the logits of tokens a row's grammar forbids (xgrammar's kernel: CPU or
    CUDA, whichever holds the logits)."""
    import xgrammar as xgr  # only a batch with a grammar pays the import

    if bitmask.device != logits.device:
        bitmask = bitmask.to(logits.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(logits, bitmask, indices=rows)


def apply_truncation(logits: torch.Tensor, params: Sequence[Any]) -> torch.Tensor:
    """Top-k, top-p and min-p over ``[M, vocab]`` logits; masked entries become -inf."""
    vocab = logits.shape[1]
    top_k = [int(p.top_k) if 0 < int(p.top_k) < vocab else vocab for p in params]
    top_p = [float(p.top_p) for p in params]
    min_p = [float(p.min_p) for p in params]
    device = logits.device
    if any(k < vocab for k in top_k) or any(tp < 1.0 for tp in top_p):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        k = torch.tensor(top_k, device=device)
        ranks = torch.arange(vocab, device=device).unsqueeze(0)
        sorted_logits.masked_fill_(ranks >= k.unsqueeze(1), float("-inf"))
        if any(tp < 1.0 for tp in top_p):
            probs = sorted_logits.softmax(dim=-1)
            before = probs.cumsum(dim=-1) - probs  # mass of strictly better tokens
            p = torch.tensor(top_p, device=device).unsqueeze(1)
            sorted_logits.masked_fill_(before >= p, float("-inf"))  # the best always stays
        logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
    if any(mp > 0.0 for mp in min_p):
        probs = logits.softmax(dim=-1)
        threshold = probs.max(dim=-1, keepdim=True).values * torch.tensor(
            min_p, device=device
        ).unsqueeze(1)
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


def _token_logprob(row_logprobs: torch.Tensor, token_id: int, num_top: int) -> TokenLogprob:
    top: list[tuple[int, float]] = []
    if num_top > 0:
        vals, ids = row_logprobs.topk(num_top)
        top = list(zip(ids.tolist(), vals.tolist(), strict=True))
    return TokenLogprob(token_id, float(row_logprobs[token_id]), top)
