"""Serving benchmark: replay a workload against any OpenAI-compatible base URL.

Requests go out at a request rate (Poisson or gamma arrivals) or as fast as a fixed
concurrency allows, each as a streaming ``/v1/completions`` call (a request with images: a
streaming ``/v1/chat/completions`` call, the images as ``image_url`` parts) so every token's
arrival is timed. Results: TTFT, TPOT, ITL and end-to-end latency (mean, median, p90, p99),
request and token throughput, and goodput (requests/s meeting the latency targets).

    portico bench serve --base-url http://127.0.0.1:8000/v1 --dataset synthetic \
        --num-requests 64 --max-concurrency 16 --out load/results/serve.json
"""

from __future__ import annotations

import asyncio
import json
import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from load.datasets import BenchRequest, arrival_gaps


@dataclass
class RequestResult:
    """Timings of one request, in seconds from its own start."""

    ok: bool
    prompt_len: int
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def tpot(self) -> float:
        """Time per output token after the first (0 for single-token outputs)."""
        if self.output_tokens <= 1:
            return 0.0
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def percentiles(values: Sequence[float]) -> dict[str, float]:
    """mean, median, p90, p99 in milliseconds (nearest-rank; zeros for an empty list)."""
    if not values:
        return {"mean": 0.0, "median": 0.0, "p90": 0.0, "p99": 0.0}
    ordered = sorted(values)

    def rank(q: float) -> float:
        return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]

    return {
        "mean": statistics.fmean(ordered) * 1000,
        "median": statistics.median(ordered) * 1000,
        "p90": rank(0.90) * 1000,
        "p99": rank(0.99) * 1000,
    }


def summarize(
    results: Sequence[RequestResult],
    duration: float,
    ttft_slo_ms: float | None = None,
    tpot_slo_ms: float | None = None,
) -> dict[str, Any]:
    """Aggregate per-request results into the report's numbers."""
    done = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in done)
    prompt_tokens = sum(r.prompt_len for r in done)
    good = [
        r
        for r in done
        if (ttft_slo_ms is None or r.ttft * 1000 <= ttft_slo_ms)
        and (tpot_slo_ms is None or r.tpot * 1000 <= tpot_slo_ms)
    ]
    return {
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "request_throughput": len(done) / duration if duration else 0.0,
        "output_throughput": output_tokens / duration if duration else 0.0,
        "total_token_throughput": (output_tokens + prompt_tokens) / duration if duration else 0.0,
        "total_output_tokens": output_tokens,
        "total_prompt_tokens": prompt_tokens,
        "goodput": len(good) / duration if duration else 0.0,
        "ttft_ms": percentiles([r.ttft for r in done]),
        "tpot_ms": percentiles([r.tpot for r in done if r.output_tokens > 1]),
        "itl_ms": percentiles([gap for r in done for gap in r.itl]),
        "e2e_ms": percentiles([r.latency for r in done]),
    }


async def _one(
    client: httpx.AsyncClient,
    model: str,
    req: BenchRequest,
    extra_body: dict[str, Any],
) -> RequestResult:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": req.output_len,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.0,
        **extra_body,
    }
    path = "completions"
    if req.images:
        parts: list[dict[str, Any]] = [
            {"type": "image_url", "image_url": {"url": url}} for url in req.images
        ]
        parts.append({"type": "text", "text": req.prompt})
        body["messages"] = [{"role": "user", "content": parts}]
        path = "chat/completions"
    else:
        body["prompt"] = req.prompt
    result = RequestResult(ok=False, prompt_len=req.prompt_len)
    start = time.perf_counter()
    last = start
    chunks = 0
    try:
        async with client.stream("POST", path, json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                result.error = f"HTTP {resp.status_code}: {resp.text[:200]}"
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    result.error = str(event["error"].get("message", "stream error"))[:200]
                    return result
                usage = event.get("usage")
                if usage:
                    result.output_tokens = int(usage.get("completion_tokens", 0))
                    if usage.get("prompt_tokens"):
                        result.prompt_len = int(usage["prompt_tokens"])
                if not any(_piece(c) for c in event.get("choices", [])):
                    continue
                now = time.perf_counter()
                if chunks == 0:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last = now
                chunks += 1
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:200]
        return result
    result.latency = time.perf_counter() - start
    if result.output_tokens == 0:
        result.output_tokens = chunks
    result.ok = True
    return result


def _piece(choice: dict[str, Any]) -> str:
    """The text a stream chunk's choice carries: ``text`` (completions) or ``delta.content``."""
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


async def run_benchmark(
    base_url: str,
    model: str,
    requests: Sequence[BenchRequest],
    *,
    request_rate: float = float("inf"),
    burstiness: float = 1.0,
    max_concurrency: int | None = None,
    api_key: str | None = None,
    extra_body: dict[str, Any] | None = None,
    seed: int = 0,
    progress: bool = True,
    ttft_slo_ms: float | None = None,
    tpot_slo_ms: float | None = None,
    keepalive: bool = True,
) -> tuple[dict[str, Any], list[RequestResult]]:
    """Send ``requests`` and return (summary, per-request results). ``keepalive`` False: a new
    connection per request (for servers that drop reused ones, as llama-server did here)."""
    gaps = arrival_gaps(len(requests), request_rate, burstiness, seed)
    limit = asyncio.Semaphore(max_concurrency or len(requests) or 1)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    pool = httpx.Limits(
        max_connections=max_concurrency or 1000,
        max_keepalive_connections=None if keepalive else 0,
    )
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(requests), desc="requests", leave=False)

    async with httpx.AsyncClient(
        base_url=base_url.rstrip("/") + "/", headers=headers, timeout=None, limits=pool
    ) as client:

        async def guarded(req: BenchRequest) -> RequestResult:
            async with limit:
                res = await _one(client, model, req, extra_body or {})
            if bar is not None:
                bar.update(1)
            return res

        start = time.perf_counter()
        tasks = []
        for req, gap in zip(requests, gaps, strict=True):
            if gap:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(guarded(req)))
        results = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - start
    if bar is not None:
        bar.close()
    summary = summarize(results, duration, ttft_slo_ms, tpot_slo_ms)
    summary.update(
        {
            "base_url": base_url,
            "model": model,
            "num_requests": len(requests),
            "request_rate": request_rate if math.isfinite(request_rate) else "inf",
            "burstiness": burstiness,
            "max_concurrency": max_concurrency,
        }
    )
    return summary, results


def write_results(
    path: str | Path, summary: dict[str, Any], results: Sequence[RequestResult]
) -> None:
    """Write the summary and the per-request timings as JSON."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = dict(summary)
    payload["requests"] = [
        {k: v for k, v in asdict(r).items() if k != "itl"} | {"tpot": r.tpot} for r in results
    ]
    out.write_text(json.dumps(payload, indent=2))
