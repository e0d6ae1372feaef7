"""PNG plots of bench results (matplotlib, headless)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _cdf(ax: Any, values: Iterable[float], label: str) -> None:
    v = sorted(values)
    if v:
        ax.step(v, [(i + 1) / len(v) for i in range(len(v))], where="post", label=label)


def _save(plt: Any, fig: Any, out: Path) -> Path:
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def latency_cdfs(series: dict[str, dict[str, Any]], out: Path, title: str) -> Path:
    """One panel per metric (TTFT, TPOT, E2E), one curve per system."""
    plt = _plt()
    metrics = [("ttft_s", "TTFT (ms)"), ("tpot_s", "TPOT (ms)"), ("e2e_s", "end-to-end (ms)")]
    fig, axes = plt.subplots(1, len(metrics), figsize=(5 * len(metrics), 3.8))
    for ax, (key, label) in zip(axes, metrics):
        for name, summary in series.items():
            _cdf(ax, (r[key] * 1000 for r in summary.get("results", []) if r["ok"]), name)
        ax.set_xlabel(label)
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(title)
    return _save(plt, fig, out)


def sweep(points: dict[str, list[tuple[float, float]]], out: Path, xlabel: str, ylabel: str, title: str) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, pts in points.items():
        xs, ys = zip(*pts) if pts else ((), ())
        ax.plot(xs, ys, marker="o", label=name)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(title)
    return _save(plt, fig, out)


def itl_cdf(series: dict[str, list[float]], out: Path, title: str) -> Path:
    """Inter-token latency CDFs (ms), log x-axis: the tail is what P/D is about."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, vals in series.items():
        _cdf(ax, vals, name)
    ax.set_xscale("log")
    ax.set_xlabel("inter-token latency (ms)")
    ax.set_ylabel("fraction of tokens")
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    ax.set_title(title)
    return _save(plt, fig, out)
