"""``--scenario goodput`` end to end at a tiny size on loopback: fake engines stand in for vLLM and a real
router for ``pdserve serve``; the scenario's own SLO probe, ladder, sweeps and conclusions (the simulation
and the crossover model alone: bench/tests/test_attainment.py, test_crossover.py)."""

from __future__ import annotations

from typing import Any

from component.fakes import MODEL, FakeApp, FakePair
from pdserve.config.schema import PDServeArgs


def test_goodput_runs_end_to_end_on_fakes(tmp_path, monkeypatch):
    from pdserve_bench import goodput
    from pdserve_bench.plan import Plan
    from pdserve_bench.scenarios import run_scenario

    built: dict[str, Any] = {}

    def app(args: PDServeArgs) -> FakeApp:
        built[len(built)] = FakeApp(args)
        return built[len(built) - 1]

    monkeypatch.setattr(goodput, "ServedApp", app)
    monkeypatch.setattr(goodput, "EnginePair", lambda args, disaggregated: FakePair())
    monkeypatch.setattr(Plan, "tokenizer", lambda self, args: None)  # made-up words: nothing to prepare
    args = PDServeArgs.model_validate({
        "cache_dir": str(tmp_path), "cpu": {"dtype": "float32"},
        **{role: {"model_loading_config": {"model_id": MODEL}} for role in ("prefill_config", "decode_config")}})
    out = run_scenario("goodput", args, {"mix": "short", "requests": "3", "probe": "2", "rates": "2,4",
                                         "slo": "ttft=60000ms,tpot=10000ms"})
    mo = out["mixes"]["short"]
    assert out["systems"] == ["colocated", "pd", "pd_by_load"]
    assert mo["slo"]["ttft_ms"] == 60000 and mo["rates"] == [2.0, 4.0]
    for s in out["systems"]:
        assert [p["rate"] for p in mo[s]] == [2.0, 4.0], s  # generous SLO: every point met, the ladder ran out
        assert all(p["failed"] == 0 and p["requests"] == 3 for p in mo[s]), mo[s]
        assert mo["goodput_rps"][s] == 4.0
    assert mo["best_pd"] in ("pd", "pd_by_load") and mo["best_pd_vs_colocated"] == 1.0
    # Each app got the router settings that make it the system it is named for.
    routers = [a.args.router for a in built.values()]
    assert [r.local_prefill_below_tokens for r in routers][0] == 0 and routers[1].disaggregate_by_load
