"""Admission by work through a router over fake engines on loopback: refusals before any leg, claims given
back when a client leaves, calibration, what a whole answer teaches decode (the pure parts: tests/unit)."""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import pytest

from pdserve.router.orchestrator import Orchestrator
from pdserve.testing.fake_router import MODEL
from pdserve.testing.fake_router import SlowRouter as Slow


def test_a_burst_of_long_prompts_is_refused_at_once_and_costs_prefill_nothing():
    # 400-token prompts at 400 tokens/s: 1 s each; with max_queue_wait_s 1 at most two are admitted.
    with Slow(rate=400.0, delay_s=1.0, max_tpot_s=None) as s:
        body = {"model": MODEL, "prompt": list(range(1, 401)), "max_tokens": 4}

        def call(_: int) -> tuple[int, float, httpx.Response]:
            t = time.perf_counter()
            r = httpx.post(s.srv.url + "/v1/completions", json=body, timeout=30)
            return r.status_code, time.perf_counter() - t, r

        with concurrent.futures.ThreadPoolExecutor(8) as ex:
            got = list(ex.map(call, range(8)))
        codes = [g[0] for g in got]
        # Two fit on prefill; one more may run on the idle decode engine.
        assert 2 <= codes.count(200) <= 4 and codes.count(429) == 8 - codes.count(200), codes
        refused = [g for g in got if g[0] == 429]
        for _, _, r in refused:
            assert int(r.headers["retry-after"]) >= 1
            assert r.json()["error"]["type"] == "rate_limit_error"
            assert "prefill is busy" in r.json()["error"]["message"]
        # Refused requests never reached an engine; admitted ones went P/D (decode was busy streaming or
        # held queued work, so nothing spilled there unless it was idle).
        assert s.prefill.counters["requests"] + s.decode.counters["recomputed"] == codes.count(200)
        text = httpx.get(s.srv.url + "/metrics?engines=0").text
        assert f'pdserve_admission_refused_total{{cause="prefill_wait"}} {float(codes.count(429))}' in text
        assert 'pdserve_engine_prompt_tokens_per_second{replica=' in text
        # Every claim came back.
        assert s.orch.gate.admitted == {"prefill": 0, "decode": 0}
        assert all(ep.load.queued_tokens == 0 and ep.load.streams == 0 for ep in s.pool.endpoints())


def _settled(s: Slow, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if s.orch.gate.admitted == {"prefill": 0, "decode": 0} and all(ep.load.idle() for ep in s.pool.endpoints()):
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("where", ["during_prefill", "before_first_byte", "mid_stream"])
def test_a_client_that_leaves_gives_every_claim_back(where):
    with Slow(rate=1e6, delay_s=0.0, max_tpot_s=None) as s:
        body = {"model": MODEL, "prompt": "a b c", "max_tokens": 64, "stream": True}
        if where == "during_prefill":
            s.prefill.faults.delay_s = 2.0
        elif where == "before_first_byte":
            s.decode.faults.delay_s = 2.0
        with httpx.Client(timeout=httpx.Timeout(0.5)) as c:
            if where == "mid_stream":
                s.decode.faults.delay_s = 0.0
                with c.stream("POST", s.srv.url + "/v1/completions", json=body) as r:
                    assert r.status_code == 200
                    next(r.iter_raw())  # one chunk, then hang up
            else:
                with pytest.raises(httpx.ReadTimeout):
                    c.post(s.srv.url + "/v1/completions", json=body)
        assert _settled(s), (s.orch.gate.admitted, [ep.as_dict() for ep in s.pool.endpoints()])
        # And the router still serves.
        s.prefill.faults.delay_s = s.decode.faults.delay_s = 0.0
        assert httpx.post(s.srv.url + "/v1/completions", json={**body, "stream": False}).status_code == 200
        assert _settled(s)


def test_calibration_measures_a_new_engine_against_a_fake():
    import asyncio

    with Slow(rate=1.0, delay_s=0.0) as s:
        for ep in s.pool.endpoints():
            ep.load.calibrated_rate = None
        orch = Orchestrator(s.pool, s.router_cfg, model_id=MODEL)
        seen: list[tuple[str, float]] = []
        orch.calibrator.on_calibrated = lambda ep, rate: seen.append((ep.role, rate))

        async def run() -> None:
            try:
                for ep in s.pool.endpoints():
                    assert await orch.calibrator.calibrate(ep, tokens=64) > 0
            finally:
                await orch.close()

        asyncio.run(run())
        dec = next(ep for ep in s.pool.endpoints() if ep.role == "decode")
        assert all(ep.load.calibrated_rate for ep in s.pool.endpoints())
        assert dec.load.tpot_single is not None and dec.load.tpot_single > 0
        assert sorted(r for r, _ in seen) == ["decode", "prefill"]


def test_short_whole_answers_do_not_teach_decode_a_speed_made_of_the_handoff():
    """A non-streamed P/D answer's decode leg includes the handoff: with two tokens, its time per token is
    the handoff's (on a slow host decode's TPOT read 1.28 s and ``max_tpot_s`` refused every request)."""
    with Slow(rate=10_000.0, delay_s=0.4, local_prefill_below_tokens=0) as s:
        dec = next(ep for ep in s.pool.endpoints() if ep.role == "decode")
        for _ in range(3):
            r = httpx.post(s.srv.url + "/v1/completions", timeout=30,
                           json={"model": MODEL, "prompt": "one two three four", "max_tokens": 2})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        assert s.prefill.counters["requests"] == 3  # every one disaggregated
        assert dec.load.tpot_s is None and dec.load.tpot_single is None
        reg = s.orch.metrics.registry

        def decode_leg() -> tuple[float, float]:  # the router's own timing of decode legs: (count, sum)
            return (reg.get_sample_value("pdserve_phase_duration_seconds_count", {"phase": "decode"}) or 0.0,
                    reg.get_sample_value("pdserve_phase_duration_seconds_sum", {"phase": "decode"}) or 0.0)

        (n0, s0) = decode_leg()
        r = httpx.post(s.srv.url + "/v1/completions", timeout=30,
                       json={"model": MODEL, "prompt": "one two three four", "max_tokens": 20})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 20
        (n1, s1) = decode_leg()
        # What decode learnt is that answer's decode leg (the handoff included) spread over its 20 tokens.
        assert n1 == n0 + 1 and dec.load.tpot_s == pytest.approx((s1 - s0) / 20)
