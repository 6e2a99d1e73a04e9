"""docs/benchmarks.md from the results of ``python -m load.standard`` (a JSON-ready dict).

:func:`render_report` never measures anything: it turns the ``results`` dict (``machine``,
``started``, ``mode`` and ``sections``, each section with ``status``, ``command``, ``result`` or
``error``) into markdown: the targets with met / not met first, then one part per section with
the command that reproduces it, its tables and its plots. A section that failed or was skipped
says so and why; a number that was not measured is never filled in.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from load.report import markdown_table
from load.standard_sections import (
    RENDERERS,
    TARGET_ENGINE_SPEEDUP,
    TARGET_PREFIX_RATIO,
    TARGET_SINGLE_STREAM,
    TARGET_STRUCTURED_RATIO,
    flatten,
)

TITLES = {
    "engine_offline": "Engine vs transformers static batching (offline)",
    "engine_served": "Engine served: `portico engine`, smollm2-135m, `--dtype bfloat16` (tuned)",
    "prefix_caching": "Prefix caching on vs off",
    "gateway": "Gateway vs calling the upstream directly",
    "admission": "Admission cost (Redis token buckets)",
    "structured": "Structured outputs: JSON schema on every request vs unconstrained",
}


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


def engine_speedup(result: Mapping[str, Any]) -> tuple[float | None, str]:
    """The engine's output-tokens/s speedup over static batching at concurrency 64, as
    engine_bench reported it (a field named ``*speedup*``; one that names 64 preferred)."""
    found = [
        (p, v)
        for p, v in flatten(result)
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
    rows = _engine_targets(sections)

    sec = sections.get("prefix_caching", {})
    target = (
        f"prefix caching cuts TTFT p50 >= {TARGET_PREFIX_RATIO:g}x on the shared-prefix workload"
    )
    ratio = sec.get("result", {}).get("ttft_p50_ratio") if sec.get("status") == "ok" else None
    rows.append(
        {
            "target": target,
            "measured": f"{ratio:.2f}x"
            if ratio is not None
            else _missing(sections, "prefix_caching"),
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
            "measured": f"{ratio:.1%}" if ratio is not None else _missing(sections, "structured"),
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
                "measured": _missing(sections, "gateway"),
                "verdict": _verdict(None),
            }
        )
    return rows


def _missing(sections: Mapping[str, Any], name: str) -> str:
    """Why a section has no number: not run, or its status and first error line."""
    sec = sections.get(name)
    if sec is None:
        return "section not run"
    first_line = (sec.get("error") or "").strip().split("\n")[0]
    return f"{sec['status']}: {first_line}"[:160]


def _engine_targets(sections: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The engine's throughput against transformers and its single-stream decode."""
    rows: list[dict[str, Any]] = []
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
            {
                "target": target,
                "measured": _missing(sections, "engine_offline"),
                "verdict": _verdict(None),
            }
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
            "measured": f"{single} tok/s"
            if single is not None
            else _missing(sections, "engine_offline"),
            "verdict": _verdict(None if single is None else single >= TARGET_SINGLE_STREAM),
        }
    )
    return rows


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
