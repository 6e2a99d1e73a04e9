"""The split-K decode attention kernel (engine/kernels/triton_decode_attention.py) against the
PyTorch reference, run under ``TRITON_INTERPRET=1`` in a separate process (the variable must be
set before triton is imported): every cache dtype, GQA groups of 1, 3 and 4, one split and
three, contexts of mixed lengths that are not multiples of the block size. And the kernel
front door under the CUDA choice: pure-decode steps take this kernel, mixed steps the general
one."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

CHECK_SCRIPT = Path(__file__).with_name("decode_attention_check.py")


def _run_check() -> list[dict]:
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, str(CHECK_SCRIPT)], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def test_decode_kernel_matches_reference_and_front_door_routes_decodes() -> None:
    lines = _run_check()
    cases = [r for r in lines if "case" in r]
    # 3 shapes x (float32, bfloat16) x (auto, int8, fp8_e4m3) x (1, 3 splits)
    assert len(cases) == 36
    for r in cases:
        if r["dtype"] == "torch.float32":
            assert r["attn_diff"] <= 1e-5, r
        else:  # bf16 outputs: a rounding step or two of the largest value (8-bit mantissa)
            assert r["attn_diff"] <= r["ref_max"] / 64, r
    door = next(r["front_door"] for r in lines if "front_door" in r)
    assert door["decode_calls"] == 1 and door["calls_after_mixed"] == 1, door
    assert door["decode_diff"] <= 1e-5 and door["mixed_diff"] <= 1e-5, door
    splits = next(r["splits"] for r in lines if "splits" in r and "case" not in r)
    # one stream on 132 SMs: 16 pieces (the cap); 256 x 8 programs fill the card: 1 piece
    assert [s[-1] for s in splits] == [16, 16, 1, 1, 1], splits


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kv", ["auto", "int8", "fp8_e4m3"])
@pytest.mark.parametrize("splits", [1, 3, None])
def test_compiled_decode_kernel_matches_reference_on_cuda(kv: str, splits: int | None) -> None:
    """The compiled kernel (16-bit tensor-core dots, not the interpreter's widened ones)."""
    from engine.kernels.reference import paged_attention_ref
    from engine.kernels.triton_decode_attention import decode_attention_triton

    spec = importlib.util.spec_from_file_location("decode_attention_check", CHECK_SCRIPT)
    assert spec is not None and spec.loader is not None
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    for i, case in enumerate(check.CASES):
        heads, _, head_dim, _, s_lens = case
        for dtype in (torch.float32, torch.bfloat16):
            cache, meta = check._case_cache(case, check.storage_dtype(kv, dtype), dtype, i)
            q = torch.randn(len(s_lens), heads, head_dim).to(dtype)
            args = (meta.block_tables, meta.query_start_loc, meta.seq_lens, head_dim**-0.5)
            ref = paged_attention_ref(q, cache, *args, meta.query_lens_cpu, meta.seq_lens_cpu)
            out = decode_attention_triton(
                q.cuda(), cache.cuda(), meta.block_tables.cuda(), meta.seq_lens.cuda(),
                head_dim**-0.5, splits,
            ).cpu()  # fmt: skip
            limit = 1e-5 if dtype == torch.float32 else float(ref.float().abs().max()) / 64
            assert float((ref.float() - out.float()).abs().max()) <= limit, (i, dtype)
