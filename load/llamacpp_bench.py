"""Portico's engine against llama.cpp's ``llama-server``, served, side by side in one run:
``python -m load.llamacpp_bench --llama-server PATH``.

Both serve the same GGUF file (the default model, SmolLM2-135M Q4_1) on this machine's cores,
one after the other, and the serve benchmark (``load/serve_bench.py``) streams the same
synthetic workload (token-id prompts, forced output lengths, greedy) to each at every
concurrency: the numbers a client sees, from the HTTP request to the last SSE chunk.

* Portico: ``portico engine`` in bfloat16 (``--gguf-activations int8`` by default, or what
  ``--portico-flags`` says), ``GOMP_SPINCOUNT=30000`` as ``make bench`` runs engines;
* llama.cpp: ``llama-server -m FILE -t THREADS -np SLOTS -c CONTEXT*SLOTS``, once per slot
  setting in ``--llama-slots``; each concurrency reports its best slot setting.

``llama-server`` is not shipped with Portico: build it from the llama.cpp that the PyPI sdist
of ``llama-cpp-python`` vendors (docs/engine-benchmark.md gives the commands).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from load import datasets
from load.standard import engine_process, free_port, serve, wait_ready, warm_up
from portico.registry import DEFAULT_MODEL, resolve


@contextlib.contextmanager
def llama_server(
    binary: str, model: Path, slots: int, threads: int, context: int, timeout_s: float
) -> Iterator[str]:
    """A ready ``llama-server``; yields its ``/v1`` base URL."""
    port = free_port()
    cmd = [binary, "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-t",
           str(threads), "-np", str(slots), "-c", str(context * slots), "--no-webui"]  # fmt: skip
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_ready(proc, f"http://127.0.0.1:{port}/health", log, timeout_s, "llama-server")
            yield f"http://127.0.0.1:{port}/v1"
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


def _row(system: str, concurrency: int, summary: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {
        "system": system,
        "concurrency": concurrency,
        "output_tok_s": summary["output_throughput"],
        "ttft_p50_ms": summary["ttft_ms"]["median"],
        "ttft_p99_ms": summary["ttft_ms"]["p99"],
        "tpot_p50_ms": summary["tpot_ms"]["median"],
        "completed": summary["completed"],
        "failed": summary["failed"],
        "errors": summary["errors"],
        **extra,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every system at every concurrency; rows of the report."""
    model = resolve(DEFAULT_MODEL).path
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    workload = datasets.synthetic(
        max(args.num_requests, max(concurrencies)),
        (args.min_prompt, args.max_prompt),
        (args.min_output, args.max_output),
        seed=args.seed,
    )

    def requests_for(concurrency: int) -> list[datasets.BenchRequest]:
        count = args.num_requests if concurrency > 1 else args.single_stream_requests
        return workload[: max(count, concurrency)]

    rows: list[dict[str, Any]] = []
    for flags in args.portico_flags.split(";"):
        extra = flags.split()
        system = "portico" if not extra else f"portico {' '.join(extra)}"
        with engine_process(extra, args.timeout) as (_, base_url):
            warm_up(base_url)
            for c in concurrencies:
                summary, _ = serve(base_url, requests_for(c), c)
                rows.append(_row(system, c, summary, flags=" ".join(extra)))
    if args.llama_server:
        for slots in (int(s) for s in args.llama_slots.split(",")):
            with llama_server(
                args.llama_server, model, slots, args.threads, args.context, args.timeout
            ) as base_url:
                warm_up(base_url)
                for c in concurrencies:
                    if c > 1 and slots == 1:
                        continue  # one slot serves one stream; its c=1 row is the baseline
                    # llama-server dropped reused keep-alive connections mid-run (requests
                    # failed at once): a new connection per request for it.
                    summary, _ = serve(base_url, requests_for(c), c, keepalive=False)
                    rows.append(_row("llama.cpp", c, summary, slots=slots))
    return {"rows": rows, "workload": vars(args) | {"model": str(model)}}


def best_rows(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per system and concurrency, the row with the most output tokens/s (best slot setting)."""
    best: dict[tuple[str, int], dict[str, Any]] = {}
    for row in rows:
        key = (row["system"], row["concurrency"])
        if key not in best or row["output_tok_s"] > best[key]["output_tok_s"]:
            best[key] = row
    return sorted(best.values(), key=lambda r: (r["concurrency"], r["system"]))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER"),
                        help="path of llama.cpp's llama-server (or $LLAMA_SERVER)")  # fmt: skip
    parser.add_argument("--llama-slots", default="1,16,32", help="llama-server -np settings")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--context", type=int, default=1024, help="context per llama.cpp slot")
    parser.add_argument(
        "--portico-flags",
        default="",
        help="flags beyond make bench's engine flags; several runs separated by ';' "
        "(e.g. ';--gguf-activations exact')",
    )
    parser.add_argument("--concurrency", default="1,16,64")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--single-stream-requests", type=int, default=16)
    parser.add_argument("--min-prompt", type=int, default=22)
    parser.add_argument("--max-prompt", type=int, default=618)
    parser.add_argument("--min-output", type=int, default=16)
    parser.add_argument("--max-output", type=int, default=255)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--out", default=".portico/bench/llamacpp_bench.json")
    args = parser.parse_args(argv)
    report = run(args)
    report["best"] = best_rows(report["rows"])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    for row in report["best"]:
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
