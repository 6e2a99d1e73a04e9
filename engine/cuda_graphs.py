"""CUDA graphs for decode steps: the whole model step replayed as one launch.

A decode step of a small model is launch-bound: hundreds of kernels of a few microseconds,
each issued by Python. Captured once per batch-size *bucket* at start-up and replayed, the
step costs one launch plus the copy of its inputs.

The pieces, each testable on CPU:

* :func:`plan_buckets` — the batch sizes captured (1, 2, 4, 8, then every 8 up to
  ``max_num_seqs``, and ``max_num_seqs`` itself), vLLM's plan; :func:`bucket_for` — the
  smallest bucket holding a step's requests.
* :func:`fallback_reason` — why a step runs eager (CPU, ``--enforce-eager``, a prefill or
  mixed step, speculative guesses, a LoRA row, more requests than the largest bucket), or
  ``None`` when a graph serves it. Structured outputs need nothing: the grammar bitmask is
  applied by the sampler to the graph's logits, outside the graph.
* :class:`DecodeBuffers` — the persistent inputs a graph reads (token ids, positions, slot
  mapping, block tables, sequence lengths), sized once for the largest bucket and updated in
  place. Rows past the step's requests (padding up to the bucket) hold token 0 at position 0
  with a context of one token whose K/V go to a *scratch* block: one block past the
  scheduler's pool, which no request owns, so padding never touches a real request's cache.
* :class:`DecodeGraphs` — the runner: loads a step into the buffers and replays the bucket's
  graph (CUDA), or runs the same padded step eagerly (CPU, and the tests: the same buffer
  logic, no capture).

The synchronous engine loads a step's inputs only after the previous step's sampled ids were
read on the host (that read waits for the GPU), so one set of host staging buffers is free to
overwrite. With ``--async-scheduling`` (engine.async_scheduling: step N+1 loaded while step N
runs) the runner asks for ``staging_sets=2`` (N+1's host rows go to the other set while N's
copies may still be in flight), and a decode's input may be a *placeholder*
(:attr:`DecodeStep.from_sampled`): "what step N samples for this request", taken from N's
sampled ids on the device, with no host read.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from engine.attention import AttentionMetadata

_SMALL_BUCKETS = (1, 2, 4, 8)
_BUCKET_STEP = 8


def plan_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, 16, 24, 32, ... up to ``max_num_seqs`` (included)."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes = [b for b in _SMALL_BUCKETS if b <= max_num_seqs]
    sizes += range(2 * _BUCKET_STEP, max_num_seqs + 1, _BUCKET_STEP)
    if sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


def bucket_for(buckets: Sequence[int], num_reqs: int) -> int | None:
    """The smallest bucket of ``buckets`` (ascending) holding ``num_reqs`` rows; None if none."""
    at = bisect.bisect_left(buckets, num_reqs)
    return buckets[at] if at < len(buckets) else None


def fallback_reason(
    *,
    device_type: str,
    enforce_eager: bool,
    query_lens: Sequence[int],
    num_sampled: int,
    has_guesses: bool,
    has_lora_rows: bool,
    max_bucket: int,
) -> str | None:
    """Why this step must run eager, or None when a captured decode graph serves it.

    ``num_sampled`` is how many requests sample a token this step: a graph step samples every
    row, so a one-token prefill chunk that does not (a prompt's middle) sends the step eager.
    """
    if device_type != "cuda":
        return "not a CUDA device"
    if enforce_eager:
        return "--enforce-eager"
    if not query_lens or any(n != 1 for n in query_lens) or num_sampled != len(query_lens):
        return "not a pure decode step"
    if has_guesses:
        return "speculative guesses"
    if has_lora_rows:
        return "a LoRA adapter row"
    if len(query_lens) > max_bucket:
        return "more requests than the largest bucket"
    return None


@dataclass(frozen=True)
class DecodeStep:
    """A decode step's host inputs, one entry per request (one new token each)."""

    token_ids: Sequence[int]
    positions: Sequence[int]
    seq_lens: Sequence[int]  # context length after this step: position + 1
    block_tables: Sequence[Sequence[int]]
    # Placeholders: per row, the index into the previous step's sampled ids (on the device)
    # whose value is this row's input token, or -1 where ``token_ids`` holds it. None: no
    # placeholder (every token on the host).
    from_sampled: Sequence[int] | None = None


class DecodeBuffers:
    """The persistent device inputs of decode graphs, for up to ``max_batch`` rows.

    Tensors are allocated once; :meth:`load` writes a step's rows and the padding rows of its
    bucket in place (through pinned host staging and one copy per tensor on CUDA; on CPU the
    staging tensors are the buffers). ``scratch_block`` is a cache block no request owns:
    padding rows write their K/V there and attend to it.
    """

    def __init__(
        self,
        max_batch: int,
        max_blocks_per_seq: int,
        block_size: int,
        scratch_block: int,
        device: torch.device,
        staging_sets: int = 1,
    ) -> None:
        self.max_batch = max_batch
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.device = device
        on_cuda = device.type == "cuda"
        if staging_sets < 1:
            raise ValueError(f"staging_sets must be >= 1, got {staging_sets}")

        def host(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, pin_memory=on_cuda)

        # ids, positions, slots in one host tensor: one staging fill, three copies. On CUDA,
        # ``staging_sets`` sets used in turn (a step's non-blocking copies read its set while
        # the next step fills another); on CPU the one set is the buffers themselves.
        self._staging: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        for _ in range(staging_sets if on_cuda else 1):
            tables = host(max_batch, max_blocks_per_seq, dtype=torch.int32)
            tables.fill_(scratch_block)
            lens = host(max_batch, dtype=torch.int32)
            self._staging.append((host(3, max_batch, dtype=torch.int64), lens, tables))
        self._next_set = 0
        self._host_i64, self._host_lens, self._host_tables = self._staging[0]
        if on_cuda:
            self._dev_i64 = torch.zeros_like(self._host_i64, device=device)
            self.seq_lens = torch.zeros_like(self._host_lens, device=device)
            self.block_tables = self._host_tables.to(device)
        else:
            self._dev_i64, self.seq_lens = self._host_i64, self._host_lens
            self.block_tables = self._host_tables
        self.input_ids, self.positions, self.slot_mapping = self._dev_i64.unbind(0)
        self.query_start_loc = torch.arange(max_batch + 1, dtype=torch.int32, device=device)
        self.sample_rows = torch.arange(max_batch, dtype=torch.int64, device=device)
        self.seq_lens_cpu: list[int] = [1] * max_batch

    @property
    def staging_sets(self) -> int:
        return len(self._staging)

    def load(self, step: DecodeStep, bucket: int, sampled: torch.Tensor | None = None) -> None:
        """Write ``step``'s rows, and padding up to ``bucket`` rows, into the buffers; rows
        with a placeholder (``step.from_sampled``) take their token from ``sampled`` (the
        previous step's sampled ids, int64, on this device), copied on the device."""
        n = len(step.token_ids)
        if not 0 < n <= bucket <= self.max_batch:
            raise ValueError(f"{n} rows do not fit a bucket of {bucket} (max {self.max_batch})")
        sources = self._placeholder_sources(step, sampled)
        self._host_i64, self._host_lens, self._host_tables = self._staging[self._next_set]
        self._next_set = (self._next_set + 1) % len(self._staging)
        bs = self.block_size
        scratch_slot = self.scratch_block * bs
        slots = [
            table[(s - 1) // bs] * bs + (s - 1) % bs
            for table, s in zip(step.block_tables, step.seq_lens, strict=True)
        ]
        pad = bucket - n
        staged = torch.tensor(
            [[*step.token_ids, *[0] * pad], [*step.positions, *[0] * pad],
             [*slots, *[scratch_slot] * pad]],
            dtype=torch.int64,
        )  # fmt: skip
        self._host_i64[:, :bucket] = staged
        self.seq_lens_cpu = [*step.seq_lens, *[1] * pad]
        self._host_lens[:bucket] = torch.tensor(self.seq_lens_cpu, dtype=torch.int32)
        # Only the blocks this step reads (a table may hold more, e.g. for lookahead slots):
        # entries past a row's context are never read.
        needed = [-(-s // bs) for s in step.seq_lens]
        width = max(needed)
        rows = [
            [*t[:k], *[self.scratch_block] * (width - k)]
            for t, k in zip(step.block_tables, needed, strict=True)
        ]
        rows += [[self.scratch_block] * width] * pad
        self._host_tables[:bucket, :width] = torch.tensor(rows, dtype=torch.int32)
        if self.device.type == "cuda":
            self._dev_i64[:, :bucket].copy_(self._host_i64[:, :bucket], non_blocking=True)
            self.seq_lens[:bucket].copy_(self._host_lens[:bucket], non_blocking=True)
            self.block_tables[:bucket, :width].copy_(
                self._host_tables[:bucket, :width], non_blocking=True
            )
        if sources is not None and sampled is not None:
            targets, src = sources.to(self.device, non_blocking=True).unbind(0)
            self.input_ids.index_copy_(0, targets, sampled.index_select(0, src))

    def _placeholder_sources(
        self, step: DecodeStep, sampled: torch.Tensor | None
    ) -> torch.Tensor | None:
        """``[2, k]``: the rows with a placeholder and their indices into ``sampled``; None
        when the step has none. Refuses placeholders without ``sampled`` or out of its range."""
        if step.from_sampled is None or all(i < 0 for i in step.from_sampled):
            return None
        if len(step.from_sampled) != len(step.token_ids):
            raise ValueError("from_sampled needs one entry per row")
        if sampled is None:
            raise ValueError("a step with placeholder rows needs the previous sampled ids")
        pairs = [(row, i) for row, i in enumerate(step.from_sampled) if i >= 0]
        if max(i for _, i in pairs) >= sampled.shape[0]:
            raise ValueError(
                f"a placeholder points past the {sampled.shape[0]} sampled ids of the last step"
            )
        return torch.tensor(pairs, dtype=torch.int64).t().contiguous()

    def load_padding(self, bucket: int) -> None:
        """Every row of ``bucket`` a padding row (what a graph is captured with)."""
        self.load(DecodeStep([0], [0], [1], [[self.scratch_block]]), bucket)

    def metadata(self, bucket: int) -> AttentionMetadata:
        """Attention metadata over the first ``bucket`` rows: views of the buffers."""
        lens = self.seq_lens_cpu[:bucket]
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bucket],
            query_start_loc=self.query_start_loc[: bucket + 1],
            seq_lens=self.seq_lens[:bucket],
            block_tables=self.block_tables[:bucket],
            max_query_len=1,
            max_seq_len=max(lens),
            query_lens_cpu=[1] * bucket,
            seq_lens_cpu=lens,
        )


class StepModel(Protocol):
    """What the graphs run: :class:`engine.models.llama.LlamaForCausalLM` satisfies it."""

    def forward_and_logits(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        rows: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass
class _Captured:
    graph: Any  # torch.cuda.CUDAGraph
    hidden: torch.Tensor
    logits: torch.Tensor


class DecodeGraphs:
    """Decode steps over :class:`DecodeBuffers`, replayed from CUDA graphs once
    :meth:`capture` ran, else run eagerly on the same padded buffers (CPU, tests).

    Not thread-safe: one step at a time, like the model runner that owns it. The tensors
    :meth:`run` returns are the graph's static outputs: valid until the next step.
    """

    def __init__(
        self,
        model: StepModel,
        kv_caches: list[torch.Tensor],
        buffers: DecodeBuffers,
        buckets: Sequence[int],
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.buffers = buffers
        self.buckets = sorted(buckets)
        if self.buckets[-1] > buffers.max_batch:
            raise ValueError("a bucket larger than the buffers")
        self._graphs: dict[int, _Captured] = {}

    @property
    def max_bucket(self) -> int:
        return self.buckets[-1]

    @property
    def captured(self) -> list[int]:
        return sorted(self._graphs)

    def _eager(self, bucket: int) -> tuple[torch.Tensor, torch.Tensor]:
        b = self.buffers
        with torch.inference_mode():
            return self.model.forward_and_logits(
                b.input_ids[:bucket], b.positions[:bucket], self.kv_caches, b.metadata(bucket),
                b.sample_rows[:bucket],
            )  # fmt: skip

    def capture(self) -> None:
        """Capture one graph per bucket, largest first (the smaller ones then reuse its memory
        pool); each after one eager warm-up run (Triton compiles, cuBLAS picks its kernels)."""
        pool = None
        for bucket in reversed(self.buckets):
            self.buffers.load_padding(bucket)
            self._eager(bucket)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.inference_mode(), torch.cuda.graph(graph, pool=pool):
                hidden, logits = self.model.forward_and_logits(
                    self.buffers.input_ids[:bucket], self.buffers.positions[:bucket],
                    self.kv_caches, self.buffers.metadata(bucket),
                    self.buffers.sample_rows[:bucket],
                )  # fmt: skip
            pool = graph.pool()
            self._graphs[bucket] = _Captured(graph, hidden, logits)
        torch.cuda.synchronize()

    def run(
        self, step: DecodeStep, sampled: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Hidden states and float32 logits of ``step``'s rows (row ``i`` for request ``i``),
        computed over its bucket's padded rows; placeholder rows read ``sampled``
        (:meth:`DecodeBuffers.load`)."""
        n = len(step.token_ids)
        bucket = bucket_for(self.buckets, n)
        if bucket is None:
            raise ValueError(f"{n} requests exceed the largest bucket, {self.max_bucket}")
        if sampled is None:
            self.buffers.load(step, bucket)
        else:
            self.buffers.load(step, bucket, sampled)
        captured = self._graphs.get(bucket)
        if captured is None:
            hidden, logits = self._eager(bucket)
            return hidden[:n], logits[:n]
        captured.graph.replay()
        return captured.hidden[:n], captured.logits[:n]
