"""Interactive latency next to a running batch: TTFT with and without a batch, one run.

    portico bench batch                              # the default model, a 1,000-line batch
    portico bench batch --quick --model DIR          # a tiny look

One real ``portico serve`` (a private redis-server, one supervised ``portico engine`` of
``--model``) and two tenants of one plan: tenant I sends short streamed chats one at a time,
tenant B a batch through the Batch API (its lines run at the ``batch`` priority class, as the
batch runner sends them). In order:

1. **alone**: I sends ``--requests`` chats, one at a time; TTFT from I's side;
2. **with the batch**: B uploads a ``--lines``-line file and creates the batch; once
   ``--batch-concurrency`` lines have been answered (the runner is in its steady state), I
   sends the same chats again; the batch's answered count before and after says it ran
   the whole time;
3. the batch is waited for to finish (its time and answered/failed counts are reported);
4. **alone again**: I's chats once more, so a drift of the machine's load weighs on both
   sides; the baseline is phases 1 and 4 pooled.

Reported: I's TTFT p50/p99 alone and with the batch, their ratios against the issue's target
(with the batch within 1.5x of alone), the batch's duration and lines/s, the machine's load
average; JSON with ``--out``. A benchmark, never a test: numbers depend on the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shlex
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from load.gateway_stack import admin_client, gateway, new_tenant_key, redis_server
from load.serve_bench import percentiles

SERVED_NAME = "batch-bench"
TARGET_RATIO = 1.5  # I's TTFT with the batch at most this times alone
CHAT = "/v1/chat/completions"
FINISHED = ("completed", "failed", "expired", "cancelled")


async def ttft(http: httpx.AsyncClient, key: str, question: str, max_tokens: int) -> float:
    """Seconds from send to the first streamed content of one interactive chat."""
    body = {
        "model": SERVED_NAME,
        "messages": [{"role": "user", "content": question}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
    }
    began = time.perf_counter()
    first = 0.0
    headers = {"authorization": f"Bearer {key}"}
    async with http.stream("POST", CHAT, json=body, headers=headers) as response:
        if response.status_code != 200:
            raise RuntimeError(f"chat answered {response.status_code}: {await response.aread()!r}")
        async for line in response.aiter_lines():
            if not first and has_content(line):
                first = time.perf_counter() - began
    return first


def has_content(line: str) -> bool:
    """Is this SSE line a chunk carrying generated text? The first chunk of a chat stream is
    the role with an empty content, sent before any token is computed: it is not a first
    token."""
    if not line.startswith("data: {"):
        return False
    chunk = json.loads(line[6:])
    return any(c.get("delta", {}).get("content") for c in chunk.get("choices") or ())


async def phase(
    http: httpx.AsyncClient, key: str, name: str, num: int, max_tokens: int
) -> list[float]:
    """``num`` chats one at a time; each phase's questions are its own, so no phase reads
    another's prompts from the prefix cache."""
    questions = [f"{name} question {i}: name a fruit." for i in range(num)]
    return [await ttft(http, key, q, max_tokens) for q in questions]


def batch_file(num_lines: int, max_tokens: int) -> bytes:
    lines = []
    for i in range(num_lines):
        body = {
            "model": SERVED_NAME,
            "messages": [{"role": "user", "content": f"Write one sentence about topic {i}."}],
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
        }
        lines.append(
            json.dumps({"custom_id": f"l{i}", "method": "POST", "url": CHAT, "body": body})
        )
    return ("\n".join(lines) + "\n").encode()


async def batch_state(http: httpx.AsyncClient, key: str, batch_id: str) -> dict[str, Any]:
    response = await http.get(f"/v1/batches/{batch_id}", headers={"authorization": f"Bearer {key}"})
    response.raise_for_status()
    state: dict[str, Any] = response.json()
    return state


async def poll(
    http: httpx.AsyncClient, key: str, batch_id: str, until: Callable[[dict[str, Any]], bool]
) -> dict[str, Any]:
    """The batch's state once ``until`` holds for it (read every 0.2 s)."""
    while True:  # the batch runs in another process: nothing to wait on but its state
        state = await batch_state(http, key, batch_id)
        if until(state):
            return state
        await asyncio.sleep(0.2)


async def measure(base_url: str, keys: tuple[str, str], args: argparse.Namespace) -> dict[str, Any]:
    interactive, owner = keys
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as http:
        await phase(
            http, interactive, "warm-up", 2, args.max_tokens
        )  # warm the engine's first steps
        alone = await phase(http, interactive, "first", args.requests, args.max_tokens)
        auth = {"authorization": f"Bearer {owner}"}
        uploaded = await http.post(
            "/v1/files",
            headers=auth,
            files={"file": ("batch.jsonl", batch_file(args.lines, args.batch_max_tokens))},
            data={"purpose": "batch"},
        )
        uploaded.raise_for_status()
        created = await http.post(
            "/v1/batches",
            headers=auth,
            json={
                "input_file_id": uploaded.json()["id"],
                "endpoint": CHAT,
                "completion_window": "24h",
            },
        )
        created.raise_for_status()
        batch_id, batch_began = created.json()["id"], time.perf_counter()
        await poll(
            http,
            owner,
            batch_id,
            lambda b: b["request_counts"]["completed"] >= args.batch_concurrency,
        )
        before = await batch_state(http, owner, batch_id)
        with_batch = await phase(http, interactive, "batch", args.requests, args.max_tokens)
        after = await batch_state(http, owner, batch_id)
        state = await poll(http, owner, batch_id, lambda b: b["status"] in FINISHED)
        batch_s = time.perf_counter() - batch_began
        alone += await phase(http, interactive, "last", args.requests, args.max_tokens)
    base, loaded = percentiles(alone), percentiles(with_batch)
    return {
        "ttft_alone": base,
        "ttft_with_batch": loaded,
        "ratio_p50": loaded["median"] / base["median"],
        "ratio_p99": loaded["p99"] / base["p99"],
        "target_ratio": TARGET_RATIO,
        "target_met_p50": loaded["median"] / base["median"] <= TARGET_RATIO,
        "target_met_p99": loaded["p99"] / base["p99"] <= TARGET_RATIO,
        "batch": {
            "lines": args.lines,
            "status": state["status"],
            "request_counts": state["request_counts"],
            "seconds": batch_s,
            "lines_per_s": args.lines / batch_s,
            "answered_while_measured": after["request_counts"]["completed"]
            - before["request_counts"]["completed"],
            "still_running_after_measuring": after["status"] == "in_progress",
        },
    }


def tenant_keys(base_url: str, admin_key: str) -> tuple[str, str]:
    with admin_client(base_url, admin_key) as admin:
        interactive, batch = (
            new_tenant_key(admin, {"id": name, "name": name})
            for name in ("interactive", "batch-owner")
        )
    return interactive, batch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="portico bench batch", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="alias, HF folder or .gguf")
    parser.add_argument("--engine-args", default="--max-num-seqs 32", help="extra engine flags")
    parser.add_argument("--lines", type=int, default=1000)
    parser.add_argument("--requests", type=int, default=20, help="interactive chats per phase")
    parser.add_argument("--max-tokens", type=int, default=8, help="per interactive chat")
    parser.add_argument("--batch-max-tokens", type=int, default=16, help="per batch line")
    parser.add_argument("--batch-concurrency", type=int, default=4, help="batches.max_concurrency")
    parser.add_argument("--quick", action="store_true", help="40 lines, 4 chats per phase")
    parser.add_argument("--out", type=Path, default=None, help="write the report as JSON")
    args = parser.parse_args(argv)
    if args.quick:
        args.lines, args.requests = 40, 4
    engine = {
        "name": SERVED_NAME,
        "model": args.model,
        "args": shlex.split(args.engine_args),
        "startup_timeout_s": 600,
    }
    extra = {"batches": {"max_concurrency": args.batch_concurrency, "scan_interval_s": 1}}
    with tempfile.TemporaryDirectory(prefix="portico-batch-bench-") as tmp:
        workdir = Path(tmp)
        with (
            redis_server(workdir, None) as redis_url,
            gateway(
                workdir,
                redis_url,
                None,
                None,
                models=("idle",),
                engines=[engine],
                extra=extra,
                ready_timeout_s=900,
            ) as gw,
        ):
            base_url = f"http://127.0.0.1:{gw.port}"
            report = asyncio.run(measure(base_url, tenant_keys(base_url, gw.admin_key), args))
    report.update(
        model=args.model,
        engine_args=args.engine_args,
        requests_per_phase=args.requests,
        load_average=os.getloadavg(),
        cpus=os.cpu_count(),
        machine=platform.platform(),
    )
    print(json.dumps(report, indent=2))
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
