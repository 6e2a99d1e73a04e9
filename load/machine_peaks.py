"""This machine's measured limits, for benchmarks to be read against.

``python -m load.machine_peaks``.

A decode step at large batch is bound by the bytes it reads (weights once, each request's K/V),
one stream by the weights' bytes and the int8 arithmetic of the block linears. Figures like
"~15 GB/s" mean little without the machine's own ceiling, so this probe measures it, with the
threads the engine uses (``torch.get_num_threads()``, or ``--threads``):

* **memory bandwidth**, STREAM-style (McCalpin's kernels, counted his way: the bytes named in
  the kernel, no write-allocate traffic) over arrays far larger than the last-level cache:
  ``read`` (a sum: what attention and the linears do), ``copy`` and ``triad`` (a = b + s c);
* **int8 dot products**: the engine's own int8 block kernel (``csrc/quantized_int8.c``: VNNI's
  ``vpdpbusd`` on AVX-512, ``vpmaddubsw`` on AVX2) on a Q8_0 weight small enough to stay in
  cache and enough rows to be arithmetic-bound, and torch's ``_int_mm`` (oneDNN) beside it;
* **float32 FMA**: a cache-resident float32 matmul (what the attention kernels' inner loops
  run after widening an int8 or bf16 row).

Each figure is the best of ``--repeats`` runs (the least disturbed by other work on a shared
machine); the JSON report keeps them all.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch

from engine import kernels


def best_seconds(fn: Callable[[], object], repeats: int) -> tuple[float, list[float]]:
    """Fastest of ``repeats`` timed calls of ``fn`` (after one warm-up), and all of them."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times), times


def stream_bandwidth(megabytes: int, repeats: int) -> dict[str, float]:
    """GB/s of STREAM's kernels over float32 arrays of ``megabytes`` each."""
    n = megabytes * 2**20 // 4
    a, b, c = torch.ones(n), torch.ones(n), torch.ones(n)
    kernels_bytes = {
        "read": (lambda: a.sum(), 4 * n),
        "copy": (lambda: b.copy_(a), 8 * n),
        "triad": (lambda: torch.add(b, c, alpha=3.0, out=a), 12 * n),
    }
    out = {}
    for name, (fn, nbytes) in kernels_bytes.items():
        seconds, _ = best_seconds(fn, repeats)
        out[f"{name}_gb_s"] = nbytes / seconds / 1e9
    return out


def int8_dot_rate(repeats: int) -> dict[str, float]:
    """Giga int8 multiply-adds (x2: ops) per second: the engine's Q8_0 kernel, torch's int_mm."""
    out: dict[str, float] = {}
    rows, n, k = 256, 512, 1024  # 0.5 MB of Q8_0 weights: cache-resident
    gen = torch.Generator().manual_seed(0)
    qs = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
    scales = (torch.rand(n, k // 32, generator=gen) * 0.01).half().float()  # float16-exact
    packed = kernels.pack_blocks_q8("q8_0", qs, scales, None)
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
    if packed is not None:
        seconds, _ = best_seconds(
            lambda: kernels.quantized_linear(x, "q8_0", qs, scales, None, None, packed), repeats
        )
        out["engine_q8_gops"] = 2 * rows * n * k / seconds / 1e9
    a = torch.randint(-127, 128, (rows, k), dtype=torch.int8, generator=gen)
    seconds, _ = best_seconds(lambda: torch._int_mm(a, qs.T.contiguous()), repeats)
    out["torch_int_mm_gops"] = 2 * rows * n * k / seconds / 1e9
    return out


def fp32_fma_rate(repeats: int) -> float:
    """GFLOP/s of a cache-resident float32 matmul."""
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    seconds, _ = best_seconds(lambda: [a @ b for _ in range(16)], repeats)
    return 16 * 2 * 256**3 / seconds / 1e9


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--megabytes", type=int, default=256, help="size of each STREAM array")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--output", default=".portico/bench/machine_peaks.json")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    report = {
        "threads": torch.get_num_threads(),
        "cpu_features": sorted(kernels.choose("cpu").features),
        **stream_bandwidth(args.megabytes, args.repeats),
        **int8_dot_rate(args.repeats),
        "fp32_gflops": fp32_fma_rate(args.repeats),
    }
    print(json.dumps(report, indent=2))
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
