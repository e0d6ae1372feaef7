"""Percentiles, throughput and goodput (DistServe: the share of requests meeting every SLO)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdserve.errors import ConfigError
from pdserve_bench.client import Result

#: Attainment (the share of requests within every SLO) a rate must reach to count towards goodput; the
#: goodput scenario measures it (goodput.py) and the request-level simulation predicts it (engine_sim.py,
#: read against a run by attainment.py).
TARGET = 0.9


def percentile(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * p / 100.0
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


@dataclass(frozen=True)
class SLO:
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    @classmethod
    def parse(cls, text: str | None) -> SLO:
        if not text:
            return cls()
        vals: dict[str, float] = {}
        for part in text.split(","):
            try:
                k, v = part.split("=")
                vals[k.strip() + "_ms"] = float(v.strip().removesuffix("ms"))
            except ValueError:
                raise ConfigError(f"bad SLO {part!r}: use e.g. ttft=500ms,tpot=50ms") from None
        unknown = set(vals) - {"ttft_ms", "tpot_ms", "e2e_ms"}
        if unknown:
            raise ConfigError(f"unknown SLO {sorted(unknown)}; valid: ttft, tpot, e2e")
        return cls(**vals)

    def met(self, r: Result) -> bool:
        if not r.ok:
            return False
        if self.ttft_ms is not None and r.ttft_s * 1000 > self.ttft_ms:
            return False
        if self.tpot_ms is not None and r.tpot_s * 1000 > self.tpot_ms:
            return False
        return not (self.e2e_ms is not None and r.e2e_s * 1000 > self.e2e_ms)

    def any(self) -> bool:
        return any(v is not None for v in (self.ttft_ms, self.tpot_ms, self.e2e_ms))


def summarize(results: list[Result], wall_s: float, slo: SLO | None = None) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    out: dict[str, Any] = {
        "requests": len(results), "succeeded": len(ok), "failed": len(results) - len(ok),
        "wall_s": wall_s,
        "request_throughput": len(ok) / wall_s if wall_s > 0 else 0.0,
        "output_throughput": sum(r.output_tokens for r in ok) / wall_s if wall_s > 0 else 0.0,
        "errors": sorted({r.error for r in results if not r.ok})[:5],
    }
    series = {
        "ttft_ms": [r.ttft_s * 1000 for r in ok],
        "tpot_ms": [r.tpot_s * 1000 for r in ok if r.output_tokens > 1],
        "itl_ms": [x * 1000 for r in ok for x in r.itl_s],
        "e2e_ms": [r.e2e_s * 1000 for r in ok],
    }
    for name, vals in series.items():
        out[name] = {f"p{p}": percentile(vals, p) for p in (50, 90, 99)}
        out[name]["mean"] = sum(vals) / len(vals) if vals else float("nan")
    if slo is not None and slo.any():
        met = sum(1 for r in results if slo.met(r))
        out["slo_attainment"] = met / len(results) if results else 0.0
        out["goodput"] = met / wall_s if wall_s > 0 else 0.0
    return out


def table(runs: dict[str, dict[str, Any]]) -> str:
    """One row per load of :func:`summarize` figures, for a person to read: requests done of asked, the
    throughputs, TTFT / TPOT / e2e p50 and p90 in ms, and SLO attainment when an SLO was given."""
    with_slo = any("slo_attainment" in s for s in runs.values())
    head = ["load", "ok", "req/s", "out tok/s", "TTFT p50", "p90", "TPOT p50", "p90", "e2e p50", "p90"]
    rows = [head + (["in SLO"] if with_slo else [])]
    for label, s in runs.items():
        row = [label, f"{s['succeeded']}/{s['requests']}", f"{s['request_throughput']:.2f}",
               f"{s['output_throughput']:.1f}"]
        for key in ("ttft_ms", "tpot_ms", "e2e_ms"):
            row += [_ms(s[key]["p50"]), _ms(s[key]["p90"])]
        if with_slo:
            row.append(f"{s['slo_attainment']:.0%}" if "slo_attainment" in s else "-")
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in rows]
    return "\n".join(lines + [f"(ms; failed: {'; '.join(e for s in runs.values() for e in s['errors'])})"
                              if any(s["failed"] for s in runs.values()) else "(ms)"])


def _ms(v: float) -> str:
    return "-" if v != v else f"{v:,.0f}"  # (nan: no request of that kind)
