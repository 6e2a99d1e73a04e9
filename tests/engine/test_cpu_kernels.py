"""The native CPU kernels (engine/kernels/csrc/) against their definitions.

Attention is compared with a per-token float64 oracle, the block-format linears with the matmul
of the weights they encode, the norm and RoPE kernels with the PyTorch code they replace. Shapes
cover both code paths of the attention kernel (head_dim 8: portable loop; 64: vectorized),
GQA, block sizes, ragged lengths, and prefill chunks mixed with decodes.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from attention_oracle import attention_oracle, float16_edge_rows, paged_case
from gguf_blocks import random_blocks

from engine import kernels
from engine.attention import AttentionMetadata
from engine.gguf_file import GGUFFile
from engine.kernels import PACKED_MAX_ROWS, cpu, prepack_linear_weight
from engine.kernels.reference import rope_write_kv_ref, write_kv_cache_ref
from engine.model_config import ModelConfig
from engine.models.block_linear import BlockLinear, GGUFBlocks, block_matmul
from engine.models.rotary import RotaryEmbedding

pytestmark = pytest.mark.skipif(not cpu.available(), reason="no C compiler for the CPU kernels")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size", "shape"),
    [
        (4, 2, 8, 4, [(1, 6), (1, 13), (1, 1), (1, 4)]),  # portable path, decodes only
        (6, 2, 8, 8, [(1, 9), (5, 5), (3, 17), (1, 2)]),  # portable, mixed
        (9, 3, 64, 16, [(1, 40), (7, 7), (1, 17), (18, 33), (1, 1)]),  # vectorized, SmolLM2 GQA
        (4, 4, 64, 4, [(1, 37), (9, 30)]),  # vectorized, no GQA, blocks smaller than a lane group
        (8, 1, 32, 16, [(5, 70), (1, 16)]),  # vectorized, 8 queries per KV head
    ],
)
def test_paged_attention_matches_per_token_oracle(
    heads: int, kv_heads: int, head_dim: int, block_size: int, shape: list[tuple[int, int]],
    dtype: torch.dtype,
) -> None:  # fmt: skip
    q, cache, meta, ks, vs, q_lens = paged_case(
        heads, kv_heads, head_dim, block_size, shape, dtype, seed=heads * 7 + block_size
    )
    scale = head_dim**-0.5
    out = cpu.paged_attention_cpu(
        q, cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, scale
    )
    assert out is not None and out.dtype == dtype and out.shape == q.shape
    expected = attention_oracle(q, ks, vs, q_lens, scale)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size", "shape"),
    [
        (6, 2, 8, 8, [(1, 9), (5, 5), (3, 17), (1, 2)]),  # portable loops, mixed
        (9, 3, 64, 16, [(1, 40), (1, 7), (1, 130), (1, 3), (1, 64)]),  # decodes: all-heads items
        (9, 3, 64, 16, [(1, 40), (7, 7), (1, 17), (18, 33), (1, 1)]),  # prefill chunks, decodes
        (8, 1, 32, 4, [(5, 70), (1, 16)]),  # 8 queries per KV head, small blocks
    ],
)
def test_paged_attention_reads_an_int8_cache(
    heads: int, kv_heads: int, head_dim: int, block_size: int, shape: list[tuple[int, int]],
    dtype: torch.dtype,
) -> None:  # fmt: skip
    q, cache, meta, ks, vs, q_lens = paged_case(
        heads, kv_heads, head_dim, block_size, shape, dtype, seed=heads * 5 + block_size,
        cache_dtype=torch.int8,
    )  # fmt: skip
    scale = head_dim**-0.5
    out = cpu.paged_attention_cpu(
        q, cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, scale
    )
    assert out is not None and out.dtype == dtype and out.shape == q.shape
    # ks, vs are what the cache holds (int8 times scale): the kernel adds only float32 sums
    expected = attention_oracle(q, ks, vs, q_lens, scale)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size", "shape"),
    [
        (6, 2, 8, 8, [(1, 9), (5, 5), (3, 17), (1, 2)]),  # portable loops, mixed
        (9, 3, 64, 16, [(1, 40), (1, 7), (1, 130), (1, 3), (1, 64)]),  # decodes only
        (9, 3, 64, 16, [(1, 40), (7, 7), (1, 17), (18, 33), (1, 1)]),  # prefill chunks, decodes
        (8, 1, 32, 4, [(5, 70), (1, 16)]),  # 8 queries per KV head, small blocks
    ],
)
def test_paged_attention_reads_a_float16_cache_under_float32(
    heads: int, kv_heads: int, head_dim: int, block_size: int, shape: list[tuple[int, int]],
) -> None:  # fmt: skip
    q, cache, meta, ks, vs, q_lens = paged_case(
        heads, kv_heads, head_dim, block_size, shape, torch.float32, seed=heads * 3 + block_size,
        cache_dtype=torch.float16,
    )  # fmt: skip
    scale = head_dim**-0.5
    out = cpu.paged_attention_cpu(
        q, cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, scale
    )
    assert out is not None and out.dtype == torch.float32 and out.shape == q.shape
    # ks, vs are what the cache holds (float16 values, exact in float32): float32 sums alone
    expected = attention_oracle(q, ks, vs, q_lens, scale)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    # a bfloat16 query with a float16 cache is no pairing the kernels read: the caller's
    # reference runs it
    args = (cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, scale)
    assert cpu.paged_attention_cpu(q.to(torch.bfloat16), *args) is None


@pytest.mark.parametrize("q_mul", [1.0, 8.0])  # 8: peaked softmax rows
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size", "shape"),
    [
        # contexts past 512 (the weight scale's sum bound), odd lengths, one position
        (9, 3, 64, 16, [(1, 1100), (1, 901), (1, 2), (1, 1), (1, 555)]),
        (4, 2, 128, 16, [(1, 300), (3, 77), (1, 1), (1, 33), (1, 64)]),  # two 64-wide chunks
        (4, 1, 32, 8, [(1, 65), (2, 9), (1, 3), (1, 16)]),  # 32 wide: int16 score pass
        (9, 3, 64, 1, [(1, 37), (1, 8), (5, 20), (1, 4)]),  # one-token blocks
    ],
)
def test_int8_cache_attention_on_integers_adds_less_than_bf16_rounding(
    heads: int, kv_heads: int, head_dim: int, block_size: int, shape: list[tuple[int, int]],
    q_mul: float,
) -> None:  # fmt: skip
    """bf16 queries on an int8 cache run both passes on integers (csrc/kv_int8.c: int16
    queries, int16 softmax weights with the V scales folded in); against the float64 oracle on
    what the cache holds, each output is off by no more than its own bf16 rounding plus 1e-3."""
    q, cache, meta, ks, vs, q_lens = paged_case(
        heads, kv_heads, head_dim, block_size, shape, torch.bfloat16, seed=head_dim + block_size,
        cache_dtype=torch.int8,
    )  # fmt: skip
    q = (q.float() * q_mul).to(torch.bfloat16)
    scale = head_dim**-0.5
    out = cpu.paged_attention_cpu(
        q, cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, scale
    )
    assert out is not None and out.dtype == torch.bfloat16
    expected = attention_oracle(q, ks, vs, q_lens, scale)
    excess = (out.double() - expected).abs() - expected.abs() * 2.0**-8
    assert excess.max().item() <= 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_of_a_request_does_not_depend_on_its_batch(dtype: torch.dtype) -> None:
    """With four or more requests, each decode row takes all its KV heads in one work item
    (one thread reads the rows of every head); each request's output is still the one it gets
    alone, bit for bit, beside a prefill chunk or not."""
    shape = [(1, 40), (1, 17), (6, 30), (1, 1), (1, 33)]
    q, cache, meta, _, _, q_lens = paged_case(9, 3, 64, 16, shape, dtype, seed=11)
    scale = 64**-0.5
    out = cpu.paged_attention_cpu(
        q, cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, scale
    )
    assert out is not None
    start = 0
    for r, (q_len, _) in enumerate(shape):
        alone = cpu.paged_attention_cpu(
            q[start : start + q_len], cache, meta.block_tables[r : r + 1],
            torch.tensor([0, q_len], dtype=torch.int32), meta.seq_lens[r : r + 1], scale,
        )  # fmt: skip
        assert alone is not None and torch.equal(alone, out[start : start + q_len])
        start += q_len
    assert start == sum(q_lens)


def test_paged_attention_declines_what_it_cannot_run() -> None:
    q = torch.randn(1, 4, 8, dtype=torch.float16)
    cache = torch.zeros(2, 2, 4, 2, 8, dtype=torch.float16)
    meta = AttentionMetadata.build([1], [1], [[1]], 4)
    args = (meta.block_tables, meta.query_start_loc, meta.seq_lens, 0.5)
    assert cpu.paged_attention_cpu(q, cache, *args) is None  # float16: not a kernel dtype
    q32 = torch.randn(1, 3, 8)  # 3 query heads over 2 KV heads: not a grouping
    assert cpu.paged_attention_cpu(q32, cache.float(), *args) is None


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 13])
def test_block_linear_equals_matmul_of_the_weights_it_encodes(kind: str, rows: int) -> None:
    blocks = random_blocks(kind, 70, 96, seed=rows)  # 70 outputs: not a multiple of the tile
    weight = blocks.dequantize()
    bias = torch.randn(70)
    x = torch.randn(rows, 96)
    out = cpu.quantized_linear(x, kind, blocks.qs, blocks.scales, blocks.mins, bias)
    assert out is not None and out.shape == (rows, 70)
    torch.testing.assert_close(out, x @ weight.T + bias, atol=1e-4, rtol=1e-5)
    # bfloat16 activations: exact products, float32 sums, one rounding at the end.
    xb = x.to(torch.bfloat16)
    outb = cpu.quantized_linear(xb, kind, blocks.qs, blocks.scales, blocks.mins, None)
    assert outb is not None and outb.dtype == torch.bfloat16
    torch.testing.assert_close(outb.float(), xb.float() @ weight.T, atol=2e-2, rtol=1e-2)


def test_block_matmul_uses_the_dense_weight_for_big_batches() -> None:
    blocks = random_blocks("q4_1", 8, 64, seed=3)
    dense = blocks.dequantize() * 2  # deliberately different: shows which path ran
    few, many = torch.randn(2, 64), torch.randn(blocks.max_rows + 1, 64)
    torch.testing.assert_close(block_matmul(few, dense, blocks, None), few @ (dense / 2).T,
                               atol=1e-4, rtol=1e-5)  # fmt: skip
    torch.testing.assert_close(block_matmul(many, dense, blocks, None), many @ dense.T)


def test_gguf_blocks_decode_to_the_files_own_dequantization(smollm2_gguf) -> None:
    gguf = GGUFFile(smollm2_gguf)
    for name, kind in (("blk.0.ffn_down.weight", "q4_1"), ("token_embd.weight", "q8_0")):
        blocks = GGUFBlocks.from_raw(kind, gguf.raw(name))
        expected = torch.from_numpy(np.asarray(gguf.load(name)))
        assert blocks.shape == tuple(expected.shape)
        assert torch.equal(blocks.dequantize(), expected)
    with pytest.raises(ValueError, match="kind"):
        GGUFBlocks.from_raw("q5_k", gguf.raw("blk.0.ffn_down.weight"))


@pytest.mark.parametrize("with_delta", [False, True])
def test_add_rms_norm_matches_the_pytorch_formula(with_delta: bool) -> None:
    torch.manual_seed(1)
    x = torch.randn(5, 96).to(torch.bfloat16)
    delta = torch.randn(5, 96).to(torch.bfloat16) if with_delta else None
    weight = torch.randn(96).to(torch.bfloat16)
    expected_x = x + delta if delta is not None else x.clone()
    x32 = expected_x.float()
    normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)).to(torch.bfloat16)
    expected = weight * normed
    out = cpu.add_rms_norm_cpu(x, delta, weight, 1e-5)
    assert out is not None
    assert torch.equal(x, expected_x)  # the residual stream was updated in place
    # One bfloat16 step at most: the sum of squares is added in another order.
    torch.testing.assert_close(out.float(), expected.float(), atol=0, rtol=2**-7)


def _small_rotary() -> RotaryEmbedding:
    """RoPE tables of a 4-head (2 KV heads) model with head_dim 16, the rope tests' shape."""
    cfg = ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=64, hidden_size=64, intermediate_size=128,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=128, rms_norm_eps=1e-5, rope_theta=10000.0,
    )  # fmt: skip
    return RotaryEmbedding(cfg)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_write_kv_matches_rotate_then_write(dtype: torch.dtype) -> None:
    rotary = _small_rotary()
    positions = torch.tensor([0, 5, 77, 3])
    qkv = torch.randn(4, (4 + 2 * 2) * 16).to(dtype)
    angles = rotary.lookup(positions, dtype)
    expected = torch.cat(rope_write_kv_ref(qkv, 4, 2, 16, angles.cos, angles.sin)[:2], dim=1)
    slots = torch.tensor([3, 9, 0, 14])
    cache = torch.zeros(2, 4, 4, 2, 16, dtype=dtype)
    expected_cache = torch.zeros_like(cache)
    values = qkv[:, 6 * 16 :].view(4, 2, 16).clone()
    write_kv_cache_ref(expected[:, 4:], values, expected_cache, slots)
    done = cpu.rope_write_kv_cpu(qkv, 4, 2, 16, rotary.cos, rotary.sin, positions, cache, slots)
    assert done
    tol = 0 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(qkv[:, : 6 * 16].view(4, 6, 16), expected, atol=tol, rtol=tol)
    torch.testing.assert_close(cache, expected_cache, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_write_kv_into_an_int8_cache_stores_the_reference_bytes(dtype: torch.dtype) -> None:
    rotary = _small_rotary()
    positions = torch.tensor([0, 5, 77, 3])
    qkv = torch.randn(4, (4 + 2 * 2) * 16).to(dtype)
    qkv[2, 6 * 16 : 7 * 16] = 0  # a V row of zeros: scale 0, values 0
    slots = torch.tensor([3, 9, 0, 14])
    cache = torch.zeros(2, 4, 4, 2, 16 + 4, dtype=torch.int8)
    done = cpu.rope_write_kv_cpu(qkv, 4, 2, 16, rotary.cos, rotary.sin, positions, cache, slots)
    assert done
    # the keys the kernel rotated in place, and the values, through the reference writer
    keys = qkv[:, 4 * 16 : 6 * 16].view(4, 2, 16)
    values = qkv[:, 6 * 16 :].view(4, 2, 16)
    expected = torch.zeros_like(cache)
    write_kv_cache_ref(keys, values, expected, slots)
    assert torch.equal(cache, expected)


def test_rope_write_kv_into_a_float16_cache_rounds_as_torch_does() -> None:
    rotary = _small_rotary()
    positions = torch.tensor([0, 5, 77, 3])
    qkv = torch.randn(4, (4 + 2 * 2) * 16)
    qkv[:, 6 * 16 :] = float16_edge_rows(4, 2 * 16)  # the V heads: no rotation, edges as given
    slots = torch.tensor([3, 9, 0, 14])
    cache = torch.zeros(2, 4, 4, 2, 16, dtype=torch.float16)
    done = cpu.rope_write_kv_cpu(qkv, 4, 2, 16, rotary.cos, rotary.sin, positions, cache, slots)
    assert done
    keys = qkv[:, 4 * 16 : 6 * 16].view(4, 2, 16)  # rotated in place by the kernel
    values = qkv[:, 6 * 16 :].view(4, 2, 16)
    expected = torch.zeros_like(cache)
    write_kv_cache_ref(keys, values, expected, slots)  # torch's .to(torch.float16)
    assert torch.equal(cache.view(torch.int16), expected.view(torch.int16))  # the same bits
    assert int(torch.isinf(cache).sum()) == 3  # 65520, -65520 and 1e6 overflow; 65519.99 does not


def test_build_is_cached_and_reused(tmp_path) -> None:
    compiler = cpu._compiler()
    assert compiler is not None
    env_before = os.environ.get("PORTICO_KERNEL_CACHE")
    os.environ["PORTICO_KERNEL_CACHE"] = str(tmp_path)
    try:
        first = cpu.build(compiler)
        stamp = first.stat().st_mtime_ns
        second = cpu.build(compiler)
    finally:
        if env_before is None:
            os.environ.pop("PORTICO_KERNEL_CACHE")
        else:
            os.environ["PORTICO_KERNEL_CACHE"] = env_before
    assert first == second and second.stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no staging file left


def test_kernels_can_be_switched_off(tiny_llama_dir) -> None:
    """PORTICO_CPU_KERNELS=0: no native code, and the model still runs on the references."""
    script = (
        "import torch\n"
        "from engine.kernels import cpu\n"
        "from engine.llm import LLM\n"
        "from engine.sampling_params import SamplingParams\n"
        "assert cpu.load() is None\n"
        f"llm = LLM(model={str(tiny_llama_dir)!r})\n"
        "out = llm.generate(['hello there'], SamplingParams(max_tokens=4, temperature=0,"
        " ignore_eos=True))\n"
        "print(len(out[0].outputs[0].token_ids))\n"
    )
    env = dict(os.environ, PORTICO_CPU_KERNELS="0")
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "4"


def test_prepacked_bf16_weights_give_the_dense_matmul_bit_for_bit() -> None:
    """What serving computes: the engine runs every step under ``torch.inference_mode``, and
    there the packed matmul equals the dense one bit for bit. (With autograd on, F.linear of a
    bf16 weight that requires grad takes another oneDNN kernel, whose result may differ by one
    bf16 step in a few elements: not a path the engine ever runs.)"""
    torch.manual_seed(5)
    layer = BlockLinear(64, 96, bias=True).to(torch.bfloat16)
    layer.packed = prepack_linear_weight(layer.weight)
    if layer.packed is None:
        pytest.skip("this torch has no oneDNN weight prepacking")
    if layer.packed.dtype == torch.float32:
        pytest.skip("this CPU has no bf16 arithmetic: the packed weight is a float32 copy")
    with torch.inference_mode():
        for rows in (1, 9, 100, PACKED_MAX_ROWS + 1):  # the last one takes the plain matmul
            x = torch.randn(rows, 64).to(torch.bfloat16)
            assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
        # Non-contiguous input (the MLP's SiLU*up is a view of the gate/up output) is accepted.
        wide = torch.randn(5, 128).to(torch.bfloat16)
        assert torch.equal(layer(wide[:, :64]), F.linear(wide[:, :64], layer.weight, layer.bias))
    assert prepack_linear_weight(torch.randn(8, 8)) is None  # float32: not packed


def test_without_bf16_arithmetic_big_bf16_steps_run_in_float32(monkeypatch) -> None:
    """Where the CPU has no bf16 arithmetic, a bf16 projection keeps a float32 copy and every
    step through it multiplies in float32 and rounds once to bf16, at any row count."""
    monkeypatch.setattr(cpu, "bf16_matmul_native", lambda: False)
    kernels.choose.cache_clear()
    try:
        assert kernels.choose("cpu").prepacked_linear == "float32"
        torch.manual_seed(6)
        layer = BlockLinear(64, 96, bias=True).to(torch.bfloat16)
        layer.packed = prepack_linear_weight(layer.weight)
        assert layer.packed is not None and layer.packed.dtype == torch.float32
        with torch.inference_mode():
            for rows in (1, 100, PACKED_MAX_ROWS + 1):
                x = torch.randn(rows, 64).to(torch.bfloat16)
                wide = F.linear(x.float(), layer.weight.float(), layer.bias.float())
                assert torch.equal(layer(x), wide.to(torch.bfloat16))
        assert prepack_linear_weight(torch.randn(8, 8)) is None  # float32 weights: no copy
    finally:
        kernels.choose.cache_clear()


def test_the_library_uses_only_instruction_sets_this_cpu_reports() -> None:
    """The kernels are built for the CPU they run on, and the front door records that choice."""
    choice = kernels.choose("cpu")
    assert choice.paged_attention == "cpu" and choice.quantized_linear == "cpu"
    assert choice.features == cpu.compiled_features()
    assert choice.features <= cpu.cpu_features()
    if "avx512_bf16" in cpu.cpu_features():  # -march=native compiles in what is present
        assert "avx512_bf16" in choice.features


def test_no_kernel_function_is_longer_than_80_lines() -> None:
    """The C kernels stay readable: one op family per file, functions that fit on a screen."""
    too_long = []
    for source in cpu.sources():
        depth, start = 0, None
        for number, line in enumerate(source.read_text().splitlines(), 1):
            if depth == 0 and "(" in line and line[:1].isalpha() and not line.endswith(";"):
                start = number
            depth += line.count("{") - line.count("}")
            if depth == 0 and start is not None and "}" in line:
                if number - start + 1 > 80:
                    too_long.append(f"{source.name}:{start}")
                start = None
    assert len(cpu.sources()) >= 3 and not too_long
