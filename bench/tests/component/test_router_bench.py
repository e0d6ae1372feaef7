"""``--scenario router``: the router alone against minimal fake engines, run for real in its smallest form
(its dry run and its parts: bench/tests/test_router_bench.py)."""

from __future__ import annotations

import math

from pdserve.config.schema import PDServeArgs


def test_router_scenario_runs_for_real():
    """Router, fakes and client as the scenario starts them, ~1 s per mode at concurrency 4: every request
    admitted and answered, both modes measured, and an added-latency figure."""
    from pdserve_bench.scenarios import run_scenario

    out = run_scenario("router", PDServeArgs(), {"seconds": "1", "concurrency": "4", "latency_requests": "20"})
    assert out["scenario"] == "router" and out["concurrency"] == 4
    for mode in ("non_streaming", "streaming"):
        m = out[mode]
        assert m["errors"] == 0 and m["failed"] == {}, (mode, m)
        assert m["requests_per_s"] > 0, (mode, m)  # a speed, not asserted: BENCHMARKS.md has the figure
        assert m["router_cpu_ms_per_request"] > 0 and m["one_core_capacity_rps"] > 0, (mode, m)
        assert 0 < m["router_cpu_utilisation"] <= 1.5, (mode, m)
    lat = out["added_latency"]
    assert lat["pairs"] == 20
    assert 0 < lat["direct_p50_ms"] < lat["router_p50_ms"], lat
    assert math.isfinite(lat["added_p50_ms"]) and lat["added_p50_ms"] > 0, lat
    assert math.isfinite(lat["added_p90_ms"]), lat
    # The router checked the bodies as deployed: the engines' context and logprob limits are known to it.
    assert out["request_checks"]["max_model_len"] and out["request_checks"]["max_logprobs"] is not None
