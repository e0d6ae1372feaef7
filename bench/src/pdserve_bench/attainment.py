"""Attainment, request by request: a step-level simulation of colocated engines and P/D, driven by the speeds
a goodput run measured, that predicts each request's TTFT and TPOT and so the share that meets the SLO.

:mod:`pdserve_bench.crossover` gives the trade in means (the rate at which the *average* request meets the
targets); goodput asks for 90 % of the requests, and with Poisson arrivals the misses are single requests
that met a collision: two prompts in one queue, a long prompt stalling a short answer's engine. This
module replays the arrivals themselves through a model of the engines and counts those misses.

The simulation itself, its engine model and the systems it runs: :mod:`pdserve_bench.engine_sim`. This
module reads a goodput run through it: the speeds the run measured (:func:`speeds_from_run`), the run's own
requests replayed against what was measured (:func:`validate`) before any crossover is read from it, the
predicted goodput per system and along prompt length (:func:`report`), the plot, and
``python -m pdserve_bench.attainment``.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from pdserve_bench.engine_sim import (
    SYSTEMS,
    Req,
    Speeds,
    attainment,
    goodput,
    poisson,
    simulate,
    uniform_mix,
)
from pdserve_bench.stats import TARGET, percentile
from pdserve_bench.workload import Lengths

#: The replay, and the simulation's names callers found here before the module's split.
__all__ = ["SYSTEMS", "Req", "Speeds", "attainment", "crossover_map", "goodput", "main", "plot", "poisson",
           "report", "report_line", "simulate", "speeds_from_run", "uniform_mix", "validate"]


def speeds_from_run(mo: dict[str, Any]) -> Speeds:
    """The speeds a goodput run measured for one mix: t1 and the prompt speed from its idle single requests,
    β, γ and the handoff from its fit (:func:`pdserve_bench.goodput.costs`)."""
    c = mo.get("crossover") or {}
    f = c.get("fit") or {}
    t1 = mo["single"]["tpot_ms"]["p50"] / 1000
    return Speeds(t1_s=t1, prompt_tok_s=float(mo["prefill_tok_s"]), beta=max(0.0, float(f.get("beta", 0.0))),
                  gamma=max(1.0, float(f.get("gamma", 1.0))), handoff_s=max(0.0, float(f.get("handoff_s", 0.0))))


def _arrivals(point: dict[str, Any]) -> list[tuple[float, int, int]]:
    """A measured point's requests as the simulation's arrivals: first attempt, prompt and new tokens."""
    res = sorted((r for r in point.get("results", []) if r.get("ok")), key=lambda r: r["start_s"])
    if not res:
        return []
    t0 = res[0]["start_s"]
    return [(r["start_s"] - t0, int(r["prompt_tokens"]), int(r["output_tokens"])) for r in res]


def validate(mo: dict[str, Any], sp: Speeds | None = None) -> dict[str, Any]:
    """Replay every measured point of every system through the simulation with the run's own arrivals and
    lengths: predicted against measured attainment per point, where the simulated router placed the
    requests (and, when the run recorded it, where the real one did), and the per-request error of TTFT and
    TPOT (median of |log(predicted / measured)|, as a ratio)."""
    sp = sp or speeds_from_run(mo)
    slo = mo["slo"]
    ttft_slo, tpot_slo = slo["ttft_ms"] / 1000, slo["tpot_ms"] / 1000
    out: dict[str, Any] = {"speeds": sp.__dict__, "systems": {}}
    for system in SYSTEMS:
        pts = []
        errs_ttft, errs_tpot = [], []
        for point in mo.get(system, []):
            arr = _arrivals(point)
            if not arr:
                continue
            measured = sorted((r for r in point["results"] if r.get("ok")), key=lambda r: r["start_s"])
            got = simulate(system, sp, arr)
            for m, g in zip(measured, got):
                if m["ttft_s"] > 0 and g.ttft_s > 0:
                    errs_ttft.append(abs(math.log(g.ttft_s / m["ttft_s"])))
                if m["output_tokens"] > 1 and m["tpot_s"] > 0 and g.tpot_s > 0:
                    errs_tpot.append(abs(math.log(g.tpot_s / m["tpot_s"])))
            pts.append({"rate": point["rate"], "measured": point["slo_attainment"],
                        "predicted": round(attainment(got, ttft_slo, tpot_slo), 3),
                        "placed": dict(Counter(g.placed for g in got)),
                        **({"measured_placed": point["placements"]} if point.get("placements") else {})})
        if pts:
            out["systems"][system] = {
                "points": pts,
                "median_ttft_error_x": round(math.exp(percentile(errs_ttft, 50)), 3) if errs_ttft else None,
                "median_tpot_error_x": round(math.exp(percentile(errs_tpot, 50)), 3) if errs_tpot else None,
                "points_agreeing": sum(1 for p in pts if (p["measured"] >= TARGET) == (p["predicted"] >= TARGET)),
            }
    return out


def crossover_map(sp: Speeds, ttft_x: float, tpot_x: float, prompts: Sequence[int], news: Sequence[int],
                  spread: float = 0.3, **kw: Any) -> list[dict[str, Any]]:
    """Predicted goodput of each system for mixes of prompts around each of ``prompts`` (± ``spread``) and
    answers around each of ``news``, with SLOs as the goodput scenario sets them (multiples of an idle
    request's TTFT and TPOT at the mix's mean lengths)."""
    rows = []
    for n in prompts:
        for m in news:
            lo_n, hi_n = max(1, round(n * (1 - spread))), round(n * (1 + spread))
            lo_m, hi_m = max(2, round(m * (1 - spread))), round(m * (1 + spread))
            lengths = uniform_mix((lo_n, hi_n), (lo_m, hi_m))
            ttft_slo = ttft_x * sp.prompt_s(n)
            tpot_slo = tpot_x * sp.t1_s
            got = {s: goodput(s, sp, lengths, ttft_slo, tpot_slo, **kw) for s in SYSTEMS}
            best = max(got["pd"], got["pd_by_load"])
            rows.append({"prompt_tokens": n, "new_tokens": m, **{k: round(v, 4) for k, v in got.items()},
                         "best_pd_vs_colocated": round(best / got["colocated"], 3) if got["colocated"] else None})
    return rows


def mix_lengths(prompt_len: str, output_len: str) -> Callable[[random.Random], tuple[int, int]]:
    p, o = Lengths.parse(prompt_len), Lengths.parse(output_len)
    return lambda rng: (p.sample(rng), max(2, o.sample(rng)))


#: Prompt lengths (tokens) along which the crossover is read, within the packaged model's context.
ALONG_PROMPTS = (100, 250, 500, 1000, 1500, 1900)


def report(mo: dict[str, Any], ttft_x: float, tpot_x: float, *, requests: int = 300, seeds: int = 2
           ) -> dict[str, Any]:
    """A goodput run's mix through the simulation: how well it replays the measured points
    (:func:`validate`), each system's predicted goodput at the mix's lengths and SLO, and the best P/D mode
    ÷ colocated along prompt length (answers as in the mix, SLO at ``ttft_x`` / ``tpot_x`` of an idle
    request of each length)."""
    sp = speeds_from_run(mo)
    out: dict[str, Any] = {"validation": validate(mo, sp)}
    slo = mo["slo"]
    lengths = mix_lengths(mo["prompt_len"], mo["output_len"])
    here = {s: goodput(s, sp, lengths, slo["ttft_ms"] / 1000, slo["tpot_ms"] / 1000, requests=requests,
                       seeds=seeds) for s in SYSTEMS}
    out["predicted_goodput_rps"] = {s: round(v, 4) for s, v in here.items()}
    col = here["colocated"]
    out["predicted_best_pd_vs_colocated"] = round(max(here["pd"], here["pd_by_load"]) / col, 3) if col else None
    o = Lengths.parse(mo["output_len"])
    new = round((o.a + o.b) / 2) if o.kind == "uniform" else round(o.a)
    out["along_prompt_length"] = crossover_map(sp, ttft_x, tpot_x, ALONG_PROMPTS, [new], requests=requests,
                                               seeds=seeds)
    return out


def report_line(rep: dict[str, Any]) -> str:
    v = rep["validation"]["systems"]
    agree = ", ".join(f"{s} {x['points_agreeing']}/{len(x['points'])} points, TTFT x{x['median_ttft_error_x']}, "
                      f"TPOT x{x['median_tpot_error_x']}" for s, x in v.items())
    along = ", ".join(f"{r['prompt_tokens']}: {r['best_pd_vs_colocated']}" for r in rep["along_prompt_length"])
    return (f"simulation replays the run ({agree}); predicted goodput {rep['predicted_goodput_rps']}, best P/D "
            f"÷ colocated {rep['predicted_best_pd_vs_colocated']}; along prompt tokens {along}")


def plot(result: dict[str, Any], m: str, out_dir: Any) -> Any:
    """Left: each measured point's attainment against the simulation's; right: the predicted best P/D ÷
    colocated goodput along prompt length, with the measured ratio at the mix's mean prompt."""
    from pdserve_bench.plots import _plt, _save

    mo = result["mixes"][m]
    rep = mo["attainment"]
    plt = _plt()
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.2))
    for s, x in rep["validation"]["systems"].items():
        rates = ", ".join(f"{p['rate']:g}" for p in x["points"])
        a.plot([p["predicted"] for p in x["points"]], [p["measured"] for p in x["points"]], marker="o", ls="",
               label=f"{s} (rates {rates})")
    a.plot([0, 1], [0, 1], color="gray", lw=0.8)
    a.axhline(TARGET, ls="--", color="gray", lw=0.8)
    a.axvline(TARGET, ls="--", color="gray", lw=0.8)
    a.set_xlabel("simulated attainment (the run's own arrivals and lengths)")
    a.set_ylabel("measured attainment")
    a.legend(fontsize=7)
    a.grid(alpha=0.3)
    rows = rep["along_prompt_length"]
    b.plot([r["prompt_tokens"] for r in rows], [r["best_pd_vs_colocated"] or 0 for r in rows], marker=".",
           label=f"simulated, {rows[0]['new_tokens']} new tokens")
    base = mo["goodput_rps"].get("colocated") or 0.0
    if base > 0:
        best = max(v for s, v in mo["goodput_rps"].items() if s != "colocated")
        pl = [int(x) for x in mo["prompt_len"].split(":")[-1].split("-")]
        b.plot([sum(pl) / len(pl)], [best / base], marker="o", ls="", color="black", label=f"measured, {m} mix")
    b.axhline(1.0, ls="--", color="gray")
    b.axhline(1.3, ls=":", color="gray", label="target 1.3x")
    b.set_xlabel("prompt tokens (±30 %)")
    b.set_ylabel("best P/D mode ÷ colocated goodput")
    b.legend(fontsize=7)
    b.grid(alpha=0.3)
    fig.suptitle(f"request-level simulation of the {m} mix on {result.get('host_cpu', '')}", fontsize=9)
    return _save(plt, fig, out_dir / f"goodput-{m}-attainment.png")


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m pdserve_bench.attainment bench-results/goodput.json``: the simulation's report for each
    mix of a finished goodput run (and its plot beside the file)."""
    import argparse
    import json
    from pathlib import Path

    ap = argparse.ArgumentParser(prog="python -m pdserve_bench.attainment", description=main.__doc__)
    ap.add_argument("result", type=Path, help="a goodput run's JSON (bench-results/goodput.json)")
    ap.add_argument("--ttft-x", type=float, default=3.0)
    ap.add_argument("--tpot-x", type=float, default=1.5)
    ns = ap.parse_args(argv)
    result = json.loads(ns.result.read_text())
    for m, mo in result.get("mixes", {}).items():
        mo["attainment"] = report(mo, ns.ttft_x, ns.tpot_x)
        print(f"{m}: {report_line(mo['attainment'])}")
        print(f"  plot: {plot(result, m, ns.result.parent)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
