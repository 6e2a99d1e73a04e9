"""Remote tiers against the engine path: the same requests, through the same gateway, in one run.

Three tiers of one gateway, each in front of the fast fake OpenAI upstream
(``load/fake_upstream.py``), with auth (API keys) and every Redis limit on:

* ``engine``: a local engine pool (the fake, supervised on a Unix socket, as engines are);
* ``engine_tcp``: an engine pool whose replica is the TCP fake (``discovery`` of 127.0.0.1):
  the engine path over the very socket and server the remote tiers use, so ``remote`` minus
  ``engine_tcp`` is what the remote path itself adds, and ``engine_tcp`` minus ``engine`` what
  TCP costs over a Unix socket;
* ``remote``: an OpenAI-compatible remote (``model: openai/...``, the fake on loopback TCP)
  over the gateway's lean transport (``gateway/remotes/openai_remote.py``);
* ``litellm``: the same remote forced through litellm (``api: litellm``), the path translation
  providers (Anthropic, Bedrock, ...) take.

Cores: the gateway alone on its core (``--gateway-cpus``); the generator, redis-server and both
fakes on the other. Phases:

1. **Latency at a fixed rate** (open loop, ``--rate``, alternating rounds with a warm-up per
   side): p50/p90/p99 per tier and directly against the TCP fake; "added" = tier minus direct,
   for streams the time to the first chunk.
2. **Paired latency, engine vs remote** (``--paired-rate``): one open loop whose requests
   alternate between the two tiers, so both see the same moments of a noisy machine; the p50
   difference (remote minus engine) is the verdict's number.
3. **Saturation** (``wrk``, one thread, ``--connections``): requests/s per tier, JSON and
   streams, and the gateway's CPU per request (``requests_per_cpu_second`` is what one whole
   core would serve, whatever share of it the gateway got on a busy machine).

    python -m load.remote_bench --out load/results/remote.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from load.gateway_bench import (
    BenchTenant,
    build_shots,
    create_tenants,
    latency_stats,
    run_wrk,
)
from load.gateway_stack import (
    GatewayHandle,
    cpu_seconds,
    cpu_set,
    default_cpus,
    direct_upstream,
    gateway,
    redis_server,
)
from load.open_loop import Shot, run_async
from load.open_loop import open_loop as open_loop_run
from load.serve_bench import percentiles

TIERS = {
    "engine": "fake-a",
    "engine_tcp": "engine-tcp",
    "remote": "remote-lean",
    "litellm": "remote-litellm",
}
KEY_ENV = "PORTICO_BENCH_UPSTREAM_KEY"  # both remotes send a key, as to a real provider
TARGET_RPS_SHARE = 0.8  # remote >= 80 % of the engine tier's requests/s
TARGET_P50_GAP_MS = 0.3  # remote's added p50 within 0.3 ms of the engine tier's


def remotes(port: int) -> list[dict[str, Any]]:
    base = f"http://127.0.0.1:{port}/v1"
    common = {"model": "openai/fake-a", "api_base": base, "api_key_env": KEY_ENV}
    return [
        {"name": TIERS["remote"], **common},
        {"name": TIERS["litellm"], "api": "litellm", **common},
    ]


def tcp_engine(port: int) -> dict[str, Any]:
    """An engine pool found by "DNS" at the TCP fake: the engine path over TCP."""
    return {
        "name": TIERS["engine_tcp"],
        "model": "fake-a",
        "count_tokens_with": "estimate",
        "discovery": {"dns": "127.0.0.1", "port": port, "interval_s": 60},
    }


def fixed_rate(
    direct_port: int,
    gw: GatewayHandle,
    tenants: Sequence[BenchTenant],
    rate: float,
    duration_s: float,
    rounds: int,
    warmup_s: float,
) -> dict[str, Any]:
    """Each side at ``rate`` req/s for ``duration_s`` per round (after ``warmup_s`` not
    counted), sides alternating, ``rounds`` times; samples pooled per side."""
    num = max(1, round(rate * duration_s))
    warm = round(rate * warmup_s)
    sides = {"direct": (direct_port, build_shots(f"127.0.0.1:{direct_port}", tenants, ["fake-a"]))}
    for tier, model in TIERS.items():
        sides[tier] = (gw.port, build_shots(f"127.0.0.1:{gw.port}", tenants, [model]))
    samples: dict[str, list[Any]] = {side: [] for side in sides}
    cpu = dict.fromkeys(sides, 0.0)
    for _ in range(rounds):
        for side, (port, shots) in sides.items():
            if warm:
                run_async(open_loop_run("127.0.0.1", port, shots, rate, warm))
            before = cpu_seconds(gw.pid)
            samples[side] += run_async(open_loop_run("127.0.0.1", port, shots, rate, num))
            cpu[side] += cpu_seconds(gw.pid) - before
    out: dict[str, Any] = {"rate": rate, "requests_per_side": num * rounds, "rounds": rounds}
    for side, runs in samples.items():
        out[side] = {label: latency_stats(runs, label) for label in ("json", "stream")}
        out[side]["errors"] = sum(1 for s in runs if s.status != 200)
        if side != "direct":
            served = sum(1 for s in runs if s.status == 200)
            out[side]["cpu_ms_per_request"] = cpu[side] * 1000 / served if served else None
    out["added_ms"] = {
        tier: {
            label: {
                k: out[tier][label][k] - out["direct"][label][k] for k in ("median", "p90", "p99")
            }
            for label in ("json", "stream")
        }
        for tier in TIERS
    }
    return out


def paired(
    gw: GatewayHandle,
    tenants: Sequence[BenchTenant],
    rate: float,
    duration_s: float,
    warmup_s: float,
) -> dict[str, Any]:
    """Requests to the engine, engine_tcp and remote tiers interleaved in one open loop at
    ``rate``: the same request (key, kind, stream) to each tier in turn. Percentiles per tier
    and kind, and remote minus each engine tier."""
    host = f"127.0.0.1:{gw.port}"
    paired_tiers = ("engine", "engine_tcp", "remote")
    lists = [build_shots(host, tenants, [TIERS[t]]) for t in paired_tiers]
    shots = []
    for same in zip(*lists, strict=True):  # same seed: the same request, tier apart
        pairs = zip(paired_tiers, same, strict=True)
        shots += [Shot(f"{t}:{s.label}", s.tenant, s.raw) for t, s in pairs]
    if warmup_s:
        run_async(open_loop_run("127.0.0.1", gw.port, shots, rate, round(rate * warmup_s)))
    samples = run_async(
        open_loop_run("127.0.0.1", gw.port, shots, rate, max(2, round(rate * duration_s)))
    )
    out: dict[str, Any] = {"rate": rate, "requests": len(samples)}
    for tier in paired_tiers:
        for label in ("json", "stream"):
            ok = [s for s in samples if s.status == 200 and s.label == f"{tier}:{label}"]
            values = [s.first_s if label == "stream" else s.total_s for s in ok]
            out[f"{tier}_{label}"] = percentiles(values) | {"count": float(len(values))}
    out["errors"] = sum(1 for s in samples if s.status != 200)
    for base in ("engine", "engine_tcp"):
        out[f"remote_minus_{base}_ms"] = {
            label: {
                k: out[f"remote_{label}"][k] - out[f"{base}_{label}"][k]
                for k in ("median", "p90", "p99")
            }
            for label in ("json", "stream")
        }
    return out


def saturation(
    gw: GatewayHandle,
    tenants: Sequence[BenchTenant],
    duration_s: float,
    connections: int,
    client_cpus: str | None,
    workdir: Path,
) -> dict[str, Any]:
    """wrk against each tier, JSON and streams; with the gateway's CPU per request."""
    out: dict[str, Any] = {"tool": "wrk", "duration_s": duration_s, "connections": connections}
    for tier, model in TIERS.items():
        shots = build_shots(f"127.0.0.1:{gw.port}", tenants, [model])
        for label in ("json", "stream"):
            mine = [s for s in shots if s.label == label]
            before, start = cpu_seconds(gw.pid), time.monotonic()
            stats = run_wrk(
                f"http://127.0.0.1:{gw.port}", mine, duration_s, connections, client_cpus, workdir
            )
            cpu, wall = cpu_seconds(gw.pid) - before, time.monotonic() - start
            served = stats["requests"] - stats["non2xx"]
            stats["cpu_ms_per_request"] = cpu * 1000 / served if served else None
            stats["core_share"] = cpu / wall
            stats["requests_per_cpu_second"] = served / cpu if cpu else None
            out[f"{tier}_{label}"] = stats
    return out


def verdicts(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets against the engine tier; the same against engine_tcp (the engine
    path over the remote's socket) when it ran."""
    out = []
    sat = result.get("saturation", {})
    pair = result.get("paired", {})
    for base in ("engine", "engine_tcp"):
        for label in ("json", "stream"):
            engine, remote = sat.get(f"{base}_{label}"), sat.get(f"remote_{label}")
            if not (engine and remote):
                continue
            for key, what in (
                ("requests_per_s", "req/s"),
                ("requests_per_cpu_second", "req/CPU-s"),
            ):
                share = remote[key] / engine[key]
                out.append(
                    {
                        "target": f"remote {what} >= {TARGET_RPS_SHARE:.0%} of {base} ({label})",
                        "measured": f"{remote[key]:.0f} vs {engine[key]:.0f} ({share:.0%})",
                        "met": share >= TARGET_RPS_SHARE,
                    }
                )
        gaps = pair.get(f"remote_minus_{base}_ms")
        for label in ("json", "stream") if gaps else ():
            gap = gaps[label]["median"]
            out.append(
                {
                    "target": f"remote added p50 within {TARGET_P50_GAP_MS} ms of {base} ({label})",
                    "measured": f"{gap:+.2f} ms",
                    "met": gap <= TARGET_P50_GAP_MS,
                }
            )
    return out


def table(result: dict[str, Any]) -> str:
    """The markdown table docs/benchmarks.md shows."""
    rows = [
        "| tier | req/s json | req/s stream | req per CPU-s json | req per CPU-s stream "
        "| added p50 json (ms) | added p50 first chunk (ms) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    sat = result.get("saturation", {})
    fixed = result.get("fixed_rate", {})
    for tier in TIERS:
        cells = [tier]
        for key in ("requests_per_s", "requests_per_cpu_second"):
            for label in ("json", "stream"):
                value = sat.get(f"{tier}_{label}", {}).get(key)
                cells.append(f"{value:.0f}" if value else "–")
        for label in ("json", "stream"):
            added = fixed.get("added_ms", {}).get(tier, {}).get(label, {}).get("median")
            cells.append(f"{added:.2f}" if added is not None else "–")
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def run(args: argparse.Namespace) -> dict[str, Any]:
    gateway_cpus, client_cpus = default_cpus()
    if args.gateway_cpus is not None:
        gateway_cpus = args.gateway_cpus or None
    if args.client_cpus is not None:
        client_cpus = args.client_cpus or None
    if client_cpus:
        os.sched_setaffinity(0, cpu_set(client_cpus))
    os.environ.setdefault(KEY_ENV, "sk-bench-" + "0" * 32)  # the gateway inherits it
    result: dict[str, Any] = {
        "config": {
            "gateway_cpus": gateway_cpus,
            "client_cpus": client_cpus,
            "tiers": TIERS,
            "rate": args.rate,
            "duration_s": args.duration,
            "rounds": args.rounds,
            "warmup_s": args.warmup,
            "paired_rate": args.paired_rate,
            "wrk_duration_s": args.wrk_duration,
            "connections": args.connections,
            "tenants": args.tenants,
            "keys_per_tenant": args.keys_per_tenant,
            "auth": "api keys (sk-...)",
            "limits": "rpm, tpm, concurrency, monthly budget per tenant (Redis Lua)",
            "load_average_before": os.getloadavg(),
        }
    }
    with contextlib.ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="remotebench-")))
        redis_url = stack.enter_context(redis_server(workdir, client_cpus))
        port = stack.enter_context(direct_upstream(workdir, client_cpus))
        gw = stack.enter_context(
            gateway(
                workdir,
                redis_url,
                gateway_cpus,
                client_cpus,
                remotes=remotes(port),
                engines=[tcp_engine(port)],
            )
        )
        tenants = create_tenants(
            f"http://127.0.0.1:{gw.port}", gw.admin_key, args.tenants, args.keys_per_tenant
        )
        if "fixed" in args.phases:
            result["fixed_rate"] = fixed_rate(
                port, gw, tenants, args.rate, args.duration, args.rounds, args.warmup
            )
        if "paired" in args.phases:
            result["paired"] = paired(gw, tenants, args.paired_rate, args.duration * 2, args.warmup)
        if "saturation" in args.phases:
            result["saturation"] = saturation(
                gw, tenants, args.wrk_duration, args.connections, client_cpus, workdir
            )
    result["config"]["load_average_after"] = os.getloadavg()
    return result


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="portico bench remote", description=__doc__.split("\n")[0])
    p.add_argument("--rate", type=float, default=20.0, help="req/s of the latency phase")
    p.add_argument("--duration", type=float, default=10.0, help="seconds per side per round")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--warmup", type=float, default=1.0)
    p.add_argument("--wrk-duration", type=float, default=15.0)
    p.add_argument("--connections", type=int, default=64)
    p.add_argument("--tenants", type=int, default=4)
    p.add_argument("--keys-per-tenant", type=int, default=2)
    p.add_argument("--paired-rate", type=float, default=100.0, help="req/s, both tiers")
    p.add_argument("--phases", nargs="+", choices=("fixed", "paired", "saturation"),
                   default=["fixed", "paired", "saturation"])  # fmt: skip
    p.add_argument("--gateway-cpus", default=None, help='taskset list; "" for no pinning')
    p.add_argument("--client-cpus", default=None, help='taskset list; "" for no pinning')
    p.add_argument("--out", type=Path, default=Path("load/results/remote.json"))
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    result["verdicts"] = verdicts(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))
    for v in result["verdicts"]:
        print(f"{'MET    ' if v['met'] else 'NOT MET'}  {v['target']}: {v['measured']}")
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
