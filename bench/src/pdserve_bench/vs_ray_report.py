"""``--scenario vs-ray-serve-llm``'s report: each system's figures per point, the ratios between systems, the
lines the run prints, and its plot."""

from __future__ import annotations

import math
from typing import Any

#: The systems compared, in the order the scenario starts and reports them.
SYSTEMS = ("ray-serve-llm", "pdserve", "colocated")
#: (figure, summary key, percentile) reported per point.
METRICS = (("ttft_p50", "ttft_ms", "p50"), ("ttft_p90", "ttft_ms", "p90"), ("tpot_p50", "tpot_ms", "p50"),
           ("e2e_p50", "e2e_ms", "p50"), ("e2e_p90", "e2e_ms", "p90"))
#: (name, numerator system, denominator system).
RATIOS = (("pdserve_over_colocated", "pdserve", "colocated"),
          ("ray_serve_llm_over_colocated", "ray-serve-llm", "colocated"),
          ("ray_serve_llm_over_pdserve", "ray-serve-llm", "pdserve"))


def figures(summary: dict[str, Any]) -> dict[str, float]:
    out = {name: summary[key][p] for name, key, p in METRICS}
    out["req_per_s"] = summary["request_throughput"]
    out["failed"] = summary["failed"]
    return out


def _ratio(a: float, b: float) -> float | None:
    if a is None or b is None or not (math.isfinite(a) and math.isfinite(b)) or b <= 0:
        return None
    return a / b


def compare(points: dict[str, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """``points[system][point]``: a summary (:func:`~pdserve_bench.stats.summarize`). Returns per point each
    system's figures and the three ratios (where both systems ran)."""
    names = list(dict.fromkeys(p for sys_points in points.values() for p in sys_points))
    table: dict[str, Any] = {}
    for name in names:
        figs = {s: figures(sp[name]) for s, sp in points.items() if name in sp}
        ratios = {}
        for label, a, b in RATIOS:
            if a in figs and b in figs:
                ratios[label] = {m: _ratio(figs[a][m], figs[b][m]) for m, _, _ in METRICS}
        table[name] = {"figures": figs, "ratios": ratios}
    return table


def point_lines(who: str, summary: dict[str, Any]) -> list[str]:
    """What the run prints for one system at one point: its p50s and failures, and where the time went when
    the point was paired."""
    f = figures(summary)
    lines = [f"  {who}: TTFT p50 {f['ttft_p50']:.0f} ms, TPOT p50 {f['tpot_p50']:.1f} ms, "
             f"e2e p50 {f['e2e_p50']:.0f} ms, failed {f['failed']}"]
    if summary.get("phases"):
        lines.append(f"    mean times: {phase_line(summary['phases'])}")
    return lines


def ratio_lines(table: dict[str, Any]) -> list[str]:
    """What the run prints at the end: per point, each ratio's TTFT, TPOT and e2e p50."""
    return [f"{key} {label}: TTFT p50 {_fmt(r['ttft_p50'])}, TPOT p50 {_fmt(r['tpot_p50'])}, "
            f"e2e p50 {_fmt(r['e2e_p50'])}"
            for key, row in table.items() for label, r in row["ratios"].items()]


def phase_line(phases: dict[str, Any]) -> str:
    """``router prefill 812 ms (n 12), ...; engine_prefill prefill 640 ms, ...``: a paired way's means."""
    parts = []
    for key, by in phases.items():
        if isinstance(by, dict) and by:
            parts.append(f"{key} " + ", ".join(f"{k} {v['mean_ms']:.0f} ms (n {v['n']})" for k, v in by.items()))
    return "; ".join(parts) or "none recorded"


def _fmt(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f}x"


def plot(result: dict[str, Any], path: Any) -> Any:
    """Left: single requests per size (TTFT, TPOT, e2e p50 per system, bars). Right: the concurrency sweep
    (TTFT and e2e p50 against concurrency, a line per system)."""
    from pdserve_bench.plots import _plt, _save

    plt = _plt()
    table = result.get("compare", {})
    systems = [s for s in SYSTEMS if any(s in row["figures"] for row in table.values())]
    singles = [k for k in table if k.endswith("_c1")]
    sweep = result.get("settings", {}).get("sweep_size") or (singles[0].rsplit("_c", 1)[0] if singles else "")
    sweep_keys = sorted((k for k in table if k.rsplit("_c", 1)[0] == sweep), key=lambda k: int(k.rsplit("_c", 1)[1]))
    panels = len(singles) + 2
    fig, axes = plt.subplots(1, panels, figsize=(4.4 * panels, 3.8), squeeze=False)
    metrics = (("ttft_p50", "TTFT"), ("tpot_p50", "TPOT"), ("e2e_p50", "e2e"))
    width = 0.8 / max(1, len(systems))
    for ax, key in zip(axes[0], singles):
        figs = table[key]["figures"]
        for i, s in enumerate(systems):
            ys = [figs.get(s, {}).get(m, float("nan")) for m, _ in metrics]
            ax.bar([x + i * width for x in range(len(metrics))], ys, width, label=s)
        ax.set_xticks([x + width * (len(systems) - 1) / 2 for x in range(len(metrics))])
        ax.set_xticklabels([f"{label} p50" for _, label in metrics])
        ax.set_yscale("log")
        ax.set_ylabel("ms")
        ax.set_title(result.get("points", {}).get(key, key) + ", concurrency 1", fontsize=9)
        ax.grid(alpha=0.3, axis="y", which="both")
    for ax, (m, label) in zip(axes[0][len(singles):], (("ttft_p50", "TTFT p50 (ms)"), ("e2e_p50", "e2e p50 (ms)"))):
        for s in systems:
            pts = [(int(k.rsplit("_c", 1)[1]), table[k]["figures"][s][m]) for k in sweep_keys
                   if s in table[k]["figures"]]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=s)
        ax.set_xlabel("concurrency")
        ax.set_ylabel(label)
        ax.set_title(f"{sweep}: {label} vs concurrency", fontsize=9)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"pdserve vs Ray Serve LLM (P/D) vs one colocated engine on {result.get('host_cpu', '?')}",
                 fontsize=9)
    return _save(plt, fig, path)
