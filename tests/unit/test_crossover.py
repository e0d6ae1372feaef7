"""The crossover model behind the goodput sweep: timelines, the fit, the closed form."""

import random

import pytest

from pdserve.bench import crossover as cx


def test_overlap_counts_the_union_once():
    assert cx._overlap(0, 10, [(1, 3), (2, 5), (8, 12), (-4, -1)]) == pytest.approx(4 + 2)
    assert cx._overlap(0, 10, []) == 0


def _req(target, start, ttft, e2e, tokens=11):
    return {"ok": True, "target": target, "start_s": start, "ttft_s": ttft, "e2e_s": e2e, "output_tokens": tokens}


def test_timelines_count_streams_and_other_prompts_on_the_same_engine_only():
    rs = [_req("a", 0, 1, 11),  # decodes 1-11
          _req("a", 5, 2, 8),  # its prompt 5-7 stalls the first; decodes 7-13
          _req("b", 0, 1, 11)]  # another engine: neither
    col = cx.timelines(rs, prompts_here=True)
    assert col[0]["streams"] == pytest.approx(1 + 4 / 10) and col[0]["stalled"] == pytest.approx(2 / 10)
    assert col[0]["tpot_s"] == pytest.approx(1.0) and col[2]["streams"] == 1 and col[2]["stalled"] == 0
    pd = cx.timelines(rs, prompts_here=False)
    assert pd[0]["stalled"] == 0 and pd[0]["streams"] == col[0]["streams"]
    # failed and one-token requests teach nothing
    assert cx.timelines([{**rs[0], "ok": False}, _req("a", 0, 1, 2, tokens=1)], prompts_here=True) == []


def test_fit_recovers_the_costs_it_was_generated_with():
    rng = random.Random(1)
    t1, beta, gamma, h = 0.05, 0.15, 0.6, 0.3
    col, pd = [], []
    for _ in range(40):
        b, s, n = 1 + 3 * rng.random(), 0.4 * rng.random(), rng.randint(20, 200)
        col.append({"streams": b, "stalled": s, "tokens": n, "tpot_s": t1 * (1 + beta * (b - 1)) / (1 - gamma * s)})
        b = 1 + 4 * rng.random()
        pd.append({"streams": b, "stalled": 0.0, "tokens": n,
                   "tpot_s": t1 * (1 + beta * (b - 1)) + h / (n - 1)})
    got = cx.fit(col, pd, t1)
    assert got["beta"] == pytest.approx(beta, abs=1e-3) and got["gamma"] == pytest.approx(gamma, abs=1e-3)
    assert got["handoff_s"] == pytest.approx(h, abs=1e-3) and got["r2"] == pytest.approx(1.0)
    # Requests that never shared an engine cannot say what sharing costs.
    alone = [{"streams": 1.0, "stalled": 0.0, "tokens": 10, "tpot_s": t1}] * 5
    assert cx.fit(alone, [], t1) is None


def test_capacities_follow_the_closed_form_and_prefill_caps_both():
    beta, gamma, t1, s = 0.1, 1.0, 0.05, 1000.0
    short = cx.capacities(beta, gamma, t1, s, prompt_tokens=200, new_tokens=100, tpot_x=1.5)
    n_s, m_s = 0.2, 5.0
    assert short["ratio"] == pytest.approx(0.5 * (1 + gamma * n_s / (beta * m_s)))  # TPOT-bound: 0.7
    assert short["pd_rps"] == pytest.approx((1 + 0.5 / beta) / (1.5 * m_s))
    long = cx.capacities(beta, gamma, t1, s, prompt_tokens=20000, new_tokens=100, tpot_x=1.5)
    assert long["pd_rps"] == pytest.approx(cx.RHO_MAX / 20.0)  # one prefill engine is the bound
    c = cx.crossover(beta, gamma, t1, s, new_tokens=100, tpot_x=1.5)
    assert c["breakeven_prompt_tokens"] == 500  # gamma*N/S = beta*M*t1 at N = 500
    assert c["best_ratio"] >= 1.0
    assert cx.crossover(beta, 0.0, t1, s, new_tokens=100, tpot_x=1.5)["breakeven_prompt_tokens"] is None
