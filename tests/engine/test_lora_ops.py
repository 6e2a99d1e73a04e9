"""The batched LoRA delta: the PyTorch reference against a per-row oracle, and the Triton
kernels against the reference under ``TRITON_INTERPRET=1`` (a separate process, as
test_kernels.py does, because the variable must be set before triton is imported)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from engine.lora.ops import lora_delta

CHECK_SCRIPT = Path(__file__).with_name("lora_triton_check.py")


def _oracle(x, a, b, slots, out):  # type: ignore[no-untyped-def]
    """Row by row in float64: the slow obvious definition."""
    expected = out.double().clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            expected[t] += (x[t].double() @ a[s].double().T) @ b[s].double().T
    return expected


def test_reference_matches_per_row_oracle_with_mixed_adapters_and_base_rows() -> None:
    torch.manual_seed(0)
    x = torch.randn(9, 12)
    a = torch.randn(3, 5, 12)
    b = torch.randn(3, 7, 5)
    slots = torch.tensor([2, -1, 0, 0, 1, -1, 2, 1, 0])
    out = torch.randn(9, 7)
    expected = _oracle(x, a, b, slots, out)
    lora_delta(x, a, b, slots, out)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(out[1], expected[1].float())  # a base row gets nothing added


def test_block_diagonal_parts_expand_alone_with_the_same_result() -> None:
    """A fused projection (q/k/v) whose B is block-diagonal: expanding part by part (long
    segments) equals expanding through the zeros (short ones)."""
    torch.manual_seed(1)
    rank, outs = 4, [(0, 8), (8, 12), (12, 16)]
    a = torch.randn(2, 3 * rank, 10)
    b = torch.zeros(2, 16, 3 * rank)
    for i, (lo, hi) in enumerate(outs):
        b[:, lo:hi, i * rank : (i + 1) * rank] = torch.randn(2, hi - lo, rank)
    x = torch.randn(150, 10)
    slots = torch.tensor([0] * 70 + [-1] * 10 + [1] * 3 + [0] * 67)
    whole, by_part = torch.zeros(150, 16), torch.zeros(150, 16)
    lora_delta(x, a, b, slots, whole)
    lora_delta(x, a, b, slots, by_part, parts=outs)
    torch.testing.assert_close(by_part, whole, rtol=1e-5, atol=1e-5)
    expected = _oracle(x, a, b, slots, torch.zeros(150, 16))
    torch.testing.assert_close(whole.double(), expected, rtol=1e-5, atol=1e-5)


def test_triton_kernels_match_reference_under_interpreter() -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, str(CHECK_SCRIPT)], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(results) == 8
    for r in results:
        limit = 1e-5 if r["dtype"] == "torch.float32" else 2e-2
        assert r["rel_diff"] <= limit, r
