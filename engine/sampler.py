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
``seed`` draws its ``q`` from a counter-based generator (:func:`seeded_exponentials`): a
hash of ``(seed, output position, token id)``, so its text does not depend on what else is in
the batch, nor on preemption and recompute, nor on the device (CPU and CUDA draw the same
bits). When every row is greedy with nothing to process, the whole step is one ``argmax``.

Every step runs as batched tensor ops, whatever the number of rows: the host only gathers
each row's parameters and token ids into one tensor per kind (penalties, biases, seeds,
logprobs), and reads the sampled ids (and any logprobs) back once at the end.

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

import numpy as np
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


@dataclass
class SampledOnDevice:
    """A step's sampled ids still on the device (int64 ``[N]``), and what reading them needs:
    the rows' log-probabilities (None: no row asked) and parameters."""

    token_ids: torch.Tensor
    logprobs: torch.Tensor | None
    params: Sequence[Any]

    @torch.inference_mode()
    def read(self) -> SamplerOutput:
        """Read the ids on the host (the step's one synchronisation) and the logprobs asked."""
        tokens = self.token_ids.tolist()
        if self.logprobs is None:
            return SamplerOutput(tokens, [None] * len(tokens))
        return SamplerOutput(
            tokens, _batch_logprobs(self.logprobs, self.token_ids, tokens, self.params)
        )


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


_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15  # splitmix64's increment: 2^64 / golden ratio
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB


def _signed64(x: int) -> int:
    x &= _MASK64
    return x - (1 << 64) if x >> 63 else x


def _mix64(x: int) -> int:
    """splitmix64's finalizer on a Python int (the host twin of :func:`_mix64_tensor`)."""
    x &= _MASK64
    x = ((x ^ (x >> 30)) * _MIX1) & _MASK64
    x = ((x ^ (x >> 27)) * _MIX2) & _MASK64
    return x ^ (x >> 31)


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's ``>>`` is arithmetic)."""
    return (x >> bits).bitwise_and_((1 << (64 - bits)) - 1)


def _mix64_tensor(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer on int64 tensors, in place (wrapping products, as two's
    complement)."""
    x.bitwise_xor_(_shr(x, 30)).mul_(_signed64(_MIX1))
    x.bitwise_xor_(_shr(x, 27)).mul_(_signed64(_MIX2))
    return x.bitwise_xor_(_shr(x, 31))


def row_key(seed: int, position: int) -> int:
    """The draw key of a seeded row at output ``position`` (signed 64-bit)."""
    return _signed64(_mix64(_mix64(int(seed)) ^ int(position)))


def seeded_exponentials(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[len(keys), vocab]`` Exp(1) draws, float32: element ``(i, t)`` is a function of
    ``keys[i]`` and ``t`` only (splitmix64 of ``key + (t + 1) * gamma``, 53 bits to a uniform
    in (0, 1), then ``-log``), computed in one batch on the keys' device."""
    cols = torch.arange(1, vocab + 1, dtype=torch.int64, device=keys.device)
    bits = _mix64_tensor(keys.unsqueeze(1) + cols * _signed64(_GAMMA))
    uniform = _shr(bits, 11).double().add_(0.5).mul_(2.0**-53)
    return uniform.log_().neg_().float()


# Rows up to which NumPy's argmax (one thread, ~5 us a row of 49,152 logits here) beats
# PyTorch's reduction (~50 us whatever the rows, at 1 or 2 threads).
_NUMPY_ARGMAX_ROWS = 8


def first_maxima(logits: torch.Tensor) -> torch.Tensor:
    """Each row's index of its first maximum (int64 ``[N]``), as ``logits.max(-1).indices``
    gives it: through NumPy for a few float32 rows on the CPU, where PyTorch's reduction costs
    ten times as much (a one-stream step pays it every token)."""
    if _host_pick(logits):
        return torch.from_numpy(logits.detach().numpy().argmax(axis=-1))
    return logits.max(dim=-1).indices


def _host_pick(logits: torch.Tensor) -> bool:
    """Whether NumPy's argmax picks ``logits``' first maxima: a few float32 rows on the CPU."""
    return (
        logits.is_cpu  # not device.type, which formats a string (engine/kernels/__init__.py)
        and logits.dtype == torch.float32
        and logits.dim() == 2
        and logits.shape[0] <= _NUMPY_ARGMAX_ROWS
    )


class Sampler:
    """Samples one token per row; stateless across steps except the unseeded generator.

    ``eos_token_ids`` are what ``min_tokens`` forbids (along with each row's stop tokens).
    ``seed`` fixes the generator used by rows without their own seed (tests, benchmarks).
    """

    def __init__(self, eos_token_ids: Iterable[int], seed: int | None = None) -> None:
        self.eos_token_ids = sorted(set(eos_token_ids))
        self._eos_set = frozenset(self.eos_token_ids)
        self._last_view: tuple[torch.Tensor, np.ndarray] | None = None
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
        if grammar_mask is None or not grammar_mask[1]:
            # A few greedy rows on the CPU are picked and read on the host, with no
            # inference-mode switch (every token of one stream pays these, cold, after a step).
            picked = self._greedy_ids(logits, rows) if _host_pick(logits) else None
            if picked is not None:
                return SamplerOutput(picked.tolist(), [None] * len(rows))
        return self.sample_on_device(logits, rows, grammar_mask).read()

    def _host_view(self, logits: torch.Tensor) -> np.ndarray:
        """NumPy's view of ``logits`` (float32, on the CPU). The view of the tensor read last is
        kept, with the tensor: a runner that hands the same tensor every step (the host step's
        persistent logits, engine/models/host_step.py) pays torch's conversion once."""
        kept = self._last_view
        if kept is not None and kept[0] is logits:
            return kept[1]
        view = logits.detach().numpy()
        self._last_view = (logits, view)
        return view

    @staticmethod
    def _plain_greedy(rows: Sequence[SamplingRow]) -> list[bool] | None:
        """Per row whether it needs processing, where every row is greedy without logprobs and
        needs none but ``min_tokens`` (EOS and stop tokens at -inf); else None."""
        process = []
        for row in rows:
            p = row.sampling_params
            if not is_greedy(p) or p.logprobs is not None:
                return None
            needs = _needs_processing(p, len(row.output_token_ids))
            if needs and (
                p.logit_bias
                or p.repetition_penalty != 1.0
                or p.frequency_penalty != 0.0
                or p.presence_penalty != 0.0
            ):
                return None
            process.append(needs)
        return process

    def _banned(self, tokens: list[int], rows: Sequence[SamplingRow], process: list[bool]) -> bool:
        """Whether a row under ``min_tokens`` picked a token its ban forbids."""
        for token, row, needs in zip(tokens, rows, process, strict=True):
            if needs and (token in self._eos_set or token in row.sampling_params.stop_token_ids):
                return True
        return False

    def _greedy_ids(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor | None:
        """Each row's greedy token where :meth:`_plain_greedy` holds, else None.

        Banning lowers only the banned entries, so a first maximum that is not banned is still
        the first maximum after the ban: the same token as processing then ``max(-1)``, without
        touching the logits. A row whose first maximum is banned takes the general path. The
        check reads the ids on the host, which a device would have to wait for: with a ban to
        check, CPU only."""
        process = self._plain_greedy(rows)
        if process is None:
            return None
        if any(process) and not logits.is_cpu:
            return None
        if _host_pick(logits):  # first_maxima's NumPy argmax, on the kept view
            picked = torch.from_numpy(self._host_view(logits).argmax(axis=-1))
        else:
            picked = first_maxima(logits)
        return None if any(process) and self._banned(picked.tolist(), rows, process) else picked

    @torch.inference_mode()
    def sample_on_device(
        self,
        logits: torch.Tensor,
        rows: Sequence[SamplingRow],
        grammar_mask: tuple[torch.Tensor, list[int]] | None = None,
    ) -> SampledOnDevice:
        """:meth:`sample` up to the host read: the ids stay on the device until
        :meth:`SampledOnDevice.read` (asynchronous scheduling feeds them to the next step)."""
        if grammar_mask is not None and grammar_mask[1]:
            apply_grammar_mask(logits, *grammar_mask)
        params = [r.sampling_params for r in rows]
        picked = self._greedy_ids(logits, rows)
        if picked is not None:
            return SampledOnDevice(picked, None, params)
        greedy = [is_greedy(p) for p in params]
        want_logprobs = any(p.logprobs is not None for p in params)
        process = [_needs_processing(r.sampling_params, len(r.output_token_ids)) for r in rows]

        logits = logits.float()
        if any(process):
            self._process(logits, rows, process)
        temps = [1.0 if g else float(p.temperature) for g, p in zip(greedy, params, strict=True)]
        if any(t != 1.0 for t in temps):
            logits.div_(torch.tensor(temps, device=logits.device).unsqueeze(1))

        logprobs = logits.log_softmax(dim=-1) if want_logprobs else None

        token_ids = logits.max(dim=-1).indices
        random_idx = [i for i, g in enumerate(greedy) if not g]
        if random_idx:
            idx = torch.tensor(random_idx, device=logits.device)
            sub = apply_truncation(logits.index_select(0, idx), [params[i] for i in random_idx])
            chosen = self._race(sub.softmax(dim=-1), [rows[i] for i in random_idx])
            token_ids.index_copy_(0, idx, chosen)
        return SampledOnDevice(token_ids, logprobs, params)

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

    def _process(
        self, logits: torch.Tensor, rows: Sequence[SamplingRow], process: list[bool]
    ) -> None:
        """Bias, min_tokens, then the penalties, on every row at once (in place)."""
        batch = _ProcessBatch(len(rows))
        for i, row in enumerate(rows):
            if process[i]:
                batch.add(i, row, self.eos_token_ids)
        batch.apply(logits)

    def _race(self, probs: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """Exponential race, all rows at once: seeded rows draw from their own keys
        (:func:`seeded_exponentials`), the others from the shared generator."""
        device = probs.device
        seeds = [r.sampling_params.seed for r in rows]
        unseeded = [i for i, seed in enumerate(seeds) if seed is None]
        if len(unseeded) == len(rows):
            q = torch.empty_like(probs).exponential_(generator=self._shared_generator(device))
            return (probs / q).argmax(dim=-1)
        q = torch.empty_like(probs)
        if unseeded:
            shared = self._shared_generator(device)
            draws = torch.empty(len(unseeded), probs.shape[1], device=device)
            draws.exponential_(generator=shared)
            q[torch.tensor(unseeded, device=device)] = draws
        seeded = [i for i, seed in enumerate(seeds) if seed is not None]
        keys = [row_key(seeds[i], len(rows[i].output_token_ids)) for i in seeded]
        q_seeded = seeded_exponentials(torch.tensor(keys, device=device), probs.shape[1])
        q[torch.tensor(seeded, device=device)] = q_seeded
        return (probs / q).argmax(dim=-1)


class _ProcessBatch:
    """(row, token) pairs of each processing kind, gathered on the host for the whole step,
    then applied on the device in one op per kind (vLLM's order: bias, min_tokens, then the
    repetition, frequency and presence penalties)."""

    def __init__(self, num_rows: int) -> None:
        self.bias_rows: list[int] = []
        self.bias_tokens: list[int] = []
        self.bias_values: list[float] = []
        self.ban_rows: list[int] = []
        self.ban_tokens: list[int] = []
        self.seen_rows: list[int] = []  # repetition penalty: prompt and output tokens
        self.seen_tokens: list[int] = []
        self.out_rows: list[int] = []  # frequency and presence penalties: output tokens
        self.out_tokens: list[int] = []
        self.repetition = [1.0] * num_rows
        self.frequency = [0.0] * num_rows
        self.presence = [0.0] * num_rows

    def add(self, i: int, row: SamplingRow, eos_token_ids: Sequence[int]) -> None:
        p = row.sampling_params
        for token, value in (p.logit_bias or {}).items():
            self.bias_rows.append(i)
            self.bias_tokens.append(int(token))
            self.bias_values.append(float(value))
        if len(row.output_token_ids) < p.min_tokens:
            banned = sorted(set(eos_token_ids) | set(p.stop_token_ids))
            self.ban_rows += [i] * len(banned)
            self.ban_tokens += banned
        if p.repetition_penalty != 1.0:
            self.repetition[i] = float(p.repetition_penalty)
            self.seen_rows += [i] * (len(row.prompt_token_ids) + len(row.output_token_ids))
            self.seen_tokens += row.prompt_token_ids
            self.seen_tokens += row.output_token_ids
        if (p.frequency_penalty != 0.0 or p.presence_penalty != 0.0) and row.output_token_ids:
            self.frequency[i] = float(p.frequency_penalty)
            self.presence[i] = float(p.presence_penalty)
            self.out_rows += [i] * len(row.output_token_ids)
            self.out_tokens += row.output_token_ids

    def apply(self, logits: torch.Tensor) -> None:
        device = logits.device

        def at(rows: list[int], tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
            return torch.tensor(rows, device=device), torch.tensor(tokens, device=device)

        def per_row(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, device=device).unsqueeze(1)

        if self.bias_rows:
            values = torch.tensor(self.bias_values, device=device)
            logits.index_put_(at(self.bias_rows, self.bias_tokens), values, accumulate=True)
        if self.ban_rows:
            minus_inf = torch.tensor(float("-inf"), device=device)
            logits.index_put_(at(self.ban_rows, self.ban_tokens), minus_inf)
        # The penalties touch only the (row, token) entries they name: gathered, changed and
        # written back (a token named twice writes the same value twice).
        if self.seen_rows:
            where = at(self.seen_rows, self.seen_tokens)
            values = logits[where]
            rp = per_row(self.repetition).squeeze(1)[where[0]]
            logits.index_put_(where, torch.where(values > 0, values / rp, values * rp))
        if self.out_rows:
            where = at(self.out_rows, self.out_tokens)
            ones = torch.ones(len(self.out_rows), device=device)
            counts = torch.zeros_like(logits).index_put_(where, ones, accumulate=True)[where]
            frequency = per_row(self.frequency).squeeze(1)[where[0]]
            presence = per_row(self.presence).squeeze(1)[where[0]]
            penalized = logits[where] - frequency * counts - presence * (counts > 0).float()
            logits.index_put_(where, penalized)


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


def _batch_logprobs(
    logprobs: torch.Tensor, token_ids: torch.Tensor, tokens: list[int], params: Sequence[Any]
) -> list[TokenLogprob | None]:
    """Each asking row's sampled-token logprob and its top ``logprobs`` alternatives: one
    gather and one top-k for all of them, one read back."""
    want = [i for i, p in enumerate(params) if p.logprobs is not None]
    out: list[TokenLogprob | None] = [None] * len(params)
    idx = torch.tensor(want, device=logprobs.device)
    rows = logprobs.index_select(0, idx)
    chosen_ids = token_ids.index_select(0, idx)
    chosen = rows.gather(1, chosen_ids.unsqueeze(1)).squeeze(1).tolist()
    num_top = max(int(params[i].logprobs) for i in want)
    top_vals: list[list[float]] = [[] for _ in want]
    top_ids: list[list[int]] = [[] for _ in want]
    if num_top > 0:
        vals, ids = rows.topk(num_top, dim=-1)
        top_vals, top_ids = vals.tolist(), ids.tolist()
    for j, i in enumerate(want):
        k = int(params[i].logprobs)
        top = list(zip(top_ids[j][:k], top_vals[j][:k], strict=True))
        out[i] = TokenLogprob(tokens[i], chosen[j], top)
    return out
