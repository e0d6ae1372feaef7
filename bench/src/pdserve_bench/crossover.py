"""Where P/D starts to pay on a host: the two costs behind a goodput sweep, fitted from its own requests.

On one engine per core, each side of the trade has one cost:

* **colocated**: a prompt computed on an engine stalls every stream there for as long as it takes;
* **P/D**: one decode engine holds every stream, and each extra stream in its batch makes every step
  longer; the handoff (KV pull and decode's first step) adds a fixed delay per request.

Both are read from the per-request timelines of a goodput run (:mod:`pdserve_bench.goodput` keeps each
request's start, TTFT, end and the engine it went to). For each request ``r`` whose tokens were streamed
from an engine: ``B_r`` is the mean number of streams on that engine during its decode (itself included),
``σ_r`` the share of that time in which the engine was computing some other request's prompt (the union of
the other requests' ``[start, first token]`` on the same engine). With ``t1`` the idle single-stream time
per token::

    TPOT_r · (1 − γ σ_r) = t1 · (1 + β (B_r − 1)) + h / (tokens_r − 1)       (h only for P/D requests)

is linear in ``β`` (what one more stream adds to a step, as a share of ``t1``), ``γ`` (the share of a
prompt's time its engine's streams lose) and ``h`` (the handoff, seconds), and is fitted by least squares.

With those, TPOT-bound capacities follow from Little's law (``B = λ·M·TPOT`` streams for ``M`` new tokens;
colocated: half the rate per engine, a share ``σ = λN/(2S)`` of its time on prompts of ``N`` tokens at
``S`` tokens/s). At the TPOT target ``k·t1`` both have the closed form::

    λ_pd = (1 + (k − 1)/β) / (k·M·t1)          λ_col = 2 (k − 1 + β) / (k (β·M·t1 + γ·N/S))

    λ_pd / λ_col = ½ · (1 + γ·(N/S) / (β·M·t1))

P/D wins on time per token when what a prompt costs a colocated engine's streams (``γ·N/S``) exceeds what
its tokens cost a shared decode batch (``β·M·t1``). The TTFT target bounds both from the other side: P/D
has one prefill queue where a colocated pair has two, and with Poisson arrivals two prompts meet in one
queue long before the mean load is high; that bound is simulated (:func:`ttft_bound_rps`). Left out, in
colocated's favour: a colocated engine's prompts also wait for its decode steps.

A model of means: it gives the rate at which the average request meets the targets, while goodput asks for
90 % of them, and on a noisy shared host the fit may explain little of the per-request variance (its R² is
reported). On a measured chat mix it predicted P/D at 1.35x colocated where the sweep
measured at most 0.21x, lost to single requests in the tail; read its β and γ as measurements, its ratio
as what those two costs alone would give.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any


def _overlap(a0: float, a1: float, spans: Sequence[tuple[float, float]]) -> float:
    """Length of [a0, a1] covered by the union of ``spans``."""
    covered, end = 0.0, a0
    for s0, s1 in sorted(spans):
        s0, s1 = max(s0, end), min(s1, a1)
        if s1 > s0:
            covered += s1 - s0
            end = s1
    return covered


def timelines(results: Sequence[dict[str, Any]], *, prompts_here: bool) -> list[dict[str, float]]:
    """Per streamed request: its TPOT, tokens, ``streams`` (B) and ``stalled`` (σ) on its engine.
    ``prompts_here``: the engine that streams also computed the prompts sent to it (colocated); in P/D the
    prompts ran elsewhere. Requests are grouped by ``target`` (the engine or endpoint they were sent to)."""
    ok = [r for r in results if r.get("ok") and r.get("output_tokens", 0) >= 2 and r.get("e2e_s", 0) > r.get("ttft_s", 0)]
    out = []
    for r in ok:
        here = [q for q in ok if q.get("target", "") == r.get("target", "") and q is not r]
        d0, d1 = r["start_s"] + r["ttft_s"], r["start_s"] + r["e2e_s"]
        span = d1 - d0
        streams = 1.0 + sum(max(0.0, min(d1, q["start_s"] + q["e2e_s"]) - max(d0, q["start_s"] + q["ttft_s"]))
                            for q in here) / span
        stalled = (_overlap(d0, d1, [(q["start_s"], q["start_s"] + q["ttft_s"]) for q in here]) / span
                   if prompts_here else 0.0)
        tokens = int(r["output_tokens"])
        out.append({"tpot_s": (r["e2e_s"] - r["ttft_s"]) / (tokens - 1), "tokens": tokens,
                    "streams": streams, "stalled": stalled})
    return out


def _solve(rows: list[list[float]], ys: list[float]) -> list[float] | None:
    """Least squares without intercept (normal equations, Gaussian elimination); None if degenerate."""
    k = len(rows[0])
    a = [[sum(r[i] * r[j] for r in rows) for j in range(k)] + [sum(r[i] * y for r, y in zip(rows, ys))]
         for i in range(k)]
    for c in range(k):
        piv = max(range(c, k), key=lambda i: abs(a[i][c]))
        if abs(a[piv][c]) < 1e-12:
            return None
        a[c], a[piv] = a[piv], a[c]
        for i in range(k):
            if i != c:
                f = a[i][c] / a[c][c]
                a[i] = [x - f * y for x, y in zip(a[i], a[c])]
    return [a[i][k] / a[i][i] for i in range(k)]


def fit(colocated: Sequence[dict[str, float]], pd: Sequence[dict[str, float]], t1_s: float) -> dict[str, Any] | None:
    """β, γ and h (see the module) from :func:`timelines` of colocated and P/D requests; None when the
    requests cannot separate them (e.g. no request ever shared its engine)."""
    rows, ys = [], []
    for r in colocated:
        rows.append([r["streams"] - 1.0, r["stalled"] * r["tpot_s"] / t1_s, 0.0])
        ys.append(r["tpot_s"] / t1_s - 1.0)
    for r in pd:
        rows.append([r["streams"] - 1.0, 0.0, 1.0 / ((r["tokens"] - 1) * t1_s)])
        ys.append(r["tpot_s"] / t1_s - 1.0)
    if len(rows) < 3:
        return None
    used = [i for i in range(3) if any(abs(r[i]) > 1e-9 for r in rows)]
    if not {0, 1} <= set(used):  # no stream ever shared an engine, or no prompt ever stalled one
        return None
    got = _solve([[r[i] for i in used] for r in rows], ys)
    if got is None:
        return None
    coef = dict.fromkeys(("beta", "gamma", "handoff_s"), 0.0)
    for i, v in zip(used, got):
        coef[("beta", "gamma", "handoff_s")[i]] = v
    pred = [sum(c * x for c, x in zip((coef["beta"], coef["gamma"], coef["handoff_s"]), r)) for r in rows]
    mean = sum(ys) / len(ys)
    ss = sum((y - mean) ** 2 for y in ys)
    r2 = 1.0 - sum((y - p) ** 2 for y, p in zip(ys, pred)) / ss if ss > 0 else None
    return {**{k: round(v, 4) for k, v in coef.items()}, "requests": len(rows), "r2": None if r2 is None else round(r2, 3)}


def ttft_bound_rps(prompt_tokens: Sequence[int], prefill_tok_s: float, slo_s: float, queues: int,
                   attainment: float = 0.9, requests: int = 2000, seed: int = 0) -> float:
    """The highest Poisson rate at which ``attainment`` of requests get their first token within ``slo_s``,
    when their prompts (lengths drawn from ``prompt_tokens``) wait in ``queues`` prefill queues taken in
    turn (1: P/D's prefill engine; 2: two colocated engines, a client alternating), each computing one
    prompt at a time at ``prefill_tok_s``. A simulation, not a formula: the TTFT target is a share of
    requests (a tail), and collisions of Poisson arrivals are what break it, not the mean load."""
    import random

    rng = random.Random(seed)
    lengths = [rng.choice(list(prompt_tokens)) for _ in range(requests)]
    gaps = [rng.expovariate(1.0) for _ in range(requests)]

    def met(rate: float) -> float:
        free = [0.0] * queues
        t, ok = 0.0, 0
        for i, (n, g) in enumerate(zip(lengths, gaps)):
            t += g / rate
            q = i % queues
            done = max(t, free[q]) + n / prefill_tok_s
            free[q] = done
            ok += done - t <= slo_s
        return ok / requests

    if met(1e-9) < attainment:
        return 0.0
    lo, hi = 1e-9, queues * prefill_tok_s / (sum(lengths) / requests)  # past this the queues only grow
    for _ in range(30):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if met(mid) >= attainment else (lo, mid)
    return lo


def capacities(beta: float, gamma: float, t1_s: float, prefill_tok_s: float, prompt_tokens: float | Sequence[int],
               new_tokens: float, tpot_x: float, ttft_slo_s: float) -> dict[str, float]:
    """Requests per second each way sustains within the TPOT target ``tpot_x · t1`` (the module's closed
    form) and the TTFT target ``ttft_slo_s`` (:func:`ttft_bound_rps`), the lower of the two, and their
    ratio. ``prompt_tokens``: one length, or the lengths of a mix."""
    lengths = [int(prompt_tokens)] if isinstance(prompt_tokens, (int, float)) else list(prompt_tokens)
    n_s = sum(lengths) / len(lengths) / prefill_tok_s  # one prompt's compute time, on average
    m_s = new_tokens * t1_s  # one request's tokens at the idle speed
    beta = max(beta, 1e-6)
    pd_tpot = (1.0 + (tpot_x - 1.0) / beta) / (tpot_x * m_s)
    col_tpot = 2.0 * (tpot_x - 1.0 + beta) / (tpot_x * (beta * m_s + max(gamma, 0.0) * n_s))
    pd_ttft = ttft_bound_rps(lengths, prefill_tok_s, ttft_slo_s, 1)
    col_ttft = ttft_bound_rps(lengths, prefill_tok_s, ttft_slo_s, 2)
    pd, col = min(pd_tpot, pd_ttft), min(col_tpot, col_ttft)
    return {"pd_rps": pd, "colocated_rps": col, "pd_tpot_bound_rps": pd_tpot, "colocated_tpot_bound_rps": col_tpot,
            "pd_ttft_bound_rps": pd_ttft, "colocated_ttft_bound_rps": col_ttft,
            "ratio": pd / col if col > 0 else math.inf}


def crossover(beta: float, gamma: float, t1_s: float, prefill_tok_s: float, new_tokens: float, tpot_x: float,
              ttft_x: float, ttft_overhead_s: float = 0.0,
              prompts: Sequence[int] = tuple(range(100, 8001, 200))) -> dict[str, Any]:
    """Along prompt length (one length at a time) at ``new_tokens`` per request, with the TTFT target at
    ``ttft_x`` times the idle TTFT (``ttft_overhead_s`` plus the prompt's compute time): the shortest prompt
    where P/D's predicted goodput reaches colocated's and 1.3x it (None: not within ``prompts``), and the
    best ratio there."""
    ratios = []
    for n in prompts:
        slo = ttft_x * (ttft_overhead_s + n / prefill_tok_s)
        ratios.append((n, capacities(beta, gamma, t1_s, prefill_tok_s, n, new_tokens, tpot_x, slo)["ratio"]))
    even = next((n for n, r in ratios if r >= 1.0), None)
    target = next((n for n, r in ratios if r >= 1.3), None)
    best_n, best = max(ratios, key=lambda x: x[1])
    return {"new_tokens": new_tokens, "breakeven_prompt_tokens": even, "x1_3_prompt_tokens": target,
            "best_ratio": round(best, 3), "best_at_prompt_tokens": best_n,
            "curve": [(n, round(r, 3)) for n, r in ratios]}
