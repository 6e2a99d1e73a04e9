"""Gateway benchmark: what the gateway adds in front of an upstream, and whether its limits hold.

One run starts everything it measures, on this machine:

* a redis-server (the rate-limit buckets; auth and limits are ON for every request);
* two fake OpenAI upstreams (``load/fake_upstream.py``): one the gateway supervises as its
  engines on Unix sockets (two models), one on TCP that the generator calls directly;
* ``portico serve`` pinned to one core (``--gateway-cpus``), with ``--tenants`` tenants of
  ``--keys-per-tenant`` keys each made through the admin API.

Cores: the gateway alone on its core; the generator, redis-server and the gateway's engines on
the other (``--client-cpus``); the direct upstream on the gateway's core, so that "direct"
crosses cores once as the generator's call to the gateway does (on the generator's own core a
round trip costs ~10 us here against ~130 us across cores: a baseline no remote upstream has).

Then, with the generator on the other core:

1. **Overhead at fixed rates** (open loop): the same mixed requests (tenants, keys, two models,
   chat and completions, streaming and not) go to the upstream directly and through the gateway,
   in alternating rounds, each side's run after ``--warmup`` seconds of the same load that are
   not counted (see :func:`fixed_rate`). Added latency = gateway minus direct at the same
   percentile; for streams the latency is the time to the first chunk. The gateway's own
   ``x-portico-overhead-ms`` (its time minus upstream time) is reported too.
2. **Rate-limit correctness under load**: tenants with small requests/min limits are hammered
   while the bench tenants' traffic runs; admitted must lie in
   ``[min(sent, limit), limit + limit/60 * elapsed]`` (token bucket: full at start, refilling).
3. **Saturation**: ``wrk`` (closed loop, one thread) against the upstream directly and against
   the gateway, streaming and not; and the Python generator's own ceiling against the upstream.

Tenants on the plan ``open`` (no limit at all) also run at the first rate, so the cost of the
limits shows apart from the rest of the gateway.

    python -m load.gateway_bench --quick --out load/results/gateway.json --plot-dir docs/img
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import random
import re
import secrets
import shutil
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from gateway.config import GatewayConfig
from load.gateway_bench_report import (
    TARGET_P50_MS,
    TARGET_P99_MS,
    TARGET_RPS,
    plot,
    verdicts,
    without_samples,
)
from load.gateway_stack import (
    MODELS,
    GatewayHandle,
    cpu_seconds,
    cpu_set,
    default_cpus,
    direct_upstream,
    gateway,
    pinned,
    redis_server,
)
from load.open_loop import Sample, Shot, build_request, closed_loop, open_loop, run_async
from load.serve_bench import percentiles

PHASES = ("fixed", "limits", "saturation")


# ---------------------------------------------------------------- tenants and requests


@dataclass(frozen=True)
class BenchTenant:
    """A tenant made through the admin API, with its keys (secrets) and its requests/min."""

    tenant_id: str
    keys: tuple[str, ...]
    requests_per_minute: int | None = None  # None: the bench plan's (never reached)


def create_tenants(
    base_url: str,
    admin_key: str,
    num_tenants: int,
    keys_per_tenant: int,
    prefix: str = "bench",
    requests_per_minute: int | None = None,
    plan: str = "bench",
) -> list[BenchTenant]:
    """``num_tenants`` tenants with ``keys_per_tenant`` keys each, through ``/admin/v1``."""
    out = []
    overrides = {"requests_per_minute": requests_per_minute} if requests_per_minute else {}
    with httpx.Client(
        base_url=base_url, timeout=30, headers={"authorization": f"Bearer {admin_key}"}
    ) as admin:
        for i in range(num_tenants):
            tenant_id = f"{prefix}-{i}-{secrets.token_hex(3)}"
            r = admin.post(
                "/admin/v1/tenants",
                json={"id": tenant_id, "name": tenant_id, "plan": plan, "overrides": overrides},
            )
            r.raise_for_status()
            keys = []
            for _ in range(keys_per_tenant):
                r = admin.post(f"/admin/v1/tenants/{tenant_id}/keys", json={})
                r.raise_for_status()
                keys.append(str(r.json()["key"]))
            out.append(BenchTenant(tenant_id, tuple(keys), requests_per_minute))
    return out


def request_body(kind: str, model: str, stream: bool, max_tokens: int = 8) -> dict[str, Any]:
    """A small chat or completions request (the fake answers ``max_tokens`` chunks)."""
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "stream": stream}
    if kind == "chat":
        body["messages"] = [{"role": "user", "content": "Name one benefit of load testing."}]
    else:
        body["prompt"] = "One benefit of load testing is"
    return body


def build_shots(
    host: str,
    tenants: Sequence[BenchTenant],
    models: Sequence[str] = MODELS,
    streams: Sequence[bool] = (False, True),
    seed: int = 0,
) -> list[Shot]:
    """Every (key, model, chat/completions, stream) combination, shuffled; label "stream" or
    "json". The same list for direct and gateway runs differs only in ``host``."""
    keys = [(t.tenant_id, k) for t in tenants for k in t.keys]
    shots = []
    for (tenant, key), model, kind, stream in itertools.product(
        keys, models, ("chat", "completions"), streams
    ):
        path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
        raw = build_request(host, path, request_body(kind, model, stream), key)
        shots.append(Shot("stream" if stream else "json", tenant, raw))
    random.Random(seed).shuffle(shots)
    return shots


# ---------------------------------------------------------------- the numbers


def latency_stats(samples: Sequence[Sample], label: str) -> dict[str, float]:
    """Percentiles (ms) of the successful samples with ``label``: time to the first chunk for
    streams, the whole answer otherwise."""
    ok = [s for s in samples if s.status == 200 and s.label == label]
    values = [s.first_s if label == "stream" else s.total_s for s in ok]
    return percentiles(values) | {"count": float(len(values))}


def overhead(direct: dict[str, float], through: dict[str, float]) -> dict[str, float]:
    """Added latency (ms) of the gateway at each percentile: gateway minus direct."""
    return {f"{k}_ms": through[k] - direct[k] for k in ("median", "p90", "p99")}


def rate_limit_check(
    tenant: BenchTenant, samples: Sequence[Sample], elapsed_s: float
) -> dict[str, Any]:
    """Did the tenant's requests/min bucket admit what a token bucket must?

    Full at the start (capacity = the limit), refilled at limit/60 per second: admitted lies in
    ``[min(sent, limit), limit + limit/60 * elapsed]``; every refusal is a 429, nothing else.
    """
    rpm = tenant.requests_per_minute
    if rpm is None:
        raise ValueError(f"{tenant.tenant_id} has no requests/min limit to check")
    mine = [s for s in samples if s.tenant == tenant.tenant_id]
    admitted = sum(1 for s in mine if s.status == 200)
    limited = sum(1 for s in mine if s.status == 429)
    other = len(mine) - admitted - limited
    low = min(len(mine), rpm)
    high = rpm + rpm / 60.0 * elapsed_s
    return {
        "tenant": tenant.tenant_id,
        "requests_per_minute": rpm,
        "sent": len(mine),
        "admitted": admitted,
        "limited_429": limited,
        "other": other,
        "elapsed_s": elapsed_s,
        "expected_min": low,
        "expected_max": high,
        "ok": other == 0 and low <= admitted <= high,
    }


# ---------------------------------------------------------------- wrk


WRK_DONE = """
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format('WRKJSON {"requests": %d, "duration_us": %d, "non2xx": %d, '
    .. '"connect_errors": %d, "read_errors": %d, "write_errors": %d, "timeouts": %d, '
    .. '"p50_us": %d, "p99_us": %d}\\n', summary.requests, summary.duration, e.status,
    e.connect, e.read, e.write, e.timeout, latency:percentile(50), latency:percentile(99)))
end
"""


def wrk_script(shots: Sequence[Shot]) -> str:
    """A wrk Lua script cycling through ``shots`` (method, path, headers, body of each)."""
    lines = ["local reqs = {}"]
    for shot in shots:
        head, _, body = shot.raw.partition(b"\r\n\r\n")
        request_line, *header_lines = head.decode("latin-1").split("\r\n")
        method, path, _ = request_line.split(" ")
        headers = ", ".join(
            f'["{n}"] = "{v.strip()}"'
            for n, _, v in (h.partition(":") for h in header_lines)
            if n.lower() not in ("host", "content-length")
        )
        text = body.decode()
        if "]==]" in text:
            raise ValueError("a request body holds the Lua long-bracket terminator")
        lines.append(
            f'reqs[#reqs + 1] = wrk.format("{method}", "{path}", {{{headers}}}, [==[{text}]==])'
        )
    lines += [
        "local i = 0",
        "request = function()",
        "  i = i % #reqs + 1",
        "  return reqs[i]",
        "end",
    ]
    return "\n".join(lines) + "\n" + WRK_DONE


def run_wrk(
    url: str,
    shots: Sequence[Shot],
    duration_s: float,
    connections: int,
    cpus: str | None,
    workdir: Path,
) -> dict[str, Any]:
    """Saturate ``url`` with wrk (one thread); requests/s counts only 2xx answers."""
    wrk = shutil.which("wrk")
    if wrk is None:
        raise RuntimeError("wrk is not installed")
    script = workdir / f"wrk-{secrets.token_hex(4)}.lua"
    script.write_text(wrk_script(shots))
    cmd = pinned(
        [
            wrk,
            "-t1",
            f"-c{connections}",
            f"-d{max(1, round(duration_s))}s",
            "--timeout",
            "10s",
            "-s",
            str(script),
            url,
        ],
        cpus,
    )
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=duration_s + 60)
    match = re.search(r"WRKJSON (\{.*\})", out.stdout)
    if out.returncode != 0 or match is None:
        raise RuntimeError(f"wrk failed ({out.returncode}): {out.stderr[-500:]}{out.stdout[-500:]}")
    stats = json.loads(match.group(1))
    seconds = stats["duration_us"] / 1e6
    ok = stats["requests"] - stats["non2xx"]
    return stats | {
        "connections": connections,
        "requests_per_s": ok / seconds,
        "p50_ms": stats["p50_us"] / 1000,
        "p99_ms": stats["p99_us"] / 1000,
    }


# ---------------------------------------------------------------- the phases


def fixed_rate(
    direct_port: int,
    gw: GatewayHandle,
    tenants: Sequence[BenchTenant],
    rate: float,
    duration_s: float,
    rounds: int,
    open_tenants: Sequence[BenchTenant] = (),
    warmup_s: float = 0.0,
) -> dict[str, Any]:
    """Direct and gateway at ``rate`` req/s, alternating ``rounds`` times; samples pooled.

    Each side's run starts with ``warmup_s`` of the same load whose samples are dropped: a side
    has sat idle while the others ran, and on a virtual machine the first tens of milliseconds
    of work on a core idle for seconds run several times slower (measured: a 0.55 ms piece of
    Python takes 2.4 ms after 1 s idle and 5 ms after 3-5 s; the gateway's first request after
    5 s idle took 30-40 ms). Without it, those first requests of every round are the p99.
    With ``open_tenants`` (no limits), a third side ``gateway_limits_off`` runs in each round.
    """
    num = max(1, round(rate * duration_s))
    warm = round(rate * warmup_s)
    sides = {
        "direct": (direct_port, build_shots(f"127.0.0.1:{direct_port}", tenants)),
        "gateway": (gw.port, build_shots(f"127.0.0.1:{gw.port}", tenants)),
    }
    if open_tenants:
        sides["gateway_limits_off"] = (gw.port, build_shots(f"127.0.0.1:{gw.port}", open_tenants))
    runs: dict[str, list[Sample]] = {side: [] for side in sides}
    cpu = dict.fromkeys(sides, 0.0)
    for _ in range(rounds):
        for side, (port, shots) in sides.items():
            if warm:
                run_async(open_loop("127.0.0.1", port, shots, rate, warm))
            before = cpu_seconds(gw.pid)
            runs[side] += run_async(open_loop("127.0.0.1", port, shots, rate, num))
            cpu[side] += cpu_seconds(gw.pid) - before
    out: dict[str, Any] = {
        "rate": rate,
        "requests_per_side": num * rounds,
        "rounds": rounds,
        "warmup_s_per_run": warmup_s,
    }
    for side, samples in runs.items():
        errors = [s for s in samples if s.status != 200]
        out[side] = {label: latency_stats(samples, label) for label in ("json", "stream")}
        out[side]["errors"] = len(errors)
        out[side]["error_examples"] = sorted({s.error or f"HTTP {s.status}" for s in errors})[:3]
        out[side]["send_lag_p99_ms"] = percentiles([s.lag_s for s in samples])["p99"]
    out["overhead"] = {
        label: overhead(out["direct"][label], out["gateway"][label]) for label in ("json", "stream")
    }
    if open_tenants:
        out["limits_cost"] = {
            label: overhead(out["gateway_limits_off"][label], out["gateway"][label])
            for label in ("json", "stream")
        }
    reported = [s.overhead_ms for s in runs["gateway"] if s.overhead_ms is not None]
    out["gateway_reported_overhead_ms"] = percentiles([v / 1000 for v in reported])
    for side in sides:
        if side != "direct":
            served = sum(1 for s in runs[side] if s.status == 200)
            out[side]["cpu_ms_per_request"] = cpu[side] * 1000 / served if served else None
    out["_samples"] = runs  # for the plots; dropped before writing JSON
    return out


def limits_under_load(
    gateway_port: int,
    bench: Sequence[BenchTenant],
    limited: Sequence[BenchTenant],
    rate: float,
    duration_s: float,
    hammer: int,
) -> dict[str, Any]:
    """Hammer the limited tenants (``hammer`` requests each, 4 in flight) while the bench
    tenants send at ``rate``; check each limited tenant's admissions."""
    import asyncio

    host = f"127.0.0.1:{gateway_port}"
    background = build_shots(host, bench)

    async def both() -> tuple[list[Sample], list[tuple[list[Sample], float]]]:
        load = asyncio.create_task(
            open_loop("127.0.0.1", gateway_port, background, rate, max(1, round(rate * duration_s)))
        )
        hammers = [
            closed_loop(
                "127.0.0.1", gateway_port, build_shots(host, [t], seed=i), 4, num_requests=hammer
            )
            for i, t in enumerate(limited)
        ]
        results = list(await asyncio.gather(*hammers))
        return await load, results

    background_samples, hammered = run_async(both())
    checks = [
        rate_limit_check(t, samples, elapsed)
        for t, (samples, elapsed) in zip(limited, hammered, strict=True)
    ]
    return {
        "background_rate": rate,
        "background_requests": len(background_samples),
        "background_errors": sum(1 for s in background_samples if s.status != 200),
        "tenants": checks,
        "ok": all(c["ok"] for c in checks),
    }


def saturation(
    direct_port: int,
    gw: GatewayHandle,
    tenants: Sequence[BenchTenant],
    duration_s: float,
    connections: int,
    client_cpus: str | None,
    workdir: Path,
) -> dict[str, Any]:
    """Max requests/s (wrk) direct and through the gateway, streaming and not; and the Python
    generator's ceiling against the direct upstream.

    For the gateway, also the CPU it used per request and the share of its core it got: on a
    machine shared with other work, ``1000 / cpu_ms_per_request`` is what one whole core
    would serve.
    """
    out: dict[str, Any] = {"tool": "wrk", "duration_s": duration_s}
    for side, port in (("direct", direct_port), ("gateway", gw.port)):
        shots = build_shots(f"127.0.0.1:{port}", tenants)
        for label in ("json", "stream"):
            mine = [s for s in shots if s.label == label]
            before, start = cpu_seconds(gw.pid), time.monotonic()
            try:
                stats = run_wrk(
                    f"http://127.0.0.1:{port}", mine, duration_s, connections, client_cpus, workdir
                )
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                out[f"{side}_{label}"] = {"error": str(exc)[:300]}
                continue
            if side == "gateway":
                cpu, wall = cpu_seconds(gw.pid) - before, time.monotonic() - start
                served = stats["requests"] - stats["non2xx"]
                stats["cpu_ms_per_request"] = cpu * 1000 / served if served else None
                stats["core_share"] = cpu / wall
                stats["requests_per_cpu_second"] = served / cpu if cpu else None
            out[f"{side}_{label}"] = stats
    shots = [s for s in build_shots(f"127.0.0.1:{direct_port}", tenants) if s.label == "json"]
    samples, elapsed = run_async(closed_loop("127.0.0.1", direct_port, shots, 32, duration_s))
    ok = sum(1 for s in samples if s.status == 200)
    out["python_generator_ceiling_rps"] = ok / elapsed
    return out


def gateway_logging(args: argparse.Namespace) -> dict[str, Any]:
    """The gateway's ``log_level`` and ``access_log``: the packaged config's (info, off) unless
    asked, so the figures are what ``portico serve`` runs with."""
    return {"log_level": args.log_level, "access_log": args.access_log}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The whole benchmark; returns the results (samples under ``_samples`` keys)."""
    gateway_cpus, client_cpus = default_cpus()
    if args.gateway_cpus is not None:
        gateway_cpus = args.gateway_cpus or None
    if args.client_cpus is not None:
        client_cpus = args.client_cpus or None
    if client_cpus:
        os.sched_setaffinity(0, cpu_set(client_cpus))
    result: dict[str, Any] = {
        "config": {
            "gateway_cpus": gateway_cpus,
            "client_cpus": client_cpus,
            "direct_upstream_cpus": gateway_cpus,
            "engine_and_redis_cpus": client_cpus,
            "warmup_s": args.warmup,
            "phases": args.phases,
            "tenants": args.tenants,
            "keys_per_tenant": args.keys_per_tenant,
            "models": list(MODELS),
            "rates": args.rates,
            "duration_s": args.duration,
            "rounds": args.rounds,
            "wrk_duration_s": args.wrk_duration,
            "wrk_connections": args.connections,
            "auth": "api keys (sk-...)",
            "limits": "rpm, tpm, concurrency, monthly budget per tenant (Redis Lua)",
            "cpu_count": os.cpu_count(),
            "gateway_logging": gateway_logging(args),
        },
        "targets": {"p50_ms": TARGET_P50_MS, "p99_ms": TARGET_P99_MS, "rps": TARGET_RPS},
    }
    with contextlib.ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="gwbench-")))
        redis_url = stack.enter_context(redis_server(workdir, client_cpus))
        # The direct upstream sits on the gateway's core (idle while direct runs): a call to it
        # crosses from the generator's core to another, as the generator's call to the gateway
        # does. On the generator's own core it answered in-core (~10 us a round trip here against
        # ~130 us across cores), a baseline no upstream elsewhere could have.
        direct_port = stack.enter_context(direct_upstream(workdir, gateway_cpus))
        gw = stack.enter_context(
            gateway(workdir, redis_url, gateway_cpus, client_cpus, logging=gateway_logging(args))
        )
        base = f"http://127.0.0.1:{gw.port}"
        tenants = create_tenants(base, gw.admin_key, args.tenants, args.keys_per_tenant)
        limited = [
            create_tenants(base, gw.admin_key, 1, 1, f"limited{rpm}", rpm)[0]
            for rpm in args.limited_rpm
        ]
        warm = build_shots(f"127.0.0.1:{gw.port}", tenants)
        run_async(closed_loop("127.0.0.1", gw.port, warm, 8, num_requests=400))
        unlimited = create_tenants(
            base, gw.admin_key, args.tenants, args.keys_per_tenant, "open", plan="open"
        )
        if "fixed" in args.phases:
            result["fixed_rate"] = [
                fixed_rate(
                    direct_port,
                    gw,
                    tenants,
                    rate,
                    args.duration,
                    args.rounds,
                    unlimited if i == 0 else (),
                    args.warmup,
                )
                for i, rate in enumerate(args.rates)
            ]
        if "limits" in args.phases:
            result["rate_limits"] = limits_under_load(
                gw.port, tenants, limited, args.rates[0], args.duration, args.hammer
            )
        if "saturation" in args.phases:
            result["saturation"] = saturation(
                direct_port, gw, tenants, args.wrk_duration, args.connections, client_cpus, workdir
            )
    return result


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="portico bench gateway", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="short phases (about 1-2 minutes)")
    p.add_argument("--rates", type=float, nargs="+", default=[50.0, 200.0, 500.0])
    p.add_argument("--duration", type=float, default=15.0, help="seconds per side per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--warmup",
        type=float,
        default=1.0,
        help="seconds of load before each side's measured run, not counted",
    )
    p.add_argument(
        "--phases",
        nargs="+",
        choices=PHASES,
        default=list(PHASES),
        help="which parts to run (default: all)",
    )
    p.add_argument("--tenants", type=int, default=8)
    p.add_argument("--keys-per-tenant", type=int, default=4)
    p.add_argument("--limited-rpm", type=int, nargs="+", default=[30, 60])
    p.add_argument("--hammer", type=int, default=100, help="requests per limited tenant")
    p.add_argument("--wrk-duration", type=float, default=15.0)
    p.add_argument("--connections", type=int, default=64)
    p.add_argument("--gateway-cpus", default=None, help='taskset list; "" for no pinning')
    p.add_argument("--client-cpus", default=None, help='taskset list; "" for no pinning')
    p.add_argument(
        "--log-level",
        default=GatewayConfig().log_level,
        choices=["debug", "info", "warning", "error"],
        help="the gateway's log_level (default: the packaged config's)",
    )
    p.add_argument(
        "--access-log",
        action=argparse.BooleanOptionalAction,
        default=GatewayConfig().access_log,
        help="uvicorn's access log, one line per request (default: the packaged config's)",
    )
    p.add_argument("--out", type=Path, default=Path("load/results/gateway.json"))
    p.add_argument("--plot-dir", type=Path, default=None)
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    args = parser().parse_args(argv)
    if args.quick:
        args.rates = [50.0, 200.0]
        args.duration = min(args.duration, 5.0)
        args.rounds = min(args.rounds, 2)
        args.wrk_duration = min(args.wrk_duration, 5.0)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    if args.plot_dir is not None:
        result["plots"] = [str(p) for p in plot(result, args.plot_dir)]
    result["verdicts"] = verdicts(result)
    clean = without_samples(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(clean, indent=2) + "\n")
    for v in clean["verdicts"]:
        print(f"{'MET    ' if v['met'] else 'NOT MET'}  {v['target']}: {v['measured']}")
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
