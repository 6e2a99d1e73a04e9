"""Triton kernels whose every output row is computed the same way whatever the number of rows
(``--batch-invariant`` on CUDA, docs/numerics.md).

cuBLAS and PyTorch's reductions pick their tiling, their split of the reduced dimension and
their kernel by the shape of the call, so a request's row can get other bits inside a bigger
step. These kernels fix all of that: the matmul's tiles (``BLOCK_M x BLOCK_N``, ``BLOCK_K`` of
the reduction per ``tl.dot``, float32 sums) and the order of the reduction (``K`` from 0 up,
one program per output tile, never split) are constants, so output ``(i, j)`` depends only on
row ``i`` of ``x`` and row ``j`` of the weight; the RMSNorm is one program per row with the
row's width padded to a fixed power of two. Attention needs no kernel of its own: the general
paged kernel (:mod:`engine.kernels.triton_paged_attention`) walks each query's context in
fixed tiles from position 0 whatever the step holds, so in this mode decode steps take it
instead of the split-K decode kernel, whose split count follows the batch's size.

The speed is not the point: a lone decode row pays a 64-row tile. vLLM offers the same trade
as an opt-in mode.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 64
BLOCK_N = 64
BLOCK_K = 32


@triton.jit
def _matmul_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, M, N, K,
    stride_xm, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = (k0 + offs_k) < K
        x = tl.load(
            x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + (k0 + offs_k)[None, :],
            mask=m_mask[:, None] & k_mask[None, :], other=0.0,
        )  # fmt: skip
        w = tl.load(
            w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + (k0 + offs_k)[None, :],
            mask=n_mask[:, None] & k_mask[None, :], other=0.0,
        )  # fmt: skip
        acc += tl.dot(x, tl.trans(w), input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(
        out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=m_mask[:, None] & n_mask[None, :],
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` in ``x``'s dtype, each output row independent of the others
    (``x`` ``[..., K]``, ``weight`` ``[N, K]`` of ``x``'s dtype)."""
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    w = weight if weight.stride(-1) == 1 else weight.contiguous()
    m, n = x2.shape[0], w.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out.reshape(*lead, n)
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
    _matmul_kernel[grid](
        x2, w, bias if bias is not None else w, out, m, n, k,
        x2.stride(0), w.stride(0), out.stride(0),
        HAS_BIAS=bias is not None,
        # float32: plain float32 products; bf16/fp16 are exact in tf32's inputs
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
    )  # fmt: skip
    return out.reshape(*lead, n)


@triton.jit
def _add_rms_norm_kernel(
    x_ptr, delta_ptr, weight_ptr, out_ptr, N, stride_x, stride_d, stride_o, eps,
    HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_DELTA:
        x = x + tl.load(delta_ptr + row * stride_d + offs, mask=mask, other=0.0)
        tl.store(x_ptr + row * stride_x + offs, x, mask=mask)
    x32 = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x32 * x32, axis=0) / N + eps)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0)
    y = (x32 * inv).to(x.dtype).to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """``x += delta`` in place (when given), then Llama's RMSNorm of ``x`` times ``weight``
    (normalized in float32, rounded to ``x``'s dtype before the weight, as Hugging Face does),
    one program per row: a row's bits do not depend on the others."""
    n = x.shape[-1]
    src = x if x.is_contiguous() else x.contiguous()  # a view: worked on in a copy
    x2 = src.view(-1, n)
    d2 = delta.reshape(-1, n).contiguous() if delta is not None else None
    out = torch.empty(x2.shape, dtype=torch.result_type(x2, weight), device=x.device)
    if x2.shape[0] == 0:
        return out.view(*x.shape[:-1], n)
    _add_rms_norm_kernel[(x2.shape[0],)](
        x2, d2 if d2 is not None else x2, weight.contiguous(), out, n,
        x2.stride(0), d2.stride(0) if d2 is not None else 0, out.stride(0), eps,
        HAS_DELTA=d2 is not None, BLOCK=triton.next_power_of_2(n),
    )  # fmt: skip
    if d2 is not None and src is not x:
        x.copy_(src)
    return out.view(*x.shape[:-1], n)
