"""Compare the LoRA Triton kernels with :func:`engine.lora.ops.lora_delta_ref` under
``TRITON_INTERPRET=1`` (set before triton is imported); one JSON line per case.
``test_lora_ops.py`` starts this script and asserts on its output."""

from __future__ import annotations

import json
import os

import torch

from engine.lora.ops import lora_delta_ref

# (tokens, in, out, slots, rank, row slots)
CASES = [
    (5, 16, 24, 3, 4, [0, -1, 2, 1, 0]),
    (7, 40, 33, 2, 8, [-1, -1, 1, 1, 1, 0, -1]),  # widths not powers of two
    (4, 70, 130, 4, 24, [3, 2, 1, 0]),  # more than one block of K, N and R
    (3, 16, 16, 2, 4, [-1, -1, -1]),  # base rows only: nothing added
]


def run_case(case: tuple, dtype: torch.dtype, seed: int) -> float:
    from engine.lora.triton_ops import lora_delta_triton

    tokens, in_features, out_features, num_slots, rank, rows = case
    torch.manual_seed(seed)
    x = torch.randn(tokens, in_features).to(dtype)
    a = torch.randn(num_slots, rank, in_features).to(dtype)
    b = torch.randn(num_slots, out_features, rank).to(dtype)
    slots = torch.tensor(rows, dtype=torch.int64)
    base = torch.randn(tokens, out_features).to(dtype)
    out_ref, out_tri = base.clone(), base.clone()
    lora_delta_ref(x, a, b, slots, out_ref)
    lora_delta_triton(x, a, b, slots, out_tri)
    untouched = [i for i, s in enumerate(rows) if s < 0]
    if untouched and not torch.equal(out_tri[untouched], base[untouched]):
        return float("inf")
    scale = float(out_ref.float().abs().max()) or 1.0
    return float((out_ref.float() - out_tri.float()).abs().max()) / scale


def main() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("set TRITON_INTERPRET=1 before running this check")
    for i, case in enumerate(CASES):
        for dtype in (torch.float32, torch.bfloat16):
            diff = run_case(case, dtype, seed=i)
            print(json.dumps({"case": i, "dtype": str(dtype), "rel_diff": diff}), flush=True)


if __name__ == "__main__":
    main()
