"""Tenant fairness through the gateway: a quiet tenant next to a noisy one, fcfs against fair.

    portico bench fairness --through-gateway                      # default model, issue 43's mix
    portico bench fairness --through-gateway --quick --model DIR  # a tiny look (a test runs it)

One real ``portico serve`` (a private redis-server, authentication, rate limits, relaying)
supervises one ``portico engine`` per policy (``--policies``, default ``fcfs,fair``): pools
``fairness-fcfs`` and ``fairness-fair``, the same model and ``--engine-args`` (default
``--max-num-seqs 16``: N's requests take every running slot, the case issue 43 found), and
``--scheduling-policy`` set per pool. Two tenants on the packaged ``enterprise`` plan, each
with its own API key, call the gateway with the OpenAI wire format; nothing talks to an engine
directly. On each pool in turn:

1. **alone**: tenant Q sends ``--quiet-requests`` short streamed chats, one at a time, each a
   random 0 to 2 x ``--quiet-gap-s`` after the previous one ended;
2. **with N**: tenant N keeps ``--noisy-concurrency`` long chats in flight (a prompt of about
   ``--noisy-prompt-tokens`` tokens, ``--noisy-output-len`` tokens out, a new one as soon as
   one ends); once ``--warmup-requests`` of them have finished, Q sends its chats again.

Reported per policy: Q's TTFT p50/p90 alone and with N (seconds from the client's send to the
first streamed token, through the gateway); the engine's mean step time under N's load (the
with-N window over the steps the engine ran in it, ``portico_engine_steps_total``, read through
the gateway's ``/metrics/engines``; the engine is never idle then); total output tok/s and N's
(the engine's own per-tenant counter) in that window. Targets (issue 43, CPU): Q's TTFT p90
with N under fair <= Q's p90 alone + 2 x that step time; total output tok/s under fair >= 0.95x
fcfs; N's tok/s under fair at most 10% below fcfs. JSON (``--out``) and plots (``--plot``).
A benchmark, never a test: numbers depend on the machine and what else runs on it.

Throughput like for like: the with-N window above lasts as long as Q's chats take, which under
fcfs is minutes longer than under fair, so the two windows hold different parts of N's request
cycle. ``--throughput-window-s W`` also reads the engine's counters W seconds after Q starts
(N keeps going until then, however soon Q ends): the same W on every pool, and the targets'
throughput ratios use it. ``--rounds R`` runs the policies R times, the order reversed every
other round (fair, fcfs, fcfs, fair for two), so a machine whose speed drifts during the run
weighs on both; each policy's figures pool its rounds, and each round's ratio is reported.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import secrets
import shlex
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

from load.fairness_bench import Timing, timed_stream
from load.fairness_gateway_report import plot_report, print_summary
from load.gateway_stack import (
    REPO_ROOT,
    admin_client,
    free_port,
    new_tenant_key,
    process,
    redis_server,
    wait_for,
)
from load.serve_bench import percentiles
from load.ttft_breakdown import TraceCollector, Traced, collect, summarize, traceparent

QUIET, NOISY = "quiet", "noisy"
PLAN = "enterprise"  # the packaged plan issue 43 was measured on
DEFAULT_ENGINE_ARGS = "--max-num-seqs 16"
TARGET_STEPS = 2.0  # Q's p90 with N at most its p90 alone + this many mean step times
TARGET_TOTAL = 0.95  # total output tok/s under fair at least this times fcfs's
TARGET_NOISY = 0.90  # N's output tok/s under fair at least this times fcfs's
WORDS = (
    "river stone garden lamp paper window orange silver market cloud winter engine bridge "
    "forest letter music planet candle harbor pencil mirror valley rocket meadow spring"
).split()


@dataclass(frozen=True)
class Workload:
    """What both tenants send; the same on every pool of a run."""

    noisy_concurrency: int = 16
    noisy_prompt_tokens: int = 700
    noisy_output_len: int = 160
    quiet_output_len: int = 16
    quiet_requests: int = 12
    quiet_gap_s: float = 0.25
    warmup_requests: int = 4
    seed: int = 0


QUICK = Workload(
    noisy_concurrency=6,
    noisy_prompt_tokens=60,
    noisy_output_len=12,
    quiet_output_len=4,
    quiet_requests=3,
    quiet_gap_s=0.0,
    warmup_requests=2,
)


@dataclass
class PoolRun:
    """Everything measured on one policy's pool."""

    policy: str
    alone: list[Timing] = field(default_factory=list)
    with_noisy: list[Timing] = field(default_factory=list)
    noisy: list[Timing] = field(default_factory=list)
    window_s: float = 0.0
    steps: float = 0.0
    generated: float = 0.0
    noisy_generated: float = 0.0
    preemptions: float = 0.0
    traced_alone: list[Traced] = field(default_factory=list)
    traced_with_noisy: list[Traced] = field(default_factory=list)
    breakdown: dict[str, Any] = field(default_factory=dict)
    # the first ``fixed_window_s`` seconds of the with-N window (--throughput-window-s)
    fixed_window_s: float = 0.0
    fixed_generated: float = 0.0
    fixed_noisy_generated: float = 0.0
    round: int = 0


def merge_runs(runs: Sequence[PoolRun]) -> PoolRun:
    """One policy's rounds as one run: timings joined, windows, steps and tokens summed."""
    merged = PoolRun(runs[0].policy)
    for run in runs:
        for name in ("alone", "with_noisy", "noisy", "traced_alone", "traced_with_noisy"):
            getattr(merged, name).extend(getattr(run, name))
        for name in ("window_s", "steps", "generated", "noisy_generated", "preemptions",
                     "fixed_window_s", "fixed_generated", "fixed_noisy_generated"):  # fmt: skip
            setattr(merged, name, getattr(merged, name) + getattr(run, name))
    merged.breakdown = runs[0].breakdown  # Q's TTFT in parts: the first round's
    return merged


def words_prompt(rng: random.Random, num_tokens: int) -> str:
    """About ``num_tokens`` tokens of unrelated words (SmolLM2's tokenizer: ~1.3 a word),
    prefixed with a number so no two prompts share a cached prefix."""
    words = [rng.choice(WORDS) for _ in range(max(1, int(num_tokens / 1.3)))]
    return f"{rng.randrange(10**9)}: " + " ".join(words)


async def stream_chat(
    client: httpx.AsyncClient,
    key: str,
    model: str,
    text: str,
    max_tokens: int,
    traced: list[Traced] | None = None,
) -> Timing:
    """One streamed chat through the gateway with ``key``; times its first token and end.
    With ``traced``, its trace is sampled (the gateway and engine record its spans) and
    appended there; without, its ``traceparent`` says not to record it."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    trace_id, header = traceparent(sampled=traced is not None)
    headers = {"authorization": f"Bearer {key}", "traceparent": header}
    sent_ns = time.time_ns()
    timing = await timed_stream(client, "/v1/chat/completions", body, headers)
    if traced is not None and timing.ok:
        traced.append(Traced(trace_id, sent_ns, timing.ttft))
    return timing


async def engine_counters(client: httpx.AsyncClient, pool: str) -> dict[str, float]:
    """Steps, generated tokens, preemptions, per-tenant generation tokens and requests in
    flight of ``pool``'s replica, from the gateway's ``/metrics/engines``."""
    text = (await client.get("/metrics/engines")).text
    out = {"steps": 0.0, "generated": 0.0, "preemptions": 0.0, "busy": 0.0}
    names = {
        "portico_engine_steps_total": "steps",
        "vllm:generation_tokens_total": "generated",
        "vllm:num_preemptions_total": "preemptions",
        "vllm:num_requests_running": "busy",
        "vllm:num_requests_waiting": "busy",
    }
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if not s.labels.get("engine", "").startswith(f"{pool}-"):
                continue
            if s.name in names:
                out[names[s.name]] += s.value
            elif s.name == "portico_engine_tenant_tokens_total":
                if s.labels.get("kind") == "generation":
                    key = f"tenant:{s.labels.get('tenant', '')}"
                    out[key] = out.get(key, 0.0) + s.value
    return out


async def quiet_sequence(
    client: httpx.AsyncClient,
    key: str,
    pool: str,
    rng: random.Random,
    work: Workload,
    traced: list[Traced],
) -> list[Timing]:
    out = []
    # Each gap is drawn from 0 to 2 x quiet_gap_s: a fixed gap after a chat that ended at a
    # step's end lands every chat at the same point of the next step (measured: 0.50-0.54 s
    # into it, with 0.5 s gaps), which times one phase of the step, not a user's arrival.
    gaps = random.Random(work.seed + 7)
    for i in range(work.quiet_requests):
        if i and work.quiet_gap_s:
            await asyncio.sleep(gaps.uniform(0.0, 2 * work.quiet_gap_s))
        text = f"{rng.randrange(10**9)}: say hello to the {rng.choice(WORDS)}"
        out.append(await stream_chat(client, key, pool, text, work.quiet_output_len, traced))
    return out


async def run_pool(
    client: httpx.AsyncClient,
    pool: str,
    keys: dict[str, str],
    work: Workload,
    progress: bool,
    fixed_window_s: float = 0.0,
) -> PoolRun:
    """The alone and with-N phases on one pool (its policy is the pool's); with
    ``fixed_window_s``, N runs at least that long after Q starts, and the counters are read
    then too."""
    run = PoolRun(pool.removeprefix("fairness-"))
    rng = random.Random(work.seed)
    await stream_chat(client, keys[QUIET], pool, "warm up", 2)  # one-time costs, untimed
    run.alone = await quiet_sequence(client, keys[QUIET], pool, rng, work, run.traced_alone)
    _say(progress, f"{run.policy}: Q alone done")
    stop = asyncio.Event()
    finished = asyncio.Condition()

    async def noisy_worker(seed: int) -> None:
        worker_rng = random.Random(seed)
        while not stop.is_set():
            text = words_prompt(worker_rng, work.noisy_prompt_tokens)
            timing = await stream_chat(client, keys[NOISY], pool, text, work.noisy_output_len)
            async with finished:
                run.noisy.append(timing)
                finished.notify_all()
            if not timing.ok:
                return

    seeds = [work.seed * 1000 + i + 1 for i in range(work.noisy_concurrency)]
    workers = [asyncio.create_task(noisy_worker(s)) for s in seeds]
    try:
        async with finished:
            await finished.wait_for(
                lambda: len(run.noisy) >= work.warmup_requests or any(not t.ok for t in run.noisy)
            )
        failed = [t.error for t in run.noisy if not t.ok]
        if failed:
            raise RuntimeError(f"{run.policy}: N's requests failed: {failed[0]}")
        _say(progress, f"{run.policy}: N warm; Q with N")
        before = await engine_counters(client, pool)
        started = time.perf_counter()
        fixed = asyncio.create_task(_counters_after(client, pool, fixed_window_s))
        run.with_noisy = await quiet_sequence(
            client, keys[QUIET], pool, rng, work, run.traced_with_noisy
        )
        run.window_s = time.perf_counter() - started
        after = await engine_counters(client, pool)
        at_fixed = await fixed  # N still running until the fixed window ends
        if fixed_window_s > 0:
            run.fixed_window_s = fixed_window_s
            run.fixed_generated = at_fixed["generated"] - before["generated"]
            noisy = f"tenant:{NOISY}"
            run.fixed_noisy_generated = at_fixed.get(noisy, 0.0) - before.get(noisy, 0.0)
    finally:
        stop.set()
        for task in workers:
            task.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
    delta = {k: v - before.get(k, 0.0) for k, v in after.items()}
    run.steps, run.generated = delta["steps"], delta["generated"]
    run.preemptions = delta["preemptions"]
    run.noisy_generated = delta.get(f"tenant:{NOISY}", 0.0)
    await _wait_idle(client, pool)
    return run


async def _counters_after(client: httpx.AsyncClient, pool: str, delay_s: float) -> dict[str, float]:
    """The engine's counters ``delay_s`` from now (none read for 0)."""
    if delay_s <= 0:
        return {}
    await asyncio.sleep(delay_s)
    return await engine_counters(client, pool)


async def _wait_idle(client: httpx.AsyncClient, pool: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while (await engine_counters(client, pool))["busy"] > 0:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{pool} did not go idle after N's requests were cancelled")
        await asyncio.sleep(0.1)


def _say(progress: bool, message: str) -> None:
    if progress:
        print(f"[fairness-gateway] {message}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- the stack


def write_config(
    workdir: Path, port: int, redis_url: str, model: str, policies: Sequence[str], args: list[str]
) -> Path:
    """``portico serve``'s config: one pool per policy, the packaged plans, one routing tier."""
    policies_dir = workdir / "policies"
    policies_dir.mkdir(parents=True, exist_ok=True)
    shutil.copy(REPO_ROOT / "policies" / "retry.yaml", policies_dir / "retry.yaml")
    pools = [f"fairness-{p}" for p in policies]
    routing = {"aliases": {}, "tiers": [{"name": "only", "model": pools[0]}], "weights": {}}
    (policies_dir / "routing.yaml").write_text(yaml.safe_dump({**routing, "keywords": []}))
    engines = [
        {
            "name": pool,
            "model": model,
            "args": [*args, "--scheduling-policy", policy],
            "startup_timeout_s": 600,
        }
        for pool, policy in zip(pools, policies, strict=True)
    ]
    config = {
        "listen": {"host": "127.0.0.1", "port": port},
        "redis": {
            "url": redis_url,
            "data_dir": str(workdir / "data"),
            "plans_file": str(REPO_ROOT / "policies" / "plans.yaml"),
        },
        "policies_dir": str(policies_dir),
        "runtime_dir": str(workdir / "run"),
        "engines": engines,
        "log_level": "warning",
        "access_log": False,
        "drain_timeout_s": 5,
    }
    path = workdir / "portico.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@contextlib.contextmanager
def serve(
    workdir: Path,
    model: str,
    policies: Sequence[str],
    engine_args: list[str],
    extra_env: dict[str, str] | None = None,
) -> Iterator[tuple[str, dict[str, str]]]:
    """Redis, then ``portico serve`` with one engine per policy, ready; yields its base URL
    and the two tenants' API keys (tenants ``quiet`` and ``noisy`` on the enterprise plan).
    ``extra_env``: added to the gateway's (and so its engines') environment."""
    with redis_server(workdir, None) as redis_url:
        port = free_port()
        config = write_config(workdir, port, redis_url, model, policies, engine_args)
        admin_key = "sk-admin-" + secrets.token_urlsafe(24)
        env = {
            **os.environ,
            "PORTICO_ADMIN_KEY": admin_key,
            "PORTICO_KEY_HASH_SECRET": secrets.token_hex(32),
            "PYTHONUNBUFFERED": "1",
            **(extra_env or {}),
        }
        env.pop("PORTICO_REDIS_URL", None)
        cmd = [sys.executable, "-m", "portico.cli", "serve", "-c", str(config)]
        log = workdir / "gateway.log"
        base = f"http://127.0.0.1:{port}"
        with process(cmd, log, env) as proc:
            wait_for(lambda: _ready(base), 900, "the gateway and its engines", proc, log)
            with admin_client(base, admin_key) as admin:
                keys = {
                    name: new_tenant_key(admin, {"id": name, "name": name, "plan": PLAN})
                    for name in (QUIET, NOISY)
                }
            yield base, keys


def _ready(base: str) -> bool:
    try:
        return httpx.get(base + "/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


# --------------------------------------------------------------------------- report


def _ttft_ms(timings: Sequence[Timing]) -> dict[str, float]:
    p = percentiles([t.ttft for t in timings if t.ok])
    return {"p50": p["median"], "p90": p["p90"], "mean": p["mean"]}


def _pool_report(run: PoolRun) -> dict[str, Any]:
    window = run.window_s or 1.0
    return {
        "quiet_ttft_ms_alone": _ttft_ms(run.alone),
        "quiet_ttft_ms_with_noisy": _ttft_ms(run.with_noisy),
        "quiet_failed": sum(not t.ok for t in run.alone + run.with_noisy),
        "noisy_finished": sum(t.ok for t in run.noisy),
        "window_s": run.window_s,
        "steps": run.steps,
        "mean_step_ms": 1000 * run.window_s / run.steps if run.steps else None,
        "preemptions": run.preemptions,
        "quiet_ttft_breakdown_ms": run.breakdown,
        "total_output_tok_s": run.generated / window,
        "noisy_output_tok_s": run.noisy_generated / window,
        "quiet_ttft_s": {
            "alone": [t.ttft for t in run.alone if t.ok],
            "with_noisy": [t.ttft for t in run.with_noisy if t.ok],
        },
        "fixed_window_s": run.fixed_window_s,
        "fixed_total_output_tok_s": _rate(run.fixed_generated, run.fixed_window_s),
        "fixed_noisy_output_tok_s": _rate(run.fixed_noisy_generated, run.fixed_window_s),
    }


def _rate(tokens: float, seconds: float) -> float | None:
    return tokens / seconds if seconds > 0 else None


def _ratio(a: float | None, b: float | None) -> float:
    return a / b if a is not None and b else 0.0


def targets(pools: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Issue 43's three CPU targets, from the fair and fcfs pools of one run."""
    if "fair" not in pools or "fcfs" not in pools:
        return {}
    fair, fcfs = pools["fair"], pools["fcfs"]
    step_ms = fair["mean_step_ms"] or 0.0
    bound = fair["quiet_ttft_ms_alone"]["p90"] + TARGET_STEPS * step_ms
    # the fixed windows where both pools have them (like for like), else the Q windows
    key = "fixed_" if fair.get("fixed_window_s") and fcfs.get("fixed_window_s") else ""
    total = _ratio(fair[f"{key}total_output_tok_s"], fcfs[f"{key}total_output_tok_s"])
    noisy = _ratio(fair[f"{key}noisy_output_tok_s"], fcfs[f"{key}noisy_output_tok_s"])
    return {
        "throughput_window": "fixed" if key else "quiet tenant's",
        "fair_p90_bound_ms": bound,
        "fair_p90_ms": fair["quiet_ttft_ms_with_noisy"]["p90"],
        "fair_p90_within_alone_plus_2_steps": fair["quiet_ttft_ms_with_noisy"]["p90"] <= bound,
        "fair_total_over_fcfs_total": total,
        "fair_total_at_least_0_95_fcfs": total >= TARGET_TOTAL,
        "fair_noisy_over_fcfs_noisy": noisy,
        "fair_noisy_within_10_percent_of_fcfs": noisy >= TARGET_NOISY,
    }


def build_report(
    runs: Sequence[PoolRun], work: Workload, model: str, engine_args: Sequence[str]
) -> dict[str, Any]:
    """The report of every run, a policy's rounds pooled (:func:`merge_runs`), each round's
    own fair / fcfs throughput ratios beside them."""
    by_policy: dict[str, list[PoolRun]] = {}
    for run in runs:
        by_policy.setdefault(run.policy, []).append(run)
    pools = {name: _pool_report(merge_runs(rs)) for name, rs in by_policy.items()}
    rounds = []
    for fair, fcfs in zip(by_policy.get("fair", []), by_policy.get("fcfs", []), strict=False):
        a, b = _pool_report(fair), _pool_report(fcfs)
        rounds.append(targets({"fair": a, "fcfs": b}) | {"round": fair.round})
    return {
        "benchmark": "fairness-through-gateway",
        "model": model,
        "engine_args": list(engine_args),
        "plan": PLAN,
        "workload": asdict(work),
        "loadavg": Path("/proc/loadavg").read_text().split()[:3],
        "policies": pools,
        "targets": targets(pools),
        "rounds": rounds if len(rounds) > 1 else [],
    }


# --------------------------------------------------------------------------- main


async def _measure(
    base: str,
    keys: dict[str, str],
    policies: Sequence[str],
    work: Workload,
    args: Any,
    traces: TraceCollector,
) -> list[PoolRun]:
    """Each policy's pool in turn; the report so far is written after each (a run cut short
    by a time limit keeps what it measured)."""
    limits = httpx.Limits(max_connections=work.noisy_concurrency + 8)
    runs = []
    order = [
        (r, p) for r in range(args.rounds) for p in (policies if r % 2 == 0 else policies[::-1])
    ]
    for round_, policy in order:
        async with httpx.AsyncClient(base_url=base, timeout=None, limits=limits) as client:
            pool = f"fairness-{policy}"
            window = args.throughput_window_s
            run = await run_pool(client, pool, keys, work, not args.no_progress, window)
        run.round = round_
        for phase, traced in (("alone", run.traced_alone), ("with_noisy", run.traced_with_noisy)):
            rows = await asyncio.to_thread(collect, traces, traced)
            run.breakdown[phase] = asdict(summarize(rows))
        runs.append(run)
        write_report(build_report(runs, work, args.model, shlex.split(args.engine_args)), args)
    return runs


def write_report(report: dict[str, Any], args: Any) -> None:
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="portico bench fairness --through-gateway", description=__doc__
    )
    parser.add_argument("--through-gateway", action="store_true", help="(this mode)")
    parser.add_argument("--model", default="smollm2-135m", help="alias, HF folder or .gguf")
    parser.add_argument("--engine-args", default=DEFAULT_ENGINE_ARGS, help="every engine's flags")
    parser.add_argument("--policies", default="fcfs,fair", help="comma-separated, run in order")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (the test's run)")
    parser.add_argument("--rounds", type=int, default=1, help="the policies R times, ABBA order")
    parser.add_argument(
        "--throughput-window-s", type=float, default=0.0,
        help="also count throughput over this many seconds from Q's start, on every pool",
    )  # fmt: skip
    d = Workload()
    for name, value in asdict(d).items():
        parser.add_argument("--" + name.replace("_", "-"), type=type(value), default=value)
    parser.add_argument("--out", default="load/results/fairness_gateway.json")
    parser.add_argument("--plot", default=None, help="PNG path prefix for the two plots")
    parser.add_argument("--no-progress", action="store_true")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    work = QUICK if args.quick else Workload(**{k: getattr(args, k) for k in asdict(Workload())})
    engine_args = shlex.split(args.engine_args)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    progress = not args.no_progress
    with tempfile.TemporaryDirectory(prefix="fairness-gateway-") as tmp, TraceCollector() as traces:
        with serve(Path(tmp), args.model, policies, engine_args, traces.env()) as (base, keys):
            _say(progress, f"gateway ready at {base}")
            runs = asyncio.run(_measure(base, keys, policies, work, args, traces))
    report = build_report(runs, work, args.model, engine_args)
    if args.plot:
        report["plots"] = plot_report(report, args.plot)
    write_report(report, args)
    print_summary(report)
    failed = sum(r["quiet_failed"] for r in report["policies"].values())
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
