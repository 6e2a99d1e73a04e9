"""``make bench``: the standard comparisons on this machine, in one go, into docs/benchmarks.md.

Sections (each runs on its own; a failure is written into the report and the next one runs):

* ``engine_offline`` — the engine against transformers static batching (``load/engine_bench.py``);
* ``engine_served`` — ``portico engine`` serving smollm2-135m in bf16, the serve bench at
  concurrency 1, 16 and 64 on one synthetic workload (TTFT/TPOT percentiles);
* ``prefix_caching`` — the same engine with prefix caching on and off on the shared-prefix
  workload (TTFT p50 ratio);
* ``gateway`` — the gateway in front of the fake upstream against the upstream directly
  (``load/gateway_bench.py``);
* ``admission`` — what admission costs per request against Redis (``load/admission_bench.py``).

    python -m load.standard --quick            # ~10-15 minutes
    python -m load.standard                    # the full sizes (longer)
    python -m load.standard --only gateway     # rerun one section, keep the others' results

Results go to ``docs/bench/results.json`` and the report to ``docs/benchmarks.md`` (plots under
``docs/img/``); the report is rendered from the JSON by :func:`render_report`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, Any

from load.standard_report import keep_hand_written, render_report

REPO_ROOT = Path(__file__).resolve().parent.parent
# Run order: the quick, machine-sensitive sections first, the longest (offline) last.
SECTIONS = (
    "gateway", "admission", "engine_served", "prefix_caching", "engine_offline", "structured",
)  # fmt: skip
SERVED_MODEL = "smollm2-135m"
SERVED_NAME = "smollm2"
ENGINE_FLAGS = (
    "--dtype",
    "bfloat16",
    "--kv-cache-memory",
    "2GiB",
    "--max-num-seqs",
    "64",
    "--max-model-len",
    "2048",
)
TARGET_ENGINE_SPEEDUP = 3.0
TARGET_PREFIX_RATIO = 3.0


@dataclass(frozen=True)
class Sizes:
    """How big each section's workload is (``--quick`` or full)."""

    served_prompt_len: tuple[int, int]
    served_output_len: tuple[int, int]
    served_requests: dict[int, int]  # concurrency -> number of requests
    prefix_groups: int
    prefix_per_group: int
    prefix_output_len: int
    admission_requests: int
    engine_timeout_s: float
    engine_bench_args: tuple[str, ...]  # load/engine_bench.py (offline, vs transformers)
    # torch threads of served engines (OMP_NUM_THREADS); None: torch's default. On a machine
    # shared with other work, more threads than free cores stall every step on OpenMP barriers.
    engine_threads: int | None = None
    # load/structured_bench.py (JSON schema on every request vs the same requests free)
    structured_bench_args: tuple[str, ...] = ("--num-requests", "64", "--rounds", "2")


ENGINE_BENCH_DEVICE = (
    "--device",
    "cpu",
    "--dtype",
    "bfloat16",
    "--max-num-seqs",
    "64",
    "--hf-batch-size",
    "64",
)
QUICK = Sizes(
    (16, 128),
    (16, 32),
    {1: 4, 16: 16, 64: 64},
    4,
    4,
    4,
    1000,
    450,
    (
        *ENGINE_BENCH_DEVICE,
        "--num-requests",
        "64",
        "--max-prompt",
        "64",
        "--min-output",
        "8",
        "--max-output",
        "16",
        "--single-stream-tokens",
        "8",
        "--threads",
        "1",
    ),
    engine_threads=1,
    structured_bench_args=("--num-requests", "32", "--max-tokens", "128", "--rounds", "1"),
)
FULL = Sizes(
    (16, 600), (16, 128), {1: 16, 16: 64, 64: 128}, 4, 8, 16, 5000, 1800, ENGINE_BENCH_DEVICE
)


class SectionSkipped(Exception):
    """A section cannot run here (a missing module or tool); the report says why."""


# ---------------------------------------------------------------- running sections


def run_section(name: str, command: str, body: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run one section; never raises (a failure becomes ``status: failed`` with the error)."""
    start = time.monotonic()
    load_before = os.getloadavg()[0]
    out: dict[str, Any] = {"command": command}
    try:
        out["result"] = body()
        out["status"] = "ok"
    except SectionSkipped as exc:
        out["status"], out["error"] = "skipped", str(exc)
    except Exception as exc:  # the report records any failure and the run goes on
        out["status"] = "failed"
        out["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        traceback.print_exc()
    out["seconds"] = round(time.monotonic() - start, 1)
    out["finished"] = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    out["load_average"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    print(f"[standard] {name}: {out['status']} in {out['seconds']:.0f} s", flush=True)
    return out


# Engines measured here have the machine's cores to themselves, as in a deployment that gives
# them their own: OpenMP threads spin briefly between ops (bounded, ~1 ms) instead of sleeping.
# `portico` waits passively by default (portico.cli.OPENMP_DEFAULTS): up to ~15% slower for one
# and 16 streams on a quiet machine, but no collapse when other work holds a core.
ENGINE_ENV = {"GOMP_SPINCOUNT": "30000"}


def engine_env(threads: int | None = None) -> dict[str, str]:
    """The environment of a measured engine process (``ENGINE_ENV``, optional thread count)."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"} | ENGINE_ENV
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def run_json_module(
    module: str,
    argv: Sequence[str],
    timeout_s: float,
    out_flag: str = "--out",
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """``python -m module argv... --out tmp.json`` in a child process; its JSON result."""
    with tempfile.TemporaryDirectory() as tmp:
        out, log = Path(tmp) / "out.json", Path(tmp) / "log.txt"
        cmd = [sys.executable, "-m", module, *argv, out_flag, str(out)]
        with log.open("wb") as sink:
            proc = subprocess.Popen(
                cmd,
                cwd=REPO_ROOT,
                stdin=subprocess.DEVNULL,
                stdout=sink,
                stderr=subprocess.STDOUT,
                env=env,
            )
            try:
                code = proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
                raise RuntimeError(
                    f"{module} did not finish in {timeout_s:.0f} s; its output "
                    f"so far:\n{_tail(log)}"
                ) from None
        if code != 0 or not out.exists():
            raise RuntimeError(f"{module} exited {code}:\n{_tail(log)}")
        return dict(json.loads(out.read_text()))


def _tail(log: Path, num_chars: int = 1500) -> str:
    return log.read_text(errors="replace")[-num_chars:]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def engine_command(port: int, extra: Sequence[str] = ()) -> list[str]:
    return [
        sys.executable,
        "-m",
        "portico.cli",
        "engine",
        "--model",
        SERVED_MODEL,
        "--served-model-name",
        SERVED_NAME,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *ENGINE_FLAGS,
        *extra,
    ]


def shell_command(cmd: Sequence[str]) -> str:
    """``cmd`` as a user would type it (``portico`` instead of ``python -m portico.cli``)."""
    words = list(cmd)
    if words[:3] == [sys.executable, "-m", "portico.cli"]:
        words = ["portico", *words[3:]]
    elif words[:2] == [sys.executable, "-m"]:
        words = ["python", "-m", *words[2:]]
    return " ".join(words)


@contextlib.contextmanager
def engine_server(
    extra: Sequence[str], timeout_s: float, threads: int | None = None
) -> Iterator[str]:
    """A ``portico engine`` process, ready; yields its ``/v1`` base URL."""
    with engine_process(extra, timeout_s, threads) as (_, base_url):
        yield base_url


@contextlib.contextmanager
def engine_process(
    extra: Sequence[str], timeout_s: float, threads: int | None = None
) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """A ``portico engine`` process, ready; yields it and its ``/v1`` base URL."""

    port = free_port()
    with tempfile.TemporaryFile() as log:
        env = engine_env(threads)
        proc = subprocess.Popen(
            engine_command(port, extra),
            cwd=REPO_ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            wait_ready(proc, f"http://127.0.0.1:{port}/ready", log, timeout_s, "portico engine")
            yield proc, f"http://127.0.0.1:{port}/v1"
        finally:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(10)


def wait_ready(
    proc: subprocess.Popen[bytes], url: str, log: IO[bytes], timeout_s: float, what: str
) -> None:
    """Poll ``url`` until it answers 200; RuntimeError with the tail of ``log`` when ``proc``
    exits first, or when ``timeout_s`` passes."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            log.seek(0)
            tail = log.read().decode(errors="replace")[-1500:]
            raise RuntimeError(f"{what} exited {proc.returncode}: {tail}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} not ready in {timeout_s:.0f} s")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2).status_code == 200:
                return
        time.sleep(0.5)


def serve(
    base_url: str,
    requests: Sequence[Any],
    concurrency: int,
    keepalive: bool = True,
    api_key: str | None = None,
) -> tuple[dict[str, Any], list[Any]]:
    from load import serve_bench

    return asyncio.run(
        serve_bench.run_benchmark(
            base_url,
            SERVED_NAME,
            requests,
            max_concurrency=concurrency,
            api_key=api_key,
            extra_body={"ignore_eos": True},
            progress=False,
            keepalive=keepalive,
        )
    )


def warm_up(base_url: str, api_key: str | None = None) -> None:
    """Two short requests, so first-call costs stay out of the numbers."""
    from load import datasets

    serve(base_url, datasets.synthetic(2, (16, 32), (4, 4), seed=99), 2, api_key=api_key)


# ---------------------------------------------------------------- the sections


def engine_offline(sizes: Sizes) -> dict[str, Any]:
    if importlib.util.find_spec("load.engine_bench") is None:
        raise SectionSkipped("load/engine_bench.py is not in the tree yet")
    return run_json_module(
        "load.engine_bench",
        sizes.engine_bench_args,
        sizes.engine_timeout_s * 2,
        out_flag="--output",
        env=engine_env(),
    )


def structured(sizes: Sizes) -> dict[str, Any]:
    return run_json_module(
        "load.structured_bench",
        sizes.structured_bench_args,
        sizes.engine_timeout_s * 2,
        out_flag="--output",
        env=engine_env(),
    )


def engine_served(sizes: Sizes, img_dir: Path) -> dict[str, Any]:
    from load import datasets
    from load.report import plot_latency_cdfs

    runs, per_run = [], {}
    most = max(sizes.served_requests.values())
    workload = datasets.synthetic(most, sizes.served_prompt_len, sizes.served_output_len, seed=0)
    with engine_server(
        ["--enable-prefix-caching"], sizes.engine_timeout_s, sizes.engine_threads
    ) as base_url:
        warm_up(base_url)
        for concurrency, num in sorted(sizes.served_requests.items()):
            summary, results = serve(base_url, workload[:num], concurrency)
            runs.append({"concurrency": concurrency} | summary)
            per_run[f"concurrency {concurrency}"] = results
    plot = plot_latency_cdfs(per_run, img_dir / "engine_served_cdf.png")
    return {
        "runs": runs,
        "plots": [str(plot)],
        "workload": {
            "dataset": "synthetic",
            "prompt_len": sizes.served_prompt_len,
            "output_len": sizes.served_output_len,
            "seed": 0,
        },
    }


def prefix_caching(sizes: Sizes, img_dir: Path) -> dict[str, Any]:
    """The shared-prefix workload one request at a time (so TTFT is the prefill alone, not
    queueing), against an engine with prefix caching on, then one with it off. The first
    request of each group finds nothing cached either way; the others may hit."""
    from load import datasets
    from load.report import plot_latency_cdfs
    from load.serve_bench import percentiles

    workload = datasets.shared_prefix(
        num_groups=sizes.prefix_groups,
        requests_per_group=sizes.prefix_per_group,
        prefix_len=512,
        suffix_len=32,
        output_len=sizes.prefix_output_len,
    )
    out: dict[str, Any] = {
        "workload": {
            "groups": sizes.prefix_groups,
            "requests_per_group": sizes.prefix_per_group,
            "prefix_len": 512,
            "suffix_len": 32,
            "output_len": sizes.prefix_output_len,
            "concurrency": 1,
        }
    }
    per_run = {}
    for label, flag in (("on", "--enable-prefix-caching"), ("off", "--no-enable-prefix-caching")):
        with engine_server([flag], sizes.engine_timeout_s, sizes.engine_threads) as base_url:
            warm_up(base_url)
            summary, results = serve(base_url, workload, 1)
        summary["ttft_ms_repeats"] = percentiles(
            [r.ttft for r in results[sizes.prefix_groups :] if r.ok]
        )
        out[label] = summary
        per_run[f"prefix caching {label}"] = results
    on, off = out["on"]["ttft_ms"]["median"], out["off"]["ttft_ms"]["median"]
    out["ttft_p50_ratio"] = off / on if on else None
    out["plots"] = [str(plot_latency_cdfs(per_run, img_dir / "prefix_caching_cdf.png"))]
    return out


def gateway(quick: bool, img_dir: Path) -> dict[str, Any]:
    argv = (["--quick"] if quick else []) + ["--plot-dir", str(img_dir)]
    return run_json_module("load.gateway_bench", argv, 900 if quick else 3600)


def admission(sizes: Sizes) -> dict[str, Any]:
    return run_json_module(
        "load.admission_bench", ["--requests", str(sizes.admission_requests)], 600
    )


def section_commands(quick: bool, sizes: Sizes) -> dict[str, str]:
    """The command that reproduces each section on its own."""
    q = " --quick" if quick else ""
    served = []
    for c, n in sorted(sizes.served_requests.items()):
        served.append(
            f"portico bench serve --base-url http://127.0.0.1:8000/v1 --model {SERVED_NAME} "
            f"--dataset synthetic --num-requests {n} --max-concurrency {c} --prompt-len "
            f"{sizes.served_prompt_len[0]} {sizes.served_prompt_len[1]} --output-len "
            f"{sizes.served_output_len[0]} {sizes.served_output_len[1]}"
        )
    prefix = " ".join(f"{k}={v}" for k, v in ENGINE_ENV.items())
    engine = f"{prefix} {shell_command(engine_command(8000))}"
    if sizes.engine_threads:
        engine = f"OMP_NUM_THREADS={sizes.engine_threads} {engine}"
    return {
        "engine_offline": f"{prefix} python -m load.engine_bench "
        + " ".join(sizes.engine_bench_args),
        "engine_served": f"{engine} --enable-prefix-caching &\n" + "\n".join(served),
        "prefix_caching": (
            f"{engine} --enable-prefix-caching   # then again with --no-enable-prefix-caching\n"
            f"python -m load.standard{q} --only prefix_caching   # shared-prefix workload: "
            f"{sizes.prefix_groups} groups x {sizes.prefix_per_group}, 512-token prefix, "
            "concurrency 1"
        ),
        "gateway": f"python -m load.gateway_bench{q} --plot-dir docs/img",
        "admission": f"python -m load.admission_bench --requests {sizes.admission_requests}",
        "structured": f"{prefix} python -m load.structured_bench "
        + " ".join(sizes.structured_bench_args),
    }


def run_all(only: Sequence[str], quick: bool, img_dir: Path) -> dict[str, dict[str, Any]]:
    sizes = QUICK if quick else FULL
    commands = section_commands(quick, sizes)
    bodies: dict[str, Callable[[], dict[str, Any]]] = {
        "engine_offline": lambda: engine_offline(sizes),
        "engine_served": lambda: engine_served(sizes, img_dir),
        "prefix_caching": lambda: prefix_caching(sizes, img_dir),
        "gateway": lambda: gateway(quick, img_dir),
        "admission": lambda: admission(sizes),
        "structured": lambda: structured(sizes),
    }
    return {
        name: run_section(name, commands[name], bodies[name]) for name in SECTIONS if name in only
    }


def machine() -> dict[str, Any]:
    model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True
    ).stdout.strip()
    try:
        import torch

        torch_version = str(torch.__version__)
    except ImportError:
        torch_version = "not installed"
    return {
        "cpu": model,
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch_version,
        "commit": commit,
        "platform": platform.platform(),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m load.standard",
        description="the standard benchmarks into docs/benchmarks.md",
    )
    parser.add_argument("--quick", action="store_true", help="small sizes (~10-15 minutes)")
    parser.add_argument(
        "--only",
        nargs="+",
        choices=SECTIONS,
        default=list(SECTIONS),
        help="run these sections; the others keep their last results",
    )
    parser.add_argument("--results", type=Path, default=REPO_ROOT / "docs/bench/results.json")
    parser.add_argument("--report", type=Path, default=REPO_ROOT / "docs/benchmarks.md")
    parser.add_argument("--img-dir", type=Path, default=REPO_ROOT / "docs/img")
    args = parser.parse_args(argv)
    previous: dict[str, Any] = {}
    if set(args.only) != set(SECTIONS) and args.results.exists():
        previous = json.loads(args.results.read_text())
    started = datetime.now(timezone.utc)
    host = machine()
    sections = run_all(args.only, args.quick, args.img_dir)
    for section in sections.values():
        section["commit"] = host["commit"]
        section["mode"] = "quick" if args.quick else "full"
    results = {
        "machine": host,
        "started": started.strftime("%Y-%m-%d %H:%M UTC"),
        "mode": "quick" if args.quick else "full",
        "sections": {**previous.get("sections", {}), **sections},
    }
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(results, indent=2) + "\n")
    existing = args.report.read_text() if args.report.exists() else None
    report = render_report(results, args.report.parent)
    args.report.write_text(keep_hand_written(report, existing))
    print(f"[standard] wrote {args.report} and {args.results}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
