"""The int8-activation block linears (engine/kernels/csrc/quantized_int8.c) against their
definition: each block of 32 inputs rounded to int8 with scale max|x| / 127, times the weights
the GGUF blocks encode. Integer products are exact, so only the float sums' order and the final
bfloat16 rounding separate the kernel from the PyTorch reference below.
"""

from __future__ import annotations

import pytest
import torch
from gguf_blocks import random_blocks

from engine import kernels
from engine.kernels import cpu
from engine.models.block_linear import block_matmul

pytestmark = pytest.mark.skipif(
    not cpu.int8_available(),
    reason="the int8 kernels need the native library built with AVX512-VNNI or AVX2",
)


def int8_reference(x: torch.Tensor) -> torch.Tensor:
    """``x`` as the kernel sees it: per block of 32, d = max|x| / 127, q = round(x / d)."""
    blocks = x.float().reshape(x.shape[0], -1, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127.0
    inverse = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(blocks * inverse).clamp(-127, 127)
    return (q * d).reshape(x.shape)


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("cols", [128, 192])  # 2 and 3 pairs of blocks per row
def test_int8_linear_matches_the_int8_reference(kind: str, rows: int, cols: int) -> None:
    blocks = random_blocks(kind, 70, cols, seed=rows)  # 70 outputs: not a multiple of 4
    assert blocks.pack_q8()
    weight = blocks.dequantize()
    bias = torch.randn(70)
    x = (torch.randn(rows, cols) * 3).to(torch.bfloat16)
    x[0, :32] = 0  # an all-zero block: scale 0, no division by it
    out = kernels.quantized_linear(
        x, kind, blocks.qs, blocks.scales, blocks.mins, bias, blocks.packed_q8
    )
    assert out is not None and out.dtype == torch.bfloat16 and out.shape == (rows, 70)
    expected = int8_reference(x) @ weight.T + bias
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=1e-2)


def test_int8_linear_stays_near_the_exact_products() -> None:
    """The documented cost: an input block rounded to 8 bits moves each output by a small
    fraction of the exact one's size."""
    blocks = random_blocks("q4_1", 64, 576, seed=7)
    exact = torch.randn(4, 576).to(torch.bfloat16)
    reference = exact.float() @ blocks.dequantize().T
    assert blocks.pack_q8()
    out = block_matmul(exact, blocks.dequantize().to(torch.bfloat16), blocks, None).float()
    error = (out - reference).norm() / reference.norm()
    assert 0 < error < 0.02


def test_float32_inputs_stay_exact_with_packed_blocks() -> None:
    blocks = random_blocks("q4_1", 12, 128, seed=2)
    assert blocks.pack_q8()
    x = torch.randn(3, 128)
    out = block_matmul(x, blocks.dequantize(), blocks, None)
    torch.testing.assert_close(out, x @ blocks.dequantize().T, atol=1e-4, rtol=1e-5)


def test_sizes_the_int8_kernel_cannot_take_stay_exact() -> None:
    blocks = random_blocks("q8_0", 8, 96, seed=4)  # 96 inputs: 3 blocks, not whole pairs
    assert not blocks.pack_q8() and blocks.packed_q8 is None
    assert kernels.pack_blocks_q8("q4_0", blocks.qs, blocks.scales, None) is None
    x = torch.randn(2, 96).to(torch.bfloat16)
    out = block_matmul(x, blocks.dequantize().to(torch.bfloat16), blocks, None)
    torch.testing.assert_close(out.float(), x.float() @ blocks.dequantize().T, atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_scales_float16_cannot_hold_stay_exact(kind: str) -> None:
    """The packed records keep scales in float16, as GGUF does; blocks whose scales (or mins)
    float16 cannot hold exactly are not packed, and their products stay exact."""
    blocks = random_blocks(kind, 8, 128, seed=6)
    assert kernels.pack_blocks_q8(kind, blocks.qs, blocks.scales, blocks.mins) is not None
    if kind == "q4_1":
        assert blocks.mins is not None
        mins = blocks.mins.clone()
        mins[3, 1] = 1e-3 + 2**-30  # below float16's precision at that size
        assert kernels.pack_blocks_q8(kind, blocks.qs, blocks.scales, mins) is None
    scales = blocks.scales.clone()
    scales[5, 2] = 70000.0  # past float16's range
    assert kernels.pack_blocks_q8(kind, blocks.qs, scales, blocks.mins) is None
    tiny = blocks.scales.clone()
    tiny[0, 0] = 2**-24  # float16's smallest subnormal: held exactly
    assert kernels.pack_blocks_q8(kind, blocks.qs, tiny, blocks.mins) is not None


def test_big_steps_take_the_int8_blocks_only_where_bf16_matmuls_are_slow(monkeypatch) -> None:
    """Where the CPU multiplies bf16 in hardware, the dense matmul serves steps over 8 rows;
    elsewhere (AVX2 only) the int8 blocks serve up to 64 rows."""
    blocks = random_blocks("q4_1", 64, 128, seed=1)
    dense = blocks.dequantize().to(torch.bfloat16)
    x = torch.randn(40, 128).to(torch.bfloat16)
    assert blocks.max_rows == 8  # not packed: the exact kernel's limit
    assert blocks.pack_q8()
    int8 = kernels.quantized_linear(x, "q4_1", blocks.qs, blocks.scales, blocks.mins, None,
                                    blocks.packed_q8)  # fmt: skip
    monkeypatch.setattr(cpu, "bf16_matmul_native", lambda: True)
    assert blocks.max_rows == 8
    assert torch.equal(block_matmul(x, dense, blocks, None), x @ dense.T)
    monkeypatch.setattr(cpu, "bf16_matmul_native", lambda: False)
    assert blocks.max_rows == 64
    assert int8 is not None and torch.equal(block_matmul(x, dense, blocks, None), int8)
