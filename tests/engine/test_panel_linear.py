"""The batch invariant kernels (csrc/panel_linear.c, silu_mul in csrc/norm_rope.c, the softmax of
csrc/paged_attention.c; the last two share common.h's exp8_clamped) compute
what their definitions say, and a row's bits do not depend on the rows around it or on the
number of threads: the property the default numerics rest on (issue 42)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from attention_oracle import attention_oracle, paged_case
from gguf_blocks import assert_panel_product, random_blocks

from engine import kernels
from engine.kernels import cpu
from engine.models.block_linear import GGUFBlocks, block_matmul

pytestmark = pytest.mark.skipif(not cpu.available(), reason="no C compiler for the CPU kernels")

KINDS = ["q4_1", "q8_0"]


@pytest.fixture
def restore_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _panel(x: torch.Tensor, blocks: GGUFBlocks, bias: torch.Tensor | None = None) -> torch.Tensor:
    assert blocks.panels is not None
    out = kernels.quantized_linear(
        x, blocks.kind, blocks.qs, blocks.scales, blocks.mins, bias, panels=blocks.panels
    )
    assert out is not None and out.dtype == x.dtype
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_panel_linear_equals_the_product_of_the_dequantized_weight(kind: str) -> None:
    """70 output rows (a padded last panel), 192 inputs, a bias; 1, 5 and 64 rows."""
    blocks = random_blocks(kind, 70, 192, seed=3)
    blocks.pack_panels()
    gen = torch.Generator().manual_seed(2)
    weight, bias = blocks.dequantize().double(), torch.randn(70, generator=gen)
    for rows in (1, 5, 64):
        x = torch.randn(rows, 192, generator=gen) * 3
        out = _panel(x, blocks, bias)
        assert out.shape == (rows, 70)
        assert_panel_product(out, x, weight, bias)
        wide = _panel(x.bfloat16(), blocks, bias)  # bf16 in and out, float32 inside
        expected_bf16 = x.bfloat16().double() @ weight.T + bias.double()
        torch.testing.assert_close(wide.double(), expected_bf16, atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize("kind", KINDS)
def test_one_row_has_the_same_bits_alone_as_inside_a_64_row_step(
    kind: str, restore_threads: None
) -> None:
    """Every row of a 64-row step, computed alone, at 1, 2 and 3 threads: equal bits."""
    blocks = random_blocks(kind, 96, 256, seed=4)
    blocks.pack_panels()
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(3)) * 2
    torch.set_num_threads(1)
    step = _panel(x, blocks)
    for threads in (1, 2, 3):
        torch.set_num_threads(threads)
        assert torch.equal(_panel(x, blocks), step)
        for i in (0, 5, 17, 63):
            assert torch.equal(_panel(x[i : i + 1], blocks)[0], step[i])
        assert torch.equal(_panel(x[3:11], blocks), step[3:11])  # tiles start elsewhere


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "k", [320, 1536]
)  # 10 blocks (a partial unpacked chunk), 48 (SmolLM2's down)
def test_a_512_row_prefill_gives_each_row_its_bits_alone(
    kind: str, k: int, restore_threads: None
) -> None:
    """Steps of 12 rows or more unpack each panel to floats once for many rows and run 6-row
    tiles; smaller ones unpack per tile: every row still has the bits it gets alone, in steps of
    7, 13 and 64 rows starting anywhere, at 1 and 2 threads, and the product is the dequantized
    weight's within float tolerance."""
    blocks = random_blocks(kind, 100, k, seed=k)
    blocks.pack_panels()
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(512, k, generator=gen)
    bias = torch.randn(100, generator=gen)
    torch.set_num_threads(2)
    step = _panel(x, blocks, bias)
    assert_panel_product(step, x, blocks.dequantize(), bias)
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for rows, start in ((1, 0), (1, 300), (1, 511), (7, 3), (13, 250), (64, 0), (64, 441)):
            assert torch.equal(
                _panel(x[start : start + rows], blocks, bias), step[start : start + rows]
            )
    bf16 = x.bfloat16()
    assert torch.equal(_panel(bf16[200:201], blocks, bias)[0], _panel(bf16, blocks, bias)[200])


@pytest.mark.skipif(not cpu.int8_available(), reason="no int8-activation kernels here")
@pytest.mark.parametrize("kind", KINDS)
def test_the_int8_path_gives_one_row_the_same_bits_alone_as_inside_a_64_row_step(
    kind: str, restore_threads: None
) -> None:
    """The opt-in int8 activations (--dtype bfloat16 --gguf-activations int8) round each row
    per block of 32 on its own scale: its kernel is row invariant too (the opt-in is not batch
    invariant because bigger steps leave it for the dense matmul)."""
    blocks = random_blocks(kind, 96, 256, seed=6)
    assert blocks.pack_q8()
    x = (torch.randn(64, 256) * 2).bfloat16()

    def int8(rows: torch.Tensor) -> torch.Tensor:
        out = kernels.quantized_linear(
            rows, kind, blocks.qs, blocks.scales, blocks.mins, None, blocks.packed_q8
        )
        assert out is not None
        return out

    for threads in (1, 2, 3):
        torch.set_num_threads(threads)
        step = int8(x)
        for i in (0, 9, 63):
            assert torch.equal(int8(x[i : i + 1])[0], step[i])


def test_block_matmul_runs_every_step_on_the_panels_when_attached() -> None:
    """Past max_rows too: a 200-row step gives each row the bits it gets alone (the dense
    weight is poisoned, so a step that left the panels would show)."""
    blocks = random_blocks("q4_1", 40, 64, seed=7)
    blocks.pack_panels()
    poisoned = torch.full((40, 64), float("nan"))
    x = torch.randn(200, 64)
    out = block_matmul(x, poisoned, blocks, None)
    assert not out.isnan().any() and 200 > blocks.max_rows
    assert torch.equal(block_matmul(x[77:78], poisoned, blocks, None)[0], out[77])


def test_inputs_of_another_width_are_declined_not_read_past_the_panels() -> None:
    blocks = random_blocks("q8_0", 16, 64, seed=8)
    blocks.pack_panels()
    assert blocks.panels is not None
    for width in (48, 32, 96):  # not a multiple of 32; narrower and wider than the weight's
        assert cpu.panel_linear(torch.randn(2, width), "q8_0", blocks.panels, 16, None) is None
    assert cpu.panel_linear(torch.randn(2, 64), "q8_0", blocks.panels, 17, None) is None


@pytest.mark.parametrize("intermediate", [1536, 100])
def test_silu_mul_matches_pytorch_and_is_position_invariant(
    intermediate: int, restore_threads: None
) -> None:
    """100: a row's last partial vector goes through the padded path."""
    gate_up = torch.randn(70, 2 * intermediate) * 4
    gate, up = gate_up.split(intermediate, dim=-1)
    out = kernels.silu_mul(gate_up, intermediate)
    torch.testing.assert_close(out, F.silu(gate) * up, atol=1e-5, rtol=1e-6)
    for threads in (1, 3):
        torch.set_num_threads(threads)
        assert torch.equal(kernels.silu_mul(gate_up, intermediate), out)
        assert torch.equal(kernels.silu_mul(gate_up[41:42], intermediate)[0], out[41])


STEP_ROWS = (1, 7, 64, 512)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_rows_keep_their_bits_in_steps_of_1_7_64_and_512_rows(
    dtype: torch.dtype, restore_threads: None
) -> None:
    """The native kernel (float32 and bf16 in and out): every row of a 512-row step equals its
    value in steps of 7 and 64 rows and alone, and PyTorch's silu within float tolerance, across
    the exp's whole range: gates out to +-40 and the clamp's edges (e^x is clamped to [-87, 88])."""
    torch.set_num_threads(2)
    gate_up = torch.randn(512, 2 * 1536, generator=torch.Generator().manual_seed(5)) * 8
    gate_up[:, :8] = torch.tensor([-200.0, -88.0, -87.5, 0.0, 1e-30, 87.0, 88.5, 300.0])
    gate_up = gate_up.to(dtype)

    def silu_mul(rows: torch.Tensor) -> torch.Tensor:
        out = cpu.silu_mul_cpu(rows, 1536)
        assert out is not None and out.dtype == dtype
        return out

    step = silu_mul(gate_up)
    gate, up = gate_up.float().split(1536, dim=-1)
    expected = (F.silu(gate) * up).to(dtype).float()  # bf16: the one rounding of the output
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(step.float(), expected, atol=tol, rtol=tol)
    for rows in STEP_ROWS:
        for start in (0, 512 - rows):
            part = silu_mul(gate_up[start : start + rows])
            assert torch.equal(part, step[start : start + rows])


@pytest.mark.parametrize("q_mul", [1.0, 12.0])  # 12: scores far below the row's maximum
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_rows_keep_their_bits_in_chunks_of_1_7_64_and_512_rows(
    dtype: torch.dtype, q_mul: float
) -> None:
    """The last N query rows of a 520-position prompt as one chunk, N = 1 (a decode), 7, 64,
    512: each row's output has the bits it has in the 512-row chunk, and the 512-row chunk
    equals the float64 oracle within float tolerance (SmolLM2's shape: 9 heads, 3 KV heads,
    head_dim 64, so the vectorized softmax runs)."""
    q, cache, meta, ks, vs, _ = paged_case(9, 3, 64, 16, [(512, 520)], dtype, seed=9)
    q = (q.float() * q_mul).to(dtype)
    scale = 64**-0.5

    def chunk(rows: int) -> torch.Tensor:
        starts = torch.tensor([0, rows], dtype=torch.int32)
        out = cpu.paged_attention_cpu(
            q[512 - rows :], cache, meta.block_tables, starts, meta.seq_lens, scale
        )
        assert out is not None
        return out

    step = chunk(512)
    expected = attention_oracle(q, ks, vs, [512], scale)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    # A float32 score's rounding grows with its size (about sqrt(head_dim) roundings of 2^-24
    # of its magnitude), and the softmax passes a score's absolute error on as a relative error
    # of its weight, so of the output (|v| ~ 1). At q_mul 12 the scores reach +-63: builds whose
    # score is one chain of 64 FMAs (AVX-512, portable) are up to 2e-5 off the float64 oracle,
    # AVX2 (8 lanes summed) 7e-6; at q_mul 1, 6e-7 for all three.
    scores = torch.einsum("thd,shd->ths", q.double(), ks[0].double().repeat_interleave(3, 1))
    atol = tol + 64**0.5 * 2.0**-24 * scores.abs().max().item() * scale
    torch.testing.assert_close(step.double(), expected, atol=atol, rtol=tol)
    for rows in STEP_ROWS[:-1]:
        assert torch.equal(chunk(rows), step[512 - rows :])
