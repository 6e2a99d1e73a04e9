"""The native kernels built for other instruction sets compute what their definitions say.

``-march=native`` compiles only the building CPU's paths: AVX-512 (VNNI, BF16) on one machine,
AVX2 on another, portable C on a third, and a test run sees only its own machine's. Here the
library is built again with the wider sets switched off (``-mno-avx512f``: the AVX2 paths;
``-mno-avx2 -mno-fma``: the portable ones) and each build is checked against the same
references as the native one: the int8-activation and exact block linears and paged attention.
"""

from __future__ import annotations

import pytest
import torch
from attention_oracle import attention_oracle, float16_edge_rows, paged_case
from gguf_blocks import assert_panel_product, random_blocks

from engine import kernels
from engine.kernels import cpu

BUILDS = {"avx2": ["-mno-avx512f"], "portable": ["-mno-avx2", "-mno-fma"]}

pytestmark = pytest.mark.skipif(not cpu.available(), reason="no C compiler for the CPU kernels")


@pytest.fixture(scope="module", params=sorted(BUILDS))
def build(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    name = request.param
    if name == "avx2" and not {"avx2", "fma", "f16c"} <= cpu.cpu_features():
        pytest.skip("this CPU cannot run an AVX2 build")
    out = tmp_path_factory.mktemp("kernels") / f"{name}.so"
    cpu.compile_library(cpu._compiler() or "cc", out, extra_flags=BUILDS[name])
    return name, cpu.open_library(out)


@pytest.fixture
def lib(build, monkeypatch: pytest.MonkeyPatch):
    """The build, as every kernel wrapper's library for one test."""
    _, library = build
    monkeypatch.setattr(cpu, "load", lambda: library)
    return build


def test_a_build_reports_the_instruction_sets_it_was_built_with(lib) -> None:
    name, library = lib
    features = cpu.compiled_features()
    assert not features & {"avx512f", "avx512bw", "avx512_bf16", "avx512_vnni"}
    assert ({"avx2", "fma"} <= features) is (name == "avx2")
    # the int8 kernels have an AVX2 build; the portable build declines them
    assert bool(library.q8_supported(64)) is (name == "avx2")
    assert not library.q8_supported(96)


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_int8_linear_of_a_build_matches_the_int8_reference(lib, kind: str) -> None:
    name, _ = lib
    blocks = random_blocks(kind, 70, 192, seed=3)
    packed = kernels.pack_blocks_q8(kind, blocks.qs, blocks.scales, blocks.mins)
    if name == "portable":
        assert packed is None  # no int8 path: the engine keeps the exact one
        return
    assert packed is not None
    weight, bias = blocks.dequantize(), torch.randn(70)
    gen = torch.Generator().manual_seed(8)
    for rows in (1, 3, 5):  # one pass of 4 weight rows; two passes of 2; both
        x = (torch.randn(rows, 192, generator=gen) * 3).to(torch.bfloat16)
        x[0, :32] = 0
        out = kernels.quantized_linear(x, kind, blocks.qs, blocks.scales, blocks.mins, bias, packed)
        assert out is not None and out.shape == (rows, 70)
        # the kernel's rounding: d = max|x| / 127 per block of 32, q = round(x * (1 / d))
        blocks_x = x.float().reshape(rows, -1, 32)
        d = blocks_x.abs().amax(-1, keepdim=True) / 127
        inverse = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
        q = torch.round(blocks_x * inverse).clamp(-127, 127)
        expected = (q * d).reshape(rows, 192) @ weight.T + bias
        torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_exact_block_linear_of_a_build_equals_the_matmul(lib, kind: str) -> None:
    blocks = random_blocks(kind, 37, 128, seed=5)
    weight = blocks.dequantize()
    for rows in (1, 6):
        x = torch.randn(rows, 128)
        out = kernels.quantized_linear(x, kind, blocks.qs, blocks.scales, blocks.mins, None)
        assert out is not None
        torch.testing.assert_close(out, x @ weight.T, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_of_a_build_matches_the_oracle(lib, dtype: torch.dtype) -> None:
    head_dim = 64
    shape = [(1, 40), (7, 7), (1, 130), (18, 33)]
    q, cache, meta, ks, vs, q_lens = paged_case(9, 3, head_dim, 16, shape, dtype, seed=11)
    scale = head_dim**-0.5
    out = cpu.paged_attention_cpu(
        q, cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, scale
    )
    assert out is not None and out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(
        out.double(), attention_oracle(q, ks, vs, q_lens, scale), atol=tol, rtol=tol
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_of_a_build_reads_an_int8_cache(lib, dtype: torch.dtype) -> None:
    head_dim = 64
    shape = [(1, 40), (7, 7), (1, 130), (18, 33), (1, 5), (1, 9)]
    q, cache, meta, ks, vs, q_lens = paged_case(
        9, 3, head_dim, 16, shape, dtype, seed=12, cache_dtype=torch.int8
    )
    scale = head_dim**-0.5
    out = cpu.paged_attention_cpu(
        q, cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, scale
    )
    assert out is not None and out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(
        out.double(), attention_oracle(q, ks, vs, q_lens, scale), atol=tol, rtol=tol
    )


def test_a_build_reads_and_writes_a_float16_cache_as_the_references_do(lib) -> None:
    """The portable build's float16 conversions are C of its own (common.h), the AVX2 build's
    reads use vcvtph2ps: both give torch's bits and the oracle's attention."""
    from engine.kernels.reference import write_kv_cache_ref

    values = float16_edge_rows(6, 2 * 16).view(6, 2, 16)
    keys = torch.randn(6, 2, 16)
    qkv = torch.cat([torch.randn(6, 4 * 16), keys.flatten(1), values.flatten(1)], dim=1)
    positions, slots = torch.zeros(6, dtype=torch.int64), torch.tensor([3, 9, 0, 14, 1, 7])
    no_turn = torch.ones(8, 8), torch.zeros(8, 8)  # cos 1, sin 0: RoPE leaves the rows as they are
    cache = torch.zeros(2, 4, 4, 2, 16, dtype=torch.float16)
    assert cpu.rope_write_kv_cpu(qkv, 4, 2, 16, *no_turn, positions, cache, slots)
    expected = torch.zeros_like(cache)
    write_kv_cache_ref(keys, values, expected, slots)
    assert torch.equal(cache.view(torch.int16), expected.view(torch.int16))
    head_dim = 64
    shape = [(1, 40), (7, 7), (1, 130), (18, 33), (1, 5), (1, 9)]
    q, cache, meta, ks, vs, q_lens = paged_case(
        9, 3, head_dim, 16, shape, torch.float32, seed=14, cache_dtype=torch.float16
    )
    scale = head_dim**-0.5
    out = cpu.paged_attention_cpu(
        q, cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, scale
    )
    assert out is not None
    torch.testing.assert_close(
        out.double(), attention_oracle(q, ks, vs, q_lens, scale), atol=1e-5, rtol=1e-5
    )


def test_int8_cache_write_of_a_build_stores_the_reference_bytes(lib) -> None:
    from engine.kernels.reference import write_kv_cache_ref

    tokens, q_heads, kv_heads, head_dim = 5, 6, 2, 32
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * head_dim).to(torch.bfloat16)
    half = head_dim // 2
    cos = torch.ones(8, half)  # angle 0: the rotation leaves every head as it is
    sin = torch.zeros(8, half)
    slots = torch.tensor([7, 0, 3, 12, 5])
    cache = torch.zeros(2, 4, 4, kv_heads, head_dim + 4, dtype=torch.int8)
    positions = torch.zeros(tokens, dtype=torch.int64)
    assert cpu.rope_write_kv_cpu(
        qkv, q_heads, kv_heads, head_dim, cos, sin, positions, cache, slots
    )
    k0 = q_heads * head_dim
    keys = qkv[:, k0 : k0 + kv_heads * head_dim].view(tokens, kv_heads, head_dim)
    values = qkv[:, k0 + kv_heads * head_dim :].view(tokens, kv_heads, head_dim)
    expected = torch.zeros_like(cache)
    write_kv_cache_ref(keys, values, expected, slots)
    assert torch.equal(cache, expected)


def test_int8_cache_attention_of_an_avx512_build_without_vnni_matches_the_oracle(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """AVX-512 without VNNI: the int8 cache's score pass takes the int16 row path (vpmaddwd)
    instead of the lanes path (vpdpbusd), and P V sums with vpmaddwd; both still add no more
    than the bf16 rounding of the output."""
    if not {"avx512f", "avx512bw"} <= cpu.cpu_features():
        pytest.skip("this CPU cannot run an AVX-512 build")
    out_path = tmp_path / "novnni.so"
    cpu.compile_library(cpu._compiler() or "cc", out_path, extra_flags=["-mno-avx512vnni"])
    library = cpu.open_library(out_path)
    monkeypatch.setattr(cpu, "load", lambda: library)
    assert "avx512_vnni" not in cpu.compiled_features()
    shape = [(1, 700), (1, 41), (7, 7), (1, 2), (1, 1)]
    q, cache, meta, ks, vs, q_lens = paged_case(
        9, 3, 64, 16, shape, torch.bfloat16, seed=5, cache_dtype=torch.int8
    )
    scale = 64**-0.5
    out = cpu.paged_attention_cpu(
        q, cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, scale
    )
    assert out is not None
    expected = attention_oracle(q, ks, vs, q_lens, scale)
    excess = (out.double() - expected).abs() - expected.abs() * 2.0**-8
    assert excess.max().item() <= 1e-3


def _same_bits_as_native(
    monkeypatch: pytest.MonkeyPatch,
    library: object,
    x: torch.Tensor,
    kind: str,
    panels: torch.Tensor,
    n: int,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """``cpu.panel_linear`` through ``library`` (another build), checked bit for bit against
    this machine's own library; returns the build's output."""
    native = cpu.panel_linear(x, kind, panels, n, bias)
    with monkeypatch.context() as patch:
        patch.setattr(cpu, "load", lambda: library)
        out = cpu.panel_linear(x, kind, panels, n, bias)
    assert native is not None and out is not None
    assert torch.equal(out, native)
    return out


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_panel_linear_of_a_build_gives_the_native_builds_bits(
    build, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """The batch invariant kernel is one chain of float32 FMAs per output element in every
    build (AVX2 vectors across output rows, or fmaf one element at a time): every build
    computes the same bits as this machine's own library. 9 rows: tiles that unpack the
    quants per tile; 70 rows: panels unpacked to floats for many rows (10 blocks: a partial
    chunk) in the AVX2 builds."""
    _, library = build
    blocks = random_blocks(kind, 37, 320, seed=9)
    blocks.pack_panels()
    assert blocks.panels is not None
    bias = torch.randn(37)
    for rows in (9, 70):
        x = torch.randn(rows, 320) * 2
        out = _same_bits_as_native(monkeypatch, library, x, kind, blocks.panels, 37, bias)
        assert_panel_product(out, x, blocks.dequantize(), bias)


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_panel_linear_of_a_build_keeps_its_bits_at_the_integer_extremes(
    build, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """The largest integers the products can meet: every quant at its end of the range (Q4_1
    nibbles 15, Q8_0 -128 and 127) against inputs just under a power of two, whose top digit
    is +-64. The AVX2 build sums Q4_1's pairs in int16 lanes over a whole block; a lane that
    saturated would change these bits against the portable build's plain integers."""
    _, library = build
    blocks = random_blocks(kind, 32, 256, seed=4)
    if kind == "q4_1":
        blocks.qs.fill_(0xFF)
    else:
        ends = torch.where(torch.arange(256) % 2 == 0, -128, 127).to(torch.int8)
        blocks.qs.copy_(ends.expand(32, -1))
    blocks.pack_panels()
    assert blocks.panels is not None
    sign = torch.where(torch.arange(256) % 3 == 0, -1.0, 1.0)
    x = torch.stack([sign * 1.9999999, -sign * 1.9999999, torch.full((256,), 1.9999999)])
    out = _same_bits_as_native(monkeypatch, library, x, kind, blocks.panels, 32, None)
    assert_panel_product(out, x, blocks.dequantize())
