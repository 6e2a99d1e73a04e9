"""Portico's engine against llama.cpp's ``llama-server``, served, side by side in one run:
``python -m load.llamacpp_bench --llama-server PATH``.

Both serve the same GGUF file (the default model, SmolLM2-135M Q4_1) on this machine's cores,
one after the other, and the serve benchmark (``load/serve_bench.py``) streams the same
synthetic workload (token-id prompts, forced output lengths, greedy) to each at every
concurrency: the numbers a client sees, from the HTTP request to the last SSE chunk.

* Portico tuned: ``portico engine`` with ``make bench``'s serving flags (KV cache, slots,
  context) but the default numerics (``--dtype auto``: the batch invariant float32 path;
  ``--portico-flags "--dtype bfloat16"`` runs the faster, load-dependent one), plus what
  ``--portico-flags`` adds, and ``GOMP_SPINCOUNT=30000`` (a bounded spin for engines with
  cores of their own; the CLI's default is passive waiting);
* Portico defaults (``--portico-defaults``): ``portico engine --model smollm2-135m`` with no
  other flag and the environment ``portico serve`` gives its engines (``make run``'s numbers);
* llama.cpp: ``llama-server -m FILE -t THREADS -np SLOTS -c CONTEXT*SLOTS``, once per slot
  setting in ``--llama-slots``, where ``default`` is ``llama-server -m FILE`` alone (its own
  threads, slots and context); each concurrency reports its best slot setting.

``llama-server`` is not shipped with Portico: build it from the llama.cpp that the PyPI sdist
of ``llama-cpp-python`` vendors (docs/engine-benchmark.md gives the commands).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from load import datasets
from load.standard import (
    ENGINE_ENV,
    ENGINE_FLAGS,
    REPO_ROOT,
    SERVED_NAME,
    engine_process,
    free_port,
    serve,
    wait_ready,
    warm_up,
)
from portico.registry import DEFAULT_MODEL, resolve


def llama_command(binary: str, model: Path, port: int, slots: str, threads: int,
                  context: int) -> list[str]:  # fmt: skip
    """``llama-server``'s command line; ``slots`` ``default`` leaves threads, slots and
    context to llama.cpp, as a user who runs ``llama-server -m FILE`` gets."""
    cmd = [binary, "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "--no-webui"]
    if slots != "default":
        cmd += ["-t", str(threads), "-np", slots, "-c", str(context * int(slots))]
    return cmd


# The benchmarks' OpenMP tuning, left out of what the defaults rows run.
OPENMP_TUNING = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY", "OMP_NUM_THREADS")


def defaults_engine_command(port: int) -> tuple[list[str], dict[str, str]]:
    """``portico engine`` as ``make run`` starts it: the model and its served name, no other
    flag, and none of the caller's OpenMP settings, so the CLI's own default applies
    (``portico.cli.openmp_defaults``), as it does for the engines of ``portico serve``."""
    cmd = [sys.executable, "-m", "portico.cli", "engine", "--model", DEFAULT_MODEL,
           "--served-model-name", SERVED_NAME, "--host", "127.0.0.1",
           "--port", str(port)]  # fmt: skip
    return cmd, {k: v for k, v in os.environ.items() if k not in OPENMP_TUNING}


@contextlib.contextmanager
def server_process(
    cmd: list[str], env: dict[str, str] | None, ready_url: str, timeout_s: float, what: str
) -> Iterator[None]:
    """``cmd`` running until ``ready_url`` answers 200, then stopped (SIGTERM, then kill)."""
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(
            cmd, cwd=REPO_ROOT, env=env, stdin=subprocess.DEVNULL, stdout=log,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            wait_ready(proc, ready_url, log, timeout_s, what)
            yield
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


@contextlib.contextmanager
def llama_server(
    binary: str, model: Path, slots: str, threads: int, context: int, timeout_s: float
) -> Iterator[str]:
    """A ready ``llama-server``; yields its ``/v1`` base URL."""
    port = free_port()
    cmd = llama_command(binary, model, port, slots, threads, context)
    with server_process(cmd, None, f"http://127.0.0.1:{port}/health", timeout_s, "llama-server"):
        yield f"http://127.0.0.1:{port}/v1"


@contextlib.contextmanager
def defaults_engine(timeout_s: float) -> Iterator[str]:
    """A ready ``portico engine`` with no flags (:func:`defaults_engine_command`)."""
    port = free_port()
    cmd, env = defaults_engine_command(port)
    with server_process(cmd, env, f"http://127.0.0.1:{port}/ready", timeout_s, "portico engine"):
        yield f"http://127.0.0.1:{port}/v1"


def summary_row(
    system: str, concurrency: int, summary: dict[str, Any], **extra: Any
) -> dict[str, Any]:
    """One row of the report: what the serve bench measured for ``system`` at ``concurrency``."""
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


def concurrencies_of(args: argparse.Namespace) -> list[int]:
    return [int(c) for c in args.concurrency.split(",")]


def workload_of(args: argparse.Namespace, seed: int | None = None) -> list[datasets.BenchRequest]:
    """The synthetic workload every system gets (one list; each concurrency takes its head),
    drawn with ``seed`` (default ``--seed``)."""
    return datasets.synthetic(
        max(args.num_requests, max(concurrencies_of(args))),
        (args.min_prompt, args.max_prompt),
        (args.min_output, args.max_output),
        seed=args.seed if seed is None else seed,
    )


def requests_for(
    workload: Sequence[datasets.BenchRequest], concurrency: int, args: argparse.Namespace
) -> list[datasets.BenchRequest]:
    """The head of ``workload`` sent at ``concurrency``: ``--single-stream-requests`` one at a
    time, ``--num-requests`` otherwise, and never fewer than ``concurrency``."""
    count = args.num_requests if concurrency > 1 else args.single_stream_requests
    return list(workload[: max(count, concurrency)])


def add_workload_arguments(parser: argparse.ArgumentParser, concurrency: str,
                           num_requests: int, single_stream_requests: int) -> None:  # fmt: skip
    """The workload's options, with the given defaults for its size."""
    parser.add_argument("--concurrency", default=concurrency)
    parser.add_argument("--num-requests", type=int, default=num_requests)
    parser.add_argument("--single-stream-requests", type=int, default=single_stream_requests)
    parser.add_argument("--min-prompt", type=int, default=22)
    parser.add_argument("--max-prompt", type=int, default=618)
    parser.add_argument("--min-output", type=int, default=16)
    parser.add_argument("--max-output", type=int, default=255)
    parser.add_argument("--seed", type=int, default=0)


def tuned_extra(flags: str) -> list[str]:
    """The flags a tuned row adds to ``make bench``'s (``ENGINE_FLAGS``, which say
    ``--dtype bfloat16``): the default numerics, then ``flags`` (a later ``--dtype`` wins)."""
    return ["--dtype", "auto", *flags.split()]


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every system at every concurrency; rows of the report."""
    model = resolve(DEFAULT_MODEL).path
    concurrencies = concurrencies_of(args)
    workload = workload_of(args)
    rows: list[dict[str, Any]] = []
    info = vars(args) | {"model": str(model)}

    def add(row: dict[str, Any]) -> None:
        # Each row is kept as it comes: a run stopped midway (a starving server) keeps the
        # systems it measured.
        rows.append(row)
        write_report(args.out, {"rows": rows, "workload": info, "partial": True})
        print(json.dumps(row), file=sys.stderr, flush=True)

    if args.portico_defaults:
        with defaults_engine(args.timeout) as base_url:
            numerics = served_numerics(base_url)
            warm_up(base_url)
            for c in concurrencies:
                summary, _ = serve(base_url, requests_for(workload, c, args), c)
                add(summary_row("portico defaults", c, summary, flags="", numerics=numerics))
    for flags in args.portico_flags.split(";"):
        system = "portico" if not flags.split() else f"portico {flags.strip()}"
        extra = tuned_extra(flags)
        tuned = " ".join([*ENGINE_FLAGS, *extra])
        with engine_process(extra, args.timeout) as (_, base_url):
            numerics = served_numerics(base_url)
            warm_up(base_url)
            for c in concurrencies:
                summary, _ = serve(base_url, requests_for(workload, c, args), c)
                add(summary_row(system, c, summary, flags=tuned, env=ENGINE_ENV, numerics=numerics))
    if args.llama_server:
        for slots in args.llama_slots.split(","):
            with llama_server(
                args.llama_server, model, slots, args.threads, args.context, args.timeout
            ) as base_url:
                warm_up(base_url)
                for c in concurrencies:
                    if c > 1 and slots == "1":
                        continue  # one slot serves one stream; its c=1 row is the baseline
                    # llama-server dropped reused keep-alive connections mid-run (requests
                    # failed at once): a new connection per request for it.
                    summary, _ = serve(
                        base_url, requests_for(workload, c, args), c, keepalive=False
                    )
                    add(summary_row("llama.cpp", c, summary, slots=slots))
    return {"rows": rows, "workload": info}


def write_report(out: str, report: dict[str, Any]) -> None:
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(report, indent=2))


def served_numerics(base_url: str, api_key: str | None = None) -> Any:
    """The path the engine computes on, from its ``/v1/models`` card."""
    import httpx

    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    cards = httpx.get(base_url + "/models", headers=headers, timeout=10).json()["data"]
    return cards[0].get("numerics")


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
    parser.add_argument("--llama-slots", default="1,16,32",
                        help="llama-server -np settings; default: llama-server -m FILE "
                        "with nothing else")  # fmt: skip
    parser.add_argument(
        "--portico-defaults",
        action="store_true",
        help="also run portico engine with no flags, as make run starts it",
    )
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--context", type=int, default=1024, help="context per llama.cpp slot")
    parser.add_argument(
        "--portico-flags",
        default="",
        help="flags beyond make bench's engine flags; several runs separated by ';' "
        "(e.g. ';--gguf-activations exact')",
    )
    add_workload_arguments(parser, "1,16,64", num_requests=256, single_stream_requests=16)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--out", default=".portico/bench/llamacpp_bench.json")
    args = parser.parse_args(argv)
    report = run(args)
    report["best"] = best_rows(report["rows"])
    write_report(args.out, report)
    for row in report["best"]:
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
