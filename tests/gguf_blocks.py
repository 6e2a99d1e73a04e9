"""Random GGUF blocks for kernel tests (``from gguf_blocks import random_blocks``; tests/ is
on sys.path because tests/conftest.py lives there)."""

from __future__ import annotations

import torch

from engine.models.block_linear import GGUFBlocks


def random_blocks(kind: str, rows: int, cols: int, seed: int) -> GGUFBlocks:
    """A ``[rows, cols]`` weight in Q4_1 or Q8_0 blocks with small random scales (and mins),
    float16 values held in float32 as a GGUF file's are."""
    gen = torch.Generator().manual_seed(seed)
    nb = cols // 32
    scales = (torch.rand(rows, nb, generator=gen) * 0.02 + 0.001).half().float()
    if kind == "q4_1":
        qs = torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8, generator=gen)
        mins = (torch.randn(rows, nb, generator=gen) * 0.05).half().float()
        return GGUFBlocks(kind, qs, scales, mins)
    qs = torch.randint(-128, 128, (rows, cols), dtype=torch.int8, generator=gen)
    return GGUFBlocks(kind, qs, scales)
