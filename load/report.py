"""Plots and markdown tables for benchmark results (matplotlib, Agg backend)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from load.serve_bench import RequestResult


def _pyplot():  # type: ignore[no-untyped-def]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt: Any, fig: Any, path: str | Path) -> Path:
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _step_cdf(ax: Any, values: Sequence[float], label: str) -> None:
    """An empirical CDF as a step line; nothing for an empty list."""
    ordered = sorted(values)
    if ordered:
        ys = [(i + 1) / len(ordered) for i in range(len(ordered))]
        ax.step(ordered, ys, where="post", label=label)


def plot_latency_cdfs(runs: Mapping[str, Sequence[RequestResult]], path: str | Path) -> Path:
    """One panel per latency (TTFT, TPOT, end-to-end), one CDF line per run."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    metrics = (("TTFT", lambda r: r.ttft), ("TPOT", lambda r: r.tpot), ("E2E", lambda r: r.latency))
    for ax, (title, get) in zip(axes, metrics, strict=True):
        for label, results in runs.items():
            _step_cdf(ax, [get(r) * 1000 for r in results if r.ok], label)
        ax.set_title(f"{title} CDF")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    return _save(plt, fig, path)


def plot_throughput_vs_rate(
    series: Mapping[str, Sequence[tuple[float, float]]], path: str | Path, ylabel: str
) -> Path:
    """Achieved throughput against offered request rate, one line per configuration."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, points in series.items():
        xs, ys = zip(*sorted(points), strict=True) if points else ((), ())
        ax.plot(xs, ys, marker="o", label=label)
    ax.set_xlabel("offered request rate (req/s)")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(plt, fig, path)


def markdown_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str]) -> str:
    """A GitHub markdown table; floats get 1-2 decimals."""

    def cell(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.2f}" if abs(value) < 100 else f"{value:.1f}"
        return str(value)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(cell(row.get(c, "")) for c in columns) + " |")
    return "\n".join(lines)


def plot_cdfs(
    series: Mapping[str, Sequence[float]], path: str | Path, xlabel: str, title: str
) -> Path:
    """One CDF line per named list of values (e.g. latencies in ms)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, values in series.items():
        _step_cdf(ax, values, label)
    ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("fraction of requests")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(plt, fig, path)


def plot_bars(values: Mapping[str, float], path: str | Path, ylabel: str, title: str) -> Path:
    """One bar per named number, the number written on top."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(5, 1.3 * len(values)), 4))
    labels = list(values)
    bars = ax.bar(labels, [values[k] for k in labels], color="#4c72b0")
    for bar, label in zip(bars, labels, strict=True):
        ax.annotate(
            f"{values[label]:.0f}",
            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.tick_params(axis="x", labelsize=8, rotation=20)
    ax.grid(alpha=0.3, axis="y")
    return _save(plt, fig, path)
