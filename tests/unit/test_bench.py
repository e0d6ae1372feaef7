import asyncio
import random

import pytest

from pdserve.bench.client import Result
from pdserve.bench.runner import Load, run_load
from pdserve.bench.stats import SLO, percentile, summarize
from pdserve.bench.workload import BenchRequest, Lengths, PromptFactory, build_requests
from pdserve.engine.fake import FakeEngine, build_fake_engine
from pdserve.errors import ConfigError
from tests.servers import ThreadServer


def test_lengths():
    rng = random.Random(0)
    assert Lengths.parse("128").sample(rng) == 128
    u = Lengths.parse("uniform:10-20")
    assert all(10 <= u.sample(rng) <= 20 for _ in range(100))
    assert Lengths.parse("normal:100,5").sample(rng) > 50
    for bad in ("x", "uniform:5", "normal:1", "gauss:1,2"):
        with pytest.raises(ConfigError):
            Lengths.parse(bad)


def test_prompts_are_seeded_and_share_prefix():
    a = build_requests(PromptFactory(None, seed=3), 5, Lengths.parse("50"), Lengths.parse("8"), shared_prefix=20)
    b = build_requests(PromptFactory(None, seed=3), 5, Lengths.parse("50"), Lengths.parse("8"), shared_prefix=20)
    assert [r.prompt_ids for r in a] == [r.prompt_ids for r in b]
    assert all(len(r.prompt_ids) == 50 for r in a)
    assert len({tuple(r.prompt_ids[:20]) for r in a}) == 1
    assert len({tuple(r.prompt_ids[20:]) for r in a}) == 5


def test_percentile_and_goodput():
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([5], 99) == 5
    rs = [Result(ok=True, prompt_tokens=1, output_tokens=11, ttft_s=t, e2e_s=t + 1.0) for t in (0.1, 0.2, 0.9)]
    rs.append(Result(ok=False, prompt_tokens=1, error="boom"))
    slo = SLO.parse("ttft=500ms,tpot=150ms")
    s = summarize(rs, wall_s=2.0, slo=slo)
    assert s["succeeded"] == 3 and s["failed"] == 1
    assert s["slo_attainment"] == 0.5  # two of four meet TTFT and TPOT (100 ms)
    assert s["goodput"] == 1.0
    with pytest.raises(ConfigError):
        SLO.parse("latency=3")


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


def test_plots_write_pngs(tmp_path):
    from pdserve.bench.plots import itl_cdf, latency_cdfs, sweep

    r = Result(ok=True, prompt_tokens=1, output_tokens=3, ttft_s=0.1, e2e_s=0.3, itl_s=[0.1, 0.1]).as_dict()
    outs = [latency_cdfs({"a": {"results": [r, r]}}, tmp_path / "a.png", "t"),
            itl_cdf({"a": [1.0, 2.0, 3.0]}, tmp_path / "b.png", "t"),
            sweep({"a": [(1.0, 2.0), (2.0, 3.0)]}, tmp_path / "c.png", "x", "y", "t")]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in outs)


def test_overload_long_phase_and_summary_against_fake_engines():
    """The closed-loop clients back off on 429 and the summary accounts for every request."""
    from pdserve.bench.overload_long import _phase, _summary
    from tests.unit.test_admission import Slow

    with Slow(rate=400.0, delay_s=0.3, max_tpot_s=None) as s:
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


def test_cpu_env_variants():
    from pdserve.bench.cpu_env import _variant
    from pdserve.config.schema import PDServeArgs

    env, kv, kb = _variant("float32", PDServeArgs())
    assert env == {} and kv == {"dtype": "float32"} and kb == {"dtype": "bfloat16"}
    with pytest.raises(ConfigError):
        _variant("turbo", PDServeArgs())


def test_prefill_cache_counters_read_prefill_engines_only():
    from pdserve.bench.scenarios import prefill_cache_counters

    text = """# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",pdserve_replica="p1",pdserve_role="prefill"} 100.0
vllm:prefix_cache_hits_total{engine="0",pdserve_replica="p2",pdserve_role="prefill"} 50.0
vllm:prefix_cache_hits_total{engine="0",pdserve_replica="d1",pdserve_role="decode"} 7.0
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",pdserve_replica="p1",pdserve_role="prefill"} 400.0
vllm:prefix_cache_queries_total{engine="0",pdserve_replica="d1",pdserve_role="decode"} 9.0
# TYPE pdserve_requests_total counter
pdserve_requests_total{route="completions",status="200"} 3.0
"""
    assert prefill_cache_counters(text) == (150.0, 400.0)
