"""load/fresh_clone_bench.py's pure parts: what it runs, in which environment, in which order,
and how its report is composed (the bench clones, installs and serves: it is run by hand,
`portico bench fresh-clone`, never in the suite)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest

from load.fresh_clone_bench import (
    BASELINE,
    DOCUMENTED_DEFAULTS,
    MAKE_RUN,
    compare,
    cpu_seconds,
    engine_processes,
    make_command,
    numerics_line,
    parse_args,
    phase_order,
    table,
    user_env,
)
from load.llamacpp_bench import concurrencies_of, requests_for, workload_of


def test_defaults_send_the_documented_defaults_rows_workload() -> None:
    """One stream of 6 requests, then 16 at concurrency 16, the llamacpp bench's prompts and
    outputs: the command the docs' defaults rows were measured with."""
    args = parse_args([])
    assert args.venv is None and args.commit == "HEAD" and args.rounds == 2
    assert concurrencies_of(args) == [1, 16]
    workload = workload_of(args)
    assert len(requests_for(workload, 1, args)) == 6
    assert len(requests_for(workload, 16, args)) == 16
    assert all(22 <= r.prompt_len <= 618 and 16 <= r.output_len <= 255 for r in workload)
    assert set(DOCUMENTED_DEFAULTS) == {1, 16}
    # later rounds draw other prompts (a repeated one would be served from the prefix cache)
    assert workload_of(args, seed=1)[0].prompt != workload[0].prompt


def test_a_venv_without_python_and_zero_rounds_are_refused() -> None:
    with pytest.raises(SystemExit):
        parse_args(["--venv", "/nonexistent/venv"])
    with pytest.raises(SystemExit):
        parse_args(["--rounds", "0"])


def test_make_run_is_run_as_is_or_told_that_the_given_venv_is_installed() -> None:
    assert make_command(None) == ["make", "run"]
    venv = Path("/opt/venv")
    assert make_command(venv) == ["make", "run", "VENV=/opt/venv", "-o", "/opt/venv/.installed"]


def test_the_given_venv_makes_no_install_step_in_the_makefile(tmp_path: Path) -> None:
    """``make -n`` with the bench's words prints the serve steps and no pip."""
    venv = tmp_path / "venv"
    words = make_command(venv)
    makefile = Path(__file__).resolve().parents[2] / "Makefile"
    dry = subprocess.run(
        ["make", "-n", "-f", str(makefile), *words[1:]], capture_output=True, text=True, check=True
    ).stdout
    assert "pip" not in dry and f"{venv}/bin/portico serve" in dry
    plain = subprocess.run(
        ["make", "-n", "-f", str(makefile), "run", f"VENV={venv}"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "pip install" in plain  # without -o, make would install into it


def test_the_users_environment_drops_the_benchs_own_settings(tmp_path: Path) -> None:
    environ = {
        "PATH": "/usr/bin",
        "HOME": "/root",
        "PYTHONPATH": "/work/tree",
        "VIRTUAL_ENV": "/work/.venv",
        "GOMP_SPINCOUNT": "30000",
        "OMP_NUM_THREADS": "1",
        "PORTICO_ADMIN_KEY": "sk-admin-x",
        "PORTICO_REDIS_URL": "redis://elsewhere",
    }
    assert user_env(environ, tmp_path, None) == {"PATH": "/usr/bin", "HOME": "/root"}
    with_venv = user_env(environ, tmp_path, tmp_path / "venv")
    assert with_venv["PYTHONPATH"] == str(tmp_path)  # the clone's code serves, not the venv's


def test_the_two_systems_take_turns_going_first() -> None:
    orders = [phase_order(r, i) for r in range(2) for i in range(2)]
    first, second = (MAKE_RUN, BASELINE), (BASELINE, MAKE_RUN)
    assert orders == [first, second, second, first]  # phase by phase, and round by round


def _row(system: str, c: int, tok_s: float, round_index: int | None = None) -> dict[str, Any]:
    row = {
        "system": system,
        "concurrency": c,
        "output_tok_s": tok_s,
        "ttft_p50_ms": 400.0,
        "ttft_p99_ms": 700.0,
        "tpot_p50_ms": 8.0,
        "completed": 6,
        "failed": 0,
        "cpu_cores": 1.5,
    }
    return row if round_index is None else row | {"round": round_index}


def test_comparison_gives_make_run_over_baseline_per_metric_and_per_round() -> None:
    pooled = [_row(MAKE_RUN, 1, 90.0), _row(BASELINE, 1, 100.0), _row(MAKE_RUN, 16, 150.0)]
    rounds = [
        _row(MAKE_RUN, 1, 80.0, 0),
        _row(BASELINE, 1, 100.0, 0),
        _row(MAKE_RUN, 1, 100.0, 1),
        _row(BASELINE, 1, 100.0, 1),
    ]
    one, sixteen = compare(pooled, rounds)
    assert one["ratio"] == {
        "output_tok_s": 0.9,
        "ttft_p50_ms": 1.0,
        "ttft_p99_ms": 1.0,
        "tpot_p50_ms": 1.0,
        "cpu_cores": 1.0,
    }
    assert one["round_ratios_output_tok_s"] == [0.8, 1.0]
    assert one["documented"] == dict(DOCUMENTED_DEFAULTS[1])
    assert sixteen[BASELINE] is None and sixteen["ratio"]["output_tok_s"] is None

    lines = table([one]).splitlines()
    assert lines[2] == f"| {MAKE_RUN} | 1 | 90.0 | 400 ms | 700 ms | 8.0 ms | 6/6 | 1.5 |"
    assert lines[3].startswith(f"| {BASELINE} | 1 | 100.0 |")
    assert "by round: 0.80, 1.00" in lines[4]
    assert lines[4].endswith("| 1 | 0.90 | 1.00 | 1.00 | 1.00 |  | 1.00 |")
    assert lines[5].startswith("| documented, no flags (quiet) | 1 | 89.5 | 384 ms | 676 ms |")
    assert {line.count("|") for line in lines} == {9}  # every row has the header's columns


def test_the_engines_numerics_line_is_found_in_make_runs_log() -> None:
    log = (
        "make: ...\n2026-12-03 INFO engine: numerics: bfloat16+int8 (--dtype auto: ...)\n"
        "INFO ready\n"
    )
    assert numerics_line(log) == "numerics: bfloat16+int8 (--dtype auto: ...)"
    assert numerics_line("nothing here") is None


def test_the_cli_lists_the_bench() -> None:
    from load.cli import _delegated

    assert ("fresh-clone", "load.fresh_clone_bench") in [(n, m) for n, m, _ in _delegated()]


def test_the_baseline_engine_is_found_by_its_port_and_its_cpu_time_read() -> None:
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)", "engine", "--port", "59999"]
    proc = subprocess.Popen(sleeper)
    try:
        found = engine_processes("http://127.0.0.1:59999/v1")
        assert [p.pid for p in found] == [proc.pid]
        assert engine_processes("http://127.0.0.1:59998/v1") == []
        assert cpu_seconds(found) >= 0.0 and cpu_seconds([psutil.Process()]) > 0.0
    finally:
        proc.kill()
        proc.wait()
