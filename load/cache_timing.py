"""Can tenant B tell, by its time to first token, whether tenant A sent a prompt?

The prefix-cache timing side channel: without isolation, B's request for a long prompt A sent
before hits A's cached blocks and its first token comes sooner, so B learns what A sent. With
the per-tenant cache salt (gateway/identity/cache_salts.py) B's request is a miss either way.
Through a real ``portico serve`` and a real engine, per trial: A sends a fresh long prompt P;
then B sends P ("B, A's prompt") and a prompt nobody sent ("B, fresh"), in alternating order;
then A sends P again ("A, repeat": the hit a tenant does get from its own cache). Reported: the
time-to-first-token distributions of the three, the cached tokens the engine reported, and a
Mann-Whitney U test of B's two (a p-value near 0 would mean B can tell them apart).

    python -m load.cache_timing [--trials 20] [--words 300] [--model smollm2-135m]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

from load.gateway_stack import admin_client, gateway, new_tenant_key, redis_server


def ttft(base: str, key: str, model: str, prompt: str) -> tuple[float, int]:
    """(seconds to the first generated token, prompt tokens the engine read from its cache)."""
    body = {"model": model, "prompt": prompt, "max_tokens": 2, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    started = time.perf_counter()
    first = None
    cached = -1
    with httpx.stream(
        "POST",
        base + "/v1/completions",
        json=body,
        headers={"authorization": f"Bearer {key}"},
        timeout=300,
    ) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            data = json.loads(line[6:])
            if first is None and data.get("choices"):
                first = time.perf_counter() - started
            usage = data.get("usage")
            if usage:
                cached = usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
    if first is None:
        raise RuntimeError("no token came back")
    return first, cached


def mann_whitney_p(a: list[float], b: list[float]) -> float:
    """Two-sided p-value of the Mann-Whitney U test (normal approximation, ties averaged)."""
    ranked = sorted([(v, 0) for v in a] + [(v, 1) for v in b])
    ranks = [0.0] * len(ranked)
    i = 0
    while i < len(ranked):
        j = i
        while j + 1 < len(ranked) and ranked[j + 1][0] == ranked[i][0]:
            j += 1
        for k in range(i, j + 1):
            ranks[k] = (i + j) / 2 + 1
        i = j + 1
    n1, n2 = len(a), len(b)
    r1 = sum(r for r, (_, g) in zip(ranks, ranked, strict=True) if g == 0)
    u = r1 - n1 * (n1 + 1) / 2
    mean, sd = n1 * n2 / 2, math.sqrt(n1 * n2 * (n1 + n2 + 1) / 12)
    z = (u - mean) / sd if sd else 0.0
    return math.erfc(abs(z) / math.sqrt(2))


def prompt(words: int) -> str:
    tag = uuid.uuid4().hex
    return " ".join(f"{tag[i % 32]}{i} story" for i in range(words))


def tenant(base: str, admin_key: str) -> str:
    tid = "t" + uuid.uuid4().hex[:10]
    with admin_client(base, admin_key, timeout_s=10) as admin:
        return new_tenant_key(admin, {"id": tid, "name": tid, "plan": "open"})


def run(args: argparse.Namespace) -> dict[str, Any]:
    engine = {"name": "m", "model": args.model, "args": ["--max-model-len", "2048"]}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        with (
            redis_server(work, None) as redis_url,
            gateway(work, redis_url, None, None, models=("fake-a",), engines=[engine]) as gw,
        ):
            base = f"http://127.0.0.1:{gw.port}"
            key_a, key_b = tenant(base, gw.admin_key), tenant(base, gw.admin_key)
            ttft(base, key_a, "m", prompt(args.words))  # warm the engine up
            times: dict[str, list[float]] = {"b_after_a": [], "b_fresh": [], "a_repeat": []}
            cached: dict[str, list[int]] = {name: [] for name in times}
            for trial in range(args.trials):
                shared = prompt(args.words)
                ttft(base, key_a, "m", shared)
                order = ["b_after_a", "b_fresh"][:: 1 if trial % 2 == 0 else -1]
                for name in order:
                    text = shared if name == "b_after_a" else prompt(args.words)
                    seconds, hit = ttft(base, key_b, "m", text)
                    times[name].append(seconds)
                    cached[name].append(hit)
                seconds, hit = ttft(base, key_a, "m", shared)
                times["a_repeat"].append(seconds)
                cached["a_repeat"].append(hit)
    summary = {
        name: {
            "p10_ms": round(1000 * statistics.quantiles(v, n=10)[0], 1),
            "median_ms": round(1000 * statistics.median(v), 1),
            "p90_ms": round(1000 * statistics.quantiles(v, n=10)[-1], 1),
            "cached_tokens": sorted(set(cached[name])),
        }
        for name, v in times.items()
    }
    return {
        "trials": args.trials,
        "words": args.words,
        "model": args.model,
        "ttft": summary,
        "b_tells_apart_p": round(mann_whitney_p(times["b_after_a"], times["b_fresh"]), 3),
        "a_hit_p": round(mann_whitney_p(times["a_repeat"], times["b_fresh"]), 6),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--words", type=int, default=300, help="prompt length (~2 tokens each)")
    parser.add_argument("--model", default="smollm2-135m")
    result = run(parser.parse_args(argv))
    print("| request | p10 ms | median ms | p90 ms | cached tokens (engine) |")
    print("|---|---|---|---|---|")
    for name, row in result["ttft"].items():
        print(f"| {name} | {row['p10_ms']} | {row['median_ms']} | {row['p90_ms']} | "
              f"{row['cached_tokens']} |")  # fmt: skip
    print(
        f"B's two distributions differ (Mann-Whitney U, two-sided): p = {result['b_tells_apart_p']}"
    )
    print(f"A's repeat vs B's fresh: p = {result['a_hit_p']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
