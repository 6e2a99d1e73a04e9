"""The through-gateway fairness bench's printed summary and plots
(load/fairness_gateway_bench.py builds the report)."""

from __future__ import annotations

from typing import Any

from load.ttft_breakdown import PARTS


def plot_report(report: dict[str, Any], prefix: str) -> list[str]:
    """``PREFIX_ttft.png`` (Q's TTFT CDFs alone and with N per policy) and
    ``PREFIX_throughput.png`` (N's and total output tok/s per policy)."""
    from load.report import plot_cdfs

    pools = report["policies"]
    series = {}
    for name, r in pools.items():
        series[f"Q alone ({name} engine)"] = [s * 1000 for s in r["quiet_ttft_s"]["alone"]]
        series[f"Q with N, {name}"] = [s * 1000 for s in r["quiet_ttft_s"]["with_noisy"]]
    title = "Quiet tenant's TTFT through the gateway"
    ttft = plot_cdfs(series, f"{prefix}_ttft.png", "TTFT (ms)", title)
    return [str(ttft), plot_throughput(pools, prefix)]


def plot_throughput(policies: dict[str, Any], prefix: str) -> str:
    """``PREFIX_throughput.png``: N's and the total output tok/s of each policy's run (this
    bench's plot and the engine-only fairness bench's)."""
    from load.report import plot_bars

    bars = {}
    for name, r in policies.items():
        bars[f"N {name}"] = r["noisy_output_tok_s"]
        bars[f"total {name}"] = r["total_output_tok_s"]
    rate = plot_bars(bars, f"{prefix}_throughput.png", "output tok/s", "Output tokens per second")
    return str(rate)


def print_summary(report: dict[str, Any]) -> None:
    lines = ["Q's TTFT (ms)         p50      p90   | step ms  total tok/s  N tok/s  preempt"]
    for name, r in report["policies"].items():
        alone, with_n = r["quiet_ttft_ms_alone"], r["quiet_ttft_ms_with_noisy"]
        lines.append(f"  alone ({name:<5})  {alone['p50']:>8.1f} {alone['p90']:>8.1f}")
        step = r["mean_step_ms"] or 0.0
        lines.append(
            f"  with N, {name:<5} {with_n['p50']:>8.1f} {with_n['p90']:>8.1f}   | {step:>7.1f}"
            f"  {r['total_output_tok_s']:>11.1f}  {r['noisy_output_tok_s']:>7.1f}"
            f"  {r['preemptions']:>7.0f}"
        )
    lines.append(_breakdown_lines(report))
    for key, value in report["targets"].items():
        lines.append(f"{key}: {value:.2f}" if isinstance(value, float) else f"{key}: {value}")
    lines.append(f"load average at the end: {' '.join(report['loadavg'])}")
    print("\n".join(lines))


def _breakdown_lines(report: dict[str, Any]) -> str:
    """Q's TTFT in parts (medians, ms; steps as counts) per policy and phase."""
    head = "Q's TTFT in parts, median ms: " + " ".join(PARTS)
    head += " | step in flight ms | steps queued, to 1st token"
    lines = [head]
    for name, r in report["policies"].items():
        for phase, summary in r["quiet_ttft_breakdown_ms"].items():
            m = summary["median"]
            if not m:
                lines.append(f"  {name:<5} {phase:<10} (no traces)")
                continue
            parts = " ".join(f"{m[p]:>8.1f}" for p in PARTS)
            steps = f"{m['steps_to_schedule']:.0f}, {m['steps_to_first_token']:.0f}"
            lines.append(f"  {name:<5} {phase:<10} {parts} | {m['inflight_step']:.1f} | {steps}")
    return "\n".join(lines)
