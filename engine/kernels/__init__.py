"""Kernels of the engine: Triton on CUDA, native C on CPU, and their PyTorch references.

:func:`write_kv_cache` and :func:`paged_attention` pick the implementation from the device of
their inputs. Triton is imported only when a CUDA tensor arrives, so a CPU process never pays
for it (and tests can set ``TRITON_INTERPRET=1`` before the first import). On CPU, attention
runs the native kernel of :mod:`engine.kernels.cpu` when it is built (it reads the paged cache
in place) and the PyTorch reference otherwise.
"""

from __future__ import annotations

import torch

from engine.kernels import cpu
from engine.kernels.reference import paged_attention_ref, write_kv_cache_ref


def write_kv_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter new K/V rows into the paged cache (see :func:`write_kv_cache_ref`)."""
    if key.is_cuda:
        from engine.kernels.kv_cache_write import write_kv_cache_triton

        write_kv_cache_triton(key, value, kv_cache, slot_mapping)
    else:
        write_kv_cache_ref(key, value, kv_cache, slot_mapping)


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    query_lens_cpu: list[int],
    seq_lens_cpu: list[int],
) -> torch.Tensor:
    """Causal attention over the paged cache (see :func:`paged_attention_ref`)."""
    args = (query, kv_cache, block_tables, query_start_loc, seq_lens, scale)
    if query.is_cuda:
        from engine.kernels.paged_attention import paged_attention_triton

        return paged_attention_triton(*args, query_lens_cpu, seq_lens_cpu)
    out = cpu.paged_attention_cpu(*args)
    if out is not None:
        return out
    return paged_attention_ref(*args, query_lens_cpu, seq_lens_cpu)


__all__ = ["paged_attention", "paged_attention_ref", "write_kv_cache", "write_kv_cache_ref"]
