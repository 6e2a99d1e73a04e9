"""The batched LoRA delta: ``out[t] += (x[t] @ A[s].T) @ B[s].T`` with ``s = slots[t]``.

Punica's two halves: *shrink* (``x @ A``, to the rank) and *expand* (``@ B``, back to the
output width), each row gathering its own adapter's slot; slot -1 is the base model (no
delta). One call covers every adapter of the step, so requests of different adapters and of
the base model share a batch, and no weight is ever merged.

Layouts (the slot buffers of :class:`engine.lora.manager.LoRAManager`): ``a`` is
``[num_slots, rank, in]`` and ``b`` is ``[num_slots, out, rank]``. On CUDA :func:`lora_delta`
runs the Triton kernels of :mod:`engine.lora.triton_ops` (one gather per row); elsewhere
:func:`lora_delta_ref`, which works on *segments*: the runner orders a step's requests so that
rows of one adapter are contiguous, and each segment is two small matmuls on views (no gather,
no copy, no work for base rows).
"""

from __future__ import annotations

import torch

Segments = list[tuple[int, int, int]]  # (slot, first row, end row), slot >= 0
PARTS_MIN_ROWS = 64  # from this many rows a fused projection's parts expand one by one


def segments_of(slots: list[int]) -> Segments:
    """Runs of equal slots (base rows, slot -1, left out)."""
    out: Segments = []
    start = 0
    for i in range(1, len(slots) + 1):
        if i == len(slots) or slots[i] != slots[start]:
            if slots[start] >= 0:
                out.append((slots[start], start, i))
            start = i
    return out


def lora_delta_ref(
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    slots: torch.Tensor,
    out: torch.Tensor,
    segments: Segments | None = None,
    parts: list[tuple[int, int]] | None = None,
) -> None:
    """Add every row's LoRA delta to ``out`` in place (the PyTorch reference).

    ``segments`` (from :func:`segments_of`) may be given when the caller already has them;
    any row order is correct, contiguous adapters only make fewer, larger matmuls. ``parts``
    are the output ranges of a fused projection whose B is block-diagonal (part ``i`` reads
    rank columns ``i * rank / len(parts)`` onward): each is expanded alone, skipping the zeros.
    """
    if segments is None:
        segments = segments_of(slots.tolist())
    width = a.shape[1] // len(parts) if parts else 0
    for slot, first, end in segments:
        shrunk = torch.mm(x[first:end], a[slot].t())
        # Few rows: one matmul through the zeros beats several tiny ones (call overhead).
        if not parts or len(parts) == 1 or end - first < PARTS_MIN_ROWS:
            out[first:end].addmm_(shrunk, b[slot].t())
            continue
        for i, (lo, hi) in enumerate(parts):
            cols = slice(i * width, (i + 1) * width)
            out[first:end, lo:hi].addmm_(shrunk[:, cols], b[slot, lo:hi, cols].t())


def lora_delta(
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    slots: torch.Tensor,
    out: torch.Tensor,
    segments: Segments | None = None,
    parts: list[tuple[int, int]] | None = None,
) -> None:
    """:func:`lora_delta_ref`'s result, by the Triton kernels when ``x`` is on CUDA."""
    if x.is_cuda:
        from engine.lora.triton_ops import lora_delta_triton

        lora_delta_triton(x, a, b, slots, out)
    else:
        lora_delta_ref(x, a, b, slots, out, segments, parts)
