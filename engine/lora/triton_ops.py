"""Triton twin of :func:`engine.lora.ops.lora_delta_ref` (same signature, same result).

Per-row gather, as punica's BGMV: the shrink kernel runs one program per (row, block of rank)
and reads only the row's own slot of A; the expand kernel runs one program per (row, block of
output columns) and reads only the row's own columns of B, adding into ``out``. A base row
(slot -1) reads and writes nothing. The rank-wide intermediate stays float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, slots_ptr, y_ptr,
    x_stride, in_features,
    RANK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    ranks = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    if slot < 0:  # a base-model row: the expand kernel skips it too
        return
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for k0 in range(0, in_features, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        col_ok = cols < in_features
        x = tl.load(x_ptr + row * x_stride + cols, mask=col_ok, other=0.0)
        a_rows = slot * RANK + ranks
        a_mask = (ranks[:, None] < RANK) & col_ok[None, :]
        a = tl.load(a_ptr + a_rows[:, None] * in_features + cols[None, :], mask=a_mask, other=0.0)
        acc += tl.sum(a.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    tl.store(y_ptr + row * RANK + ranks, acc, mask=ranks < RANK)


@triton.jit
def _expand_kernel(
    y_ptr, b_ptr, slots_ptr, out_ptr,
    out_stride, out_features,
    RANK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    if slot < 0:
        return
    col_ok = cols < out_features
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for r0 in range(0, RANK, BLOCK_R):
        ranks = r0 + tl.arange(0, BLOCK_R)
        r_ok = ranks < RANK
        y = tl.load(y_ptr + row * RANK + ranks, mask=r_ok, other=0.0)
        b_offsets = (slot * out_features + cols[:, None]) * RANK + ranks[None, :]
        b = tl.load(b_ptr + b_offsets, mask=col_ok[:, None] & r_ok[None, :], other=0.0)
        acc += tl.sum(b.to(tl.float32) * y[None, :], axis=1)
    dst = out_ptr + row * out_stride + cols
    old = tl.load(dst, mask=col_ok, other=0.0)
    tl.store(dst, (old.to(tl.float32) + acc).to(old.dtype), mask=col_ok)


def lora_delta_triton(
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    slots: torch.Tensor,
    out: torch.Tensor,
    segments: object = None,
) -> None:
    """Add each row's LoRA delta into ``out`` (``segments`` is the reference's; unused)."""
    tokens, in_features = x.shape
    rank = a.shape[1]
    if tokens == 0:
        return
    if x.stride(1) != 1:
        x = x.contiguous()
    shrunk = torch.empty(tokens, rank, dtype=torch.float32, device=x.device)
    block_r = min(triton.next_power_of_2(rank), 64)
    _shrink_kernel[(tokens, triton.cdiv(rank, block_r))](
        x, a, slots, shrunk, x.stride(0), in_features,
        RANK=rank, BLOCK_R=block_r, BLOCK_K=64,
    )  # fmt: skip
    out_features = out.shape[1]
    block_n = 64
    _expand_kernel[(tokens, triton.cdiv(out_features, block_n))](
        shrunk, b, slots, out, out.stride(0), out_features,
        RANK=rank, BLOCK_N=block_n, BLOCK_R=min(triton.next_power_of_2(rank), 32),
    )  # fmt: skip
