"""A fresh clone's ``make run`` against ``portico engine`` with no flags, served, in one run:
``python -m load.fresh_clone_bench`` (``portico bench fresh-clone``).

What a new user does: ``git clone`` the repository (``--source``, default the one this bench
runs from, at ``--commit``, default its HEAD) into a temporary folder and run ``make run``
there, which builds ``.venv`` (torch first, then Portico), pulls the default model and starts
``portico serve`` with no config file: the gateway on the packaged ``listen`` address
(127.0.0.1:8000), one engine, the embedded Redis. ``--venv PATH`` runs
``make run VENV=PATH -o PATH/.installed`` instead, for a user who has a virtual environment
already: make neither installs nor reinstalls into it, and the clone is put first on
PYTHONPATH so that the clone's code is what serves (an editable install elsewhere would win).

Once the gateway is ready, the bench does what its first-start message says: it reads the admin
key generated under the clone's ``.portico/``, creates a tenant on the packaged ``enterprise``
plan (the default ``free`` plan admits two requests at a time) and a key, and sends the
workload of docs/benchmarks.md's defaults rows (``load/llamacpp_bench.py``'s: token prompts
22-618, forced outputs 16-255, greedy; 6 requests one at a time, then 16 at concurrency 16)
through the gateway. The baseline is that section's "Portico, no flags" row, ``portico engine
--model smollm2-135m`` with no other flag, started by this bench and up for the whole run; the
two take turns phase by phase (the order alternating), so both see the same load. Round ``r``
draws its prompts with seed ``--seed + r`` (a prompt sent again would hit the prefix cache;
round 0 is the docs' workload). Each system's rounds are pooled, and the report gives the
ratio make run / baseline, that ratio in each round (the noise) and the documented figures.

Then make run is stopped as Ctrl-C in a terminal stops it (SIGINT to its process group), and
every process it started (make's descendants, and whatever runs from inside the clone, such as
the embedded redis-server, which daemonizes) must have exited: what is left is reported, then
killed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, Any
from urllib.parse import urlsplit

import httpx

from load.gateway_stack import admin_client, new_tenant_key
from load.llamacpp_bench import (
    OPENMP_TUNING,
    add_workload_arguments,
    concurrencies_of,
    defaults_engine,
    requests_for,
    served_numerics,
    summary_row,
    workload_of,
    write_report,
)
from load.standard import REPO_ROOT, serve, warm_up

MAKE_RUN = "make run"
BASELINE = "portico engine, no flags"
# docs/benchmarks.md, "Defaults vs tuned flags (issue 35)": the "Portico, no flags" rows of the
# passive-waiting run (16:02-16:03 UTC, load average 1.76 falling to 1.62).
DOCUMENTED_DEFAULTS: Mapping[int, Mapping[str, float]] = {
    1: {"output_tok_s": 89.5, "ttft_p50_ms": 384.0, "ttft_p99_ms": 676.0, "tpot_p50_ms": 8.3},
    16: {"output_tok_s": 148.0, "ttft_p50_ms": 1840.0, "ttft_p99_ms": 3034.0, "tpot_p50_ms": 73.6},
}
METRICS = ("output_tok_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms")
RATIOS = (*METRICS, "cpu_cores")
TENANT = "fresh-clone"
TENANT_PLAN = "enterprise"
# What this shell has and a new user's would not: the bench's own PYTHONPATH and virtual
# environment, Portico's settings (PORTICO_*), the benchmarks' OpenMP tuning.
NOT_A_USERS = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", *OPENMP_TUNING)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="portico bench fresh-clone", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--source", default=str(REPO_ROOT), help="repository to clone")
    parser.add_argument("--commit", default="HEAD", help="commit of --source to check out")
    parser.add_argument(
        "--venv",
        type=Path,
        default=None,
        help="an existing virtual environment: make run VENV=PATH, no install",
    )
    parser.add_argument(
        "--rounds", type=int, default=2, help="turns of the whole workload on each system"
    )
    add_workload_arguments(parser, "1,16", num_requests=16, single_stream_requests=6)
    parser.add_argument(
        "--ready-timeout",
        type=float,
        default=1200.0,
        help="seconds for make run's install, model pull and start",
    )
    parser.add_argument(
        "--stop-timeout", type=float, default=90.0, help="seconds make run has to exit after SIGINT"
    )
    parser.add_argument("--keep", action="store_true", help="keep the clone (and its .venv)")
    parser.add_argument("--out", default="load/results/fresh_clone_bench.json")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.venv is not None and not (args.venv / "bin" / "python").exists():
        parser.error(f"--venv {args.venv}: no bin/python inside")
    return args


def make_command(venv: Path | None) -> list[str]:
    """``make run``, or with ``venv``: make run in that environment, told (``-o``) that its
    install target is done, so it installs nothing and reinstalls nothing into it."""
    if venv is None:
        return ["make", "run"]
    return ["make", "run", f"VENV={venv}", "-o", f"{venv}/.installed"]


def user_env(environ: Mapping[str, str], clone: Path, venv: Path | None) -> dict[str, str]:
    """``environ`` less what a new user's shell would not have (:data:`NOT_A_USERS`,
    ``PORTICO_*``); with ``venv``, the clone first on PYTHONPATH."""
    env = {
        k: v for k, v in environ.items() if k not in NOT_A_USERS and not k.startswith("PORTICO_")
    }
    if venv is not None:
        env["PYTHONPATH"] = str(clone)
    return env


def phase_order(round_index: int, phase_index: int) -> tuple[str, str]:
    """Which system goes first in a phase: alternating, so neither is always first."""
    if (round_index + phase_index) % 2 == 0:
        return MAKE_RUN, BASELINE
    return BASELINE, MAKE_RUN


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def compare(
    rows: Sequence[dict[str, Any]], rounds: Sequence[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Per concurrency: both systems' pooled rows, make run / baseline for every metric, that
    ratio of output tok/s in each round, and the documented figures of the no-flags engine."""
    out = []
    for c in sorted({r["concurrency"] for r in rows}):
        at = {r["system"]: r for r in rows if r["concurrency"] == c}
        make_run, baseline = at.get(MAKE_RUN), at.get(BASELINE)
        per_round = []
        for i in sorted({r["round"] for r in rounds}):
            pair = {r["system"]: r for r in rounds if r["concurrency"] == c and r["round"] == i}
            if MAKE_RUN in pair and BASELINE in pair:
                mr, bl = pair[MAKE_RUN]["output_tok_s"], pair[BASELINE]["output_tok_s"]
                per_round.append(_ratio(mr, bl))
        out.append(
            {
                "concurrency": c,
                MAKE_RUN: make_run,
                BASELINE: baseline,
                "ratio": {
                    m: _ratio((make_run or {}).get(m), (baseline or {}).get(m)) for m in RATIOS
                },
                "round_ratios_output_tok_s": per_round,
                "documented": dict(DOCUMENTED_DEFAULTS.get(c, {})),
            }
        )
    return out


def table(comparison: Sequence[dict[str, Any]]) -> str:
    """The comparison as docs/benchmarks.md's tables are written (markdown)."""
    lines = [
        "| system | concurrency | output tok/s | TTFT p50 | TTFT p99 | TPOT p50 | completed "
        "| CPU (cores) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for entry in comparison:
        c = entry["concurrency"]
        for system in (MAKE_RUN, BASELINE):
            row = entry[system]
            if row is None:
                continue
            done = f"{row['completed']}/{row['completed'] + row['failed']}"
            cores = row.get("cpu_cores")
            lines.append(
                f"| {system} | {c} | {row['output_tok_s']:.1f} | "
                f"{row['ttft_p50_ms']:.0f} ms | {row['ttft_p99_ms']:.0f} ms | "
                f"{row['tpot_p50_ms']:.1f} ms | {done} | {'-' if cores is None else cores} |"
            )
        ratio = entry["ratio"]
        cells = [f"{ratio[m]:.2f}" if ratio[m] is not None else "-" for m in RATIOS]
        cells.insert(len(METRICS), "")  # no ratio of completed requests
        rounds = ", ".join(f"{r:.2f}" for r in entry["round_ratios_output_tok_s"] if r)
        lines.append(
            f"| make run / baseline (tok/s by round: {rounds}) | {c} | " + " | ".join(cells) + " |"
        )
        doc = entry["documented"]
        if doc:
            lines.append(
                f"| documented, no flags (quiet) | {c} | {doc['output_tok_s']:.1f} | "
                f"{doc['ttft_p50_ms']:.0f} ms | {doc['ttft_p99_ms']:.0f} ms | "
                f"{doc['tpot_p50_ms']:.1f} ms | | |"
            )
    return "\n".join(lines)


def numerics_line(log_text: str) -> str | None:
    """The engine's ``numerics: ...`` log line (what ``--dtype auto`` chose), if logged."""
    for line in log_text.splitlines():
        if "numerics:" in line:
            return line[line.index("numerics:") :].strip()
    return None


def listening(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex((host, port)) == 0


def clone(source: str, commit: str, dest: Path) -> str:
    """``git clone`` ``source`` into ``dest`` and check out ``commit``; return its hash."""
    sha = subprocess.run(
        ["git", "-C", source, "rev-parse", "--verify", f"{commit}^{{commit}}"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    subprocess.run(["git", "clone", "--quiet", "--no-checkout", source, str(dest)], check=True)
    subprocess.run(["git", "-C", str(dest), "checkout", "--quiet", "--detach", sha], check=True)
    return sha


class MakeRun:
    """``make run`` in a clone, started in a process group of its own as a terminal runs it.

    ``wait_ready`` times its steps from make's own log (make prints each recipe line as it
    starts it); ``stop`` sends SIGINT to the group, as Ctrl-C does, and reports what did not
    exit."""

    def __init__(self, clone_dir: Path, venv: Path | None, log: IO[bytes]) -> None:
        self.clone_dir = clone_dir
        self.log = log
        self.command = make_command(venv)
        self.env = user_env(os.environ, clone_dir, venv)
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            self.command,
            cwd=self.clone_dir,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def log_text(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read().decode(errors="replace")

    def wait_ready(self, url: str, timeout_s: float) -> dict[str, float | None]:
        """Seconds from make's start to: its model pull (the install done), its ``portico
        serve``, and ``url`` answering 200."""
        marks: dict[str, float | None] = {"install_s": None, "pull_s": None}
        while True:
            elapsed = time.monotonic() - self.started
            text = self.log_text()
            if marks["install_s"] is None and "portico models pull" in text:
                marks["install_s"] = round(elapsed, 1)
            if marks["pull_s"] is None and any(
                line.rstrip().endswith("portico serve") for line in text.splitlines()
            ):
                marks["pull_s"] = round(elapsed, 1)
            if self.proc.poll() is not None:
                raise RuntimeError(f"make run exited {self.proc.returncode}:\n{text[-3000:]}")
            if elapsed > timeout_s:
                raise RuntimeError(f"make run not ready in {timeout_s:.0f} s:\n{text[-3000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url, timeout=2).status_code == 200:
                    return marks | {"ready_s": round(elapsed, 1)}
            time.sleep(0.5)

    def processes(self) -> list[Any]:
        """make's descendants and every process running from inside the clone."""
        import psutil

        found: dict[int, psutil.Process] = {}
        with contextlib.suppress(psutil.NoSuchProcess):
            make = psutil.Process(self.proc.pid)
            found = {p.pid: p for p in [make, *make.children(recursive=True)]}
        inside = str(self.clone_dir)
        for p in psutil.process_iter(["cwd", "cmdline"]):
            cwd, cmdline = p.info["cwd"] or "", p.info["cmdline"] or []
            if cwd.startswith(inside) or any(inside in arg for arg in cmdline):
                found.setdefault(p.pid, p)
        return list(found.values())

    def stop(self, timeout_s: float) -> dict[str, Any]:
        """SIGINT to make's process group; SIGTERM, then SIGKILL, to the group if make has not
        exited in ``timeout_s``. Then every process seen before the signal has ``timeout_s``
        to exit; those still alive are reported, then killed."""
        seen = self.processes()
        described = {p.pid: _describe(p) for p in seen}  # while their command lines are there
        report: dict[str, Any] = {"signal": "SIGINT to the process group", "escalated": None}
        started = time.monotonic()
        for sig, wait_s in (
            (signal.SIGINT, timeout_s),
            (signal.SIGTERM, 30.0),
            (signal.SIGKILL, 10.0),
        ):
            if sig != signal.SIGINT:
                report["escalated"] = sig.name
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(wait_s)
                break
        report["exit_code"] = self.proc.returncode
        report["make_exit_s"] = round(time.monotonic() - started, 1)
        deadline = time.monotonic() + timeout_s
        while any(_alive(p) for p in seen) and time.monotonic() < deadline:
            time.sleep(0.2)  # the gateway drains and stops its engines and its Redis
        report["all_exited_s"] = round(time.monotonic() - started, 1)
        left = [p for p in {p.pid: p for p in [*seen, *self.processes()]}.values() if _alive(p)]
        report["processes_seen"] = list(described.values())
        report["left_running"] = [described.get(p.pid) or _describe(p) for p in left]
        for p in left:  # reported above; not left behind on the machine
            with contextlib.suppress(Exception):
                p.kill()
        return report


def _alive(process: Any) -> bool:
    import psutil

    try:
        return bool(process.is_running()) and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _describe(process: Any) -> str:
    try:
        cmdline = " ".join(process.cmdline())[:160]
    except Exception:  # gone, or a zombie whose command line cannot be read
        cmdline = "?"
    return f"{process.pid} {cmdline}"


def tenant_key(base_url: str, admin_key: str) -> str:
    """A tenant on :data:`TENANT_PLAN` and its API key, through the admin API."""
    with admin_client(base_url, admin_key) as admin:
        return new_tenant_key(
            admin, {"id": TENANT, "name": "fresh clone bench", "plan": TENANT_PLAN}
        )


def served_from(python: Path, cwd: Path, env: Mapping[str, str]) -> str:
    """Where ``python`` (as make run's processes run it) imports Portico from."""
    probe = "import gateway, portico; print(portico.__file__, gateway.__file__)"
    done = subprocess.run(
        [str(python), "-c", probe],
        cwd=cwd,
        env=dict(env),
        capture_output=True,
        text=True,
        check=False,
    )
    return (done.stdout or done.stderr).strip()


@dataclass(frozen=True)
class Target:
    """A system under test: where it serves, the key it wants, and the processes that serve it
    (their CPU seconds are read around every phase)."""

    base_url: str
    api_key: str | None
    processes: Callable[[], Sequence[Any]]


def cpu_seconds(processes: Sequence[Any]) -> float:
    """User and system CPU seconds of ``processes`` (psutil), those gone counting nothing."""
    import psutil

    total = 0.0
    for p in processes:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.ZombieProcess):
            times = p.cpu_times()
            total += times.user + times.system
    return total


def measure(
    targets: Mapping[str, Target], args: argparse.Namespace
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The workload on each system, phase by phase and round by round; returns the pooled rows
    (per system and concurrency) and the rows of each round. ``cpu_cores``: the CPU the
    system's processes used over the phase, in cores (on a shared machine, a system slower
    than the other at the same CPU time was waiting for a core)."""
    from load.serve_bench import summarize

    results: dict[tuple[str, int], list[Any]] = {}
    seconds: dict[tuple[str, int], list[float]] = {}  # [wall, cpu]
    rounds = []
    for r in range(args.rounds):
        # Each round its own prompts (seed + round): a prompt sent again would be served from
        # the prefix cache. Within a round, the docs' workload: its head at every concurrency.
        workload = workload_of(args, seed=args.seed + r)
        for i, c in enumerate(concurrencies_of(args)):
            for system in phase_order(r, i):
                target = targets[system]
                processes = target.processes()
                cpu, wall = cpu_seconds(processes), time.perf_counter()
                reqs = requests_for(workload, c, args)
                summary, done = serve(target.base_url, reqs, c, api_key=target.api_key)
                wall, cpu = time.perf_counter() - wall, cpu_seconds(processes) - cpu
                rounds.append(
                    summary_row(system, c, summary, round=r, cpu_cores=round(cpu / wall, 2),
                                load_1m=round(os.getloadavg()[0], 2))
                )  # fmt: skip
                print(json.dumps(rounds[-1]), file=sys.stderr, flush=True)
                results.setdefault((system, c), []).extend(done)
                totals = seconds.setdefault((system, c), [0.0, 0.0])
                totals[0] += wall
                totals[1] += cpu
    pooled = []
    for (system, c), done in results.items():
        wall, cpu = seconds[system, c]
        pooled.append(summary_row(system, c, summarize(done, wall), cpu_cores=round(cpu / wall, 2)))
    return pooled, rounds


def engine_processes(base_url: str) -> list[Any]:
    """The process of the ``portico engine`` serving ``base_url`` (found by its ``--port``)."""
    import psutil

    port = str(urlsplit(base_url).port)
    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmdline = p.info["cmdline"] or []
        if "engine" in cmdline and "--port" in cmdline[:-1]:
            if cmdline[cmdline.index("--port") + 1] == port:
                found.append(p)
    return found


def _machine_now() -> dict[str, Any]:
    return {
        "utc": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S"),
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }


@contextlib.contextmanager
def _workdir(keep: bool) -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="portico-fresh-clone-"))
    try:
        yield path
    finally:
        if not keep:
            shutil.rmtree(path, ignore_errors=True)


def run(args: argparse.Namespace, report: dict[str, Any]) -> None:
    """The whole run, into ``report`` (filled as it goes: a failed run keeps its steps)."""
    from gateway.config import ListenConfig

    listen = ListenConfig()  # `portico serve` with no config file
    gateway_url = f"http://{listen.host}:{listen.port}"
    if listening(listen.host, listen.port):
        raise RuntimeError(
            f"{listen.host}:{listen.port} is taken: make run's gateway listens there "
            "(the packaged listen address); stop what holds it first"
        )
    report["start"] = _machine_now()
    report["workload"] = vars(args) | {"venv": str(args.venv) if args.venv else None}
    with _workdir(args.keep) as work, (work / "make-run.log").open("w+b") as log:
        dest = work / "portico"
        report["clone"] = {
            "source": args.source,
            "commit": clone(args.source, args.commit, dest),
            "path": str(dest),
        }
        make = MakeRun(dest, args.venv, log)
        report["make_command"] = " ".join(make.command)
        venv = args.venv or dest / ".venv"
        report["venv"] = {"path": str(venv), "built_by_make_run": args.venv is None}
        try:
            report["startup"] = make.wait_ready(gateway_url + "/ready", args.ready_timeout)
            print(f"make run ready: {json.dumps(report['startup'])}", file=sys.stderr, flush=True)
            report["served_from"] = served_from(venv / "bin" / "python", dest, make.env)
            key = tenant_key(gateway_url, (dest / ".portico" / "admin_key").read_text().strip())
            with defaults_engine(args.ready_timeout) as engine_url:
                report["baseline_numerics"] = served_numerics(engine_url)
                warm_up(gateway_url + "/v1", api_key=key)
                warm_up(engine_url)
                baseline = engine_processes(engine_url)
                targets = {
                    MAKE_RUN: Target(gateway_url + "/v1", key, make.processes),
                    BASELINE: Target(engine_url, None, lambda: baseline),
                }
                report["rows"], report["rounds"] = measure(targets, args)
        finally:
            report["make_run_numerics"] = numerics_line(make.log_text())
            report["shutdown"] = make.stop(args.stop_timeout)
            report["make_run_log_tail"] = make.log_text()[-2000:]
    report["comparison"] = compare(report["rows"], report["rounds"])
    report["end"] = _machine_now()


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    report: dict[str, Any] = {}
    try:
        run(args, report)
    finally:
        write_report(args.out, report)
    summary = {
        k: report[k]
        for k in (
            "start",
            "end",
            "clone",
            "make_command",
            "venv",
            "startup",
            "served_from",
            "make_run_numerics",
            "baseline_numerics",
        )
    }
    print(json.dumps(summary, indent=2))
    print(table(report["comparison"]))
    shutdown = report["shutdown"]
    print(
        f"make run stopped: exit code {shutdown['exit_code']} in {shutdown['make_exit_s']} s "
        f"after {shutdown['signal']} (all its processes gone in {shutdown['all_exited_s']} s), "
        f"escalated: {shutdown['escalated']}; "
        f"{len(shutdown['processes_seen'])} processes seen, left running: "
        f"{shutdown['left_running'] or 'none'}"
    )
    return 0 if not shutdown["left_running"] and shutdown["escalated"] is None else 1


if __name__ == "__main__":
    raise SystemExit(main())
