"""``--scenario goodput``: how many requests per second each system serves within latency targets.

Goodput (DistServe) is the highest Poisson arrival rate at which at least 90 % of requests meet every SLO.
The systems share the same two cores, one after the other:

* ``colocated``: two plain vLLM engines, one core each, every request prefilled and decoded where it lands
  (the client alternates between them);
* ``pd``: ``pdserve serve``, one prefill and one decode replica, every prompt disaggregated;
* ``pd_by_load``: the same, with conditional disaggregation by load (``router.disaggregate_by_load``: each
  prompt where it starts sooner, each request's tokens where a new stream goes faster);
* ``pd_conditional`` (on request): conditional disaggregation by prompt length
  (``router.local_prefill_below_tokens``: prompts shorter than the threshold are prefilled on decode).

The SLOs come from the host, not from constants: each mix's single-request TTFT and TPOT are measured
first on an idle colocated engine, and the targets are multiples of them (``ttft_x``, ``tpot_x``; default
3x and 1.5x). Rates then climb a geometric ladder from a fraction of the colocated engines' estimated
capacity until a system's attainment falls below 90 % (each system stops on its own). Every point uses
fresh prompts (the engines cache prefixes), the same ones and the same arrival times for every system.

With P/D in the run, each mix ends with two readings of the trade: the means model of
:mod:`pdserve_bench.crossover` and the request-level simulation of :mod:`pdserve_bench.attainment`,
replayed against the run's own points before it predicts goodput along prompt length.

A refused request (429) is retried after its ``retry-after-ms``, as OpenAI's clients do; its TTFT counts
from the first attempt, so a refusal costs the request its wait, not its place in the figure.

``--opt mix=long,chat`` (``long``: 1,000-1,900-token prompts, 64-128 new tokens; ``chat``: 64-640 / 32-160;
``short``: 300 / 32), ``--opt requests=16`` per point, ``--opt rates=0.2,0.3`` (a fixed ladder instead),
``--opt ttft_x=3 --opt tpot_x=1.5`` or ``--opt slo=ttft=3000ms,tpot=150ms``, ``--opt threshold=256``,
``--opt systems=colocated,pd,pd_by_load,pd_conditional`` (default: the first three), ``--opt start=0.5 --opt factor=1.3 --opt max_points=12``.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from pdserve.config.schema import PDServeArgs
from pdserve.errors import ConfigError
from pdserve_bench import attainment
from pdserve_bench.plan import Plan
from pdserve_bench.runner import Load, run_load
from pdserve_bench.stats import SLO, TARGET, summarize
from pdserve_bench.systems import EnginePair, ServedApp, _say
from pdserve_bench.workload import BenchRequest, Lengths, PromptFactory, build_requests

#: (prompt tokens, new tokens) of each mix.
MIXES: dict[str, tuple[str, str]] = {
    "long": ("uniform:1000-1900", "uniform:64-128"),
    "chat": ("uniform:64-640", "uniform:32-160"),
    "short": ("300", "32"),
}
SYSTEMS = ("colocated", "pd", "pd_by_load", "pd_conditional")
DEFAULT_SYSTEMS = ("colocated", "pd", "pd_by_load")
#: Requests sent to a system before its measured points: the first ones pay one-time costs.
WARMUP = 3
#: Rates of the ladder at most. Each system stops at its first miss, so more rates cost only systems that
#: keep meeting the targets; with 8, two colocated engines met every rate of a chat-mix ladder started low
#: (a slow host's probe) and their goodput was only a lower bound.
MAX_POINTS = 12


@dataclass
class MixPlan:
    name: str
    probe: list[BenchRequest]  # single requests the SLO is measured with
    warm: list[BenchRequest]
    points: list[list[BenchRequest]]  # fresh prompts for each point of the ladder


def _floats(text: Any) -> list[float]:
    return [float(x) for x in str(text).split(",") if x.strip()]


def ladder(start: float, factor: float, points: int) -> list[float]:
    """``points`` rates from ``start``, each ``factor`` times the last, rounded to 3 significant digits."""
    if start <= 0 or factor <= 1 or points < 1:
        raise ConfigError(f"bad rate ladder: start {start:g} must be > 0, factor {factor:g} > 1, points >= 1")
    return [float(f"{start * factor ** i:.3g}") for i in range(points)]


def goodput_rate(points: list[dict[str, Any]]) -> float:
    """The highest rate of the ladder whose attainment reached the target, climbing until the first miss
    (a later lucky point past a miss does not count)."""
    best = 0.0
    for p in sorted(points, key=lambda p: p["rate"]):
        if p["slo_attainment"] < TARGET:
            break
        best = p["rate"]
    return best


def slo_from_single(single: dict[str, Any], ttft_x: float, tpot_x: float) -> SLO:
    """Targets as multiples of one idle engine's single-request TTFT p50 and TPOT p50."""
    return SLO(ttft_ms=round(single["ttft_ms"]["p50"] * ttft_x, 1), tpot_ms=round(single["tpot_ms"]["p50"] * tpot_x, 1))


#: The router's counter of where each request ran (``decision:reason``), read around each point.
DECISIONS = "pdserve_pd_decisions_total"


def placements_now(urls: str | list[str]) -> Any:
    """The router's decision counters now (a served app); None for plain engines."""
    if not isinstance(urls, str):
        return None
    from pdserve_bench.scrape import scrape

    try:
        return scrape(urls)
    except OSError:
        return None


async def _sweep_async(urls: str | list[str], model: str, mix: MixPlan, rates: list[float], slo: SLO,
                       label: str) -> list[dict[str, Any]]:
    points: list[dict[str, Any]] = []
    for rate, reqs in zip(rates, mix.points):
        before = placements_now(urls)
        res, wall = await run_load(urls, model, reqs, Load("poisson", rate), seed=int(rate * 1000),
                                   retry_refused=True)
        sm = summarize(res, wall, slo)
        p = {"rate": rate, "slo_attainment": sm["slo_attainment"], "goodput": sm["goodput"],
             "ttft_p50_ms": sm["ttft_ms"]["p50"], "ttft_p90_ms": sm["ttft_ms"]["p90"],
             "tpot_p50_ms": sm["tpot_ms"]["p50"], "tpot_p90_ms": sm["tpot_ms"]["p90"],
             "e2e_p90_ms": sm["e2e_ms"]["p90"], "failed": sm["failed"], "errors": sm["errors"],
             "retried_after_429": sum(r.retries for r in res),
             "met_ttft": sum(1 for r in res if r.ok and r.ttft_s * 1000 <= (slo.ttft_ms or float("inf"))),
             "met_tpot": sum(1 for r in res if r.ok and r.tpot_s * 1000 <= (slo.tpot_ms or float("inf"))),
             "requests": len(res), "results": [r.as_dict() for r in res]}
        if before is not None:
            from pdserve_bench.scrape import delta

            after = placements_now(urls)
            p["placements"] = {k: int(v) for k, v in delta(before, after or {}, DECISIONS, "decision,reason").items()}
        points.append(p)
        _say(f"  {label} {mix.name} @ {rate:g} req/s: {p['slo_attainment']:.0%} within SLO "
             f"(TTFT ok {p['met_ttft']}, TPOT ok {p['met_tpot']} of {len(res)}), TTFT p90 "
             f"{p['ttft_p90_ms']:.0f} ms, TPOT p90 {p['tpot_p90_ms']:.1f} ms, failed {p['failed']}"
             + (f"; placed {p['placements']}" if p.get("placements") else ""))
        if p["slo_attainment"] < TARGET:
            break
    return points


@dataclass(frozen=True)
class Options:
    """What ``--opt`` asks of a goodput run."""

    mixes: list[str]
    systems: list[str]  # in SYSTEMS order: colocated first, it measures the SLO and the ladder
    requests: int
    probe: int
    rates: list[float] | None  # a fixed ladder, or None: the ladder from the measured capacity
    max_points: int
    start: float
    factor: float
    ttft_x: float
    tpot_x: float
    threshold: int
    slo: SLO | None  # fixed targets, or None: from single requests
    seed: int

    @classmethod
    def parse(cls, opts: dict[str, Any]) -> Options:
        mixes = [m for m in str(opts.get("mix", "long")).split(",") if m]
        bad = [m for m in mixes if m not in MIXES]
        if bad:
            raise ConfigError(f"unknown mix {bad}; valid: {', '.join(MIXES)}")
        asked = [s for s in str(opts.get("systems", ",".join(DEFAULT_SYSTEMS))).split(",") if s]
        if not set(asked) <= set(SYSTEMS) or "colocated" not in asked:
            raise ConfigError(f"systems must include colocated and be among {', '.join(SYSTEMS)}: {asked}")
        fixed = _floats(opts["rates"]) if opts.get("rates") else None
        return cls(mixes=mixes, systems=[s for s in SYSTEMS if s in asked], requests=int(opts.get("requests", 16)),
                   probe=int(opts.get("probe", 5)), rates=fixed,
                   max_points=len(fixed) if fixed else int(opts.get("max_points", MAX_POINTS)),
                   start=float(opts.get("start", 0.5)), factor=float(opts.get("factor", 1.3)),
                   ttft_x=float(opts.get("ttft_x", 3.0)), tpot_x=float(opts.get("tpot_x", 1.5)),
                   threshold=int(opts.get("threshold", 256)),
                   slo=SLO.parse(opts["slo"]) if opts.get("slo") else None, seed=int(opts.get("seed", 0)))


def _mix_plans(o: Options, factory: PromptFactory, plan: Plan) -> dict[str, MixPlan]:
    """Each mix's prompts: the SLO probe, the warm-up, and fresh prompts for every point of the ladder."""
    plans: dict[str, MixPlan] = {}
    for m in o.mixes:
        plen, olen = (Lengths.parse(x) for x in MIXES[m])
        mp = MixPlan(m, build_requests(factory, o.probe, plen, olen), build_requests(factory, WARMUP, plen, olen),
                     [build_requests(factory, o.requests, plen, olen) for _ in range(o.max_points)])
        plans[m] = mp
        plan.workload(f"{m}-probe", mp.probe, use="single requests on idle colocated engines: the SLO")
        plan.workload(m, [r for pt in mp.points for r in pt], per_point=o.requests, points=o.max_points,
                      use="fresh prompts for each rate, the same for every system")
    return plans


def _systems(args: PDServeArgs, o: Options, plan: Plan) -> dict[str, Any]:
    """The systems asked (not started), each with the config that makes it what it is."""
    built: dict[str, Any] = {}
    if "colocated" in o.systems:
        built["colocated"] = plan.system("colocated", EnginePair(args, disaggregated=False))
    router: dict[str, dict[str, Any]] = {"pd": {"local_prefill_below_tokens": 0},  # every request disaggregated
                                         "pd_by_load": {"disaggregate_by_load": True},
                                         "pd_conditional": {"local_prefill_below_tokens": o.threshold}}
    for name, settings in router.items():
        if name in o.systems:
            a = args.model_copy(deep=True)
            for k, v in settings.items():
                setattr(a.router, k, v)
            built[name] = plan.system(name, ServedApp(a), **settings)
    return built


def _probe_slo(first: str, model: str, mp: MixPlan, o: Options, mo: dict[str, Any]) -> None:
    """Single requests on an idle colocated engine: the SLO (unless fixed) and the ladder's rates, into ``mo``."""
    res, wall = asyncio.run(run_load(first, model, mp.probe, Load("concurrency", 1)))
    single = summarize(res, wall)
    if single["failed"]:
        raise RuntimeError(f"single requests failed on an idle engine: {single['errors']}")
    slo = o.slo or slo_from_single(single, o.ttft_x, o.tpot_x)
    e2e_s = single["e2e_ms"]["p50"] / 1000
    capacity = 2 / e2e_s  # two engines, each serving one request at a time
    ok = [r for r in res if r.ok and r.ttft_s > 0]
    mo.update(single={k: single[k] for k in ("ttft_ms", "tpot_ms", "e2e_ms")}, slo=slo.__dict__,
              prefill_tok_s=sum(r.prompt_tokens for r in ok) / sum(r.ttft_s for r in ok),
              est_capacity_rps=capacity, rates=o.rates or ladder(o.start * capacity, o.factor, o.max_points))
    _say(f"{mp.name}: single request TTFT p50 {single['ttft_ms']['p50']:.0f} ms, TPOT p50 "
         f"{single['tpot_ms']['p50']:.1f} ms -> SLO {slo.__dict__}; rates {mo['rates']}")


def _conclude(mo: dict[str, Any], m: str, o: Options) -> None:
    """A mix's goodput per system, the best P/D system against colocated, and with P/D in the run the two
    readings of the trade (crossover means model, attainment simulation)."""
    mo["goodput_rps"] = {s: goodput_rate(mo[s]) for s in o.systems}
    base = mo["goodput_rps"]["colocated"]
    best = max((s for s in o.systems if s != "colocated"), key=lambda s: mo["goodput_rps"][s], default=None)
    if best is not None:
        mo["best_pd"] = best
        mo["best_pd_vs_colocated"] = (mo["goodput_rps"][best] / base) if base else None
    _say(f"{m}: goodput (req/s at >= {TARGET:.0%} within SLO) {mo['goodput_rps']}")
    if "pd" in o.systems:
        mo["crossover"] = costs(mo, o.tpot_x, o.ttft_x)
        if mo["crossover"]:
            _say(f"{m}: {crossover_line(mo['crossover'])}")
            mo["attainment"] = attainment.report(mo, o.ttft_x, o.tpot_x)
            _say(f"{m}: {attainment.report_line(mo['attainment'])}")


def goodput(args: PDServeArgs, opts: dict[str, Any], plan: Plan) -> dict[str, Any]:
    from pdserve_bench.overload_long import host_cpu

    model = args.model_id
    o = Options.parse(opts)
    plan.set(mixes=o.mixes, systems=o.systems, requests_per_point=o.requests, probe=o.probe, rates=o.rates or "ladder",
             ladder={"start_share_of_capacity": o.start, "factor": o.factor, "max_points": o.max_points},
             slo=o.slo.__dict__ if o.slo else f"ttft {o.ttft_x:g}x, tpot {o.tpot_x:g}x single-request p50",
             threshold=o.threshold, target_attainment=TARGET)
    plans = _mix_plans(o, PromptFactory(plan.tokenizer(args), seed=o.seed), plan)
    built = _systems(args, o, plan)
    for m in o.mixes:
        plan.phase(f"{m}: single requests (SLO)", system="colocated", load="concurrency:1", workload=f"{m}-probe")
        for s in o.systems:
            plan.phase(f"{m} on {s}", system=s, workload=m,
                       load=(f"poisson {o.rates}" if o.rates else
                             f"poisson ladder x{o.factor:g} from {o.start:g} of the measured capacity"),
                       until=f"attainment < {TARGET:.0%}")
    if plan.dry_run:
        return plan.as_dict()

    out: dict[str, Any] = {"host_cpu": host_cpu(), "systems": o.systems, "requests_per_point": o.requests,
                           "mixes": {}}
    for s in o.systems:
        with built[s] as sysm:
            urls = sysm.urls if s == "colocated" else sysm.url
            every = urls if isinstance(urls, list) else [urls]
            for m in o.mixes:
                mp = plans[m]
                mo = out["mixes"].setdefault(m, {"prompt_len": MIXES[m][0], "output_len": MIXES[m][1]})
                for u in every:
                    asyncio.run(run_load(u, model, mp.warm, Load("concurrency", 1), progress=False))
                if s == "colocated":
                    _probe_slo(every[0], model, mp, o, mo)
                mo[s] = asyncio.run(_sweep_async(urls, model, mp, mo["rates"], SLO(**mo["slo"]), s))
    for m, mo in out["mixes"].items():
        _conclude(mo, m, o)
    return out


def costs(mo: dict[str, Any], tpot_x: float, ttft_x: float) -> dict[str, Any] | None:
    """The trade behind a mix's sweep (:mod:`pdserve_bench.crossover`): β, γ and the handoff fitted from
    the colocated and P/D requests of every rate, and what they predict, at this mix and along prompt
    length."""
    from pdserve_bench import crossover as cx

    t1 = mo["single"]["tpot_ms"]["p50"] / 1000
    col = [r for p in mo.get("colocated", []) for r in cx.timelines(p.get("results", []), prompts_here=True)]
    pd = [r for p in mo.get("pd", []) for r in cx.timelines(p.get("results", []), prompts_here=False)]
    got = cx.fit(col, pd, t1)
    every = [r for s in ("colocated", "pd") for p in mo.get(s, []) for r in p.get("results", []) if r.get("ok")]
    if got is None or not every:
        return None
    lengths = [int(r["prompt_tokens"]) for r in every]
    m = sum(r["output_tokens"] for r in every) / len(every)
    s = mo["prefill_tok_s"]
    here = cx.capacities(got["beta"], got["gamma"], t1, s, lengths, m, tpot_x, mo["slo"]["ttft_ms"] / 1000)
    return {"fit": got, "t1_ms": round(t1 * 1000, 1), "prefill_tok_s": round(s, 1),
            "prompt_tokens": round(sum(lengths) / len(lengths)), "new_tokens": round(m), "ttft_x": ttft_x,
            "tpot_x": tpot_x, "predicted": {k: round(v, 3) for k, v in here.items()},
            "along_prompt_length": cx.crossover(got["beta"], got["gamma"], t1, s, m, tpot_x, ttft_x)}


def crossover_line(c: dict[str, Any]) -> str:
    f, p, a = c["fit"], c["predicted"], c["along_prompt_length"]
    return (f"one more decode stream adds {f['beta']:.0%} of an idle step (beta), a prompt stalls its engine's "
            f"streams for {f['gamma']:.0%} of its time (gamma), handoff {f['handoff_s'] * 1000:.0f} ms "
            f"({f['requests']} requests, R^2 {f['r2']}); predicted P/D / colocated goodput here "
            f"{p['ratio']:.2f}x; P/D breaks even from {a['breakeven_prompt_tokens'] or 'no'} prompt tokens, "
            f"1.3x from {a['x1_3_prompt_tokens'] or 'no length'} (at {a['new_tokens']:.0f} new tokens; best "
            f"{a['best_ratio']:.2f}x)")


def plot(result: dict[str, Any], out_dir: Any) -> list[Any]:
    """Per mix: SLO attainment, TTFT p90 and TPOT p90 against the offered rate, one line per system."""
    from pdserve_bench.plots import _plt, _save

    made = []
    for m, mo in result.get("mixes", {}).items():
        plt = _plt()
        fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
        panels = [("slo_attainment", "requests within SLO", 1.0), ("ttft_p90_ms", "TTFT p90 (ms)", None),
                  ("tpot_p90_ms", "TPOT p90 (ms)", None)]
        for ax, (key, ylabel, _) in zip(axes, panels):
            for s in result["systems"]:
                pts = mo.get(s, [])
                ax.plot([p["rate"] for p in pts], [p[key] for p in pts], marker="o",
                        label=f"{s} (goodput {mo.get('goodput_rps', {}).get(s, 0):.2g}/s)")
            ax.set_xlabel("offered rate (req/s, Poisson)")
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
        axes[0].axhline(TARGET, ls="--", color="gray")
        axes[1].axhline(mo["slo"]["ttft_ms"], ls="--", color="gray", label="SLO")
        axes[2].axhline(mo["slo"]["tpot_ms"], ls="--", color="gray", label="SLO")
        axes[0].legend(fontsize=7)
        fig.suptitle(f"goodput, {m} mix (prompts {mo['prompt_len']}, new tokens {mo['output_len']}) on "
                     f"{result.get('host_cpu', '')}", fontsize=9)
        made.append(_save(plt, fig, out_dir / f"goodput-{m}.png"))
        if mo.get("crossover"):
            made.append(_crossover_plot(plt, result, m, mo, out_dir))
        if mo.get("attainment"):
            made.append(attainment.plot(result, m, out_dir))
    return made


def _crossover_plot(plt: Any, result: dict[str, Any], m: str, mo: dict[str, Any], out_dir: Any) -> Any:
    """The fitted model's P/D ÷ colocated goodput along prompt length at the mix's new tokens, with what
    the sweep measured at the mix's mean prompt."""
    from pdserve_bench.plots import _save

    c = mo["crossover"]
    f = c["fit"]
    lengths, ratios = zip(*c["along_prompt_length"]["curve"])
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(lengths, ratios, label=f"model: beta {f['beta']:.2f}, gamma {f['gamma']:.2f}, "
                                   f"{c['prefill_tok_s']:.0f} prompt tok/s, t1 {c['t1_ms']:.0f} ms")
    ax.plot([c["prompt_tokens"]], [c["predicted"]["ratio"]], marker="x", ls="", color="black",
            label=f"model at the {m} mix's lengths")
    ax.axhline(1.0, ls="--", color="gray")
    ax.axhline(1.3, ls=":", color="gray", label="target 1.3x")
    base = mo["goodput_rps"].get("colocated") or 0.0
    col_pts = mo.get("colocated") or [{}]
    bound = " (at most: colocated met every rate)" if col_pts[-1].get("slo_attainment", 0) >= TARGET else ""
    for i, s in enumerate(x for x in result["systems"] if x != "colocated"):
        if base > 0:
            ax.plot([c["prompt_tokens"] + 60 * i], [mo["goodput_rps"][s] / base], marker="o", ls="",
                    label=f"measured {s} ÷ colocated ({m} mix){bound}")
    ax.set_xlabel(f"prompt tokens (at {c['new_tokens']} new tokens; SLO TTFT {c['ttft_x']:g}x, "
                  f"TPOT {c['tpot_x']:g}x idle)")
    ax.set_ylabel("P/D goodput ÷ colocated")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title(f"P/D ÷ colocated goodput: the fitted model (of means) and the sweep, on "
                 f"{result.get('host_cpu', '')}, one core per engine", fontsize=9)
    return _save(plt, fig, out_dir / f"goodput-{m}-crossover.png")
