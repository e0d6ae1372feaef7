"""The request-level simulation behind the goodput crossover (pdserve_bench/attainment.py): each system's timeline
for cases small enough to work out by hand, and the checks that tie it to a run."""

from __future__ import annotations

import math

import pytest

from pdserve_bench import attainment as at

SP = at.Speeds(t1_s=0.1, prompt_tok_s=1000.0, prompt_s0=0.05, beta=0.1, gamma=1.0, handoff_s=0.4)


def one(system: str, arrivals, sp: at.Speeds = SP) -> list[at.Req]:
    return at.simulate(system, sp, arrivals)


def test_a_lone_request_costs_its_prompt_then_a_step_per_token_plus_the_handoff_in_pd():
    (c,) = one("colocated", [(0.0, 500, 11)])
    assert c.ttft_s == pytest.approx(0.55)
    assert c.tpot_s == pytest.approx(0.1)
    (p,) = one("pd", [(0.0, 500, 11)])
    assert p.ttft_s == pytest.approx(0.55)  # the first token comes from the prefill leg at once
    assert p.tpot_s == pytest.approx(0.1 + 0.4 / 10)  # the handoff is spread over the other ten tokens


def test_two_prompts_arriving_together_wait_in_one_prefill_queue_but_not_on_two_engines():
    both = [(0.0, 1000, 5), (0.01, 1000, 5)]
    col = one("colocated", both)
    assert [round(r.ttft_s, 3) for r in col] == [1.05, 1.05]
    pd = one("pd", both)
    assert pd[0].ttft_s == pytest.approx(1.05)
    # one batch of 2,000 tokens (within the budget) would finish both at once; the second arrived during the
    # first's step, so it waits for it and then takes its own
    assert pd[1].ttft_s == pytest.approx(2.1 - 0.01)


def test_a_prompt_stalls_the_streams_of_its_colocated_engine_and_not_pd_decode():
    # the client alternates a, b, a: the long prompt lands on the stream's engine
    arrivals = [(0.0, 100, 41), (0.45, 50, 2), (0.5, 1000, 2)]
    col = one("colocated", arrivals)
    idle = one("colocated", arrivals[:1])[0]
    stalled = col[0]
    assert col[2].placed == stalled.placed != col[1].placed
    # the stream waited one prompt's time (1.05 s) in the step that computed it, and shared one step with
    # the long prompt's own second token (β: a tenth of a step)
    assert (stalled.end_s - idle.end_s) == pytest.approx(1.05 + 0.1 * 0.1, abs=1e-6)
    pd = one("pd", arrivals)
    alone = one("pd", arrivals[:1])[0]
    # on P/D the prompts are computed elsewhere; the stream only shares decode's steps with the short answers
    assert pd[0].end_s - alone.end_s < 0.1


def test_gamma_stretches_a_prompt_only_when_streams_share_its_step():
    slow = at.Speeds(t1_s=0.1, prompt_tok_s=1000.0, gamma=2.0)
    (alone,) = one("colocated", [(0.0, 1000, 2)], slow)
    assert alone.ttft_s == pytest.approx(1.0)
    got = one("colocated", [(0.0, 10, 30), (0.05, 10, 2), (0.5, 1000, 2)], slow)
    assert got[2].ttft_s == pytest.approx(2.0 + 0.1, abs=0.11)  # behind at most one step, then twice as long


def test_budget_chunks_a_prompt_longer_than_a_step_like_chunked_prefill():
    (r,) = one("colocated", [(0.0, 5000, 2)])
    assert r.ttft_s == pytest.approx(5.05)  # three steps, the fixed cost once


def test_by_load_computes_a_short_prompt_on_idle_decode_when_prefill_is_busy():
    got = one("pd_by_load", [(0.0, 1800, 400), (0.1, 100, 2)])
    assert got[0].placed in ("pd", "whole")
    assert got[1].placed == "local"
    assert got[1].ttft_s < one("pd", [(0.0, 1800, 400), (0.1, 100, 2)])[1].ttft_s
    # the stream on its way to decode (in its prefill leg) is two tokens long: 0.15 s of prompt is more than
    # 8 % of its decode time, so the short prompt waits for prefill instead
    assert one("pd_by_load", [(0.0, 1800, 2), (0.1, 100, 2)])[1].placed == "pd"


def test_by_load_keeps_long_prompts_off_a_decode_engine_with_streams():
    arrivals = [(0.0, 100, 200), (2.0, 1800, 2), (2.01, 1800, 2)]
    got = one("pd_by_load", arrivals)
    assert got[2].placed != "local"


def test_replaying_a_run_made_by_the_model_itself_agrees_exactly():
    lengths = at.uniform_mix((200, 900), (8, 40))
    mo = {"slo": {"ttft_ms": 2000.0, "tpot_ms": 150.0}, "single": {"tpot_ms": {"p50": 100.0}},
          "prefill_tok_s": 1000.0}
    for system in at.SYSTEMS:
        mo[system] = []
        for rate in (0.5, 1.0, 2.0):
            arr = at.poisson(rate, 30, lengths, seed=int(rate * 10))
            reqs = at.simulate(system, SP, arr)
            results = [{"ok": True, "start_s": 100 + r.arrival_s, "prompt_tokens": r.prompt_tokens,
                        "output_tokens": r.new_tokens, "ttft_s": r.ttft_s, "tpot_s": r.tpot_s} for r in reqs]
            mo[system].append({"rate": rate, "slo_attainment": at.attainment(reqs, 2.0, 0.15),
                               "results": results})
    got = at.validate(mo, SP)
    for system in at.SYSTEMS:
        s = got["systems"][system]
        assert s["median_ttft_error_x"] == pytest.approx(1.0)
        assert s["median_tpot_error_x"] == pytest.approx(1.0)
        assert all(p["predicted"] == pytest.approx(p["measured"], abs=1e-3) for p in s["points"])
        assert all(sum(p["placed"].values()) == 30 for p in s["points"])
    # and with other speeds it does not
    off = at.validate(mo, at.Speeds(t1_s=0.2, prompt_tok_s=500.0))
    assert off["systems"]["pd"]["median_tpot_error_x"] > 1.2


def test_goodput_favours_pd_where_prompts_stall_long_answers_and_colocated_where_queues_collide():
    fast_decode = at.Speeds(t1_s=0.05, prompt_tok_s=1000.0, beta=0.02, gamma=1.0, handoff_s=0.1)
    kw = {"requests": 150, "seeds": 2}
    # long prompts against long answers with a tight TPOT target: a colocated stream is stalled by every
    # prompt of its engine, P/D's decode never is
    long_mix = at.uniform_mix((1500, 1900), (200, 300))
    col = at.goodput("colocated", fast_decode, long_mix, 12.0, 1.2 * 0.05, **kw)
    pd = at.goodput("pd", fast_decode, long_mix, 12.0, 1.2 * 0.05, **kw)
    assert pd > 1.3 * col
    # short prompts with a tight TTFT target: one prefill queue against two
    short = at.uniform_mix((400, 600), (2, 3))
    col = at.goodput("colocated", fast_decode, short, 1.5, 10.0, **kw)
    pd = at.goodput("pd", fast_decode, short, 1.5, 10.0, **kw)
    assert col > 1.3 * pd


def test_unknown_system_is_refused():
    with pytest.raises(ValueError, match="unknown system"):
        at.simulate("mystery", SP, [(0.0, 10, 2)])
    assert math.isnan(at.Req(0.0, 1, 1).first_s)
