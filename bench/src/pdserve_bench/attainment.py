"""Attainment, request by request: a step-level simulation of colocated engines and P/D, driven by the speeds
a goodput run measured, that predicts each request's TTFT and TPOT and so the share that meets the SLO.

:mod:`pdserve_bench.crossover` gives the trade in means (the rate at which the *average* request meets the
targets); goodput asks for 90 % of the requests, and with Poisson arrivals the misses are single requests
that met a collision: two prompts in one queue, a long prompt stalling a short answer's engine. This
module replays the arrivals themselves through a model of the engines and counts those misses.

The engine model (vLLM's scheduler on one CPU core, as measured, not assumed):

* an engine runs in steps; a step advances every running stream by one token and computes the prompts that
  fit its batch budget (``max_num_batched_tokens``; at least one prompt per step, larger ones in chunks
  like vLLM's chunked prefill);
* a step's time is ``t1 · (1 + β (B − 1))`` for ``B`` streams (nothing without streams) plus each prompt's
  ``prompt_s0 + n / prompt_tok_s``, stretched by ``γ`` when streams share the step (what a prompt costs
  them, :mod:`pdserve_bench.crossover`'s γ);
* a prompt's first token comes at the end of the step that finishes it; the stream runs from the next step.

Systems, as the goodput scenario runs them:

* ``colocated``: two engines, the client alternating;
* ``pd``: one prefill engine (prompts only, in arrival order) and one decode engine; the first token
  reaches the client when prefill finishes (the router streams it at once) and the stream joins decode
  ``handoff_s`` later (KV pull and decode's first step);
* ``pd_by_load``: ``pd`` with :func:`pdserve.router.admission.by_load`'s placement, read from the simulated
  engines' queues: the prompt on decode when it finishes there clearly sooner and stalls decode's shortest
  stream by at most its share; the whole request on prefill when a new stream is clearly faster there.

Left out: admission (pdserve's 429s and retries), the router's own CPU, and the host's noise. The
simulation is checked against a run's own requests (:func:`validate`) before any crossover is read from it.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pdserve.router.admission import BY_LOAD_MARGIN, BY_LOAD_STALL_SHARE
from pdserve.router.load import BUSY_BURST_S, BUSY_SHARE_CAP, BUSY_WINDOW_S
from pdserve_bench.stats import TARGET, percentile
from pdserve_bench.workload import Lengths

#: vLLM's CPU default batch budget (tokens per step).
BATCH_TOKENS = 2048
SYSTEMS = ("colocated", "pd", "pd_by_load")


@dataclass(frozen=True)
class Speeds:
    """One engine's speeds on one core, and the handoff between two."""

    t1_s: float  # a decode step with one stream
    prompt_tok_s: float  # prompt tokens per second, idle
    prompt_s0: float = 0.0  # fixed cost of a prompt (s), besides its tokens
    beta: float = 0.0  # what each further stream adds to a step, as a share of t1
    gamma: float = 1.0  # a prompt's time in a step that streams share, as a multiple of its idle time
    handoff_s: float = 0.0  # P/D: first token (end of prefill) to the stream's place on decode

    def prompt_s(self, tokens: int) -> float:
        return self.prompt_s0 + tokens / self.prompt_tok_s

    def step_s(self, streams: int) -> float:
        return self.t1_s * (1.0 + self.beta * (streams - 1)) if streams else 0.0


@dataclass
class Req:
    arrival_s: float
    prompt_tokens: int
    new_tokens: int
    first_s: float = math.nan  # first token, as the client sees it
    end_s: float = math.nan
    placed: str = ""
    stay: bool = False  # streams where its prompt was computed, even on a prefill engine
    left: int = 0  # prompt tokens still to compute
    tokens: int = 0  # tokens produced so far

    @property
    def ttft_s(self) -> float:
        return self.first_s - self.arrival_s

    @property
    def tpot_s(self) -> float:
        return (self.end_s - self.first_s) / (self.new_tokens - 1) if self.new_tokens > 1 else 0.0


@dataclass
class _Engine:
    name: str
    sp: Speeds
    waiting: deque = field(default_factory=deque)  # Req with prompt tokens left, in arrival order
    running: list = field(default_factory=list)  # Req streaming here
    joining: list = field(default_factory=list)  # Req to join ``running`` at the next step's start
    busy_until: float = 0.0
    prompt_spans: deque = field(default_factory=deque)  # (start, end) of the steps that computed prompts
    expected: list = field(default_factory=list)  # Req in their prefill leg or handoff towards this engine
    on_prompt_done: Callable[[Req, float], None] | None = None
    # the step under way: (streams, prompts computed with their tokens this step)
    step: tuple[list, list] | None = None

    def queued_s(self, now: float) -> float:
        """Time until this engine has computed every prompt it holds (its own estimate of a wait)."""
        rest = max(0.0, self.busy_until - now)
        return rest + sum(self.sp.prompt_s(r.left) for r in self.waiting)

    def streams(self) -> list[Req]:
        return self.running + self.joining

    def busy_share(self, now: float, horizon_s: float = BUSY_WINDOW_S) -> float:
        """Share of the last ``horizon_s`` (at most ``BUSY_WINDOW_S``) spent on prompts, capped as the
        router caps it (``EngineLoad.busy_share``)."""
        since = now - horizon_s
        while self.prompt_spans and self.prompt_spans[0][1] < now - BUSY_WINDOW_S:
            self.prompt_spans.popleft()  # older than any window asked for
        busy = sum(max(0.0, min(b, now) - max(a, since)) for a, b in self.prompt_spans)
        return min(BUSY_SHARE_CAP, busy / horizon_s)


class _Sim:
    def __init__(self) -> None:
        self.events: list[tuple[float, int, Callable[[float], None]]] = []
        self.n = 0

    def at(self, t: float, fn: Callable[[float], None]) -> None:
        self.n += 1
        heapq.heappush(self.events, (t, self.n, fn))

    def run(self) -> None:
        while self.events:
            t, _, fn = heapq.heappop(self.events)
            fn(t)

    def kick(self, e: _Engine, now: float) -> None:
        if e.step is None and (e.waiting or e.running or e.joining):
            self._start(e, now)

    def _start(self, e: _Engine, now: float) -> None:
        e.running += e.joining
        e.joining = []
        streams = list(e.running)
        budget = max(1, BATCH_TOKENS - len(streams))
        chunks, dur = [], 0.0
        for r in e.waiting:
            if budget <= 0:
                break
            take = min(r.left, budget)
            chunks.append((r, take))
            budget -= take
            dur += take / e.sp.prompt_tok_s + (e.sp.prompt_s0 if take == r.left else 0.0)
        if streams and chunks:
            dur *= e.sp.gamma
        dur += e.sp.step_s(len(streams))
        e.step = (streams, chunks)
        e.busy_until = now + dur
        if chunks:
            e.prompt_spans.append((now, now + dur))
        self.at(now + dur, lambda t, e=e: self._end(e, t))

    def _end(self, e: _Engine, now: float) -> None:
        streams, chunks = e.step or ([], [])
        e.step = None
        for r in streams:
            r.tokens += 1
            if r.tokens >= r.new_tokens:
                r.end_s = now
                e.running.remove(r)
        for r, take in chunks:
            r.left -= take
            if r.left == 0:
                e.waiting.remove(r)
                r.tokens = 1
                r.first_s = now
                if r.new_tokens <= 1:
                    r.end_s = now
                elif e.on_prompt_done is not None and not r.stay:
                    e.on_prompt_done(r, now)
                else:
                    e.joining.append(r)
        self.kick(e, now)


def simulate(system: str, sp: Speeds, arrivals: Sequence[tuple[float, int, int]]) -> list[Req]:
    """Each request's first token and end on ``system``: ``arrivals`` are (seconds, prompt tokens, new
    tokens), in order of arrival."""
    if system not in SYSTEMS:
        raise ValueError(f"unknown system {system!r}; valid: {', '.join(SYSTEMS)}")
    sim = _Sim()
    reqs = [Req(float(t), int(n), int(m)) for t, n, m in arrivals]
    if system == "colocated":
        engines = [_Engine("a", sp), _Engine("b", sp)]

        def place(i: int, r: Req, now: float) -> None:
            e = engines[i % 2]
            r.placed = e.name
            r.left = r.prompt_tokens
            e.waiting.append(r)
            sim.kick(e, now)
    else:
        p, d = _Engine("prefill", sp), _Engine("decode", sp)

        def handed(r: Req, now: float) -> None:
            def join(t: float) -> None:
                d.expected.remove(r)
                d.joining.append(r)
                sim.kick(d, t)
            sim.at(now + sp.handoff_s, join)

        p.on_prompt_done = handed

        def place(i: int, r: Req, now: float) -> None:
            r.placed = _by_load(p, d, r, now) if system == "pd_by_load" else "pd"
            r.left, r.stay = r.prompt_tokens, r.placed == "whole"
            if r.placed == "pd":
                d.expected.append(r)
            e = d if r.placed == "local" else p
            e.waiting.append(r)
            sim.kick(e, now)

    for i, r in enumerate(reqs):
        sim.at(r.arrival_s, lambda t, i=i, r=r: place(i, r, t))
    sim.run()
    return reqs


def _by_load(p: _Engine, d: _Engine, r: Req, now: float) -> str:
    """The router's by-load placement (admission.by_load) read from the simulated engines."""
    sp = d.sp
    svc = sp.prompt_s(r.prompt_tokens)
    p_done = p.queued_s(now) + svc
    d_done = d.queued_s(now) + svc
    bound = [q.new_tokens for q in d.streams() + d.expected]
    stalls_little = not bound or svc <= BY_LOAD_STALL_SHARE * min(bound) * sp.step_s(len(bound))
    if stalls_little and d_done < BY_LOAD_MARGIN * p_done:
        return "local"

    def new_stream(e: _Engine) -> float:
        busy = max(e.busy_share(now), e.busy_share(now, BUSY_BURST_S))
        return sp.step_s(len(e.streams()) + len(e.expected) + 1) / (1.0 - busy)
    if new_stream(p) < BY_LOAD_MARGIN * new_stream(d):
        return "whole"
    return "pd"


def attainment(reqs: Sequence[Req], ttft_slo_s: float, tpot_slo_s: float) -> float:
    ok = sum(1 for r in reqs if r.ttft_s <= ttft_slo_s and r.tpot_s <= tpot_slo_s)
    return ok / len(reqs) if reqs else 0.0


def poisson(rate: float, count: int, lengths: Callable[[random.Random], tuple[int, int]], seed: int = 0
            ) -> list[tuple[float, int, int]]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(count):
        t += rng.expovariate(rate)
        out.append((t, *lengths(rng)))
    return out


def goodput(system: str, sp: Speeds, lengths: Callable[[random.Random], tuple[int, int]], ttft_slo_s: float,
            tpot_slo_s: float, *, target: float = TARGET, requests: int = 400, seeds: int = 3) -> float:
    """The highest Poisson rate at which ``target`` of the requests meet both targets (bisection over the
    rate; each rate's attainment pooled over ``seeds`` runs of ``requests``)."""
    def met(rate: float) -> float:
        got = []
        for s in range(seeds):
            got += simulate(system, sp, poisson(rate, requests, lengths, seed=s))
        return attainment(got, ttft_slo_s, tpot_slo_s)

    lo, hi = 0.0, 0.05
    while met(hi) >= target and hi < 1e3:
        lo, hi = hi, hi * 2
    if hi >= 1e3:
        return math.inf
    for _ in range(14):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if met(mid) >= target else (lo, mid)
    return lo


def uniform_mix(prompt: tuple[int, int], new: tuple[int, int]) -> Callable[[random.Random], tuple[int, int]]:
    return lambda rng: (rng.randint(*prompt), rng.randint(*new))


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
