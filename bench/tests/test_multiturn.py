"""``--scenario multiturn``: the conversations (seeded, sized to the context), the report's arithmetic, the
counters' deltas and the plan (the scenario run end to end on fakes: bench/tests/component/test_multiturn.py)."""

from __future__ import annotations

import json

import pytest

from pdserve.config.schema import PDServeArgs
from pdserve.errors import ConfigError
from pdserve_bench import multiturn_report as report
from pdserve_bench.multiturn_run import (
    CACHE_HITS,
    CACHE_QUERIES,
    DECISIONS,
    ENGINE_TIMES,
    HANDBACKS,
    NIXL_BYTES,
    NIXL_TRANSFERS,
    PHASES,
    TOKEN_SOURCES,
    counters_delta,
)
from pdserve_bench.multiturn_workload import (
    HEADER_TOKENS,
    MARGIN,
    Shape,
    build_conversations,
    describe,
    fallback_words,
    probe_prompts,
    span,
)
from pdserve_bench.stats import SLO

WORDS = fallback_words()


def test_conversations_are_the_same_for_a_seed_and_differ_across_seeds():
    shape = Shape(conversations=3)
    a, b = build_conversations(shape, WORDS, 7), build_conversations(shape, WORDS, 7)
    assert [(c.system, [(t.user, t.think_s) for t in c.turns], c.start_s) for c in a] == \
           [(c.system, [(t.user, t.think_s) for t in c.turns], c.start_s) for c in b]
    other = build_conversations(shape, WORDS, 8)
    assert [c.system for c in other] != [c.system for c in a]
    assert len({c.system for c in a}) == 3  # a system prompt of its own per conversation


def test_conversations_have_the_asked_turns_sizes_and_think_times():
    shape = Shape(conversations=6, turns=(8, 12), tool_tokens=(20, 200), think_s=2.0)
    convs = build_conversations(shape, WORDS, 0)
    assert all(8 <= len(c.turns) <= 12 for c in convs)
    for c in convs:
        for k, t in enumerate(c.turns, start=1):
            assert t.user.startswith(f"Tool output, step {k}:")
            assert 20 + HEADER_TOKENS <= t.new_tokens <= 200 + HEADER_TOKENS
            words = len(t.user.split()) - 4  # less the header's four words
            assert t.new_tokens - HEADER_TOKENS - words in range(0, 20)  # full stops count as tokens
            assert 1.0 <= t.think_s <= 3.0
        assert c.budget(shape.max_tokens) <= shape.max_model_len - MARGIN
        assert c.system_tokens == 1500  # room for all of it at 4,096
    assert [c.start_s for c in convs] == [round(i * 2.0 / 6, 3) for i in range(6)]
    info = describe(convs, shape)
    assert info["conversations"] == 6 and info["turns"] == sum(len(c.turns) for c in convs)
    assert info["longest_budget_tokens"] <= 4096 - MARGIN


def test_a_small_context_shortens_the_system_prompt_then_refuses():
    small = Shape(conversations=4, turns=(12, 12), tool_tokens=(200, 200), max_model_len=4096)
    convs = build_conversations(small, WORDS, 0)
    assert all(c.system_tokens < 1500 for c in convs)  # 12 x (208 + 8 + 32 + 8) leaves ~960
    assert all(c.budget(small.max_tokens) <= 4096 - MARGIN for c in convs)
    with pytest.raises(ConfigError, match="system prompt"):
        build_conversations(Shape(turns=(12, 12), tool_tokens=(200, 200), max_model_len=2048), WORDS, 0)


def test_probe_prompts_are_fresh_first_turns():
    shape = Shape()
    probe = probe_prompts(shape, WORDS, 3, 0)
    assert len(probe) == 3 and all([m["role"] for m in p] == ["system", "user"] for p in probe)
    systems = {c.system for c in build_conversations(shape, WORDS, 0)}
    assert not systems & {p[0]["content"] for p in probe}


def test_ranges_parse():
    assert span("10", (8, 12)) == (10, 10) and span("8-12", (1, 1)) == (8, 12) and span("", (3, 4)) == (3, 4)
    for bad in ("x", "5-2", "0"):
        with pytest.raises(ConfigError):
            span(bad, (1, 1))


def _row(conv, turn, ttft, *, ok=True, prompt=1500, new=100, e2e=None, out=32, turns=3):
    return {"conversation": conv, "turn": turn, "turns": turns, "ok": ok, "ttft_s": ttft,
            "e2e_s": e2e if e2e is not None else ttft + 0.031 * (out - 1), "prompt_tokens": prompt,
            "output_tokens": out, "new_tokens": new, "error": "" if ok else "HTTP 500: boom", "start_s": 0.0}


def test_by_turn_short_turns_and_goodput():
    rows = [_row(0, 1, 1.0), _row(0, 2, 0.2, prompt=1700), _row(0, 3, 0.4, prompt=1900),
            _row(1, 1, 2.0), _row(1, 2, 0.0, ok=False, prompt=0)]  # conversation 1 stopped at turn 2
    bt = report.by_turn(rows)
    assert bt[1]["ttft_p50_ms"] == 1500.0 and bt[1]["ttft_p90_ms"] == pytest.approx(1900.0)
    assert bt[2] == {**bt[2], "turns": 2, "failed": 1, "ttft_p50_ms": 200.0}
    assert bt[3]["turns"] == 1 and bt[3]["prompt_tokens_mean"] == 1900
    assert [r["turn"] for r in report.short_turns(rows)] == [2, 3]
    assert report.short_turns([_row(0, 2, 0.1, prompt=1000)]) == []  # 900 tokens of history: not long
    g = report.goodput(rows, 10.0, SLO(ttft_ms=1000, tpot_ms=40))
    # Within 1 s TTFT and 40 ms TPOT: turns 1-3 of conversation 0; planned: 3 + 3 turns.
    assert g == {"turns_within_slo": 3, "turns_planned": 6, "attainment": 0.5, "goodput_turns_per_s": 0.3}


def test_goodput_at_looser_slo_scales():
    # TPOT 40 ms a token (e2e = ttft + 0.031 s x 31 tokens: 31 ms a token), TTFT 1.0 / 1.4 / 2.5 s.
    rows = [_row(0, 1, 1.0), _row(0, 2, 1.4, e2e=1.4 + 0.045 * 31), _row(0, 3, 2.5)]
    slo = SLO(ttft_ms=1000, tpot_ms=40)
    assert report.scaled(slo, 1.5) == SLO(ttft_ms=1500.0, tpot_ms=60.0)
    got = report.by_slo_scale(rows, 10.0, slo, (1.0, 1.5, 3.0))
    assert list(got) == ["1", "1.5", "3"]
    assert got["1"] == {"attainment": round(1 / 3, 4), "goodput_turns_per_s": 0.1}
    assert got["1.5"]["goodput_turns_per_s"] == 0.2  # turn 2 (1.4 s, 45 ms) within 1.5 s and 60 ms
    assert got["3"]["attainment"] == 1.0
    assert report.slo_scales("2,1.5") == (1.0, 1.5, 2.0) and report.slo_scales("1") == (1.0,)
    for bad in ("0.5", "x", "1,inf", "nan"):
        with pytest.raises(ConfigError):
            report.slo_scales(bad)
    # the ratios at each looser scale, beside the target at the SLO
    def sysm(good, by):
        return {"short_ttft_p50_ms": 100.0, "goodput_turns_per_s": good,
                "by_slo_scale": {sc: {"attainment": 0.5, "goodput_turns_per_s": g} for sc, g in by.items()}}
    t = report.targets({"pd": sysm(0.2, {"1": 0.2, "1.5": 0.4, "2": 0.0}),
                        "adaptive": sysm(0.1, {"1": 0.1, "1.5": 0.5, "2": 0.6})})
    assert t["adaptive_goodput_vs_pd"] == {"ratio": 0.5, "met": False, "by_scale": {"1.5": 1.25}}
    sp = report.spread([{"pd": sysm(0.2, {"1": 0.2, "1.5": 0.4}), "adaptive": sysm(0.1, {"1": 0.1, "1.5": 0.5})}])
    assert sp["adaptive"]["goodput_vs_pd@1.5x"] == [1.25] and "goodput_vs_pd@1x" not in sp["adaptive"]
    whole = report.summarize_system(rows, 10.0, slo, None, None, (1.0, 1.5))
    assert whole["by_slo_scale"] == {k: got[k] for k in ("1", "1.5")}
    text = "\n".join(report.lines({"systems": {"pd": whole}, "targets": t}))
    assert "goodput (attainment) at SLO x 1: 0.1 (33%), 1.5: 0.2 (67%)" in text and "looser SLO x1.5 1.25" in text


def test_slo_from_probe_is_multiples_of_the_p50():
    probe = [_row(0, 1, t, out=11, e2e=t + 0.5) for t in (1.0, 2.0, 3.0)] + [_row(0, 1, 0, ok=False)]
    slo = report.slo_from_probe(probe, 1.0, 1.5)
    assert slo.ttft_ms == 2000.0 and slo.tpot_ms == 75.0  # 50 ms a token x 1.5
    with pytest.raises(RuntimeError):
        report.slo_from_probe([_row(0, 1, 0, ok=False)], 1, 1)


def test_no_prefill_share_and_kv_bytes(tmp_path):
    assert report.no_prefill_share({"pd:pd": 3, "local:cached_on_decode": 6, "local:short_prompt": 1}) == 0.7
    assert report.no_prefill_share({}) is None and report.no_prefill_share(None) is None
    # SmolLM2-135M: 30 layers, 3 KV heads of 64 (576 / 9): 11,520 values a token.
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 30, "num_attention_heads": 9,
                                                      "num_key_value_heads": 3, "hidden_size": 576}))
    assert report.kv_bytes_per_token(str(tmp_path), "float32") == 46080
    assert report.kv_bytes_per_token(str(tmp_path), "bfloat16") == 23040
    assert report.kv_bytes_per_token(str(tmp_path), None) is None
    assert report.kv_bytes_per_token(None, "float32") is None
    delta = {"decode_pulled_tokens": 3000.0, "nixl_bytes": 1.5e8, "decisions": {}}
    kv = report.kv_moved(delta, 10, 46080)
    assert kv["source"].startswith("NIXL") and kv["measured_bytes_per_turn"] == 15_000_000
    assert kv["pulled_tokens_per_turn"] == 300.0 and kv["estimated_bytes_per_turn"] == 300 * 46080
    est = report.kv_moved({**delta, "nixl_bytes": None}, 10, 46080)
    assert est["source"] == "estimate" and est["measured_bytes_per_turn"] is None
    assert report.kv_moved(None, 10, 46080) is None


def test_targets():
    def sysm(short, good):
        return {"short_ttft_p50_ms": short, "goodput_turns_per_s": good}

    got = report.targets({"pd": sysm(400.0, 1.0), "cache_aware": sysm(150.0, 1.2), "colocated": sysm(140.0, 1.3)})
    assert got["short_ttft_vs_pd"] == {"ratio": 0.375, "target": 0.5, "met": True}
    assert got["goodput_vs_pd"] == {"ratio": 1.2, "met": True}
    assert got["goodput_vs_colocated"]["met"] is False
    assert report.targets({"pd": sysm(400.0, 1.0)}) == {}
    both = report.targets({"pd": sysm(400.0, 1.0), "adaptive": sysm(300.0, 0.9)})
    assert both == {"adaptive_short_ttft_vs_pd": {"ratio": 0.75, "target": 0.5, "met": False},
                    "adaptive_goodput_vs_pd": {"ratio": 0.9, "met": False}}
    hb = report.targets({"pd": sysm(400.0, 1.0), "pd_bidir": sysm(190.0, 1.0), "adaptive_bidir": sysm(210.0, 1.1)})
    assert hb["pd_bidir_short_ttft_vs_pd"]["met"] and hb["pd_bidir_goodput_vs_pd"] == {"ratio": 1.0, "met": True}
    assert not hb["adaptive_bidir_short_ttft_vs_pd"]["met"] and hb["adaptive_bidir_goodput_vs_pd"]["ratio"] == 1.1
    # Neither had a turn within the SLO: no ratio, and the target is not met.
    none = report.targets({"pd": sysm(400.0, 0.0), "cache_aware": sysm(150.0, 0.0)})
    assert none["goodput_vs_pd"] == {"ratio": None, "met": False}


def test_the_whole_answer_compared_with_plain_p_d():
    got = report.compared({"pd": {"e2e_mean_ms": 10000.0}, "cache_aware": {"e2e_mean_ms": 8500.0},
                           "colocated": {"e2e_mean_ms": None}})
    assert got == {"cache_aware_e2e_mean_vs_pd": 0.85}
    both = report.compared({"pd": {"e2e_mean_ms": 10000.0, "short_ttft_p50_ms": 4000.0},
                            "pd_bidir": {"e2e_mean_ms": 9000.0, "short_ttft_p50_ms": 3000.0}})
    assert both == {"pd_bidir_e2e_mean_vs_pd": 0.9, "pd_bidir_short_ttft_vs_pd": 0.75}
    assert report.compared({"cache_aware": {"e2e_mean_ms": 1.0}}) == {}
    rows = [_row(0, 1, 1.0), _row(0, 2, 0.2, prompt=1700)]
    s = report.summarize_system(rows, 5.0, SLO(ttft_ms=1000), None, None)
    assert s["e2e_mean_ms"] == round(1000 * sum(r["e2e_s"] for r in rows) / 2, 1)
    text = "\n".join(report.lines({"systems": {"cache_aware": s}, "compared": got}))
    assert "cache_aware_e2e_mean_vs_pd: 0.85" in text


def _samples(decisions, nixl, pulled, computed, prefill_s=0.0, n=0, handback=None):
    s = {(DECISIONS, (("decision", d), ("reason", r))): v for (d, r), v in decisions.items()}
    s.update({(HANDBACKS, (("outcome", k),)): v for k, v in (handback or {}).items()})
    s[(PHASES + "_sum", (("phase", "prefill"),))] = prefill_s
    s[(PHASES + "_count", (("phase", "prefill"),))] = n
    s[(ENGINE_TIMES["queue"] + "_sum", (("pdserve_role", "decode"),))] = prefill_s / 2
    s[(ENGINE_TIMES["queue"] + "_count", (("pdserve_role", "decode"),))] = n
    s[(CACHE_QUERIES, (("pdserve_role", "prefill"),))] = 100.0 * n
    s[(CACHE_HITS, (("pdserve_role", "prefill"),))] = 75.0 * n
    s[(TOKEN_SOURCES, (("pdserve_role", "decode"), ("source", "external_kv_transfer")))] = pulled
    s[(TOKEN_SOURCES, (("pdserve_role", "decode"), ("source", "local_compute")))] = computed
    s[(TOKEN_SOURCES, (("pdserve_role", "prefill"), ("source", "local_compute")))] = 1e9  # not decode's
    if nixl is not None:
        s[(NIXL_BYTES, (("pdserve_role", "decode"),))] = nixl
        s[(NIXL_TRANSFERS, (("pdserve_role", "decode"),))] = nixl / 1000
    return {"samples": s}


def test_counters_delta():
    before = _samples({("pd", "pd"): 5}, 1000.0, 100.0, 10.0, prefill_s=1.0, n=1, handback={"read": 2, "gone": 1})
    after = _samples({("pd", "pd"): 8, ("local", "cached_on_decode"): 4}, 5000.0, 400.0, 50.0, prefill_s=7.0, n=4,
                     handback={"read": 9, "gone": 1, "differs": 1})
    got = counters_delta(before, after)
    assert got == {"decisions": {"pd:pd": 3, "local:cached_on_decode": 4}, "handback": {"read": 7, "differs": 1},
                   "nixl_bytes": 4000.0,
                   "nixl_transfers": 4.0, "decode_pulled_tokens": 300.0, "decode_computed_tokens": 40.0,
                   "time_split": {"router prefill": {"mean_ms": 2000.0, "n": 3},
                                  "decode queue": {"mean_ms": 1000.0, "n": 3}},
                   "prefix_cache_hits": {"prefill": 0.75}}
    plain = counters_delta(_samples({}, None, 0, 0), _samples({}, None, 0, 0))
    assert plain["nixl_bytes"] is None and plain["decisions"] == {}
    assert counters_delta(None, after) is None


def test_report_lines_and_plot(tmp_path):
    rows = [_row(0, 1, 1.0), _row(0, 2, 0.2, prompt=1700), _row(0, 3, 0.4, prompt=1900)]
    delta = {"decisions": {"pd:pd": 1, "local:cached_on_decode": 2}, "nixl_bytes": None, "handback": {"read": 1},
             "decode_pulled_tokens": 1500.0, "time_split": {"router prefill": {"mean_ms": 812.5, "n": 1}}}
    s = report.summarize_system(rows, 5.0, SLO(ttft_ms=1000), delta, 46080)
    assert s["no_prefill_share"] == round(2 / 3, 4) and s["short_turns"] == 2 and s["failed"] == 0
    assert s["kv_moved"]["estimated_bytes_per_turn"] == 500 * 46080
    result = {"systems": {"cache_aware": s}, "topology": "1p1d", "workload": {"conversations": 1},
              "targets": {"goodput_vs_pd": {"ratio": 1.1, "met": True}}}
    text = "\n".join(report.lines(result))
    assert "without prefill 67%" in text and "(estimate)" in text and "met" in text
    assert "router prefill 812.5 (1)" in text and "handback read 1" in text
    json.loads(json.dumps(result))  # every figure serializes
    assert report.plot(json.loads(json.dumps(result)), tmp_path).exists()
    assert (tmp_path / "multiturn-goodput.png").exists()  # goodput by SLO scale beside it


def _args(tmp_path):
    return PDServeArgs.model_validate({"cache_dir": str(tmp_path), "cpu": {"dtype": "float32"}})


def test_the_plan_names_four_systems_on_the_asked_topology(tmp_path, nothing_starts):
    from pdserve_bench.scenarios import run_scenario

    plan = run_scenario("multiturn", _args(tmp_path), {"topology": "2p2d", "conversations": "2", "turns": "3"},
                        dry_run=True)
    systems = {s["name"]: s for s in plan["systems"]}
    assert list(systems) == ["colocated", "pd", "cache_aware", "adaptive"]
    assert systems["pd"]["cache_aware_steps"] == 0.0 and systems["cache_aware"]["cache_aware_steps"] == 4.0
    assert systems["adaptive"]["cache_aware_steps"] == 4.0 and systems["adaptive"]["disaggregate_by_load"]
    assert not systems["cache_aware"]["disaggregate_by_load"]
    assert systems["pd"]["replicas"] == {"prefill": 2, "decode": 2}
    assert systems["pd"]["config"]["router"] == {"cache_aware_steps": 0.0}
    assert systems["adaptive"]["config"]["router"] == {"disaggregate_by_load": True}  # (steps: the default)
    assert len(systems["colocated"]["engines"]) == 2
    assert plan["workloads"]["conversations"]["turns"] == 6
    assert [p["name"] for p in plan["phases"]][0] == "SLO probe on colocated"
    one = run_scenario("multiturn", _args(tmp_path), {"systems": "cache_aware", "slo": "ttft=500ms",
                                                      "steps": "2"}, dry_run=True)
    assert [s["name"] for s in one["systems"]] == ["cache_aware"] and one["systems"][0]["cache_aware_steps"] == 2.0
    assert not any(p["name"].startswith("SLO probe") for p in one["phases"])
    # The handback systems (asked by name): the same apps with nixl.bidirectional.
    hb = run_scenario("multiturn", _args(tmp_path), {"systems": "pd,pd_bidir,cache_aware_bidir", "slo": "ttft=500ms"},
                      dry_run=True)
    got = {s["name"]: s for s in hb["systems"]}
    assert list(got) == ["pd", "pd_bidir", "cache_aware_bidir"]
    assert got["pd_bidir"]["bidirectional"] and not got["pd"]["bidirectional"]
    assert got["pd_bidir"]["cache_aware_steps"] == 0.0 and got["cache_aware_bidir"]["cache_aware_steps"] == 4.0
    assert got["pd_bidir"]["config"]["nixl"] == {"bidirectional": True} and "nixl" not in got["pd"]["config"]
    ab = {s["name"]: s for s in run_scenario("multiturn", _args(tmp_path), {"systems": "adaptive_bidir",
                                                                          "slo": "ttft=500ms"}, dry_run=True)["systems"]}
    assert ab["adaptive_bidir"]["disaggregate_by_load"] and ab["adaptive_bidir"]["bidirectional"]
    assert ab["adaptive_bidir"]["cache_aware_steps"] == 4.0
    for bad in ({"topology": "3p1d"}, {"systems": "pd,vllm"}):
        with pytest.raises(ConfigError):
            run_scenario("multiturn", _args(tmp_path), bad, dry_run=True)


def test_rounds_alternate_the_systems_order_and_are_refused_below_one(tmp_path, nothing_starts):
    from pdserve_bench.scenarios import run_scenario

    plan = run_scenario("multiturn", _args(tmp_path), {"systems": "colocated,pd,pd_bidir", "rounds": "2",
                                                       "slo": "ttft=500ms"}, dry_run=True)
    assert [p["name"] for p in plan["phases"]] == [
        "conversations on colocated (round 1)", "conversations on pd (round 1)", "conversations on pd_bidir (round 1)",
        "conversations on pd_bidir (round 2)", "conversations on pd (round 2)", "conversations on colocated (round 2)"]
    with pytest.raises(ConfigError, match="rounds"):
        run_scenario("multiturn", _args(tmp_path), {"rounds": "0"}, dry_run=True)


def test_rounds_merge_counters_and_list_each_rounds_figures_and_ratios():
    a = {"decisions": {"pd:pd": 3}, "nixl_bytes": 10.0, "nixl_transfers": 2.0, "decode_pulled_tokens": 5.0,
         "decode_computed_tokens": 1.0, "time_split": {"router prefill": {"mean_ms": 100.0, "n": 1}},
         "prefix_cache_hits": {"decode": 0.5}}
    b = {**a, "decisions": {"pd:pd": 1, "local:short": 1}, "nixl_bytes": None,
         "time_split": {"router prefill": {"mean_ms": 200.0, "n": 3}}, "prefix_cache_hits": {"decode": 0.7}}
    m = report.merge_deltas([{**a, "handback": {"read": 2}}, {**b, "handback": {"read": 1, "gone": 3}}])
    assert m is not None and m["decisions"] == {"pd:pd": 4, "local:short": 1}
    assert m["handback"] == {"read": 3, "gone": 3}
    assert m["nixl_bytes"] is None and m["nixl_transfers"] == 4.0  # one round without NIXL's figure: none
    assert m["time_split"]["router prefill"] == {"mean_ms": 175.0, "n": 4}
    assert m["prefix_cache_hits"] == {"decode": 0.6}
    assert report.merge_deltas([a, None]) is None  # (colocated: no router counters in any round)

    def fig(goodput: float, ttft: float) -> dict:
        return {"short_ttft_p50_ms": ttft, "tpot_p50_ms": 80.0, "e2e_mean_ms": 1.0, "attainment": 0.3,
                "goodput_turns_per_s": goodput}

    sp = report.spread([{"pd": fig(0.1, 4000), "pd_bidir": fig(0.12, 2000), "colocated": fig(0.2, 2100)},
                        {"pd": fig(0.05, 5000), "pd_bidir": fig(0.1, 1800), "colocated": fig(0.08, 2000)}])
    assert sp["pd_bidir"]["goodput_turns_per_s"] == [0.12, 0.1]
    assert sp["pd_bidir"]["goodput_vs_pd"] == [1.2, 2.0] and sp["pd_bidir"]["goodput_vs_colocated"] == [0.6, 1.25]
    assert "goodput_vs_pd" not in sp["pd"] and sp["colocated"]["goodput_vs_pd"] == [2.0, 1.6]


def test_the_time_per_output_token_of_each_turn():
    rows = [{**_row(0, 1, 1.0), "e2e_s": 4.1, "output_tokens": 32}, {**_row(0, 2, 0.5), "e2e_s": 2.05,
                                                                     "output_tokens": 32}]
    s = report.summarize_system(rows, 10.0, SLO(ttft_ms=1000), None, None)
    assert s["tpot_p50_ms"] == pytest.approx(75.0)  # (100 ms and 50 ms a token)


def _turns(round_: int, met_per_conversation: list[int], turns: int = 10) -> list[dict]:
    """Rows of one round: conversation i has ``turns`` turns, the first ``met_per_conversation[i]`` of them fast
    (within a 1-s TTFT SLO), the rest slow."""
    return [{"round": round_, "conversation": i, "turn": t, "turns": turns, "ok": True, "prompt_tokens": 100,
             "output_tokens": 8, "ttft_s": 0.5 if t < met else 5.0, "e2e_s": 6.0}
            for i, met in enumerate(met_per_conversation) for t in range(turns)]


def test_goodput_ratio_interval_is_paired_by_conversation_and_decides_only_when_the_run_can():
    slo = SLO(ttft_ms=1000)
    # Twice as many turns within the SLO in every conversation of both rounds: the whole interval at 2.
    mine = {"results": _turns(0, [4, 2, 6, 8]) + _turns(1, [2, 4, 4, 6]), "wall_s": 100.0}
    other = {"results": _turns(0, [2, 1, 3, 4]) + _turns(1, [1, 2, 2, 3]), "wall_s": 100.0}
    assert report.goodput_ratio_interval(mine, other, slo) == [2.0, 2.0]
    # The run's time counts: the same turns in half the time is twice the goodput.
    assert report.goodput_ratio_interval(mine, {**other, "wall_s": 50.0}, slo) == [1.0, 1.0]
    # One conversation carries the whole lead: the interval spans 1, the verdict is undecided.
    lucky = {"results": _turns(0, [9, 1, 1, 1]) + _turns(1, [1, 1, 1, 1]), "wall_s": 100.0}
    even = {"results": _turns(0, [2, 2, 2, 2]) + _turns(1, [2, 2, 2, 2]), "wall_s": 100.0}
    ci = report.goodput_ratio_interval(lucky, even, slo)
    assert ci is not None and ci[0] < 1.0 < ci[1] and report.verdict(ci) == "undecided"
    assert report.verdict([0.4, 0.9]) == "missed" and report.verdict([1.0, 3.0]) == "met"
    # Seeded: the same figures give the same interval.
    assert report.goodput_ratio_interval(lucky, even, slo) == ci
    # Nothing in common to pair, or no time: no interval.
    assert report.goodput_ratio_interval(mine, {"results": _turns(5, [1, 1]), "wall_s": 1.0}, slo) is None
    assert report.verdict(None) is None


def test_targets_carry_the_interval_and_the_lines_say_it():
    slo = SLO(ttft_ms=1000)
    fig = {"short_ttft_p50_ms": 100.0, "goodput_turns_per_s": 0.2, "by_slo_scale": {}}
    mine = {**fig, "results": _turns(0, [4, 2, 6, 8]), "wall_s": 100.0}
    pd = {**fig, "goodput_turns_per_s": 0.1, "results": _turns(0, [2, 1, 3, 4]), "wall_s": 100.0}
    t = report.targets({"pd": pd, "cache_aware": mine}, slo)
    assert t["goodput_vs_pd"]["ci90"] == [2.0, 2.0] and t["goodput_vs_pd"]["verdict"] == "met"
    assert "ci90" not in report.targets({"pd": pd, "cache_aware": mine})["goodput_vs_pd"]  # no SLO given
    text = "\n".join(report.lines({"systems": {}, "targets": t}))
    assert "target goodput_vs_pd: ratio 2.0 -> met (90 % interval 2-2: met)" in text
