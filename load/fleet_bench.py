"""Fleet routing: prefix_aware against least_loaded and round_robin, one run.

    portico bench fleet                               # the default model, 2 replicas
    portico bench fleet --quick --model DIR           # a tiny look

For each replica policy (``--policies``) and once with a single replica (the hit rate to
match), a real ``portico serve`` is started in front of ``--replicas`` engine replicas with
``replica_policy: <policy>`` in its routing policy, and the prefix workload is sent through it:
``--tenants`` tenants, each with its own key (so its own cache salt) and its own long system
prompt (``--system-words`` random words), each asking ``--questions`` short questions, in one
seeded interleaved order, ``--concurrency`` requests in flight, streamed. Reported per run:
the prefix-cache hit rate (the engines' ``cached_tokens`` over prompt tokens, from each
answer's usage), TTFT p50/p99, output tokens per second (and, in ``--out``, each request's
tenant, send time, TTFT and cached tokens), and the issue's targets
(prefix_aware's hit rate within 10% of the single engine's, TTFT p50 at least 2x better than
round_robin's). ``load_only`` is least_loaded with no prefix affinity at all (``prefix_chars:
0``), the baseline a router without any prefix knowledge gives. JSON (``--out``) and a plot
(``--plot PATH``). A benchmark, never a test:
numbers depend on the machine and on what else runs on it.

KV cache sizing. By default every engine, the single one included, gets ``--engine-args`` as
given (``--kv-cache-memory 256MiB``: every replica holds every tenant's prompt, so routing
decides little). ``--cache-fit F`` sizes the caches to the workload instead, the case prefix
routing is for: each replica's KV cache holds F times the tenants' prompts (the full KV blocks
of each tenant's first prompt, summed over the tenants, at the engine's own bytes per block,
``engine.memory_plan``), so with F < 1 one replica cannot hold every tenant but the fleet
(``--replicas`` x F) can; and the single engine gets the fleet's total KV memory, so its hit
rate is what the fleet's memory allows when nothing is split.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import secrets
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from gateway.admission.prompt_tokens import load_tokenizer
from gateway.config import DEFAULT_MODEL_SPEC
from load.gateway_stack import (
    BENCH_PLAN,
    admin_client,
    free_port,
    new_tenant_key,
    process,
    redis_server,
    wait_for,
)
from load.serve_bench import percentiles

POLICIES = ("prefix_aware", "least_loaded", "round_robin", "load_only")
# A baseline, not a replica policy: least_loaded without its rendezvous affinity on the prompt's
# first characters (prefix_chars 0), which already keeps each tenant of this workload (its own
# system prompt) on one replica and so is prefix routing of a kind.
BASELINES = {"load_only": ("least_loaded", {"prefix_chars": 0})}
SERVED = "fleet"
WORDS = "alpha beta gamma delta river stone cloud amber cedar harbor lantern meadow".split()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="portico bench fleet", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="engine model (default: the gateway's default)")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--tenants", type=int, default=16)
    p.add_argument("--system-words", type=int, default=600)
    p.add_argument("--questions", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--engine-args", default="--kv-cache-memory 256MiB --max-model-len 4096")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--cache-fit",
        type=float,
        default=None,
        help="size each replica's KV cache to hold this share of all tenants' prompts (the "
        "single engine gets the replicas' total); default: --engine-args as given",
    )
    p.add_argument("--quick", action="store_true", help="4 tenants, 3 questions, short prompts")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--plot", type=Path, default=None)
    args = p.parse_args(argv)
    if args.quick:
        args.tenants, args.questions, args.system_words, args.concurrency = 4, 3, 200, 4
    if args.cache_fit is not None and args.cache_fit <= 0:
        p.error("--cache-fit must be positive")
    return args


def workload(args: argparse.Namespace) -> list[tuple[int, list[dict[str, str]]]]:
    """(tenant index, messages) in one seeded interleaved order."""
    rng = random.Random(args.seed)
    systems = [
        f"You are assistant {t}. " + " ".join(rng.choice(WORDS) for _ in range(args.system_words))
        for t in range(args.tenants)
    ]
    reqs = [
        (t, [{"role": "system", "content": systems[t]},
             {"role": "user", "content": f"Question {q}: name a {rng.choice(WORDS)}."}])
        for t in range(args.tenants)
        for q in range(args.questions)
    ]  # fmt: skip
    rng.shuffle(reqs)
    return reqs


def kv_sizing(args: argparse.Namespace) -> dict[str, Any]:
    """``--cache-fit``'s KV cache per replica and for the single engine, from the workload's
    prompts as the served model's tokenizer counts them and the engine's bytes per block."""
    from engine.config import EngineConfig
    from engine.memory_plan import plan

    model = args.model or DEFAULT_MODEL_SPEC
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    engine = plan(EngineConfig.from_cli_args(parser.parse_args(
        ["--model", model, *args.engine_args.split()])))  # fmt: skip
    tokenizer = load_tokenizer(model)
    if tokenizer is None:
        raise SystemExit(f"--cache-fit needs the tokenizer of {model}")
    first: dict[int, list[dict[str, str]]] = {}
    for tenant, messages in workload(args):
        first.setdefault(tenant, messages)
    block_size = engine.engine_config.block_size
    prompt_blocks = 0
    for messages in first.values():
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        prompt_blocks += len(tokenizer.encode(text, add_special_tokens=False)) // block_size
    replica_blocks = math.ceil(args.cache_fit * prompt_blocks)
    return {
        "prompt_blocks": prompt_blocks,  # all tenants' prompts, in full KV blocks
        "block_size": block_size,
        "block_bytes": engine.kv_block_bytes,
        "replica_blocks": replica_blocks,
        "replica_bytes": replica_blocks * engine.kv_block_bytes,
        "single_bytes": args.replicas * replica_blocks * engine.kv_block_bytes,
    }


def engine_args(args: argparse.Namespace, kv_bytes: int | None) -> list[str]:
    """``--engine-args``, with ``--kv-cache-memory`` set to ``kv_bytes`` when given (the
    engine's parser takes the last of a repeated flag)."""
    extra = [] if kv_bytes is None else ["--kv-cache-memory", str(kv_bytes)]
    return [*args.engine_args.split(), *extra]


def replica_args(args: argparse.Namespace, kv_bytes: int | None, replicas: int) -> list[str]:
    """:func:`engine_args` for one of ``replicas`` engines run at once: on CUDA each takes
    its share of the card (``--gpu-memory-utilization``, engine.memory_plan.gpu_share_flags)."""
    import torch

    from engine.memory_plan import gpu_share_flags

    return gpu_share_flags(engine_args(args, kv_bytes), replicas, torch.cuda.is_available())


def write_config(workdir: Path, port: int, redis_url: str, policy: str, replicas: int,
                 args: argparse.Namespace, kv_bytes: int | None = None) -> Path:  # fmt: skip
    policies = workdir / "policies"
    policies.mkdir(parents=True, exist_ok=True)
    (policies / "retry.yaml").write_text("{}\n")
    replica_policy, extra = BASELINES.get(policy, (policy, {}))
    routing: dict[str, Any] = {
        "tiers": [{"name": "only", "model": SERVED}],
        "replica_policy": replica_policy,
    }
    routing.update(extra)
    (policies / "routing.yaml").write_text(yaml.safe_dump(routing))
    plans = workdir / "plans.yaml"
    plan = {**BENCH_PLAN, "max_tokens_default": args.max_tokens}
    plans.write_text(yaml.safe_dump({"default_plan": "bench", "plans": {"bench": plan}}))
    engine: dict[str, Any] = {
        "name": SERVED,
        "replicas": replicas,
        "args": replica_args(args, kv_bytes, replicas),
        "startup_timeout_s": 900,
    }
    if args.model:
        engine["model"] = args.model
    config = {
        "listen": {"host": "127.0.0.1", "port": port},
        "redis": {"url": redis_url, "data_dir": str(workdir / "data"), "plans_file": str(plans)},
        "policies_dir": str(policies),
        "runtime_dir": str(workdir / "run"),
        "engines": [engine],
        "log_level": "warning",
        "drain_timeout_s": 5,
    }
    path = workdir / "portico.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


async def one_request(
    client: httpx.AsyncClient, key: str, messages: list[dict[str, str]], max_tokens: int
) -> dict[str, float]:
    body = {
        "model": SERVED,
        "messages": messages,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0,
        "ignore_eos": True,
    }
    start = time.perf_counter()
    ttft = None
    usage: dict[str, Any] = {}
    async with client.stream(
        "POST", "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"}
    ) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if ttft is None and any(c.get("delta", {}).get("content") for c in chunk["choices"]):
                ttft = time.perf_counter() - start
            usage = chunk.get("usage") or usage
    details = usage.get("prompt_tokens_details") or {}
    return {
        "ttft_s": ttft if ttft is not None else time.perf_counter() - start,
        "prompt_tokens": float(usage.get("prompt_tokens", 0)),
        "cached_tokens": float(details.get("cached_tokens", 0)),
        "completion_tokens": float(usage.get("completion_tokens", 0)),
    }


async def drive(base_url: str, keys: list[str], args: argparse.Namespace) -> dict[str, Any]:
    reqs = workload(args)
    gate = asyncio.Semaphore(args.concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:

        async def run(t: int, messages: list[dict[str, str]]) -> dict[str, float]:
            async with gate:
                sent = time.perf_counter() - start
                result = await one_request(client, keys[t], messages, args.max_tokens)
                return {"tenant": t, "sent_s": sent, **result}

        start = time.perf_counter()
        results = await asyncio.gather(*(run(t, m) for t, m in reqs))
        wall = time.perf_counter() - start
    ttfts = [r["ttft_s"] for r in results]
    prompt = sum(r["prompt_tokens"] for r in results)
    return {
        "requests": len(results),
        "hit_rate": sum(r["cached_tokens"] for r in results) / prompt if prompt else 0.0,
        # requests that found less than half their prompt cached (a cold system prompt)
        "cold": sum(1 for r in results if r["cached_tokens"] < r["prompt_tokens"] / 2),
        "ttft_ms": percentiles(ttfts),  # mean, median, p90, p99
        "output_tok_s": sum(r["completion_tokens"] for r in results) / wall,
        "wall_s": wall,
        # per request, in send order: which tenant, when, its TTFT and cached prompt tokens
        "detail": [
            {
                "tenant": r["tenant"],
                "sent_s": round(r["sent_s"], 3),
                "ttft_ms": round(1000 * r["ttft_s"], 1),
                "cached": r["cached_tokens"],
                "prompt": r["prompt_tokens"],
            }
            for r in sorted(results, key=lambda r: r["sent_s"])
        ],
    }


def create_keys(base_url: str, admin_key: str, n: int) -> list[str]:
    with admin_client(base_url, admin_key) as admin:
        tids = [f"fleet{t}-{secrets.token_hex(3)}" for t in range(n)]
        return [new_tenant_key(admin, {"id": tid, "name": tid}) for tid in tids]


def run_policy(root: Path, redis_url: str, policy: str, replicas: int,
               args: argparse.Namespace, kv_bytes: int | None) -> dict[str, Any]:  # fmt: skip
    workdir = root / f"{policy}-{replicas}"
    workdir.mkdir()
    port = free_port()
    config = write_config(workdir, port, redis_url, policy, replicas, args, kv_bytes)
    admin_key = "sk-admin-" + secrets.token_urlsafe(24)
    env = {**os.environ, "PORTICO_ADMIN_KEY": admin_key,
           "PORTICO_KEY_HASH_SECRET": secrets.token_hex(32)}  # fmt: skip
    env.pop("PORTICO_REDIS_URL", None)
    log = workdir / "gateway.log"
    base_url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "portico.cli", "serve", "-c", str(config)]
    with process(cmd, log, env) as proc:

        def ready() -> bool:
            try:
                return httpx.get(base_url + "/ready", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(ready, 900, "the gateway", proc, log)
        keys = create_keys(base_url, admin_key, args.tenants)
        result = asyncio.run(drive(base_url, keys, args))
    return {"policy": policy, "replicas": replicas, "kv_cache_bytes": kv_bytes, **result}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    policies = [p for p in args.policies.split(",") if p]
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        print(f"error: unknown policies {unknown}", file=sys.stderr)
        return 2
    sizing = kv_sizing(args) if args.cache_fit is not None else None
    if sizing is not None:
        print(json.dumps({"kv_sizing": sizing}), flush=True)
    single_kv, replica_kv = (sizing["single_bytes"], sizing["replica_bytes"]) if sizing else (
        None, None)  # fmt: skip
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="portico-fleet-") as tmp:
        root = Path(tmp)
        with redis_server(root, None) as redis_url:
            # the single engine: with --cache-fit, the fleet's total KV memory
            runs.append(run_policy(root, redis_url, "least_loaded", 1, args, single_kv))
            print(json.dumps(_brief(runs[-1])), flush=True)
            for policy in policies:
                runs.append(run_policy(root, redis_url, policy, args.replicas, args, replica_kv))
                print(json.dumps(_brief(runs[-1])), flush=True)
    by = {r["policy"]: r for r in runs[1:]}
    single = runs[0]
    targets: dict[str, bool] = {}
    if "prefix_aware" in by:
        pa = by["prefix_aware"]
        targets["hit_rate_within_10pct_of_single"] = pa["hit_rate"] >= 0.9 * single["hit_rate"]
        if "round_robin" in by:
            rr = by["round_robin"]["ttft_ms"]["median"]
            targets["ttft_p50_2x_better_than_round_robin"] = rr >= 2 * pa["ttft_ms"]["median"]
    summary = {"args": vars(args) | {"out": None, "plot": None}, "kv_sizing": sizing,
               "single": single, "runs": runs[1:], "targets": targets}  # fmt: skip
    brief = summary | {"single": _brief(single), "runs": [_brief(r) for r in runs[1:]]}
    print(json.dumps(brief, indent=2, default=str))
    if args.out:
        args.out.write_text(json.dumps(summary, indent=2, default=str))
    if args.plot:
        plot(summary, args.plot)
    return 0


def _brief(run: dict[str, Any]) -> dict[str, Any]:
    """A run without its per-request detail (what is printed; ``--out`` keeps it all)."""
    return {k: v for k, v in run.items() if k != "detail"}


def plot(summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [summary["single"] | {"policy": "single engine"}, *summary["runs"]]
    names = [r["policy"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    axes[0].bar(names, [100 * r["hit_rate"] for r in rows])
    axes[0].set_ylabel("prefix cache hit rate (%)")
    axes[1].bar(names, [r["ttft_ms"]["median"] for r in rows], label="median")
    axes[1].bar(names, [r["ttft_ms"]["p99"] - r["ttft_ms"]["median"] for r in rows],
                bottom=[r["ttft_ms"]["median"] for r in rows], alpha=0.4, label="p99")  # fmt: skip
    axes[1].set_ylabel("TTFT (ms)")
    axes[1].legend()
    axes[2].bar(names, [r["output_tok_s"] for r in rows])
    axes[2].set_ylabel("output tokens / s")
    for ax in axes:
        ax.tick_params(axis="x", rotation=20)
    sizing = summary.get("kv_sizing")
    if sizing:
        fig.suptitle(
            f"KV cache: {sizing['replica_bytes'] / 2**20:.0f} MiB a replica "
            f"({summary['args']['cache_fit']} of the tenants' prompts), "
            f"{sizing['single_bytes'] / 2**20:.0f} MiB the single engine"
        )
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
