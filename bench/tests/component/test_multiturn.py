"""``--scenario multiturn`` end to end at a tiny size on loopback: fake engines stand in for vLLM, a real router
(pdserve.router.build) for ``pdserve serve``; the scenario's own client, counters and report (its parts alone:
bench/tests/test_multiturn.py)."""

from __future__ import annotations

from typing import Any

import pytest

from component.fakes import MODEL, FakeApp, FakePair
from pdserve.config.schema import PDServeArgs


def test_multiturn_runs_end_to_end_on_fakes(tmp_path, monkeypatch):
    from pdserve_bench import multiturn
    from pdserve_bench.plan import Plan
    from pdserve_bench.scenarios import run_scenario

    built: dict[str, Any] = {}

    real = multiturn.build_system

    def recorded(name: str, *a: Any) -> Any:  # the scenario's own systems, over fakes
        built[name] = real(name, *a)
        return built[name]

    monkeypatch.setattr(multiturn, "EnginePair", lambda args, disaggregated: FakePair())
    monkeypatch.setattr(multiturn, "ServedApp", FakeApp)
    monkeypatch.setattr(multiturn, "build_system", recorded)
    monkeypatch.setattr(Plan, "tokenizer", lambda self, args: None)  # made-up words: nothing to prepare
    args = PDServeArgs.model_validate({
        "cache_dir": str(tmp_path), "cpu": {"dtype": "float32"},
        **{role: {"model_loading_config": {"model_id": MODEL}} for role in ("prefill_config", "decode_config")}})
    out = run_scenario("multiturn", args, {"conversations": "2", "turns": "2-3", "system_tokens": "300",
                                           "tool_tokens": "20-40", "max_tokens": "4", "think_s": "0.05",
                                           "probe": "2"})
    assert set(out["systems"]) == {"colocated", "pd", "cache_aware", "adaptive"}
    assert out["slo_probe"]["system"] == "colocated" and out["slo"]["ttft_ms"] > 0
    turns = out["workload"]["turns"]
    for name, s in out["systems"].items():
        assert s["failed"] == 0 and s["turns"] == turns, (name, s["errors"])
        assert s["turns_planned"] == turns and s["by_turn"][1]["turns"] == 2
        rows = s["results"]
        # Each turn's prompt holds the history: the system prompt, every earlier turn and answer.
        for conv in {r["conversation"] for r in rows}:
            mine = sorted((r for r in rows if r["conversation"] == conv), key=lambda r: r["turn"])
            assert all(b["prompt_tokens"] > a["prompt_tokens"] + a["output_tokens"] for a, b in zip(mine, mine[1:]))
    # Conversations stay on their colocated engine; the apps' routers counted every turn.
    col = out["systems"]["colocated"]
    assert col["decisions"] is None and col["no_prefill_share"] is None
    assert all(r["target"] == built["colocated"].urls[r["conversation"] % 2] for r in col["results"])
    for name in ("pd", "cache_aware", "adaptive"):
        s = out["systems"][name]
        assert sum(s["decisions"].values()) == turns, s["decisions"]
        assert s["kv_moved"]["source"] == "estimate" and s["kv_moved"]["measured_bytes_per_turn"] is None
    pd = out["systems"]["pd"]
    assert pd["no_prefill_share"] == 0.0  # plain P/D: every turn handed off
    assert built["pd"].args.router.cache_aware_steps == 0.0 and built["cache_aware"].args.router.cache_aware_steps > 0
    assert built["adaptive"].args.router.disaggregate_by_load and not built["cache_aware"].args.router.disaggregate_by_load
    assert set(out["targets"]) <= {f"{p}{t}" for p in ("", "adaptive_")
                                   for t in ("short_ttft_vs_pd", "goodput_vs_pd", "goodput_vs_colocated")}


def test_multiturn_rounds_run_each_system_again_and_pool_their_turns(tmp_path, monkeypatch):
    from pdserve_bench import multiturn
    from pdserve_bench.plan import Plan
    from pdserve_bench.scenarios import run_scenario

    monkeypatch.setattr(multiturn, "EnginePair", lambda args, disaggregated: FakePair())
    monkeypatch.setattr(multiturn, "ServedApp", FakeApp)
    monkeypatch.setattr(Plan, "tokenizer", lambda self, args: None)
    args = PDServeArgs.model_validate({
        "cache_dir": str(tmp_path), "cpu": {"dtype": "float32"},
        **{role: {"model_loading_config": {"model_id": MODEL}} for role in ("prefill_config", "decode_config")}})
    out = run_scenario("multiturn", args, {"systems": "colocated,pd", "rounds": "2", "conversations": "2",
                                           "turns": "2", "system_tokens": "300", "tool_tokens": "20-40",
                                           "max_tokens": "4", "think_s": "0.05", "slo": "ttft=60000ms"})
    turns = out["workload"]["turns"]
    assert len(out["rounds"]) == 2 and all(set(r) == {"colocated", "pd"} for r in out["rounds"])
    assert all(r["pd"]["turns"] == turns and "results" not in r["pd"] for r in out["rounds"])
    pooled = out["systems"]["pd"]
    assert pooled["turns"] == 2 * turns and pooled["failed"] == 0
    assert pooled["turns_planned"] == 2 * turns and pooled["attainment"] == 1.0  # (each round's plan counted)
    assert pooled["wall_s"] == pytest.approx(sum(r["pd"]["wall_s"] for r in out["rounds"]), abs=0.02)
    assert sum(pooled["decisions"].values()) == 2 * turns  # both rounds' router counters
    assert len(out["spread"]["pd"]["goodput_turns_per_s"]) == 2 and len(out["spread"]["pd"]["goodput_vs_colocated"]) == 2
    from pdserve_bench import multiturn_report

    assert any(line.startswith("pd by round: short_ttft_p50_ms") for line in multiturn_report.lines(out))
