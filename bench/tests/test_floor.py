"""``--scenario floor``: its report maths and its plan (nothing started)."""

from __future__ import annotations

import math

import pytest

from pdserve.errors import ConfigError
from pdserve_bench.client import Result


def _rows(ttfts_ms: list[float], e2e_extra_ms: float = 1000.0, failed: int = 0) -> list[Result]:
    ok = [Result(ok=True, prompt_tokens=300, output_tokens=32, ttft_s=t / 1000, e2e_s=(t + e2e_extra_ms) / 1000)
          for t in ttfts_ms]
    return ok + [Result(ok=False, prompt_tokens=300, error="boom") for _ in range(failed)]


def test_report_ratios_per_round_and_pooled():
    from pdserve_bench.floor import TARGET, floor_report, report_lines

    rows = {300: [{"alone": _rows([100, 110, 120]), "pdserve": _rows([104, 116, 130])},
                  {"pdserve": _rows([210, 220, 230], 1300), "alone": _rows([200, 200, 200], 1000)}],
            1500: [{"alone": _rows([1000]), "pdserve": _rows([1200], 980, failed=1)}]}
    rep = floor_report(rows)
    r300 = rep["300"]
    assert [rd["ratio"]["ttft_p50"] for rd in r300["rounds"]] == pytest.approx([116 / 110, 220 / 200])
    assert r300["rounds"][1]["ratio"]["e2e_p50"] == pytest.approx(1520 / 1200)
    # Pooled over rounds: the p50 of all six requests of each system, not the mean of the rounds' ratios.
    assert r300["alone"]["ttft_ms"]["p50"] == pytest.approx(160.0)  # 100 110 120 200 200 200
    assert r300["pdserve"]["ttft_ms"]["p50"] == pytest.approx(170.0)  # 104 116 130 210 220 230
    assert r300["ratio"]["ttft_p50"] == pytest.approx(170 / 160)
    assert r300["ratio"]["e2e_p50"] == pytest.approx((1130 + 1510) / (1120 + 1200))
    assert r300["alone"]["requests"] == 6 and len(r300["alone"]["results"]) == 6
    assert r300["target"] == TARGET == 1.10
    assert r300["within_target"] == {"ttft_p50": True, "e2e_p50": False}  # 1.06x and 1.14x
    r1500 = rep["1500"]
    assert r1500["ratio"]["ttft_p50"] == pytest.approx(1.2) and r1500["within_target"]["ttft_p50"] is False
    assert r1500["pdserve"]["failed"] == 1
    lines = report_lines(rep)
    assert any(line.startswith("300 tokens, round 2: TTFT p50 alone 200 ms, pdserve 220 ms (1.10x)")
               for line in lines), lines
    summary = [line for line in lines if line.startswith("1500 tokens: pdserve ÷ alone")]
    assert summary == ["1500 tokens: pdserve ÷ alone, p50: TTFT 1.20x, e2e 1.09x (target ≤ 1.10x: ttft OVER, "
                       "e2e within); 1 requests failed"]


def test_report_without_answers_is_not_within_target():
    from pdserve_bench.floor import floor_report, report_lines

    rep = floor_report({300: [{"alone": _rows([], failed=2), "pdserve": _rows([100])}]})
    assert math.isnan(rep["300"]["ratio"]["ttft_p50"])
    assert rep["300"]["within_target"] == {"ttft_p50": False, "e2e_p50": False}
    assert "TTFT n/a" in report_lines(rep)[-1]


def test_options_and_round_order():
    from pdserve_bench.floor import read_settings, round_order

    s = read_settings({})
    assert (s.requests, s.sizes, s.output_len, s.rounds, s.connector, s.alone_core) == (
        12, [300, 1500], 32, 2, False, "prefill")
    assert [round_order(r) for r in range(3)] == [("alone", "pdserve"), ("pdserve", "alone"), ("alone", "pdserve")]
    for bad in ({"rounds": "0"}, {"prompts": "300,x"}, {"alone_core": "last"}, {"requests": "0"}):
        with pytest.raises(ConfigError, match="floor"):
            read_settings(bad)


def test_plan_alternates_a_plain_engine_alone_and_the_app(tmp_path, nothing_starts):
    from pdserve.config.schema import PDServeArgs
    from pdserve.engine.allocator import usable_cores
    from pdserve_bench.scenarios import WARMUP, run_scenario

    args = PDServeArgs.model_validate({"cache_dir": str(tmp_path), "cpu": {"dtype": "float32"}})
    plan = run_scenario("floor", args, {"requests": "4", "rounds": "3"}, dry_run=True)
    assert plan["settings"]["order"] == [["alone", "pdserve"], ["pdserve", "alone"], ["alone", "pdserve"]]
    assert plan["settings"]["dtype"] == "float32" and plan["settings"]["target"] == 1.10
    assert [s["name"] for s in plan["systems"]] == ["alone", "pdserve"]
    alone, served = plan["systems"]
    [engine] = alone["engines"]
    core = usable_cores()[0]  # where pdserve puts its prefill engine
    assert engine["core"] == core and alone["cores_by_round"] == [core] * 3
    argv, env = engine["argv"], engine["env"]
    assert "--kv-transfer-config" not in argv
    assert argv[argv.index("--dtype") + 1] == "float32"
    assert served["config"]["prefill_config"]["engine_kwargs"]["dtype"] == "float32"  # the same for both
    for flag in ("--max-model-len", "--kv-cache-memory-bytes", "--enforce-eager"):
        assert flag in argv, flag
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == str(core) and env["OMP_NUM_THREADS"] == "1"
    for size in (300, 1500):
        w = plan["workloads"][f"{size}-token prompts"]
        assert w["requests"] == 3 * 2 * (4 + WARMUP)  # rounds x systems x (warm-up + measured): all fresh
        assert w["prompt_tokens"]["min"] == w["prompt_tokens"]["max"] == size
        assert w["max_tokens"] == {"min": 32, "max": 32}
    assert [p["system"] for p in plan["phases"]] == (["alone"] * 2 + ["pdserve"] * 4 + ["alone"] * 4
                                                     + ["pdserve"] * 2)
    kept = run_scenario("floor", args, {"connector": "1", "alone_core": "rotate", "rounds": "2"}, dry_run=True)
    assert "--kv-transfer-config" in kept["systems"][0]["engines"][0]["argv"]
    cores = usable_cores()
    assert kept["systems"][0]["cores_by_round"] == [cores[0], cores[1 % len(cores)]]
