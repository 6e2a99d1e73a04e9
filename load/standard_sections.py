"""The standard report's per-section renderers (:mod:`load.standard_report` puts them
together): each turns one section's ``result`` into markdown lines, tables first, and says
"not measured" for a number that is absent, never filling one in."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from load.report import markdown_table

TARGET_ENGINE_SPEEDUP = 3.0
TARGET_PREFIX_RATIO = 3.0
TARGET_SINGLE_STREAM = 50.0
TARGET_STRUCTURED_RATIO = 0.90


def flatten(value: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """Every scalar leaf of ``value`` with its dotted path (``a.b[0].c``)."""
    if isinstance(value, Mapping):
        for key, item in value.items():
            yield from flatten(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, list) and value and all(isinstance(v, Mapping) for v in value):
        for i, item in enumerate(value):
            yield from flatten(item, f"{path}[{i}]")
    elif isinstance(value, (int, float, str, bool)) or value is None:
        yield path, value


def _ms(d: Mapping[str, Any] | None, key: str) -> Any:
    return "" if not d else d.get(key, "")


def _engine_offline(result: Mapping[str, Any]) -> list[str]:
    if "portico" in result:
        w = result.get("workload", {})
        rows = [
            {
                "system": name,
                "elapsed s": r.get("elapsed_s", ""),
                "output tok/s": r.get("output_tokens_per_s", ""),
                "total tok/s": r.get("total_tokens_per_s", ""),
            }
            for name, r in (
                ("portico engine (continuous batching, paged KV)", result["portico"]),
                ("transformers generate, static batches", result.get("transformers", {})),
            )
        ]
        single = result.get("single_stream", {})
        return [
            f"Workload: {w.get('num_requests')} requests, prompts {w.get('prompt_len')} "
            f"tokens, outputs {w.get('output_len')} tokens (EOS ignored; "
            f"{w.get('num_output_tokens')} output tokens in all), seed {w.get('seed')}; "
            f"{result.get('device')} {result.get('dtype')}, {result.get('threads')} torch "
            f"threads, engine {result.get('engine_config')}.",
            markdown_table(rows, ["system", "elapsed s", "output tok/s", "total tok/s"]),
            f"Speedup (output tokens/s): **{result['speedup']}x**."
            if "speedup" in result
            else "transformers was not run (no speedup).",
            f"Single stream: {single.get('decode_tokens_per_s')} tokens/s decode, TTFT "
            f"{single.get('ttft_s')} s."
            if single
            else "",
        ]
    runs = result.get("runs")
    if isinstance(runs, list) and runs and all(isinstance(r, Mapping) for r in runs):
        columns = [k for k in runs[0] if not isinstance(runs[0][k], (Mapping, list))]
        return [markdown_table(runs, columns)]
    rows = [{"field": p, "value": v} for p, v in flatten(result)][:80]
    return [markdown_table(rows, ["field", "value"])]


def _engine_served(result: Mapping[str, Any]) -> list[str]:
    w = result.get("workload", {})
    rows = [
        {
            "concurrency": r["concurrency"],
            "requests": r["completed"],
            "failed": r["failed"],
            "output tok/s": r["output_throughput"],
            "req/s": r["request_throughput"],
            "TTFT p50 ms": r["ttft_ms"]["median"],
            "TTFT p99 ms": r["ttft_ms"]["p99"],
            "TPOT p50 ms": r["tpot_ms"]["median"],
            "TPOT p99 ms": r["tpot_ms"]["p99"],
            "E2E p50 ms": r["e2e_ms"]["median"],
        }
        for r in result.get("runs", [])
    ]
    return [
        f"Workload: synthetic token-id prompts of {w.get('prompt_len')} tokens, outputs of "
        f"{w.get('output_len')} tokens (`ignore_eos`), seed {w.get('seed')}; each "
        "concurrency replays the first N requests of the same list.",
        markdown_table(rows, list(rows[0]) if rows else ["concurrency"]),
    ]


def _prefix(result: Mapping[str, Any]) -> list[str]:
    w = result.get("workload", {})
    rows = []
    for label in ("on", "off"):
        s = result.get(label)
        if s:
            rows.append(
                {
                    "prefix caching": label,
                    "requests": s["completed"],
                    "TTFT p50 ms": s["ttft_ms"]["median"],
                    "TTFT p90 ms": s["ttft_ms"]["p90"],
                    "TTFT p99 ms": s["ttft_ms"]["p99"],
                    "E2E p50 ms": s["e2e_ms"]["median"],
                    "TTFT p50 ms, repeats only": s.get("ttft_ms_repeats", {}).get("median", ""),
                }
            )
    ratio = result.get("ttft_p50_ratio")
    return [
        f"Workload: {w.get('groups')} groups x {w.get('requests_per_group')} requests sharing "
        f"a {w.get('prefix_len')}-token prefix (+{w.get('suffix_len')} own tokens, "
        f"{w.get('output_len')} output tokens), interleaved, concurrency "
        f"{w.get('concurrency')}.",
        markdown_table(
            rows,
            [
                "prefix caching",
                "requests",
                "TTFT p50 ms",
                "TTFT p90 ms",
                "TTFT p99 ms",
                "E2E p50 ms",
                "TTFT p50 ms, repeats only",
            ],
        ),
        '"Repeats only" leaves out the first request of each group (nothing to hit yet).',
        f"TTFT p50 off / on: **{ratio:.2f}x**" if ratio else "TTFT p50 ratio: not measured",
    ]


def _gateway(result: Mapping[str, Any]) -> list[str]:
    cfg = result.get("config", {})
    direct_cpus = cfg.get("direct_upstream_cpus", cfg.get("client_cpus"))
    behind_cpus = cfg.get("engine_and_redis_cpus", cfg.get("client_cpus"))
    warmup = cfg.get("warmup_s")
    parts = [
        f"Setup: gateway pinned to CPU {cfg.get('gateway_cpus')}; load generator on CPU "
        f"{cfg.get('client_cpus')}; the gateway's fake engines and redis-server on CPU "
        f"{behind_cpus}; the direct fake upstream on CPU {direct_cpus} (idle gateway core "
        f"while direct runs, so both paths cross cores once); {cfg.get('tenants')} "
        f"tenants x {cfg.get('keys_per_tenant')} keys, models {cfg.get('models')}, chat and "
        f"completions, streaming and not, in a shuffled mix; auth: {cfg.get('auth')}; "
        f"limits: {cfg.get('limits')}. Open loop (fixed send times), "
        f"{cfg.get('rounds')} alternating rounds of {cfg.get('duration_s')} s per side"
        + (f", each after {warmup} s of the same load that is not counted" if warmup else "")
        + ". Streams are timed to their first chunk, the others to the whole answer."
    ]
    for run in result.get("fixed_rate", []):
        parts += _gateway_fixed_rate(run)
    sat = result.get("saturation", {})
    if sat:
        parts += _gateway_saturation(sat, cfg)
    limits = result.get("rate_limits")
    if limits:
        parts += _gateway_rate_limits(limits)
    return parts


def _gateway_fixed_rate(run: Mapping[str, Any]) -> list[str]:
    """One fixed-rate run: each side's percentiles, failures, the overhead, the gateway's own
    reported overhead."""
    parts: list[str] = []
    rows = []
    for side in ("direct", "gateway", "gateway_limits_off"):
        if side not in run:
            continue
        for label in ("json", "stream"):
            d = run[side][label]
            rows.append(
                {
                    "side": side,
                    "requests": label,
                    "count": int(d["count"]),
                    "p50 ms": d["median"],
                    "p90 ms": d["p90"],
                    "p99 ms": d["p99"],
                    "errors": run[side]["errors"],
                    "gateway CPU ms/req (side)": run[side].get("cpu_ms_per_request", ""),
                }
            )
    parts.append(
        f"**At {run['rate']:g} requests/s** ({run['requests_per_side']} requests per side):"
    )
    parts.append(
        markdown_table(
            rows,
            [
                "side",
                "requests",
                "count",
                "p50 ms",
                "p90 ms",
                "p99 ms",
                "errors",
                "gateway CPU ms/req (side)",
            ],
        )
    )
    failed = [
        f"{side}: {run[side]['errors']} failed ({', '.join(run[side]['error_examples'])})"
        for side in ("direct", "gateway", "gateway_limits_off")
        if side in run and run[side].get("errors")
    ]
    if failed:
        parts.append("Failed requests (not in the percentiles): " + "; ".join(failed) + ".")
    added = [
        {
            "what": f"gateway - direct ({label})",
            "p50 ms": o["median_ms"],
            "p90 ms": o["p90_ms"],
            "p99 ms": o["p99_ms"],
        }
        for label, o in run["overhead"].items()
    ]
    added += [
        {
            "what": f"limits on - limits off ({label})",
            "p50 ms": o["median_ms"],
            "p90 ms": o["p90_ms"],
            "p99 ms": o["p99_ms"],
        }
        for label, o in run.get("limits_cost", {}).items()
    ]
    parts.append(markdown_table(added, ["what", "p50 ms", "p90 ms", "p99 ms"]))
    rep = run.get("gateway_reported_overhead_ms", {})
    parts.append(
        f"The gateway's own `x-portico-overhead-ms` (its time minus upstream time, "
        f"queueing included): p50 {_ms(rep, 'median'):.2f} ms, p99 "
        f"{_ms(rep, 'p99'):.2f} ms."
        if rep
        else ""
    )
    return parts


def _gateway_saturation(sat: Mapping[str, Any], cfg: Mapping[str, Any]) -> list[str]:
    """wrk's closed loop against the upstream and the gateway, and the generator's ceiling."""
    parts: list[str] = []
    rows = []
    for key in ("direct_json", "direct_stream", "gateway_json", "gateway_stream"):
        d = sat.get(key, {})
        if "error" in d:
            rows.append({"run": key, "req/s (2xx)": f"failed: {d['error'][:80]}"})
            continue
        rows.append(
            {
                "run": key,
                "req/s (2xx)": d.get("requests_per_s", ""),
                "p50 ms": d.get("p50_ms", ""),
                "p99 ms": d.get("p99_ms", ""),
                "non-2xx": d.get("non2xx", ""),
                "gateway CPU ms/req": d.get("cpu_ms_per_request", ""),
                "gateway core share": d.get("core_share", ""),
                "req per gateway CPU-second": d.get("requests_per_cpu_second", ""),
            }
        )
    parts.append(
        f"**Saturation** ({sat.get('tool')}, one thread, "
        f"{cfg.get('wrk_connections')} connections, {sat.get('duration_s')} s each; "
        '"core share" is the fraction of one core the gateway process got, '
        '"req per gateway CPU-second" what one whole core would serve at that '
        "cost):"
    )
    parts.append(
        markdown_table(
            rows,
            [
                "run",
                "req/s (2xx)",
                "p50 ms",
                "p99 ms",
                "non-2xx",
                "gateway CPU ms/req",
                "gateway core share",
                "req per gateway CPU-second",
            ],
        )
    )
    ceiling = sat.get("python_generator_ceiling_rps")
    if ceiling:
        parts.append(
            f"The Python load generator's own ceiling (closed loop, 32 connections, "
            f"against the fake upstream directly): {ceiling:.0f} requests/s."
        )
    return parts


def _gateway_rate_limits(limits: Mapping[str, Any]) -> list[str]:
    """Each hammered tenant's admitted count against the token bucket's bounds."""
    parts: list[str] = []
    rows = [
        {
            "tenant limit (req/min)": c["requests_per_minute"],
            "sent": c["sent"],
            "admitted": c["admitted"],
            "429": c["limited_429"],
            "other": c["other"],
            "elapsed s": c["elapsed_s"],
            "expected admitted": f"{c['expected_min']}..{c['expected_max']:.1f}",
            "in bounds": "yes" if c["ok"] else "NO",
        }
        for c in limits["tenants"]
    ]
    parts.append(
        f"**Rate limits under load**: each limited tenant was hammered (4 in "
        f"flight) while the bench tenants sent {limits['background_rate']:g} req/s "
        f"({limits['background_requests']} requests, "
        f"{limits['background_errors']} errors). A token bucket full at the start "
        "and refilled at limit/60 per second admits between min(sent, limit) and "
        "limit + limit/60 x elapsed."
    )
    parts.append(markdown_table(rows, list(rows[0]) if rows else ["tenant"]))
    return parts


def _admission(result: Mapping[str, Any]) -> list[str]:
    seq = result.get("sequential", {})
    conc = result.get("concurrent", {})
    local = result.get("local_limiter_sequential", {})
    rows = [
        {
            "measure": "admit, one at a time (Redis Lua, all limits on)",
            "p50 us": _ms(seq.get("admit"), "p50_us"),
            "p99 us": _ms(seq.get("admit"), "p99_us"),
            "mean us": _ms(seq.get("admit"), "mean_us"),
        },
        {
            "measure": "settle + release, one at a time",
            "p50 us": _ms(seq.get("settle_and_release"), "p50_us"),
            "p99 us": _ms(seq.get("settle_and_release"), "p99_us"),
            "mean us": _ms(seq.get("settle_and_release"), "mean_us"),
        },
        {
            "measure": f"admit at concurrency {conc.get('concurrency')}",
            "p50 us": _ms(conc.get("admit_latency"), "p50_us"),
            "p99 us": _ms(conc.get("admit_latency"), "p99_us"),
            "mean us": _ms(conc.get("admit_latency"), "mean_us"),
        },
        {
            "measure": "admit with the in-process limiter (Redis-down `local` policy)",
            "p50 us": _ms(local.get("admit"), "p50_us"),
            "p99 us": _ms(local.get("admit"), "p99_us"),
            "mean us": _ms(local.get("admit"), "mean_us"),
        },
    ]
    rps = conc.get("requests_per_second")
    return [
        markdown_table(rows, ["measure", "p50 us", "p99 us", "mean us"]),
        f"Admissions per second at concurrency {conc.get('concurrency')}: "
        f"{rps:.0f}; the script's own time inside Redis: "
        f"{result.get('redis_evalsha_usec_per_call')} us per call (Redis "
        f"{result.get('redis_version')})."
        if rps
        else "",
        "Limits off vs on end to end (the same gateway, a plan without limits) is in the "
        "gateway section's table (`gateway_limits_off`).",
    ]


def _structured(result: Mapping[str, Any]) -> list[str]:
    rows = []
    for mode, runs in result.get("rounds", {}).items():
        for i, run in enumerate(runs):
            rows.append(
                {
                    "mode": mode,
                    "round": i + 1,
                    "output tokens": run["output_tokens"],
                    "seconds": f"{run['seconds']:.1f}",
                    "tokens/s": f"{run['tokens_per_s']:.1f}",
                    "valid JSON": run["valid_json"],
                    "finished stop": run["finished_stop"],
                }
            )
    compile_rows = [
        {
            "schema": name,
            "cold compile ms": f"{c['compile_only_ms']:.1f}",
            "cached ms": f"{c['cached_ms']:.3f}",
            "vocabulary table ms (once per engine)": f"{c['tokenizer_setup_ms']:.0f}",
        }
        for name, c in result.get("compile", {}).items()
    ]
    parts = [
        markdown_table(rows, list(rows[0]) if rows else ["mode"]),
        f"Ratio of the best rounds: {result.get('ratio', 0):.1%} "
        f"(target {TARGET_STRUCTURED_RATIO:.0%}).",
        markdown_table(compile_rows, list(compile_rows[0]) if compile_rows else ["schema"]),
    ]
    libs = result.get("libraries")
    if libs:
        lib_rows = [
            {
                "library": name,
                "vocabulary setup ms": f"{v['tokenizer_setup_ms']:.0f}",
                "compile ms": f"{v['compile_ms']:.1f}",
                "mask us/token mean": f"{v['mask_us_mean']:.1f}",
                "mask us/token max": f"{v['mask_us_max']:.0f}",
            }
            for name, v in libs.items()
            if name != "document_tokens"
        ]
        parts.append(markdown_table(lib_rows, list(lib_rows[0])))
    return parts


RENDERERS = {
    "engine_offline": _engine_offline,
    "engine_served": _engine_served,
    "prefix_caching": _prefix,
    "gateway": _gateway,
    "admission": _admission,
    "structured": _structured,
}
