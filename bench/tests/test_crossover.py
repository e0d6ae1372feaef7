"""The crossover model behind the goodput sweep: timelines, the fit, the closed form."""

import random

import pytest

from pdserve_bench import crossover as cx


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


def test_capacities_follow_the_closed_form_and_the_ttft_bound():
    beta, gamma, t1, s = 0.1, 1.0, 0.05, 1000.0
    short = cx.capacities(beta, gamma, t1, s, prompt_tokens=200, new_tokens=100, tpot_x=1.5, ttft_slo_s=10.0)
    n_s, m_s = 0.2, 5.0
    assert short["ratio"] == pytest.approx(0.5 * (1 + gamma * n_s / (beta * m_s)))  # TPOT-bound: 0.7
    assert short["pd_rps"] == pytest.approx((1 + 0.5 / beta) / (1.5 * m_s))
    # A tight TTFT target: one prefill queue meets it at a lower rate than two.
    tight = cx.capacities(beta, gamma, t1, s, prompt_tokens=2000, new_tokens=100, tpot_x=1.5, ttft_slo_s=6.0)
    assert tight["pd_rps"] == tight["pd_ttft_bound_rps"] < tight["colocated_ttft_bound_rps"]


def test_ttft_bound_is_where_queueing_breaks_the_target():
    # 1 s prompts, target 3 s: below the bound 90 % start within 2 s of arriving; two queues take more.
    one = cx.ttft_bound_rps([1000], 1000.0, 3.0, 1)
    two = cx.ttft_bound_rps([1000], 1000.0, 3.0, 2)
    assert 0.3 < one < 1.0 and one < two < 2.0
    assert cx.ttft_bound_rps([4000], 1000.0, 3.0, 1) == 0.0  # the prompt alone is past the target
    # Lengths spread around the same mean: the long ones miss first, so the bound is lower.
    assert cx.ttft_bound_rps([200, 1800], 1000.0, 3.0, 1) < one


def test_crossover_along_prompt_length():
    c = cx.crossover(0.1, 1.0, 0.05, 1000.0, new_tokens=100, tpot_x=1.5, ttft_x=3.0,
                     prompts=(100, 300, 500, 700, 1000, 2000))
    assert c["breakeven_prompt_tokens"] in (500, 700) and c["best_ratio"] >= 1.0
    assert [n for n, _ in c["curve"]] == [100, 300, 500, 700, 1000, 2000]
    assert cx.crossover(0.1, 0.0, 0.05, 1000.0, new_tokens=100, tpot_x=1.5, ttft_x=3.0,
                        prompts=(100, 1000))["breakeven_prompt_tokens"] is None
