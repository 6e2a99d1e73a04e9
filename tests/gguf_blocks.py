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


# |X| <= 2^PANEL_X_BITS: the integers the panel kernel (csrc/panel_linear.c) writes an input in.
PANEL_X_BITS = 13


def assert_panel_product(
    out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> None:
    """``out`` is ``x @ weight.T (+ bias)`` as the panel kernel defines it: each input carried
    as an integer multiple of its block's power-of-two step s (2^-PANEL_X_BITS of the block's
    power of two above its largest magnitude), so off by at most s / 2; the bound is those
    errors times |weight|, plus float32 rounding of the chain."""
    xd, wd = x.double(), weight.double()
    expected = xd @ wd.T + (bias.double() if bias is not None else 0.0)
    top = xd.abs().reshape(x.shape[0], -1, 32).amax(dim=-1)
    step = torch.exp2(torch.floor(torch.log2(top.clamp_min(1e-30))) + 1 - PANEL_X_BITS)
    err = (step / 2).repeat_interleave(32, dim=1)
    bound = err @ wd.abs().T + 1e-5 * (xd.abs() @ wd.abs().T) + 1e-6
    assert bool(((out.double() - expected).abs() <= bound).all()), (
        f"off by {(out.double() - expected).abs().max().item():.3g}, "
        f"bound {bound.min().item():.3g}..{bound.max().item():.3g}"
    )
