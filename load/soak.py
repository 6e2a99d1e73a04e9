"""Soak: mixed traffic against a gateway for a while, sampling the gateway's RSS over time.

The resident set must stay flat: a leak per request (a slot, a task, a buffer, a client) shows
as a slope. The traffic mixes chat and completions, streaming and not, clients that disconnect
mid-stream, and bad requests (bad JSON, unknown model), so every path is exercised. (Bad keys
are left out: after a few the per-address abuse guard answers 429 to everything from the soak's
address, by design.)

Against a running gateway::

    python -m load.soak --url http://127.0.0.1:8000 --api-key sk-... --pid 12345 --model smollm2

Self-contained (starts ``portico serve`` with two fake engines and a redis-server; needs the
``redis-server`` binary)::

    python -m load.soak --duration 600 --concurrency 32

Prints one line per sample (elapsed s, requests, RSS MiB) and a summary with the RSS slope
after warm-up (MiB per hour, least squares) and the growth between the first and last third.
Exit status 1 when the slope exceeds ``--max-slope-mib-per-hour``. Not a test: it runs as long
as you ask.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil

from load.gateway_stack import admin_client, new_tenant_key

REPO_ROOT = Path(__file__).resolve().parent.parent
ADMIN_KEY = "soak-admin-key-0123456789abcdef"


def _body(model: str, rng: random.Random) -> tuple[str, dict[str, object]]:
    stream = rng.random() < 0.5
    n = rng.randint(1, 32)
    system = f"system prompt {rng.randint(0, 9)} " * 8
    if rng.random() < 0.5:
        return "/v1/chat/completions", {
            "model": model,
            "stream": stream,
            "max_tokens": n,
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": "hello " * rng.randint(1, 50)},
            ],
        }
    return "/v1/completions", {
        "model": model,
        "stream": stream,
        "max_tokens": n,
        "prompt": system + "once upon a time",
    }


async def _one(client: httpx.AsyncClient, model: str, rng: random.Random, counts: Counter) -> None:
    roll = rng.random()
    try:
        if roll < 0.03:
            r = await client.post("/v1/chat/completions", content=b"{not json")
        elif roll < 0.05:
            r = await client.post("/v1/completions", json={"model": "no-such", "prompt": "x"})
        else:
            path, body = _body(model, rng)
            if body["stream"]:
                async with client.stream("POST", path, json=body) as resp:
                    cut = roll < 0.15  # some clients walk away mid-stream
                    async for _ in resp.aiter_lines():
                        if cut:
                            break
                    counts[f"{resp.status_code}{' cut' if cut else ''}"] += 1
                return
            r = await client.post(path, json=body)
        counts[str(r.status_code)] += 1
    except httpx.HTTPError as exc:
        counts[type(exc).__name__] += 1


async def traffic(
    url: str, key: str, model: str, concurrency: int, stop_at: float, counts: Counter
) -> None:
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(
        base_url=url, headers={"authorization": f"Bearer {key}"}, timeout=60, limits=limits
    ) as client:

        async def worker(seed: int) -> None:
            rng = random.Random(seed)
            while time.monotonic() < stop_at:
                await _one(client, model, rng, counts)

        await asyncio.gather(*(worker(i) for i in range(concurrency)))


async def sample_rss(
    pid: int,
    interval: float,
    stop_at: float,
    counts: Counter,
    samples: list[tuple[float, int, float]],
) -> None:
    proc = psutil.Process(pid)
    start = time.monotonic()
    while time.monotonic() < stop_at:
        rss = proc.memory_info().rss / 2**20
        done = sum(counts.values())
        samples.append((time.monotonic() - start, done, rss))
        print(f"{samples[-1][0]:8.0f} s  {done:9d} requests  RSS {rss:8.1f} MiB", flush=True)
        await asyncio.sleep(interval)


def slope_per_hour(points: list[tuple[float, float]]) -> float:
    n = len(points)
    if n < 2:
        return 0.0
    mx = sum(p[0] for p in points) / n
    my = sum(p[1] for p in points) / n
    var = sum((p[0] - mx) ** 2 for p in points)
    cov = sum((p[0] - mx) * (p[1] - my) for p in points)
    return cov / var * 3600 if var else 0.0


def summarize(samples: list[tuple[float, int, float]], warmup_s: float) -> dict[str, object]:
    steady = [(t, rss) for t, _, rss in samples if t >= warmup_s] or [
        (t, rss) for t, _, rss in samples
    ]
    third = max(1, len(steady) // 3)
    first = sum(r for _, r in steady[:third]) / third
    last = sum(r for _, r in steady[-third:]) / third
    return {
        "samples": len(samples),
        "requests": samples[-1][1] if samples else 0,
        "rss_first_mib": round(samples[0][2], 1) if samples else None,
        "rss_max_mib": round(max(s[2] for s in samples), 1) if samples else None,
        "rss_last_mib": round(samples[-1][2], 1) if samples else None,
        "steady_growth_mib": round(last - first, 2),
        "slope_mib_per_hour": round(slope_per_hour(steady), 2),
    }


@contextlib.contextmanager
def own_gateway(workdir: Path, port: int) -> Iterator[tuple[str, str, int]]:
    """redis-server + ``portico serve`` with two fake engines; yields (url, key, gateway pid)."""
    redis_sock = workdir / "redis.sock"
    redis_proc = subprocess.Popen(
        [
            "redis-server",
            "--port",
            "0",
            "--unixsocket",
            str(redis_sock),
            "--save",
            "",
            "--appendonly",
            "no",
        ],
        stdout=subprocess.DEVNULL,
    )
    engine = [
        sys.executable,
        "-m",
        "load.fake_upstream",
        "--uds",
        "{uds}",
        "--model",
        "{name}",
        "--chunk-delay-ms",
        "2",
    ]
    config = {
        "listen": {"port": port},
        "log_level": "warning",
        "redis": {"url": f"unix://{redis_sock}", "data_dir": str(workdir / "data")},
        "engines": [{"name": "fake", "replicas": 2, "command": engine}],
    }
    (workdir / "soak.yaml").write_text(json.dumps(config))
    env = {**os.environ, "PORTICO_ADMIN_KEY": ADMIN_KEY}
    gw = subprocess.Popen(
        [sys.executable, "-m", "portico.cli", "serve", "-c", str(workdir / "soak.yaml")],
        cwd=REPO_ROOT,
        env=env,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/ready", timeout=2).status_code == 200:
                    break
            time.sleep(0.25)
        unlimited = {
            "requests_per_minute": 10**9,
            "tokens_per_minute": 10**12,
            "max_concurrency": 10**6,
            "monthly_token_budget": 10**15,
        }
        soak = {"id": "soak", "name": "soak", "plan": "enterprise", "overrides": unlimited}
        with admin_client(url, ADMIN_KEY) as admin:
            key = new_tenant_key(admin, soak)
        yield url, key, gw.pid
    finally:
        gw.send_signal(signal.SIGTERM)
        gw.wait(60)
        redis_proc.terminate()
        redis_proc.wait(10)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m load.soak", description=__doc__.split("\n")[0])
    p.add_argument("--url", help="gateway base URL (omit to start one with fake engines)")
    p.add_argument("--api-key", help="tenant key for --url")
    p.add_argument("--pid", type=int, help="gateway process id for --url (RSS is sampled)")
    p.add_argument("--model", default="fake")
    p.add_argument("--duration", type=float, default=300.0, help="seconds of traffic")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--interval", type=float, default=5.0, help="seconds between RSS samples")
    p.add_argument("--warmup", type=float, default=60.0, help="seconds left out of the slope")
    p.add_argument("--port", type=int, default=18765, help="port of the self-started gateway")
    p.add_argument("--max-slope-mib-per-hour", type=float, default=50.0)
    p.add_argument("--json", type=Path, help="write the summary and samples here")
    return p


async def _soak(
    url: str, key: str, pid: int, args: argparse.Namespace
) -> tuple[Counter, list[tuple[float, int, float]]]:
    counts: Counter = Counter()
    samples: list[tuple[float, int, float]] = []
    stop_at = time.monotonic() + args.duration
    await asyncio.gather(
        traffic(url, key, args.model, args.concurrency, stop_at, counts),
        sample_rss(pid, args.interval, stop_at, counts, samples),
    )
    return counts, samples


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.url:
        if not (args.api_key and args.pid):
            parser().error("--url needs --api-key and --pid")
        counts, samples = asyncio.run(_soak(args.url, args.api_key, args.pid, args))
    else:
        with (
            tempfile.TemporaryDirectory(prefix="portico-soak-") as tmp,
            own_gateway(Path(tmp), args.port) as (url, key, pid),
        ):
            counts, samples = asyncio.run(_soak(url, key, pid, args))
    summary = summarize(samples, args.warmup)
    summary["outcomes"] = dict(counts)
    print(json.dumps(summary, indent=2))
    if args.json:
        args.json.write_text(json.dumps({**summary, "rss_samples": samples}, indent=2))
    return 1 if float(summary["slope_mib_per_hour"]) > args.max_slope_mib_per_hour else 0


if __name__ == "__main__":
    sys.exit(main())
