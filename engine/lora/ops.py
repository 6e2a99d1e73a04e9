"""The batched LoRA delta: ``out[t] += (x[t] @ A[s].T) @ B[s].T`` with ``s = slots[t]``.

Punica's two halves: *shrink* (``x @ A``, to the rank) and *expand* (``@ B``, back to the
output width), each row gathering its own adapter's slot; slot -1 is the base model (no
delta). One call covers every adapter of the step, so requests of different adapters and of
the base model share a batch, and no weight is ever merged.

Layouts (the slot buffers of :class:`engine.lora.manager.LoRAManager`): ``a`` is
``[num_slots, rank, in]`` and ``b`` is ``[out, num_slots, rank]``, both contiguous, so that
``a`` viewed as ``[num_slots * rank, in]`` and ``b`` as ``[out, num_slots * rank]`` are the
stacked adapters with no copy. On CUDA :func:`lora_delta` runs the Triton kernels of
:mod:`engine.lora.triton_ops`; elsewhere :func:`lora_delta_ref`.
"""

from __future__ import annotations

import torch


def slot_mask(slots: torch.Tensor, num_slots: int, rank: int, dtype: torch.dtype) -> torch.Tensor:
    """``[T, num_slots * rank]``: 1 in the columns of row ``t``'s slot, 0 elsewhere (and on
    every column of a base row)."""
    own = slots[:, None] == torch.arange(num_slots, device=slots.device)[None, :]
    return own.to(dtype).repeat_interleave(rank, dim=1)


def lora_delta_ref(
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    slots: torch.Tensor,
    out: torch.Tensor,
    mask: torch.Tensor | None = None,
) -> None:
    """Add every row's LoRA delta to ``out`` in place (the PyTorch reference).

    Two dense matmuls whatever the number of adapters: shrink through *all* slots at once,
    zero the columns that are not the row's own slot (``mask``, from :func:`slot_mask`; built
    here when not given), expand through all slots. The wasted columns cost little next to the
    base projection at LoRA ranks, and the step pays no per-adapter Python loop.
    """
    num_slots, rank, in_features = a.shape
    if mask is None:
        mask = slot_mask(slots, num_slots, rank, x.dtype)
    shrunk = torch.mm(x, a.view(num_slots * rank, in_features).t()).mul_(mask)
    out.addmm_(shrunk, b.view(b.shape[0], num_slots * rank).t())


def lora_delta(
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    slots: torch.Tensor,
    out: torch.Tensor,
    mask: torch.Tensor | None = None,
) -> None:
    """:func:`lora_delta_ref`'s result, by the Triton kernels when ``x`` is on CUDA."""
    if x.is_cuda:
        from engine.lora.triton_ops import lora_delta_triton

        lora_delta_triton(x, a, b, slots, out)
    else:
        lora_delta_ref(x, a, b, slots, out, mask)
