"""Where a served engine spends its CPU: ``python -m load.profile_served``.

Starts ``portico engine`` as ``make bench`` does (smollm2-135m, bf16), samples it with py-spy
(every thread, without pausing it) while the serve benchmark streams the
standard synthetic workload at one concurrency, and splits the samples into the shares issue
22 names: scheduling, batch building, the forward pass by op, sampling, detokenization and
output building, the HTTP side (handlers, SSE, the event loop). Shares of CPU samples are
robust on a shared, noisy machine where wall times are not.

    python -m load.profile_served --concurrency 1 --num-requests 8
    python -m load.profile_served --concurrency 64 --num-requests 128 --raw prof64.txt
    python -m load.profile_served --concurrency 64 --engine-args="--kv-cache-dtype int8"

Needs py-spy (``pip install py-spy``; the dev extra has it) and the right to attach to a
child process (ptrace).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from load import datasets, serve_bench, standard

# (share, markers): a sample goes to the first share, in the order below, one of whose markers
# occurs anywhere in its stack (forward-pass shares first for stacks inside the model).
_FORWARD: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("forward: fused native step (every layer in one call)", ("fused_step.py",)),
    ("forward: attention", ("paged_attention", "attend_paged", "scaled_dot_product")),
    ("forward: lm_head", ("compute_logits",)),
    ("forward: linears, GGUF blocks (steps of <= 8 rows)", ("quantized_linear",)),
    ("forward: linears, dense bf16", ("block_matmul", "block_linear.py", "linear (")),
    ("forward: norm, RoPE, KV write", ("add_rms_norm", "rope_write_kv", "write_kv_cache")),
)
_ENGINE: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("sampling", ("sampler.py",)),
    ("detokenization", ("detokenizer.py",)),
    ("scheduling", ("scheduler.py", "kv_cache_manager.py", "block_pool.py")),
    ("batch building (runner, metadata)", ("model_runner.py", "attention.py")),
    ("output building (engine)", ("llm_engine.py",)),
    ("engine thread: hand-off", ("async_engine.py",)),
)
_HTTP: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("HTTP: handlers and SSE", ("serving_", "sse.py", "engine_requests.py", "protocol.py")),
    ("HTTP: server and middleware", ("httptools_impl", "starlette", "fastapi", "errors.py")),
    ("HTTP: event loop", ("asyncio", "uvicorn")),
)


def classify(stack: str) -> str:
    """The share of one sampled stack (``frame;frame;...``, outermost first)."""
    if "llama.py" in stack or "compute_logits" in stack:
        for share, markers in _FORWARD:
            if any(m in stack for m in markers):
                return share
        return "forward: Python and small ops"
    for share, markers in (*_ENGINE, *_HTTP):
        if any(m in stack for m in markers):
            return share
    return "engine thread: other" if "portico-engine" in stack else "other"


def shares(raw_lines: Iterable[str]) -> tuple[dict[str, int], int]:
    """Sample counts per share from py-spy's raw output, and the total."""
    counts: collections.Counter[str] = collections.Counter()
    for line in raw_lines:
        stack, _, count = line.rstrip().rpartition(" ")
        if stack and count.isdigit():
            counts[classify(stack)] += int(count)
    return dict(counts.most_common()), sum(counts.values())


def profile(
    concurrency: int, num_requests: int, rate: int, raw_out: Path | None,
    engine_args: Sequence[str] = (),
) -> dict[str, Any]:  # fmt: skip
    """Serve the workload at ``concurrency`` under py-spy; the shares and the serve summary.
    ``engine_args``: flags added to the engine's (``--kv-cache-dtype int8``...)."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    workload = datasets.synthetic(num_requests, (22, 618), (16, 255), seed=0)
    with (
        tempfile.TemporaryDirectory() as tmp,
        standard.engine_process(["--enable-prefix-caching", *engine_args], 600) as (proc, base_url),
    ):
        standard.warm_up(base_url)
        raw = Path(tmp) / "raw.txt"
        args = [spy, "record", "--pid", str(proc.pid), "--threads", "--nonblocking"]
        sampler = subprocess.Popen(
            [*args, "--rate", str(rate), "--format", "raw", "--output", str(raw)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )  # fmt: skip
        time.sleep(1.0)  # py-spy attaches
        start = time.monotonic()
        summary, _ = asyncio.run(
            serve_bench.run_benchmark(
                base_url, standard.SERVED_NAME, workload, max_concurrency=concurrency,
                extra_body={"ignore_eos": True}, progress=False,
            )
        )  # fmt: skip
        seconds = time.monotonic() - start
        sampler.send_signal(signal.SIGINT)
        _, err = sampler.communicate(timeout=120)
        if not raw.is_file():
            raise RuntimeError(f"py-spy wrote nothing: {err.decode(errors='replace')[-800:]}")
        if raw_out is not None:
            shutil.copy(raw, raw_out)
        counts, total = shares(raw.read_text().splitlines())
    return {
        "concurrency": concurrency,
        "num_requests": num_requests,
        "engine_args": list(engine_args),
        "seconds": round(seconds, 1),
        "cores_busy": round(total / rate / seconds, 2),
        "shares_pct": {k: round(100 * v / total, 1) for k, v in counts.items()},
        "output_tokens_per_s": round(summary["output_throughput"], 1),
        "ttft_ms_median": round(summary["ttft_ms"]["median"], 1),
        "tpot_ms_median": round(summary["tpot_ms"]["median"], 2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--num-requests", type=int, default=8)
    parser.add_argument("--rate", type=int, default=100, help="py-spy samples per second")
    parser.add_argument("--raw", type=Path, help="also keep py-spy's raw stacks here")
    parser.add_argument("--engine-args", default="", help="flags added to the engine's")
    args = parser.parse_args(argv)
    report = profile(
        args.concurrency, args.num_requests, args.rate, args.raw, args.engine_args.split()
    )
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
