"""Admission by work: engine queues in prompt tokens, measured speeds, refusals before any leg."""

from __future__ import annotations

import math

import pytest

from pdserve.config.schema import RouterConfig
from pdserve.errors import NoEngineAvailable
from pdserve.router.admission import BY_LOAD_STALL_SHARE, BY_LOAD_UNKNOWN_TOKENS, HEADROOM, Refused, admit
from pdserve.router.endpoint import Endpoint
from pdserve.router.flight import Flight
from pdserve.router.load import BUSY_BURST_S, CALIBRATION_DERATE, EngineLoad
from pdserve.router.metrics import RouterMetrics
from pdserve.router.orchestrator import Orchestrator
from pdserve.router.pool import EnginePool

MODEL = "fake-model"


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def endpoint(role: str, url: str, clock: Clock, rate: float | None = 100.0) -> Endpoint:
    ep = Endpoint(role=role, url=url)  # type: ignore[arg-type]
    ep.load = EngineLoad(clock)
    ep.load.calibrated_rate = rate / CALIBRATION_DERATE if rate else None  # admission's rate: `rate`
    return ep


def test_rate_is_tokens_over_busy_time_and_batches_count_once():
    c = Clock()
    load = EngineLoad(c)
    load.calibrated_rate = 50.0
    assert load.rate() == 50.0 * CALIBRATION_DERATE  # until two prompts finished
    load.add_prompt(100)
    load.add_prompt(100)
    c.t += 1.0
    load.end_prompt(100, 100)
    c.t += 0.001  # the second prompt was batched with the first: it finishes right after
    load.end_prompt(100, 100)
    assert load.rate() == pytest.approx(200 / 1.001)
    assert load.queued_tokens == 0 and load.wait_s() == 0.0


def test_prompts_computed_beside_streams_teach_no_speed():
    """A prompt computed on a decode engine that is generating is timed to its first token, which waits
    for the step in progress: that time is not the engine's prompt speed."""
    c = Clock()
    load = EngineLoad(c)
    load.calibrated_rate = 1000.0
    load.add_stream()
    for _ in range(3):
        load.add_prompt(8)
        c.t += 0.3  # a decode step's wait, not 8 tokens' work
        load.end_prompt(8, 8)
    assert load.measured_rate() is None and load.rate() == 1000.0 * CALIBRATION_DERATE
    assert load.busy_share() > 0  # the time still counts as time spent on prompts
    # A stream that starts while a prompt is queued spoils that prompt's timing too.
    load.end_stream(None)
    load.add_prompt(8)
    load.add_stream()
    c.t += 0.3
    load.end_prompt(8, 8)
    assert load.measured_rate() is None
    # Alone again: prompts teach their speed.
    load.end_stream(None)
    for _ in range(2):
        load.add_prompt(100)
        c.t += 0.1
        load.end_prompt(100, 100)
    assert load.measured_rate() == pytest.approx(1000.0)


def test_wait_drains_at_the_measured_rate_and_unknown_speed_takes_one_prompt():
    c = Clock()
    load = EngineLoad(c)
    load.add_prompt(300)
    assert load.wait_s() == math.inf  # speed unknown and busy: nothing more until it is measured
    load.calibrated_rate = 100.0 / CALIBRATION_DERATE
    assert load.wait_s() == pytest.approx(3.0)
    c.t += 1.0
    assert load.wait_s() == pytest.approx(2.0)
    c.t += 5.0
    assert load.wait_s() == 0.0  # overdue, not negative
    load.end_prompt(300, None)  # abandoned: teaches nothing about speed
    assert load.rate() == 100.0 and load.queued_tokens == 0


def test_tpot_bound_scales_with_streams():
    load = EngineLoad(Clock())
    assert load.tpot_with_one_more() is None
    load.add_stream()
    load.add_stream()
    load.end_stream(0.1)  # measured with 2 streams
    assert load.streams == 1
    # Seen with ~1.3 streams on average: one more adds a share of the step (FIRST_STREAM_SHARE), not all of it.
    from pdserve.router.load import FIRST_STREAM_SHARE

    assert load.tpot_with_one_more() == pytest.approx(0.1 + FIRST_STREAM_SHARE * 0.1 * (2 - 1.3), rel=0.01)


def test_a_host_slow_for_other_reasons_does_not_look_like_decode_load():
    """TPOT at one stream far above its idle figure (the host is busy with something else): what one more
    stream is estimated to add stays a share of the step, so 64 new tokens do not look seconds slower."""
    load = EngineLoad(Clock())
    load.add_stream()
    load.end_stream(0.058)  # idle, alone
    load.add_stream()
    for _ in range(10):
        load.add_stream()
        load.end_stream(0.16)  # still about one stream, but 2.8x slower
    assert load.decode_slowdown_s(64) < 0.25 * 0.16 * 2 * 63
    assert load.decode_slowdown_s(64) < 4.8  # the default budget's share: admitted


def cfg(wait_s: float = 5.0, **kw) -> RouterConfig:
    """A router whose estimates may fill ``wait_s`` seconds (its max_queue_wait_s less the headroom)."""
    return RouterConfig(max_queue_wait_s=wait_s / HEADROOM, **kw)


def test_pd_when_prefill_fits_else_429_with_retry_after_from_the_estimate():
    c = Clock()
    p, d = endpoint("prefill", "http://p", c), endpoint("decode", "http://d", c)
    pool = EnginePool([p, d])
    got = admit(pool, cfg(), disaggregate=True, reason="pd", prompt_tokens=100, lease_s=30)
    assert got.prefill is p and got.decode is d and got.reason == "pd"
    p.load.add_prompt(1200)  # 12 s of queue at 100 tokens/s
    d.load.add_stream()  # decode is streaming: no spill onto it
    with pytest.raises(Refused) as e:
        admit(pool, cfg(), disaggregate=True, reason="pd", prompt_tokens=100, lease_s=30)
    # the wait beyond the budget (12 - 5 s), moved by up to a fifth either way at random
    assert e.value.cause == "prefill_wait" and 5600 <= e.value.retry_after_ms <= 8400
    assert e.value.retry_after_s == -(-e.value.retry_after_ms // 1000)
    assert e.value.status_code == 429


def test_busy_prefill_spills_only_onto_an_idle_decode_with_room():
    c = Clock()
    p, d = endpoint("prefill", "http://p", c), endpoint("decode", "http://d", c)
    pool = EnginePool([p, d])
    p.load.add_prompt(1200)
    got = admit(pool, cfg(), disaggregate=True, reason="pd", prompt_tokens=100, lease_s=30)
    assert got.prefill is None and got.decode is d and got.reason == "prefill_busy"
    d.load.pending = 1  # a P/D request is on its way to decode: its decode leg must not queue behind
    with pytest.raises(Refused):
        admit(pool, cfg(), disaggregate=True, reason="pd", prompt_tokens=100, lease_s=30)
    d.load.pending = 0
    d.load.add_prompt(10)  # decode computes a prompt already: not idle
    with pytest.raises(Refused):
        admit(pool, cfg(), disaggregate=True, reason="pd", prompt_tokens=100, lease_s=30)


def test_decode_queue_past_half_the_lease_keeps_requests_off_prefill():
    c = Clock()
    p, d = endpoint("prefill", "http://p", c), endpoint("decode", "http://d", c)
    pool = EnginePool([p, d])
    d.load.add_prompt(400)  # decode would pull 4 s after prefill ends; the lease is 6 s
    with pytest.raises(Refused):
        admit(pool, cfg(), disaggregate=True, reason="pd", prompt_tokens=100, lease_s=6)
    assert admit(pool, cfg(), disaggregate=True, reason="pd", prompt_tokens=100, lease_s=30).prefill is p


def test_no_prefill_engine_runs_local_only_with_room():
    c = Clock()
    d = endpoint("decode", "http://d", c)
    pool = EnginePool([d])
    got = admit(pool, cfg(), disaggregate=True, reason="pd", prompt_tokens=100, lease_s=30)
    assert got.prefill is None and got.reason == "no_prefill_engine"
    with pytest.raises(NoEngineAvailable):
        admit(pool, cfg(prefill_fallback="error"), disaggregate=True, reason="pd", prompt_tokens=100, lease_s=30)
    d.load.add_prompt(1000)
    with pytest.raises(Refused) as e:
        admit(pool, cfg(), disaggregate=False, reason="short_prompt", prompt_tokens=10, lease_s=30)
    assert e.value.cause == "decode_wait"


def test_decode_tpot_bound():
    c = Clock()
    p, d = endpoint("prefill", "http://p", c), endpoint("decode", "http://d", c)
    pool = EnginePool([p, d])
    d.load.add_stream()
    d.load.add_stream()
    d.load.end_stream(0.9)  # with ~1.3 streams: one more makes 0.9 + 0.25 * 0.9 * 0.7 > 1.0
    with pytest.raises(Refused) as e:
        admit(pool, cfg(max_tpot_s=1.0), disaggregate=True, reason="pd", prompt_tokens=10, lease_s=30)
    assert e.value.cause == "decode_tpot"
    assert admit(pool, cfg(max_tpot_s=None), disaggregate=True, reason="pd", prompt_tokens=10, lease_s=30)


def test_admission_picks_the_replica_that_fits():
    c = Clock()
    p1, p2 = endpoint("prefill", "http://p1", c), endpoint("prefill", "http://p2", c)
    d = endpoint("decode", "http://d", c)
    pool = EnginePool([p1, p2, d], policy="round_robin")
    p1.load.add_prompt(5000)
    for _ in range(4):
        assert admit(pool, cfg(), disaggregate=True, reason="pd", prompt_tokens=10, lease_s=30).prefill is p2


def test_a_crowded_decode_counts_against_the_wait_budget():
    c = Clock()
    p, d = endpoint("prefill", "http://p", c), endpoint("decode", "http://d", c)
    pool = EnginePool([p, d])
    for _ in range(3):
        d.load.add_stream()
    d.load.tpot_single, d.load.tpot_s, d.load.tpot_streams = 0.03, 0.07, 3.0  # 20 ms per extra stream
    assert d.load.tpot_with_one_more() == pytest.approx(0.03 + 0.02 * 3)
    # What one more stream costs the request's own tokens, over the engine as it runs now.
    assert d.load.decode_slowdown_s(101) == pytest.approx(0.02 * 100)
    p.load.add_prompt(100)  # 1 s of prefill queue
    assert admit(pool, cfg(8.0), disaggregate=True, reason="pd", prompt_tokens=10, lease_s=30,
                 new_tokens=101).prefill is p  # 1 + 2 s fits 8
    with pytest.raises(Refused) as e:
        admit(pool, cfg(8.0), disaggregate=True, reason="pd", prompt_tokens=10, lease_s=30, new_tokens=501)
    assert 2400 <= e.value.retry_after_ms <= 3600  # 1 + 10 - 8, within a fifth


def test_requests_on_their_way_to_decode_count_as_its_streams():
    load = EngineLoad(Clock())
    load.tpot_single, load.tpot_s, load.tpot_streams = 0.03, 0.07, 3.0
    load.add_stream()
    assert load.decode_slowdown_s(11) == 0.0  # fewer streams than when it was measured
    load.pending = 4  # admitted P/D requests still in prefill: they will stream here as well
    assert load.decode_slowdown_s(11) == pytest.approx(0.02 * (1 + 4 + 1 - 3) * 10)


def _streams_in_waves(load: EngineLoad, c: Clock, step_s: float, per_stream_s: float,
                      waves: list[int], tokens: int = 20) -> None:
    """Waves of streams that start and end together: each one's TPOT is the engine's step with that many."""
    for n in waves:
        marks = [load.add_stream() for _ in range(n)]
        c.t += tokens * (step_s + per_stream_s * (n - 1))
        for m in marks:
            load.end_stream(step_s + per_stream_s * (n - 1), m)


def test_per_stream_cost_is_fitted_over_streams_beside_different_numbers_of_others():
    """What one more stream adds is the slope of TPOT against the streams beside each one (here 3 % of a
    40 ms step, as measured on a CPU engine), not a guessed share of the step."""
    c = Clock()
    load = EngineLoad(c)
    _streams_in_waves(load, c, 0.040, 0.0012, [1, 1, 1, 1, 1, 1])
    assert load.stream_cost_fit() is None  # never more than one stream: nothing says what a second adds
    from pdserve.router.load import FIRST_STREAM_SHARE

    load.add_stream()
    load.add_stream()
    guessed = load.tpot_with_one_more()
    assert guessed == pytest.approx(0.040 + FIRST_STREAM_SHARE * 0.040 * 2)
    load.streams = 0
    _streams_in_waves(load, c, 0.040, 0.0012, [3, 1, 4, 2])
    single, per_stream = load.stream_cost_fit()  # type: ignore[misc]
    assert per_stream == pytest.approx(0.0012, rel=1e-6) and single == pytest.approx(0.040, rel=1e-6)
    load.add_stream()
    load.add_stream()
    # the slope, from the average the engine was measured at (the EWMA's stream count)
    assert load._per_stream_s() == pytest.approx(0.0012)
    assert load.decode_slowdown_s(64) < 0.1 * 0.040 * 63
    assert load.as_dict()["tpot_per_extra_stream_s"] == pytest.approx(0.0012, abs=1e-5)


def test_a_fitted_slope_never_goes_below_zero_or_above_an_even_split():
    c = Clock()
    load = EngineLoad(c)
    _streams_in_waves(load, c, 0.040, -0.005, [1, 4, 1, 4, 2, 3])  # noise: more streams looked faster
    assert load.stream_cost_fit()[1] < 0  # type: ignore[index]
    assert load._per_stream_s() == 0.0
    load2 = EngineLoad(c)
    _streams_in_waves(load2, c, 0.001, 0.05, [1, 4, 1, 4, 2, 3])
    assert load2._per_stream_s() <= load2.tpot_s / load2.tpot_streams  # type: ignore[operator]


def test_per_stream_cost_never_exceeds_an_even_split_of_the_average():
    load = EngineLoad(Clock())
    load.tpot_single, load.tpot_s, load.tpot_streams = 0.001, 0.08, 1.6  # a noisy fit would say 130 ms
    load.add_stream()
    load.add_stream()
    assert load.tpot_with_one_more() == pytest.approx(0.08 + 0.05 * 1.4)


def test_calibration_times_the_engine_after_a_warm_up_prompt():
    """An engine's first prompt pays one-time costs: it warms the engine and is not the measurement."""
    import asyncio
    import json

    from pdserve.router.endpoint import Endpoint
    from pdserve.router.pool import EnginePool

    ep = Endpoint(role="prefill", url="http://x", engine_id="p0")
    orch = Orchestrator(EnginePool([ep]), cfg(5.0), model_id=MODEL)
    calls: list[list[int]] = []

    async def probe(ep, prompt, max_tokens, timeout_s):
        calls.append(prompt)
        took = 10.0 if len(calls) == 1 else 0.1  # the first prompt: 100x slower (kernels, allocator)
        return 200, json.dumps({"usage": {"prompt_tokens": len(prompt)}}).encode(), took

    orch.calibrator._probe = probe  # type: ignore[method-assign]
    rate = asyncio.run(orch.calibrator.calibrate(ep, tokens=64))
    assert len(calls) == 2 and calls[0] != calls[1]  # a different prompt: no prefix cache answers the second
    assert rate == pytest.approx(640.0) and ep.load.calibrated_rate == pytest.approx(640.0)


def test_calibration_fits_the_engines_context_and_shrinks_after_a_refusal():
    """A short context (max_model_len below the calibration prompt) is calibrated all the same: the prompt fits
    the context the router knows, and a try the engine refuses is followed by a shorter one."""
    import asyncio
    import json

    from pdserve.router.calibration import CALIBRATION_MIN_TOKENS, CALIBRATION_TOKENS
    from pdserve.router.endpoint import Endpoint
    from pdserve.router.pool import EnginePool
    from pdserve.router.validate import EngineLimits

    ep = Endpoint(role="prefill", url="http://x", engine_id="p0")
    orch = Orchestrator(EnginePool([ep]), cfg(5.0), model_id=MODEL, limits=EngineLimits(max_model_len=300))
    sizes: list[int] = []
    context = [150]  # the model's own context is shorter still: the engine refuses longer prompts

    async def probe(ep, prompt, max_tokens, timeout_s):
        sizes.append(len(prompt))
        if len(prompt) + max_tokens > context[0]:
            return 400, b'{"error": {"message": "maximum context length is 150 tokens"}}', 0.01
        return 200, json.dumps({"usage": {"prompt_tokens": len(prompt)}}).encode(), 0.1

    orch.calibrator._probe = probe  # type: ignore[method-assign]
    assert asyncio.run(orch.calibrator.calibrate(ep)) is None and sizes == [299]  # fits the context it knows
    assert ep.load.calibration_failures == 0  # (a refused size is not a try: the next is shorter)
    assert asyncio.run(orch.calibrator.calibrate(ep)) == pytest.approx(1490.0)  # 149 tokens in 0.1 s
    assert sizes[1:] == [149, 149]
    context[0] = 10  # no prompt fits: the size stops at the floor, where refusals count as tries
    ep2 = Endpoint(role="prefill", url="http://y", engine_id="p1")
    for _ in range(6):
        asyncio.run(orch.calibrator.calibrate(ep2))
    assert sizes[-6:] == [299, 149, 74, 37, 32, 32] and CALIBRATION_MIN_TOKENS == 32 < CALIBRATION_TOKENS
    assert ep2.load.calibration_failures == 2


def test_refusals_of_one_burst_are_told_to_come_back_spread_out():
    """Clients refused at the same moment get different waits (else they return as one burst), on average
    the estimate."""
    from pdserve.router.admission import RETRY_JITTER

    waits = [Refused("busy", cause="prefill_wait", wait_s=9.0, cfg=cfg(5.0)).retry_after_ms for _ in range(400)]
    excess_ms = (9.0 - 5.0) * 1000  # the estimate beyond the budget (cfg(5.0): 5 s)
    assert all(excess_ms * (1 - RETRY_JITTER) <= w <= excess_ms * (1 + RETRY_JITTER) + 1 for w in waits)
    assert len(set(waits)) > 100
    assert abs(sum(waits) / len(waits) - excess_ms) < excess_ms * RETRY_JITTER / 4
    # the jitter's extremes, exactly
    lo = Refused("busy", cause="prefill_wait", wait_s=9.0, cfg=cfg(5.0), jitter=lambda: 0.0)
    hi = Refused("busy", cause="prefill_wait", wait_s=9.0, cfg=cfg(5.0), jitter=lambda: 1.0)
    assert lo.retry_after_ms == pytest.approx(excess_ms * (1 - RETRY_JITTER), abs=1)
    assert hi.retry_after_ms == pytest.approx(excess_ms * (1 + RETRY_JITTER), abs=1)
    assert lo.retry_after_s == -(-lo.retry_after_ms // 1000) and hi.retry_after_s == -(-hi.retry_after_ms // 1000)


def test_a_burst_of_prompts_slows_a_new_stream_at_once_not_after_a_minute():
    """A new stream's expected time per token counts the engine's time on prompts over the last minute and
    over the last few seconds, whichever is higher: a run of long prompts that just began stalls a stream
    put there as much as one that has lasted a minute."""
    c = Clock()
    load = EngineLoad(c)
    load.tpot_single = 0.05
    c.t = 1000.0  # an engine idle for long
    for _ in range(3):  # then 6 s of prompts in the last 8 s
        load.add_prompt(1000)
        c.t += 2.0
        load.end_prompt(1000, 1000)
    c.t += 2.0
    assert load.busy_share() == pytest.approx(0.1)
    assert load.busy_share(BUSY_BURST_S) == pytest.approx(0.6)
    assert load.tpot_for_new_stream(None) == pytest.approx(0.05 / (1 - 0.6))
    c.t += 60.0  # the burst is over: the minute and the burst window are both idle again
    assert load.tpot_for_new_stream(None) == pytest.approx(0.05)


def test_by_load_disaggregates_when_idle_and_shares_phases_when_loaded():
    """router.disaggregate_by_load: P/D on idle engines; the tokens go to the prefill engine when the decode
    engine's streams make a new one slower there; the prompt goes to decode when prefill's queue is long."""
    c = Clock()
    pool = EnginePool([endpoint("prefill", "http://p", c), endpoint("decode", "http://d", c)])
    p, d = pool.endpoints()
    cfg = RouterConfig(disaggregate_by_load=True, max_tpot_s=None, max_queue_wait_s=100)

    def where(tokens: int = 100, new: int = 10):
        a = admit(pool, cfg, disaggregate=True, reason="pd", prompt_tokens=tokens, lease_s=None, new_tokens=new)
        return (a.prefill.role if a.prefill else None, a.decode.role, a.reason)

    assert where() == ("prefill", "decode", "pd")
    assert admit(pool, RouterConfig(max_tpot_s=None), disaggregate=True, reason="pd", prompt_tokens=100,
                 lease_s=None).reason == "pd"
    # Decode holds four streams, measured at 0.1 s per token with four (0.05 alone); prefill holds none.
    d.load.tpot_single, d.load.tpot_s, d.load.tpot_streams, d.load.streams = 0.05, 0.1, 4.0, 4
    assert where() == (None, "prefill", "by_load_whole_on_prefill")
    # Prefill busy with prompts the whole time: its streams would stall, so P/D again.
    p.load.add_prompt(1000)
    c.t += 60.0
    assert p.load.busy_share() == pytest.approx(0.9)
    assert where(new=1) in (("prefill", "decode", "pd"), (None, "decode", "by_load_prefill_on_decode"))
    # A long prefill queue and an idle decode engine of the same speed: the prompt is computed on decode.
    pool = EnginePool([endpoint("prefill", "http://p", c), endpoint("decode", "http://d", c)])
    p, d = pool.endpoints()
    p.load.add_prompt(2000)  # 20 s of work at 100 tokens/s
    assert where() == (None, "decode", "by_load_prefill_on_decode")
    # ... but not while decode streams, unless the prompt is short against the shortest stream there: it
    # stalls every stream for its whole length. Decode runs 0.05 s steps, prompts at 100 tokens/s.
    d.load.tpot_s = d.load.tpot_single = 0.05
    d.load.add_stream()  # a stream that did not say its length: counted as BY_LOAD_UNKNOWN_TOKENS
    assert where() == ("prefill", "decode", "pd")  # 100 tokens: 1 s, 20 steps
    short = int(BY_LOAD_STALL_SHARE * BY_LOAD_UNKNOWN_TOKENS * 0.05 * 100)
    assert where(tokens=short) == (None, "decode", "by_load_prefill_on_decode")
    assert where(tokens=short + 5)[2] == "pd"
    d.load.end_stream(None)
    # A P/D request on its way to decode (due now: its prefill engine's speed unknown) waits for the
    # prompt: decode takes it only while that costs the request on its way less than the prompt gains.
    d.load.add_pending(10)
    assert where() == (None, "decode", "by_load_prefill_on_decode")  # 1 s of wait against 20 s gained
    d.load.add_pending(10)
    assert where(tokens=1000)[2] != "by_load_prefill_on_decode"  # 2 x 10 s of wait against 20 s
    d.load.end_pending(10)
    d.load.end_pending(10)
    assert d.load.pending == 0 and d.load.pending_delay_s(5.0) == 0.0
    assert where() == (None, "decode", "by_load_prefill_on_decode")
    # The stall is judged against each stream's own length: a 400-token answer takes a prompt 4x as long
    # as an unknown one does, a 25-token answer a quarter of it; the shortest stream decides.
    long_answer = Flight({"prefill": 0, "decode": 0}, RouterMetrics(), 10, new_tokens=400)
    long_answer.start_stream(d)
    assert where(tokens=4 * short) == (None, "decode", "by_load_prefill_on_decode")
    assert where(tokens=4 * short + 10)[2] != "by_load_prefill_on_decode"
    short_answer = Flight({"prefill": 0, "decode": 0}, RouterMetrics(), 10, new_tokens=25)
    short_answer.bound_for(d)  # on its way: its prefill leg runs
    assert where(tokens=short // 4) == (None, "decode", "by_load_prefill_on_decode")
    assert where(tokens=short // 4 + 5)[2] != "by_load_prefill_on_decode"
    short_answer.release()
    long_answer.release()
    assert d.load.answers == {} and d.load.shortest_answer(BY_LOAD_UNKNOWN_TOKENS) is None
    assert where() == (None, "decode", "by_load_prefill_on_decode")


def test_by_load_a_burst_of_long_prompts_is_shared_by_a_decode_engine_that_streams_nothing():
    """Long first turns arriving together: prefill's queue is soon past the budget, and decode, not idle
    (the first one's decode leg is on its way), would refuse them all; by load, decode computes one itself
    when it is done before that leg is due, or keeps it waiting less than the prompt gains."""
    c = Clock()
    p, d = endpoint("prefill", "http://p", c), endpoint("decode", "http://d", c)
    pool = EnginePool([p, d])
    by_load = cfg(disaggregate_by_load=True, max_tpot_s=None)  # 5 s of queue allowed; 100 tokens/s each

    def admit_one(conf: RouterConfig = by_load, tokens: int = 800):
        return admit(pool, conf, disaggregate=True, reason="pd", prompt_tokens=tokens, lease_s=60,
                     new_tokens=32)

    def flight(tokens: int = 800) -> Flight:
        return Flight({"prefill": 0, "decode": 0}, RouterMetrics(), tokens, new_tokens=32)

    first = admit_one()
    assert (first.prefill, first.decode, first.reason) == (p, d, "pd")
    f1 = flight()
    f1.bound_for(d, p)  # due on decode in 8 s: prefill's 800 tokens
    f1.queue_prompt(p)
    assert d.load.pending_delay_s(8.0) == pytest.approx(0.0) and d.load.pending_delay_s(9.0) == pytest.approx(1.0)
    with pytest.raises(Refused):  # prefill's 8 s of queue is past the budget; decode is not idle
        admit_one(cfg(max_tpot_s=None))
    second = admit_one()  # on decode: done in 8 s, when the first's leg arrives
    assert (second.prefill, second.decode, second.reason) == (None, d, "by_load_prefill_on_decode")
    f2 = flight()
    f2.queue_prompt(d)
    with pytest.raises(Refused):  # decode's own queue (8 s) is past the budget now too
        admit_one()
    f2.release()
    # A leg due sooner than decode would finish waits out the rest: decode only while that is less than
    # what the prompt gains. Due in 8 s; a 1,000-token prompt done in 10 s on decode, 18 s on prefill.
    assert admit_one(tokens=1000).reason == "by_load_prefill_on_decode"  # 2 s of wait for 8 s gained
    f1.release()
    late = flight(300)
    late.bound_for(d, p)  # due in 3 s
    late.queue_prompt(p)
    p.load.add_prompt(300)  # prefill's queue: 6 s
    with pytest.raises(Refused):  # 10 s on decode (7 s of wait for the leg) against 16 s on prefill
        admit_one(tokens=1000)
    assert admit_one(tokens=700).reason == "by_load_prefill_on_decode"  # 4 s of wait against 6 s gained
    # Streams running on decode: a long prompt there would stall them, so no.
    late.release()
    p.load.add_prompt(300)  # prefill's queue: 6 s again
    d.load.tpot_s = d.load.tpot_single = 0.05
    d.load.add_stream()
    with pytest.raises(Refused):
        admit_one()


def test_a_request_of_many_sequences_counts_as_that_many_streams_and_what_it_slows_the_others_by():
    """One ``n: 64`` request counted as one stream: admission let it onto a streaming engine, where each of its
    sequences costs every other stream a step's share, and kept sending more there."""
    c = Clock()
    d = endpoint("decode", "http://d", c)
    pool = EnginePool([d])
    d.load.tpot_single, d.load.tpot_s, d.load.tpot_streams = 0.03, 0.05, 2.0  # 20 ms per extra stream
    many = dict(disaggregate=False, reason="n>1", prompt_tokens=10, lease_s=30, new_tokens=50, sequences=64)
    # 64 sequences at once: 1.3 s per token, past max_tpot_s; on an idle engine its own sequences are its
    # service (a 429 there would never end), beside a stream they are not.
    assert admit(pool, cfg(8.0), **many).decode is d
    assert admit(pool, cfg(8.0, max_tpot_s=None), **many).decode is d
    running = Flight({"prefill": 0, "decode": 0}, RouterMetrics(), 10, new_tokens=101)
    running.start_stream(d)
    with pytest.raises(Refused) as e:
        admit(pool, cfg(8.0), **many)
    assert e.value.cause == "decode_tpot" and "64 sequences" in str(e.value)
    assert d.load.others_slowdown_s(64, 100) == pytest.approx(0.02 * 63 * 100)
    assert d.load.others_slowdown_s(1, 100) == 0.0
    with pytest.raises(Refused) as e:
        admit(pool, cfg(8.0, max_tpot_s=None), **many)
    assert e.value.cause == "decode_wait"
    assert admit(pool, cfg(8.0, max_tpot_s=None), **{**many, "sequences": 1}).decode is d
    # Admitted, it is 64 streams in the engine's load until it ends, and its time per token teaches nothing.
    big = Flight({"prefill": 0, "decode": 0}, RouterMetrics(), 10, new_tokens=50, sequences=64)
    big.start_stream(d)
    assert d.load.streams == 65 and d.load.tpot_with_one_more() == pytest.approx(0.05 + 0.02 * 64)
    before = d.load.tpot_s
    big.end_stream(0.001)
    assert d.load.streams == 1 and d.load.tpot_s == before and sum(d.load.answers.values()) == 1


def test_many_sequences_wait_for_a_measured_engine_before_joining_its_streams():
    c = Clock()
    d = endpoint("decode", "http://d", c)
    pool = EnginePool([d])
    many = dict(disaggregate=False, reason="n>1", prompt_tokens=10, lease_s=30, new_tokens=50, sequences=8)
    assert admit(pool, cfg(8.0), **many).decode is d  # idle, unmeasured: nothing to slow
    Flight({"prefill": 0, "decode": 0}, RouterMetrics(), 10, new_tokens=100).start_stream(d)
    with pytest.raises(Refused) as e:
        admit(pool, cfg(8.0), **many)
    assert e.value.cause == "decode_wait" and "until the engine's speed is measured" in str(e.value)
    assert admit(pool, cfg(8.0), **{**many, "sequences": 1}).decode is d
    # Its calibration's idle step is enough: a stream costs a quarter of it (and no stream of many
    # sequences would ever time one).
    d.load.calibrated(1000.0, tpot_single=0.04)
    assert d.load.others_slowdown_s(8, 100) == pytest.approx(0.25 * 0.04 * 7 * 99)
    assert admit(pool, cfg(8.0), **{**many, "sequences": 2}).decode is d


def test_a_request_that_cannot_be_split_and_is_mostly_prompt_leaves_a_streaming_decode_engine_alone():
    """``max_tokens: 1`` (or prompt logprobs, a fetched image, a batch of prompts) cannot be split, and was
    computed on the decode engine beside other clients' streams, an 8,000-token prompt stalling each of them for
    its whole time. Now: on decode only where the stall is small or none streams, else whole on a prefill
    engine (which holds no streams), else 429."""
    c = Clock()
    p, d = endpoint("prefill", "http://p", c, rate=1000.0), endpoint("decode", "http://d", c, rate=1000.0)
    pool = EnginePool([p, d])
    d.load.tpot_s = d.load.tpot_single = 0.05
    one = dict(disaggregate=False, reason="max_tokens=1", lease_s=30, new_tokens=1)
    assert admit(pool, cfg(8.0), prompt_tokens=8000, **one).decode is d  # nothing streams there: decode
    Flight({"prefill": 0, "decode": 0}, RouterMetrics(), 10, new_tokens=200).start_stream(d)
    got = admit(pool, cfg(8.0), prompt_tokens=6000, **one)  # 6 s against a stream's 200 × 50 ms
    assert got.decode is p and got.prefill is None and got.reason == "max_tokens=1_on_prefill"
    got = admit(pool, cfg(8.0), prompt_tokens=200, **one)  # 0.2 s: within 8 % of the stream's 10 s
    assert got.decode is d and got.reason == "max_tokens=1"
    for reason in ("prompt logprobs", "media_url", "batched prompts"):
        assert admit(pool, cfg(8.0), prompt_tokens=6000, **{**one, "reason": reason}).decode is p
    assert admit(pool, cfg(8.0), prompt_tokens=6000, **{**one, "reason": "n>1"}).decode is d  # (its sequences)
    # A long answer would decode on prefill, where its queue does not show it: decode, as any request.
    assert admit(pool, cfg(8.0), prompt_tokens=6000, **{**one, "new_tokens": 200}).decode is d
    # What decode engines refuse (their token rate, their LoRA batch) does not refuse it: prefill may answer.
    assert admit(pool, cfg(8.0, max_tpot_s=0.01), prompt_tokens=200, **one).decode is p
    p.load.add_prompt(9000)  # prefill's queue past the budget: 429, never decode's streams
    with pytest.raises(Refused) as e:
        admit(pool, cfg(8.0), prompt_tokens=6000, **one)
    assert e.value.cause == "prefill_wait"
    assert admit(EnginePool([d]), cfg(8.0), prompt_tokens=6000, **one).decode is d  # no prefill role: as before
