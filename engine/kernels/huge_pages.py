"""Memory the CPU kernels stream every step, mapped on transparent huge pages where Linux allows.

One decode step of the default model reads about 96 MB of weight panels and, at a few hundred
positions, tens of megabytes of KV cache. On 4 KB pages that is some 30,000 TLB misses a step,
and the hardware prefetchers start over at every 4 KB page boundary. Linux's transparent huge
pages in ``madvise`` mode (the usual default) back a region with 2 MB pages only where the
program asks for them. This module maps such regions (anonymous, 2 MB-aligned,
``MADV_HUGEPAGE``) and hands them out as tensors:

* :func:`huge_zeros`: a zeroed tensor (the CPU KV cache), its pages taken at once, as
  ``torch.zeros`` takes them (a request never waits on the first touch of its blocks).
* :func:`gather_on_huge_pages`: one region holding copies of many small tensors side by side,
  in the given order (the weight panels of every linear, in the order a step reads them).

Where the system has no transparent huge pages (``never``, another OS, a region under 2 MB),
the memory is ordinary and nothing else changes. Only the page size changes, never a value: the
kernels read the same bytes at other addresses. Measured in docs/benchmarks.md ("Huge pages for
the streamed memory").
"""

from __future__ import annotations

import mmap
from collections.abc import Sequence

import torch

HUGE_PAGE = 2 << 20
_ALIGN = 64  # each gathered tensor starts on a cache line


def _advise() -> int | None:
    """``MADV_HUGEPAGE`` where this platform has it (Linux), else None."""
    return getattr(mmap, "MADV_HUGEPAGE", None)


def huge_buffer(nbytes: int) -> torch.Tensor:
    """A zeroed uint8 tensor of ``nbytes``; from 2 MB on, on an anonymous mapping whose 2 MB
    aligned span is advised for huge pages. The tensor keeps the mapping alive."""
    advice = _advise()
    if nbytes < HUGE_PAGE or advice is None:
        return torch.zeros(nbytes, dtype=torch.uint8)
    span = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    region = mmap.mmap(-1, span + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(region, dtype=torch.uint8)
    offset = -whole.data_ptr() % HUGE_PAGE  # a multiple of the 4 KB page: madvise takes it
    try:
        region.madvise(advice, offset, span)
    except OSError:  # a kernel built without THP: ordinary pages
        pass
    return whole[offset : offset + nbytes]


def huge_zeros(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """``torch.zeros(shape, dtype=dtype)`` on the CPU, on huge pages where they apply."""
    count = 1
    for n in shape:
        count *= n
    nbytes = count * torch.empty((), dtype=dtype).element_size()
    out = huge_buffer(nbytes).view(dtype).view(tuple(shape))
    return out.zero_()  # touched now: every page mapped before the first step


def gather_on_huge_pages(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of ``tensors`` (contiguous CPU tensors) side by side in one huge-page region, in
    order, each on a 64-byte boundary: views of the region, equal to the originals."""
    sizes = [t.numel() * t.element_size() for t in tensors]
    starts, at = [], 0
    for size in sizes:
        starts.append(at)
        at += -(-size // _ALIGN) * _ALIGN
    region = huge_buffer(max(at, 1))
    out = []
    for t, start, size in zip(tensors, starts, sizes, strict=True):
        if not t.is_contiguous() or not t.is_cpu:
            raise ValueError("gather_on_huge_pages takes contiguous CPU tensors")
        view = region[start : start + size].view(t.dtype).view(t.shape)
        view.copy_(t)
        out.append(view)
    return out
