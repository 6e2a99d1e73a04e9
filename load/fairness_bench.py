"""Tenant fairness: a quiet tenant's latency next to a noisy one, fcfs against fair, one run.

    portico bench fairness                          # the default model, both policies
    portico bench fairness --quick --model DIR      # a tiny look (the test runs this)
    portico bench fairness --through-gateway        # through `portico serve`: see
                                                    # load/fairness_gateway_bench.py

For each scheduling policy (``--policies``, default ``fcfs,fair``) one real ``portico engine``
process is started with ``--scheduling-policy <policy>`` and the same flags otherwise (an entry
``POLICY:FLAGS`` adds engine flags for that engine alone, e.g.
``fair:--fair-contended-prefill-tokens 0`` to price one part of fair against the rest), and
talked to directly on the engine hop: every request carries the ``x-portico-*`` headers the
gateway would set (engine/tenancy.py), so what is measured is the engine's scheduler alone,
without the gateway's admission in front. All engines stay up (an idle one costs nothing) and
``--rounds`` alternate them, so a machine whose load drifts weighs on every policy alike; each
policy's rounds are pooled. On each engine, each round, in order:

1. **alone**: tenant Q ("quiet") sends ``--quiet-requests`` short requests, one at a time;
2. **with N**: tenant N ("noisy") keeps ``--noisy-concurrency`` long requests in flight (a
   new one as soon as one ends); once ``--warmup-requests`` of them have finished, so that
   N's requests are staggered as in steady state, Q sends the same short requests again,
   one at a time. N's requests are cancelled when Q is done (the engine aborts them).

Both engines get the same prompts (seeded random token ids) and greedy decoding with
``ignore_eos``, so every request writes exactly its ``max_tokens``. Reported: Q's TTFT p50/p99
alone, with N under each policy; the output tokens per second of N and of the engine in total
while Q ran (from the engine's own ``vllm:generation_tokens_total``, N's as the total minus
Q's); the issue's targets (Q's p99 under fair within 2x alone and at least 3x better than
under fcfs; total output tok/s under fair at least 0.95x fcfs), whether each was met; JSON
(``--out``) and two plots (``--plot PREFIX``: Q's TTFT CDFs, throughput bars). A benchmark,
never a test: numbers depend on the machine and on what else runs on it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import platform
import random
import shlex
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from load.datasets import TOKEN_ID_RANGE
from load.gateway_stack import free_port, process
from load.serve_bench import percentiles

SERVED_NAME = "fairness-bench"
QUIET, NOISY = "quiet", "noisy"
TARGET_FAIR_VS_ALONE = 2.0  # Q's TTFT p99 under fair at most this times its p99 alone
TARGET_FCFS_VS_FAIR = 3.0  # ... and at least this many times better than under fcfs
TARGET_THROUGHPUT = 0.95  # total output tok/s under fair at least this times fcfs's
STARTUP_TIMEOUT_S = 600.0
IDLE_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Workload:
    """What both tenants send; the same on every engine of a run."""

    noisy_concurrency: int = 16
    noisy_prompt_len: int = 1536
    noisy_output_len: int = 64
    quiet_prompt_len: int = 64
    quiet_output_len: int = 16
    quiet_requests: int = 40
    quiet_gap_s: float = 0.1  # pause between two of Q's requests
    warmup_requests: int = 16  # N's requests finished before Q starts
    seed: int = 0
    rounds: int = 1  # the policies take turns this many times


QUICK = Workload(
    noisy_concurrency=16,
    noisy_prompt_len=96,
    noisy_output_len=8,
    quiet_prompt_len=16,
    quiet_output_len=4,
    quiet_requests=4,
    quiet_gap_s=0.0,
    warmup_requests=4,
)


@dataclass
class Timing:
    """One streamed request: seconds from its send to its first token and to its end."""

    ok: bool = False
    ttft: float = 0.0
    latency: float = 0.0
    output_tokens: int = 0
    error: str = ""


@dataclass
class PolicyRun:
    """Everything measured on the engine of one policy."""

    policy: str
    alone: list[Timing] = field(default_factory=list)
    with_noisy: list[Timing] = field(default_factory=list)
    noisy: list[Timing] = field(default_factory=list)  # N's requests that finished in the run
    window_s: float = 0.0  # Q's with-N phase, first send to last answer
    generated_tokens: float = 0.0  # by the engine in that window (its own counter)
    tenant_tokens: dict[str, float] = field(default_factory=dict)  # per-tenant counter delta
    round_tok_s: list[float] = field(default_factory=list)  # total output tok/s, each round
    cache_queries: float = 0.0  # prompt tokens looked up in the prefix cache in that window
    cache_hits: float = 0.0  # ... and found there (no prompt repeats: should stay near 0)

    def add(self, other: PolicyRun) -> None:
        """Pool another round of the same policy into this one."""
        self.alone += other.alone
        self.with_noisy += other.with_noisy
        self.noisy += other.noisy
        self.window_s += other.window_s
        self.generated_tokens += other.generated_tokens
        for tenant, tokens in other.tenant_tokens.items():
            self.tenant_tokens[tenant] = self.tenant_tokens.get(tenant, 0.0) + tokens
        self.round_tok_s += other.round_tok_s
        self.cache_queries += other.cache_queries
        self.cache_hits += other.cache_hits


def token_prompts(count: int, length: int, seed: int) -> list[list[int]]:
    """``count`` prompts of ``length`` random token ids (deterministic for a seed)."""
    rng = random.Random(seed)
    lo, hi = TOKEN_ID_RANGE
    return [[rng.randint(lo, hi) for _ in range(length)] for _ in range(count)]


def prompt_seed(work: Workload, round_number: int, stream: str) -> int:
    """A seed per (round, prompt stream): no prompt repeats within a run, so the prefix cache
    serves neither policy from an earlier phase or round. (It did: N cycled through 64
    prompts, so a policy whose with-N window came later or lasted longer found more of N's
    prompts cached and showed more output per second for the same scheduling.)"""
    streams = ("quiet-alone", "quiet-with-noisy", "noisy", "warm")
    return work.seed + 1_000 * round_number + streams.index(stream)


def hop_headers(tenant: str) -> dict[str, str]:
    """The engine-hop headers the gateway sets (gateway/relay/engine_hop.py): one plan,
    weight 1, interactive, the whole KV cache, for both tenants."""
    return {
        "x-portico-tenant": tenant,
        "x-portico-tenant-weight": "1.0",
        "x-portico-priority-class": "interactive",
        "x-portico-kv-share": "1.0",
    }


async def stream_one(
    client: httpx.AsyncClient, tenant: str, prompt: list[int], max_tokens: int
) -> Timing:
    """Send one streaming completion as ``tenant``; time its first token and its end."""
    body = {
        "model": SERVED_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    return await timed_stream(client, "/v1/completions", body, hop_headers(tenant))


def has_token(event: dict[str, Any]) -> bool:
    """Does a stream chunk carry generated output? A chat stream's first chunk is the role with
    empty content, sent before anything is computed: timing it would not be a first token."""
    for choice in event.get("choices", ()):
        if choice.get("text") or (choice.get("delta") or {}).get("content"):
            return True
    return False


async def timed_stream(
    client: httpx.AsyncClient, path: str, body: dict[str, Any], headers: dict[str, str]
) -> Timing:
    """POST a streaming ``body`` to ``path``; time its first generated token and its end."""
    timing = Timing()
    start = time.perf_counter()
    try:
        async with client.stream("POST", path, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                await resp.aread()
                timing.error = f"HTTP {resp.status_code}: {resp.text[:200]}"
                return timing
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    timing.error = str(event["error"].get("message", "stream error"))[:200]
                    return timing
                if timing.ttft == 0.0 and has_token(event):
                    timing.ttft = time.perf_counter() - start
                if event.get("usage"):
                    timing.output_tokens = int(event["usage"].get("completion_tokens") or 0)
    except httpx.HTTPError as exc:
        timing.error = f"{type(exc).__name__}: {exc}"[:200]
        return timing
    timing.latency = time.perf_counter() - start
    timing.ok = timing.ttft > 0.0
    if not timing.ok:
        timing.error = "no token streamed"
    return timing


async def quiet_sequence(
    client: httpx.AsyncClient, prompts: Sequence[list[int]], work: Workload
) -> list[Timing]:
    """Q's requests, one at a time, ``quiet_gap_s`` apart."""
    out = []
    for i, prompt in enumerate(prompts):
        if i and work.quiet_gap_s:
            await asyncio.sleep(work.quiet_gap_s)
        out.append(await stream_one(client, QUIET, prompt, work.quiet_output_len))
    return out


def _samples(text: str) -> Iterator[tuple[str, dict[str, str], float]]:
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            yield s.name, s.labels, s.value


async def read_counters(client: httpx.AsyncClient) -> dict[str, float]:
    """The engine's generated-token total, its per-tenant generation tokens (when it exports
    them: ``tenant:<name>`` keys) and its requests running + waiting (``busy``)."""
    text = (await client.get("/metrics")).text
    out: dict[str, float] = {"generated": 0.0, "busy": 0.0, "cache_queries": 0.0, "cache_hits": 0.0}
    for name, labels, value in _samples(text):
        if name == "vllm:generation_tokens_total":
            out["generated"] += value
        elif name == "vllm:prefix_cache_queries_total":
            out["cache_queries"] += value
        elif name == "vllm:prefix_cache_hits_total":
            out["cache_hits"] += value
        elif name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
            out["busy"] += value
        elif name == "portico_engine_tenant_tokens_total" and labels.get("kind") == "generation":
            key = f"tenant:{labels.get('tenant', '')}"
            out[key] = out.get(key, 0.0) + value
    return out


async def run_policy(
    client: httpx.AsyncClient,
    policy: str,
    work: Workload,
    progress: bool = True,
    round_number: int = 0,
) -> PolicyRun:
    """The alone and with-N phases on one (started, ready) engine. Every engine gets the same
    prompts in the same round; no prompt repeats within a run (``prompt_seed``)."""
    run = PolicyRun(policy)
    quiet_len, noisy_len = work.quiet_prompt_len, work.noisy_prompt_len
    seed = functools.partial(prompt_seed, work, round_number)
    quiet_alone = token_prompts(work.quiet_requests, quiet_len, seed("quiet-alone"))
    quiet_with = token_prompts(work.quiet_requests, quiet_len, seed("quiet-with-noisy"))
    noisy_rng = random.Random(seed("noisy"))
    lo, hi = TOKEN_ID_RANGE
    # one untimed request first: the engine's first step pays one-time costs (kernels, caches)
    await stream_one(client, QUIET, token_prompts(1, 8, seed("warm"))[0], 2)
    run.alone = await quiet_sequence(client, quiet_alone, work)
    _say(progress, f"{policy}: Q alone done")

    stop = asyncio.Event()
    finished = asyncio.Condition()

    async def noisy_worker() -> None:
        while not stop.is_set():
            prompt = [noisy_rng.randint(lo, hi) for _ in range(noisy_len)]
            timing = await stream_one(client, NOISY, prompt, work.noisy_output_len)
            async with finished:
                run.noisy.append(timing)
                finished.notify_all()
            if not timing.ok:
                return  # reported by the caller; no tight loop of failures

    workers = [asyncio.create_task(noisy_worker()) for _ in range(work.noisy_concurrency)]
    try:
        async with finished:
            await finished.wait_for(
                lambda: len(run.noisy) >= work.warmup_requests or any(not t.ok for t in run.noisy)
            )
        failed = [t.error for t in run.noisy if not t.ok]
        if failed:
            raise RuntimeError(f"{policy}: N's requests failed: {failed[0]}")
        _say(progress, f"{policy}: N warm ({len(run.noisy)} finished); Q with N")
        before = await read_counters(client)
        started = time.perf_counter()
        run.with_noisy = await quiet_sequence(client, quiet_with, work)
        run.window_s = time.perf_counter() - started
        after = await read_counters(client)
    finally:
        stop.set()
        for task in workers:
            task.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
    run.generated_tokens = after["generated"] - before["generated"]
    run.cache_queries = after["cache_queries"] - before["cache_queries"]
    run.cache_hits = after["cache_hits"] - before["cache_hits"]
    run.tenant_tokens = {
        k.removeprefix("tenant:"): v - before.get(k, 0.0)
        for k, v in after.items()
        if k.startswith("tenant:")
    }
    run.round_tok_s = [run.generated_tokens / run.window_s] if run.window_s else []
    await _wait_idle(client)
    return run


async def _wait_idle(client: httpx.AsyncClient) -> None:
    """Until the engine has aborted N's cancelled requests (nothing running or waiting)."""
    deadline = time.monotonic() + IDLE_TIMEOUT_S
    while (await read_counters(client))["busy"] > 0:
        if time.monotonic() > deadline:
            raise RuntimeError("the engine did not go idle after N's requests were cancelled")
        await asyncio.sleep(0.1)


def _say(progress: bool, message: str) -> None:
    if progress:
        print(f"[fairness] {message}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- engine process


@contextlib.contextmanager
def engine_process(
    model: str, variant: str, engine_args: Sequence[str], log_dir: Path
) -> Iterator[str]:
    """A ``portico engine`` on a loopback port for ``variant`` (``POLICY`` or
    ``POLICY:FLAGS``: ``--scheduling-policy POLICY``, then ``engine_args``, then ``FLAGS``);
    yields its base URL once ``/ready`` answers; SIGTERM (then kill) on the way out."""
    policy, _, own_flags = variant.partition(":")
    port = free_port()
    cmd = [
        sys.executable, "-m", "portico.cli", "engine",
        "--model", model, "--served-model-name", SERVED_NAME,
        "--host", "127.0.0.1", "--port", str(port),
        "--scheduling-policy", policy, "--log-level", "warning",
        *engine_args, *shlex.split(own_flags),
    ]  # fmt: skip
    log_path = log_dir / f"engine-{len(list(log_dir.glob('engine-*.log')))}-{policy}.log"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    url = f"http://127.0.0.1:{port}"
    with process(cmd, log_path, env) as proc:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"engine ({policy}) exited {proc.returncode}:\n{_tail(log_path)}"
                )
            try:
                if httpx.get(url + "/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"engine ({policy}) not ready in time:\n{_tail(log_path)}")
            time.sleep(0.25)
        yield url


def _tail(path: Path, num_chars: int = 3000) -> str:
    return path.read_text(errors="replace")[-num_chars:]


# --------------------------------------------------------------------------- report


def _ttft(timings: Sequence[Timing]) -> dict[str, float]:
    p = percentiles([t.ttft for t in timings if t.ok])
    return {"p50": p["median"], "p99": p["p99"], "mean": p["mean"]}


def _policy_report(run: PolicyRun) -> dict[str, Any]:
    quiet_tokens = sum(t.output_tokens for t in run.with_noisy if t.ok)
    noisy_tokens = max(0.0, run.generated_tokens - quiet_tokens)
    window = run.window_s or 1.0
    return {
        "quiet_ttft_ms_alone": _ttft(run.alone),
        "quiet_ttft_ms_with_noisy": _ttft(run.with_noisy),
        "quiet_failed": sum(not t.ok for t in run.alone + run.with_noisy),
        "noisy_finished": sum(t.ok for t in run.noisy),
        "noisy_ttft_ms": _ttft(run.noisy),
        "window_s": run.window_s,
        "generated_tokens": run.generated_tokens,
        "quiet_output_tokens": quiet_tokens,
        "noisy_output_tok_s": noisy_tokens / window,
        "total_output_tok_s": run.generated_tokens / window,
        "total_output_tok_s_each_round": run.round_tok_s,
        "prefix_cache_hit_rate": run.cache_hits / run.cache_queries if run.cache_queries else 0.0,
        "engine_tenant_generation_tokens": run.tenant_tokens,
        "quiet_ttft_s": {
            "alone": [t.ttft for t in run.alone if t.ok],
            "with_noisy": [t.ttft for t in run.with_noisy if t.ok],
        },
    }


def build_report(
    runs: Sequence[PolicyRun], work: Workload, model: str, engine_args: Sequence[str]
) -> dict[str, Any]:
    """The JSON report: the workload, each policy's numbers, the summary and the targets."""
    policies = {run.policy: _policy_report(run) for run in runs}
    alone_run = policies.get("fair") or next(iter(policies.values()))
    summary: dict[str, Any] = {
        "quiet_ttft_ms": {"alone": alone_run["quiet_ttft_ms_alone"]}
        | {p: r["quiet_ttft_ms_with_noisy"] for p, r in policies.items()},
        "noisy_output_tok_s": {p: r["noisy_output_tok_s"] for p, r in policies.items()},
        "total_output_tok_s": {p: r["total_output_tok_s"] for p, r in policies.items()},
    }
    targets: dict[str, Any] = {}
    if "fair" in policies and "fcfs" in policies:
        alone = alone_run["quiet_ttft_ms_alone"]["p99"]
        fair, fcfs = policies["fair"], policies["fcfs"]
        fair_p99 = fair["quiet_ttft_ms_with_noisy"]["p99"]
        fcfs_p99 = fcfs["quiet_ttft_ms_with_noisy"]["p99"]
        ratios = {
            "fair_p99_over_alone_p99": fair_p99 / alone if alone else None,
            "fcfs_p99_over_fair_p99": fcfs_p99 / fair_p99 if fair_p99 else None,
            "fair_total_over_fcfs_total": fair["total_output_tok_s"] / fcfs["total_output_tok_s"]
            if fcfs["total_output_tok_s"]
            else None,
        }
        targets = {
            **ratios,
            "fair_p99_within_2x_alone": ratios["fair_p99_over_alone_p99"] is not None
            and ratios["fair_p99_over_alone_p99"] <= TARGET_FAIR_VS_ALONE,
            "fair_p99_3x_better_than_fcfs": ratios["fcfs_p99_over_fair_p99"] is not None
            and ratios["fcfs_p99_over_fair_p99"] >= TARGET_FCFS_VS_FAIR,
            "fair_total_at_least_0_95_fcfs": ratios["fair_total_over_fcfs_total"] is not None
            and ratios["fair_total_over_fcfs_total"] >= TARGET_THROUGHPUT,
        }
    return {
        "benchmark": "fairness",
        "model": model,
        "engine_args": list(engine_args),
        "policies_run": [run.policy for run in runs],
        "workload": asdict(work),
        "machine": {"platform": platform.platform(), "python": platform.python_version()},
        "policies": policies,
        "summary": summary,
        "targets": targets,
    }


def plot_report(report: dict[str, Any], prefix: str) -> list[str]:
    """``PREFIX_ttft.png`` (Q's TTFT CDFs: alone, with N per policy) and
    ``PREFIX_throughput.png`` (N's and total output tok/s per policy)."""
    from load.fairness_gateway_report import plot_throughput
    from load.report import plot_cdfs

    policies = report["policies"]
    first = policies.get("fair") or next(iter(policies.values()))
    series = {"Q alone": [s * 1000 for s in first["quiet_ttft_s"]["alone"]]}
    for name, r in policies.items():
        series[f"Q with N, {name}"] = [s * 1000 for s in r["quiet_ttft_s"]["with_noisy"]]
    ttft = plot_cdfs(series, f"{prefix}_ttft.png", "TTFT (ms)", "Quiet tenant's TTFT")
    return [str(ttft), plot_throughput(policies, prefix)]


def print_summary(report: dict[str, Any]) -> None:
    s = report["summary"]
    lines = ["Q's TTFT (ms)      p50      p99"]
    for name, p in s["quiet_ttft_ms"].items():
        label = "alone" if name == "alone" else f"with N, {name}"
        lines.append(f"  {label:<14}{p['p50']:>8.1f} {p['p99']:>8.1f}")
    for name in s["total_output_tok_s"]:
        lines.append(
            f"{name}: N {s['noisy_output_tok_s'][name]:.1f} tok/s, "
            f"total {s['total_output_tok_s'][name]:.1f} tok/s"
        )
    for key, value in report["targets"].items():
        lines.append(f"{key}: {value:.2f}" if isinstance(value, float) else f"{key}: {value}")
    print("\n".join(lines))


# --------------------------------------------------------------------------- main


async def _measure(urls: dict[str, str], work: Workload, progress: bool) -> list[PolicyRun]:
    """``work.rounds`` rounds, the policies in turn within each; one pooled run per policy."""
    limits = httpx.Limits(max_connections=work.noisy_concurrency + 8)
    pooled: dict[str, PolicyRun] = {}
    for number in range(work.rounds):
        for policy, url in urls.items():
            async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits) as client:
                run = await run_policy(client, policy, work, progress, number)
            _say(progress, f"{policy}: round {number + 1} done")
            if policy in pooled:
                pooled[policy].add(run)
            else:
                pooled[policy] = run
    return list(pooled.values())


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--through-gateway" in argv:  # the same two tenants through `portico serve`
        from load import fairness_gateway_bench

        return fairness_gateway_bench.main(argv)
    parser = argparse.ArgumentParser(prog="portico bench fairness", description=__doc__)
    parser.add_argument("--model", default="smollm2-135m", help="alias, HF folder or .gguf")
    parser.add_argument(
        "--engine-args", default="", help='extra engine flags, e.g. "--max-num-seqs 64"'
    )
    parser.add_argument(
        "--policies",
        default="fcfs,fair",
        help="comma-separated, run in order; POLICY:FLAGS adds engine flags to that one",
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes (the test's run)")
    d = Workload()
    parser.add_argument("--noisy-concurrency", type=int, default=d.noisy_concurrency)
    parser.add_argument("--noisy-prompt-len", type=int, default=d.noisy_prompt_len)
    parser.add_argument("--noisy-output-len", type=int, default=d.noisy_output_len)
    parser.add_argument("--quiet-prompt-len", type=int, default=d.quiet_prompt_len)
    parser.add_argument("--quiet-output-len", type=int, default=d.quiet_output_len)
    parser.add_argument("--quiet-requests", type=int, default=d.quiet_requests)
    parser.add_argument("--quiet-gap-s", type=float, default=d.quiet_gap_s)
    parser.add_argument("--warmup-requests", type=int, default=d.warmup_requests)
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--rounds", type=int, default=d.rounds, help="policies take turns")
    parser.add_argument("--out", default="load/results/fairness.json")
    parser.add_argument("--plot", default=None, help="PNG path prefix for the two plots")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)

    if args.quick:
        work = QUICK
    else:
        work = Workload(
            noisy_concurrency=args.noisy_concurrency,
            noisy_prompt_len=args.noisy_prompt_len,
            noisy_output_len=args.noisy_output_len,
            quiet_prompt_len=args.quiet_prompt_len,
            quiet_output_len=args.quiet_output_len,
            quiet_requests=args.quiet_requests,
            quiet_gap_s=args.quiet_gap_s,
            warmup_requests=args.warmup_requests,
            seed=args.seed,
            rounds=args.rounds,
        )
    import torch

    from engine.memory_plan import gpu_share_flags

    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    # The policies' engines run side by side: on CUDA each takes its share of the card.
    engine_args = gpu_share_flags(
        shlex.split(args.engine_args), len(policies), torch.cuda.is_available()
    )
    progress = not args.no_progress
    with tempfile.TemporaryDirectory(prefix="fairness-bench-") as tmp:
        with contextlib.ExitStack() as engines:
            urls = {}
            for policy in policies:
                urls[policy] = engines.enter_context(
                    engine_process(args.model, policy, engine_args, Path(tmp))
                )
                _say(progress, f"{policy}: engine ready at {urls[policy]}")
            runs = asyncio.run(_measure(urls, work, progress))
    report = build_report(runs, work, args.model, engine_args)
    if args.plot:
        report["plots"] = plot_report(report, args.plot)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print_summary(report)
    failed = sum(r["quiet_failed"] for r in report["policies"].values())
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
