"""docs/benchmarks.md from the results of ``python -m load.standard`` (a JSON-ready dict).

:func:`render_report` never measures anything: it turns the ``results`` dict (``machine``,
``started``, ``mode`` and ``sections``, each section with ``status``, ``command``, ``result`` or
``error``) into markdown: the targets with met / not met first, then one part per section with
the command that reproduces it, its tables and its plots. A section that failed or was skipped
says so and why; a number that was not measured is never filled in.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from load.report import markdown_table

TITLES = {
    "engine_offline": "Engine vs transformers static batching (offline)",
    "engine_served": "Engine served: `portico engine`, smollm2-135m, `--dtype bfloat16` (tuned)",
    "prefix_caching": "Prefix caching on vs off",
    "gateway": "Gateway vs calling the upstream directly",
    "admission": "Admission cost (Redis token buckets)",
    "structured": "Structured outputs: JSON schema on every request vs unconstrained",
}
TARGET_ENGINE_SPEEDUP = 3.0
TARGET_PREFIX_RATIO = 3.0
TARGET_SINGLE_STREAM = 50.0
TARGET_STRUCTURED_RATIO = 0.90


HOW = """## How these numbers are taken

- `make bench` runs `python -m load.standard` (full sizes); `python -m load.standard --quick`
  runs every section small (15-25 minutes on 2 shared cores); `--only SECTION...` reruns some
  sections and keeps the others' last results. Each section is also a command of its own
  (`portico bench serve|gateway|admission|engine`), given above each table.
- **Served engine and prefix caching**: `load/serve_bench.py` streams `/v1/completions` with
  token-id prompts and `ignore_eos`, so prompt and output lengths are exact; TTFT is the time
  to the first token, TPOT the time per output token after it. Two warm-up requests run first.
- **Gateway**: `load/gateway_bench.py`. "Direct" is the same fake upstream
  (`load/fake_upstream.py`, ~28k req/s on a core) on loopback TCP; the gateway reaches its fake
  engines over Unix sockets, supervised like real engines. The fixed-rate load is open loop
  (each request leaves at its scheduled time whatever the earlier ones do, so a slow answer
  cannot hide queueing); direct and gateway alternate in rounds so both see the same machine,
  each run after a short uncounted warm-up (a VM core idle for seconds runs its first
  milliseconds several times slower), and the generator and fake upstreams freeze their heaps
  so their garbage collector never stalls a measurement.
  Added latency = gateway percentile minus direct percentile at the same rate. Saturation uses
  `wrk` (closed loop) with a Lua script cycling through the same requests and keys. The
  gateway's CPU time comes from `/proc/<pid>/stat`.
- Nothing is extrapolated: a section that failed shows its error and no numbers."""


def _flatten(value: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(value, Mapping):
        for key, item in value.items():
            yield from _flatten(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, list) and value and all(isinstance(v, Mapping) for v in value):
        for i, item in enumerate(value):
            yield from _flatten(item, f"{path}[{i}]")
    elif isinstance(value, (int, float, str, bool)) or value is None:
        yield path, value


def engine_speedup(result: Mapping[str, Any]) -> tuple[float | None, str]:
    """The engine's output-tokens/s speedup over static batching at concurrency 64, as
    engine_bench reported it (a field named ``*speedup*``; one that names 64 preferred)."""
    found = [
        (p, v)
        for p, v in _flatten(result)
        if "speedup" in p.lower() and isinstance(v, (int, float)) and not isinstance(v, bool)
    ]
    if not found:
        return None, "engine_bench reported no speedup field"
    best = next(((p, v) for p, v in found if "64" in p), found[0])
    return float(best[1]), best[0]


def _verdict(met: bool | None) -> str:
    return {True: "**met**", False: "**not met**", None: "not measured"}[met]


def targets(sections: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Every target of the issue with its measured number and verdict."""
    rows: list[dict[str, Any]] = []

    def missing(name: str) -> str:
        sec = sections.get(name)
        if sec is None:
            return "section not run"
        first_line = (sec.get("error") or "").strip().split("\n")[0]
        return f"{sec['status']}: {first_line}"[:160]

    sec = sections.get("engine_offline", {})
    target = f"engine >= {TARGET_ENGINE_SPEEDUP:g}x transformers static batching, output tokens/s"
    target += " at concurrency 64 (`load.engine_bench --dtype bfloat16`, CPU)"
    if sec.get("status") == "ok":
        speedup, where = engine_speedup(sec["result"])
        rows.append(
            {
                "target": target,
                "measured": f"{speedup:.2f}x (`{where}`)" if speedup is not None else where,
                "verdict": _verdict(None if speedup is None else speedup >= TARGET_ENGINE_SPEEDUP),
            }
        )
    else:
        rows.append(
            {"target": target, "measured": missing("engine_offline"), "verdict": _verdict(None)}
        )
    target = f"single-stream decode >= {TARGET_SINGLE_STREAM:g} tokens/s (in process, "
    target += "`load.engine_bench --dtype bfloat16`, CPU)"
    single = (
        sec.get("result", {}).get("single_stream", {}).get("decode_tokens_per_s")
        if sec.get("status") == "ok"
        else None
    )
    rows.append(
        {
            "target": target,
            "measured": f"{single} tok/s" if single is not None else missing("engine_offline"),
            "verdict": _verdict(None if single is None else single >= TARGET_SINGLE_STREAM),
        }
    )

    sec = sections.get("prefix_caching", {})
    target = (
        f"prefix caching cuts TTFT p50 >= {TARGET_PREFIX_RATIO:g}x on the shared-prefix workload"
    )
    ratio = sec.get("result", {}).get("ttft_p50_ratio") if sec.get("status") == "ok" else None
    rows.append(
        {
            "target": target,
            "measured": f"{ratio:.2f}x" if ratio is not None else missing("prefix_caching"),
            "verdict": _verdict(None if ratio is None else ratio >= TARGET_PREFIX_RATIO),
        }
    )

    sec = sections.get("structured", {})
    target = (
        f"JSON schema on every request >= {TARGET_STRUCTURED_RATIO:.0%} of unconstrained output "
        "tokens/s at concurrency 16"
    )
    ratio = sec.get("result", {}).get("ratio") if sec.get("status") == "ok" else None
    rows.append(
        {
            "target": target,
            "measured": f"{ratio:.1%}" if ratio is not None else missing("structured"),
            "verdict": _verdict(None if ratio is None else ratio >= TARGET_STRUCTURED_RATIO),
        }
    )

    sec = sections.get("gateway", {})
    if sec.get("status") == "ok" and sec["result"].get("verdicts"):
        for v in sec["result"]["verdicts"]:
            rows.append(
                {
                    "target": v["target"],
                    "measured": v["measured"],
                    "verdict": _verdict(bool(v["met"])),
                }
            )
    else:
        rows.append(
            {
                "target": "gateway adds <= 1 ms p50, <= 5 ms p99 at 200 req/s; >= 1500 "
                "req/s on one core (auth and limits on)",
                "measured": missing("gateway"),
                "verdict": _verdict(None),
            }
        )
    return rows


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
    rows = [{"field": p, "value": v} for p, v in _flatten(result)][:80]
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
    sat = result.get("saturation", {})
    if sat:
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
    limits = result.get("rate_limits")
    if limits:
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


def _plots(result: Mapping[str, Any], report_dir: Path) -> list[str]:
    out = []
    for plot in result.get("plots", []):
        rel = os.path.relpath(plot, report_dir) if os.path.isabs(plot) else plot
        out.append(f"![{Path(plot).stem}]({rel})")
    return out


def render_section(name: str, sec: Mapping[str, Any], report_dir: Path) -> str:
    parts = [
        f"## {TITLES.get(name, name)}",
        "Reproduce:\n\n```sh\n" + sec.get("command", "") + "\n```",
    ]
    load = sec.get("load_average", ["?", "?"])
    parts.append(
        f"Run: {sec.get('mode', '?')} mode at commit `{sec.get('commit', '?')}`, "
        f"finished {sec.get('finished', '?')}, "
        f"{sec.get('seconds', '?')} s; 1-minute load average {load[0]} before, "
        f"{load[1]} after."
    )
    status = sec.get("status")
    if status == "ok":
        try:
            parts += [p for p in RENDERERS[name](sec["result"]) if p]
        except (KeyError, TypeError, ValueError) as exc:
            parts.append(
                f"The results could not be rendered ({type(exc).__name__}: {exc}); "
                "they are in docs/bench/results.json."
            )
        parts += _plots(sec["result"], report_dir)
    elif status == "skipped":
        parts.append(f"**Skipped**: {sec.get('error', '')}")
    else:
        parts.append(
            f"**This section failed**; no numbers were measured.\n\n```\n"
            f"{sec.get('error', '')}\n```"
        )
    return "\n\n".join(parts)


# Everything after this line in docs/benchmarks.md is written by hand (each section names the
# command that measured it); a new ``make bench`` report replaces only what comes before it.
HAND_WRITTEN_MARKER = (
    "<!-- The sections below are written by hand, each with the command that measured it; "
    "`make bench` rewrites only what is above this line. -->"
)


def keep_hand_written(generated: str, existing: str | None) -> str:
    """``generated`` (a :func:`render_report`), then the hand-written part of the ``existing``
    report: what follows :data:`HAND_WRITTEN_MARKER` (the marker included), so that rerunning
    ``make bench`` does not erase the measurements other benchmarks wrote into the page."""
    if existing is None or HAND_WRITTEN_MARKER not in existing:
        return generated
    kept = existing[existing.index(HAND_WRITTEN_MARKER) :]
    return generated.rstrip("\n") + "\n\n" + kept


def render_report(results: Mapping[str, Any], report_dir: Path = Path("docs")) -> str:
    """The whole of docs/benchmarks.md."""
    m = results.get("machine", {})
    sections = results.get("sections", {})
    quick = " --quick" if results.get("mode") == "quick" else ""
    head = [
        "# Benchmarks",
        f"Generated by `python -m load.standard{quick}` (last run started "
        f"{results.get('started')}; each section names its commit) on {m.get('cpu')} "
        f"({m.get('cpu_count')} CPUs), Python {m.get('python')}, torch {m.get('torch')}, "
        f"{m.get('platform')}. Raw results: `docs/bench/results.json`.",
        "This machine has no GPU. Each section gives the 1-minute load average before and "
        "after it: where it is above the CPU count, other work was waiting for a core and "
        "that section's latency and throughput are lower and noisier than on a quiet machine "
        "(the gateway's CPU time per request is the steadier number). Every number below was "
        "measured; nothing is estimated unless it says so.",
        "## Targets",
        markdown_table(targets(sections), ["target", "measured", "verdict"]),
    ]
    body = [render_section(name, sections[name], report_dir) for name in TITLES if name in sections]
    return "\n\n".join(head + body + [HOW]) + "\n"
