"""The load generator and the overload phase against fake engines and a fake router on loopback (the
workloads, statistics, plans and plots: bench/tests/test_bench.py)."""

import asyncio

import pytest

from pdserve.errors import ConfigError
from pdserve.testing.fake_engine import FakeEngine, build_fake_engine
from pdserve.testing.thread_server import ThreadServer
from pdserve_bench.runner import Load, run_load
from pdserve_bench.workload import BenchRequest, Lengths, PromptFactory


def test_run_load_against_fake_engine():
    eng = FakeEngine("decode", "m")
    reqs = [BenchRequest(list(range(i + 1)), 6) for i in range(6)]
    with ThreadServer(build_fake_engine(eng)) as srv:
        for load in (Load.parse("concurrency:2"), Load.parse("poisson:50")):
            results, wall = asyncio.run(run_load(srv.url, "m", reqs, load, progress=False))
            assert len(results) == 6 and all(r.ok for r in results), [r.error for r in results]
            assert all(r.output_tokens == 6 and len(r.itl_s) == 5 and r.ttft_s > 0 for r in results)
            assert wall > 0
    with pytest.raises(ConfigError):
        Load.parse("burst:3")


def test_overload_long_phase_and_summary_against_fake_engines():
    """The closed-loop clients back off on 429 and the summary accounts for every request."""
    from pdserve.testing.fake_router import SlowRouter
    from pdserve_bench.overload_long import _phase, _summary

    with SlowRouter(rate=400.0, delay_s=0.3, max_tpot_s=None) as s:
        sent, wall = asyncio.run(_phase(s.srv.url, "fake-model", PromptFactory(None, seed=1),
                                        Lengths.parse("400"), 4, clients=6, seconds=3.0, timeout_s=30))
    summary = _summary(sent, wall, 3.0, bound_s=10.0, capacity_tps=400.0)
    assert summary["sent"] == len(sent) == summary["ok"] + summary["refused_429"]
    assert summary["ok"] >= 2 and summary["refused_429"] >= 1
    assert summary["refused_with_retry_after"] == summary["refused_429"]
    assert summary["client_timeouts"] == 0 and summary["http_5xx"] == 0
    # Refused clients waited Retry-After (1 s) before sending again: at most ~3 refusals per client.
    assert summary["refused_429"] <= 6 * 4
    assert summary["refusal_ms"]["max"] > 0


def test_run_load_retries_refused_requests_and_counts_from_the_first_attempt(monkeypatch):
    """With retry_refused a 429 is sent again after the wait its answer names; the result that counts is the
    last attempt's, its times counted from the first attempt's start (asserted on the runner's own records
    and figures, not against a clock)."""
    import dataclasses

    from pdserve.testing.fake_router import SlowRouter
    from pdserve_bench import runner

    answers: dict[int, list] = {}  # per request (its prompt's list): each attempt's Result, and a copy as answered
    waits: list[float] = []
    real_completion = runner.stream_completion

    async def recorded(session, url, body, prompt_tokens, **kw):
        r = await real_completion(session, url, body, prompt_tokens, **kw)
        answers.setdefault(id(body["prompt"]), []).append((r, dataclasses.replace(r)))
        return r

    class RecordedSleeps:  # the runner's asyncio, its sleeps recorded
        def __getattr__(self, name):
            return getattr(asyncio, name)

        async def sleep(self, s):
            waits.append(s)
            await asyncio.sleep(s)

    reqs = [BenchRequest(list(range(1, 401)), 4) for _ in range(5)]
    with monkeypatch.context() as m:
        m.setattr(runner, "stream_completion", recorded)
        m.setattr(runner, "asyncio", RecordedSleeps())
        with SlowRouter(rate=400.0, delay_s=1.0, max_tpot_s=None) as s:  # 400 tokens at 400 tokens/s: 1 s each
            results, _ = asyncio.run(run_load(s.srv.url, "fake-model", reqs, Load.parse("concurrency:5"),
                                              progress=False, retry_refused=True, timeout_s=60))
    with SlowRouter(rate=400.0, delay_s=1.0, max_tpot_s=None) as s:
        plain, _ = asyncio.run(run_load(s.srv.url, "fake-model", reqs, Load.parse("concurrency:5"),
                                        progress=False, timeout_s=60))
    assert all(r.ok for r in results), [r.error for r in results]
    assert sum(r.retries > 0 for r in results) >= 1, "five 1-second prompts at once must overflow a 1-second queue"
    refused = []
    for req in reqs:
        tries = answers[id(req.prompt_ids)]
        (final, _), (_, first), (_, last) = tries[-1], tries[0], tries[-1]
        assert sum(final is r for r in results) == 1  # the last attempt is the result
        assert final.retries == len(tries) - 1 and all(a.status == 429 for _, a in tries[:-1])
        refused += [a for _, a in tries[:-1]]
        if final.retries:  # its times run from before the first attempt to the last attempt's token
            assert final.start_s <= first.start_s < last.start_s
            assert final.ttft_s == pytest.approx(last.ttft_s + last.start_s - final.start_s)
            assert final.e2e_s == pytest.approx(last.e2e_s + last.start_s - final.start_s)
    # Each refusal was sent again after the wait its answer named (retry-after-ms, else Retry-After).
    assert all(a.retry_after_ms or a.retry_after for a in refused)
    assert sorted(waits) == sorted(a.retry_wait_s for a in refused) and min(waits) > 0
    assert any(r.status == 429 and r.retries == 0 for r in plain)  # without it, refusals are results
