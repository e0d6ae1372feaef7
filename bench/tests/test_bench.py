import random

import pytest

from pdserve.errors import ConfigError
from pdserve_bench.client import Result
from pdserve_bench.stats import SLO, percentile, summarize
from pdserve_bench.workload import Lengths, PromptFactory, build_requests


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


def test_plots_write_pngs(tmp_path):
    from pdserve_bench.plots import itl_cdf, latency_cdfs, sweep

    r = Result(ok=True, prompt_tokens=1, output_tokens=3, ttft_s=0.1, e2e_s=0.3, itl_s=[0.1, 0.1]).as_dict()
    outs = [latency_cdfs({"a": {"results": [r, r]}}, tmp_path / "a.png", "t"),
            itl_cdf({"a": [1.0, 2.0, 3.0]}, tmp_path / "b.png", "t"),
            sweep({"a": [(1.0, 2.0), (2.0, 3.0)]}, tmp_path / "c.png", "x", "y", "t")]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in outs)


def test_overload_long_capacity_is_the_phase_mean_and_occupancy_counts_waiting_prompts():
    from pdserve_bench.client import Result
    from pdserve_bench.overload_long import Sent, phase_capacity, prefill_occupancy

    samples = [{"t": t, "engines": [{"role": "prefill", "measured_prompt_tokens_per_s": r},
                                    {"role": "decode", "measured_prompt_tokens_per_s": 5.0}]}
               for t, r in ((1.0, 9999.0), (11.0, 1000.0), (12.0, 1200.0), (13.0, None), (30.0, 9999.0))]
    assert phase_capacity(samples, 10.0, 20.0) == pytest.approx(1100.0)  # in the window, measured only
    assert phase_capacity(samples, 40.0, 50.0) is None

    def sent(start: float, ttft: float, ok: bool = True) -> Sent:
        r = Result(ok=ok, prompt_tokens=10, output_tokens=2, ttft_s=ttft, e2e_s=ttft + 1.0, itl_s=[], error="")
        return Sent(r, start + ttft + 1.0)

    # Waiting for a first token over [0, 4] and [6, 9] within the window [2, 10]: 5 of 8 s.
    got = [sent(0.0, 3.0), sent(1.0, 3.0), sent(6.0, 3.0), sent(4.0, 5.0, ok=False)]
    assert prefill_occupancy(got, 2.0, 10.0) == pytest.approx(5 / 8)


def test_cpu_env_variants():
    from pdserve.config.schema import PDServeArgs
    from pdserve_bench.cpu_env import _variant

    env, kv, kb = _variant("float32", PDServeArgs())
    assert env == {} and kv == {"dtype": "float32"} and kb == {"dtype": "bfloat16"}
    assert _variant("shared-weights", PDServeArgs()) == ({}, {}, {})
    with pytest.raises(ConfigError):
        _variant("turbo", PDServeArgs())


def test_cpu_env_shared_weights_pairs_the_setting_on_against_it_off(tmp_path, monkeypatch):
    """The variant's engine gets the weight cache's directory, the baseline's the variable emptied (off),
    on both core orders."""
    from pdserve.config.schema import PDServeArgs
    from pdserve.settings import SHARED_WEIGHTS_ENV
    from pdserve_bench import cpu_env as mod
    from pdserve_bench.plan import Plan
    from pdserve_bench.systems import EnginePair

    made: list[EnginePair] = []

    class Recorded(EnginePair):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            made.append(self)

        def spec(self):
            return {"kind": "recorded", "engines": 2}

    monkeypatch.setattr(mod, "EnginePair", Recorded)
    ports = iter(range(8100, 8200))
    monkeypatch.setattr("pdserve.engine.allocator.free_ephemeral_port", lambda host="127.0.0.1": next(ports))
    monkeypatch.setattr("pdserve.engine.allocator.port_is_free", lambda port, host="0.0.0.0": True)
    monkeypatch.setenv("PDSERVE_LOCK_DIR", str(tmp_path / "locks"))
    plan = Plan("cpu-env", dry_run=True)
    got = mod.cpu_env(PDServeArgs(cache_dir=str(tmp_path)), {"variant": "shared-weights", "concurrency": "4"}, plan)
    assert len(made) == 2 and got["workloads"]["output speed"]["concurrency"] == 4
    for swap, pair in zip((False, True), made):
        envs = [pair._command(role, "/m", core, 5600, index=i).env
                for i, (role, core) in enumerate((("prefill", 0), ("decode", 1)))]
        on, off = envs[::-1] if swap else envs
        assert on[SHARED_WEIGHTS_ENV].startswith(str(tmp_path / "shared-weights"))
        assert off[SHARED_WEIGHTS_ENV] == ""


def test_prefill_cache_counters_read_prefill_engines_only():
    from pdserve_bench.scenarios import prefill_cache_counters

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


# --- scenarios: the registry, the CLI, BENCHMARKS.md, and every scenario's plan (--dry-run) -------------

#: The smallest form of every scenario, as ``--opt`` gives them (strings). cpu-env: a dtype variant, which
#: needs no library (tcmalloc's is refused where it is not installed).
SMALL = {"requests": "2", "bursts": "2", "streams": "1", "seconds": "1", "rates": "0.5", "bound": "1",
         "clients": "2", "outs": "2", "prompts": "1", "out": "4", "prompt_len": "64", "concurrency": "2",
         "latency_requests": "5", "iters": "1", "compile": "0", "app": "0", "variant": "float32"}


def _scenarios():
    from pdserve_bench.scenarios import SCENARIOS

    return sorted(SCENARIOS)


@pytest.mark.parametrize("name", _scenarios())
def test_every_scenario_plans_without_starting_anything(name, tmp_path, nothing_starts):
    import json

    from pdserve.config.schema import PDServeArgs
    from pdserve_bench.scenarios import run_scenario

    # A cache without the prepared model: prompts come from a fixed id range, nothing is converted.
    plan = run_scenario(name, PDServeArgs(cache_dir=str(tmp_path)), dict(SMALL), dry_run=True)
    assert plan["dry_run"] is True and plan["scenario"] == name
    assert plan["systems"] and plan["phases"], plan
    systems = [s["name"] for s in plan["systems"]]
    assert len(set(systems)) == len(systems), systems
    for phase in plan["phases"]:
        assert phase["system"] is None or phase["system"] in systems, phase
        assert phase.get("workload") is None or phase["workload"] in plan["workloads"], phase
    for s in plan["systems"]:
        assert s.get("argv") or s.get("engines"), s  # what it would run, not only a name
    json.dumps(plan)  # what --dry-run prints


def test_plan_workloads_are_the_requests_the_run_sends(tmp_path, nothing_starts):
    from pdserve.config.schema import PDServeArgs
    from pdserve.engine.allocator import usable_cores
    from pdserve_bench.scenarios import WARMUP, run_scenario

    args = PDServeArgs(cache_dir=str(tmp_path))
    plan = run_scenario("handoff", args, {"requests": "5", "prompt_len": "40", "output_len": "7"}, dry_run=True)
    w = plan["workloads"]["prompts"]
    assert w["requests"] == 5 + WARMUP and w["prompt_tokens"]["max"] == 40 and w["max_tokens"] == {"min": 7, "max": 7}
    assert [s["kind"] for s in plan["systems"]] == ["2 colocated engines", "prefill + decode engines, bare handoff"]
    pd = plan["systems"][1]["engines"]
    assert [e["name"] for e in pd] == ["prefill", "decode"]
    assert len({e["core"] for e in pd}) == min(2, len(usable_cores()))  # one core each
    assert all("--kv-transfer-config" in e["argv"] for e in pd)
    assert all("--kv-transfer-config" not in e["argv"] for e in plan["systems"][0]["engines"])
    assert "not prepared" in plan["settings"]["prompts_from"]
    goodput = run_scenario("goodput", args, {"rates": "0.2,0.4", "requests": "3", "mix": "long,chat"}, dry_run=True)
    assert [s["name"] for s in goodput["systems"]] == ["colocated", "pd", "pd_by_load"]
    assert goodput["systems"][2]["config"]["router"]["disaggregate_by_load"] is True
    assert [p["system"] for p in goodput["phases"]] == ["colocated", "colocated", "pd", "pd_by_load"] * 2
    w = goodput["workloads"]["long"]
    assert w["requests"] == 6 and w["prompt_tokens"]["min"] >= 1000 and w["max_tokens"]["max"] <= 128


def test_dry_run_refuses_a_scenario_that_ran(monkeypatch, tmp_path):
    from pdserve.config.schema import PDServeArgs
    from pdserve_bench import scenarios

    monkeypatch.setitem(scenarios.SCENARIOS, "eager", lambda args, opts, plan: {"ran": True})
    with pytest.raises(RuntimeError, match="ran instead of returning its plan"):
        scenarios.run_scenario("eager", PDServeArgs(cache_dir=str(tmp_path)), {}, dry_run=True)
    with pytest.raises(ConfigError, match="unknown scenario"):
        scenarios.run_scenario("nope", PDServeArgs(), {}, dry_run=True)


def test_bench_help_names_every_scenario():
    import contextlib
    import io

    from pdserve.cli.main import build_parser
    from pdserve_bench.scenarios import SCENARIOS

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        build_parser().parse_args(["bench", "--help"])
    import re

    text = re.sub(r"-\s+", "-", " ".join(out.getvalue().split()))  # argparse wraps lines at hyphens
    missing = [name for name in SCENARIOS if name not in text]
    assert not missing, f"pdserve bench --help does not name {missing}"


def test_registry_cli_and_benchmarks_name_the_same_scenarios():
    import argparse
    import re
    from pathlib import Path

    from pdserve.cli.main import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    bench = sub.choices["bench"]
    help_text = next(a.help for a in bench._actions if a.dest == "scenario")
    listed = {n.strip() for n in help_text.split("(")[0].split("|")}
    assert listed == set(_scenarios())
    md = (Path(__file__).resolve().parents[2] / "BENCHMARKS.md").read_text()
    reproduce = md.split("## Reproduce", 1)[1].split("\n## ", 1)[0]
    assert set(re.findall(r"--scenario ([\w-]+)", reproduce)) == set(_scenarios())


def test_cli_dry_run_prints_and_writes_the_plan(tmp_path, capsys, nothing_starts):
    import json

    from pdserve.cli.main import main

    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"cache_dir: {tmp_path / 'cache'}\n")
    out = tmp_path / "out"
    assert main(["bench", "--scenario", "overload", "--dry-run", "--config", str(cfg), "--out", str(out),
                 "--requests", "2", "--opt", "seconds=5"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads((out / "overload-plan.json").read_text())
    assert printed["settings"]["seconds_per_phase"] == 5.0
    assert [p["name"] for p in printed["phases"]] == ["capacity", "bounded_1x", "bounded_2x", "unbounded_2x"]
    assert main(["bench", "--dry-run", "--out", str(out)]) == 2


def test_goodput_ladder_rate_and_slo():
    from pdserve_bench.goodput import goodput_rate, ladder, slo_from_single

    assert ladder(0.2, 1.5, 4) == [0.2, 0.3, 0.45, 0.675]
    with pytest.raises(ConfigError, match="bad rate ladder"):
        ladder(0.2, 1.0, 3)
    pts = [{"rate": 0.2, "slo_attainment": 1.0}, {"rate": 0.3, "slo_attainment": 0.95},
           {"rate": 0.45, "slo_attainment": 0.85}, {"rate": 0.6, "slo_attainment": 0.95}]
    assert goodput_rate(pts) == 0.3  # climbing stops at the first miss; a lucky point past it is not goodput
    assert goodput_rate([{"rate": 0.2, "slo_attainment": 0.5}]) == 0.0
    slo = slo_from_single({"ttft_ms": {"p50": 1000.0}, "tpot_ms": {"p50": 40.0}}, 3, 1.5)
    assert (slo.ttft_ms, slo.tpot_ms) == (3000.0, 60.0)


def test_goodput_fits_the_trade_from_its_requests_and_plots_it(tmp_path):
    """A sweep's per-request timelines give the crossover: the fit, its prediction for the mix, the plot."""
    from pdserve_bench import crossover as cx
    from pdserve_bench.goodput import costs, crossover_line, plot

    def req(target, start, ttft, e2e, tokens=65, prompt=1000):
        return {"ok": True, "target": target, "start_s": start, "ttft_s": ttft, "e2e_s": e2e,
                "output_tokens": tokens, "prompt_tokens": prompt}

    col = [req("a", 0, 1, 5), req("a", 2, 1.5, 9), req("b", 0, 1, 4.5), req("b", 1, 2, 9.5), req("a", 6, 1, 7)]
    pd = [req("u", 0, 1, 6), req("u", 1, 1, 7.5), req("u", 3, 1, 9), req("u", 9, 1, 13)]
    mo = {"single": {"tpot_ms": {"p50": 50.0}}, "prefill_tok_s": 1000.0, "slo": {"ttft_ms": 3000, "tpot_ms": 75.0},
          "colocated": [{"rate": 0.2, "slo_attainment": 1.0, "ttft_p90_ms": 2e3, "tpot_p90_ms": 70.0, "results": col}],
          "pd": [{"rate": 0.2, "slo_attainment": 1.0, "ttft_p90_ms": 1e3, "tpot_p90_ms": 72.0, "results": pd}],
          "goodput_rps": {"colocated": 0.2, "pd": 0.2}, "prompt_len": "1000", "output_len": "65"}
    got = costs(mo, 1.5, 3.0)
    assert got["fit"]["requests"] == 9 and got["prompt_tokens"] == 1000 and got["new_tokens"] == 65
    want = cx.capacities(got["fit"]["beta"], got["fit"]["gamma"], 0.05, 1000.0, [1000] * 9, 65, 1.5, 3.0)
    assert got["predicted"]["ratio"] == pytest.approx(want["ratio"], abs=1e-3)
    assert "breaks even" in crossover_line(got)
    mo["crossover"] = got
    made = plot({"systems": ["colocated", "pd"], "mixes": {"long": mo}}, tmp_path)
    assert [p.name for p in made] == ["goodput-long.png", "goodput-long-crossover.png"]
    assert all(p.stat().st_size > 0 for p in made)


def test_goodput_rejects_unknown_mixes_and_systems(tmp_path):
    from pdserve.config.schema import PDServeArgs
    from pdserve_bench.scenarios import run_scenario

    args = PDServeArgs(cache_dir=str(tmp_path))
    with pytest.raises(ConfigError, match="unknown mix"):
        run_scenario("goodput", args, {"mix": "long,novel"}, dry_run=True)
    with pytest.raises(ConfigError, match="must include colocated"):
        run_scenario("goodput", args, {"systems": "pd"}, dry_run=True)


def test_an_endpoint_runs_summary_reads_as_a_table():
    """`pdserve bench --url` prints its runs as a table as well as JSON: one row per load, ms rounded, the
    SLO column only when an SLO was given, and the errors of a run with failures named under it."""
    from pdserve_bench.stats import summarize, table

    def result(ttft, ok=True):
        return Result(ok=ok, prompt_tokens=100, ttft_s=ttft, e2e_s=ttft + 1.0, output_tokens=11, itl_s=[0.1] * 10,
                      error="" if ok else "HTTP 429: busy")

    good = summarize([result(0.5), result(0.7)], wall_s=2.0)
    rows = table({"concurrency:1": good}).splitlines()
    assert rows[0].split() == ["load", "ok", "req/s", "out", "tok/s", "TTFT", "p50", "p90", "TPOT", "p50", "p90",
                               "e2e", "p50", "p90"]
    assert rows[1].split()[:4] == ["concurrency:1", "2/2", "1.00", "11.0"] and rows[-1] == "(ms)"
    bad = summarize([result(0.5), result(0.0, ok=False)], wall_s=1.0, slo=SLO.parse("ttft=600ms"))
    rows = table({"rate:1": bad, "rate:2": good}).splitlines()
    assert rows[0].endswith("in SLO") and rows[1].split()[1] == "1/2" and rows[1].endswith("50%")
    assert rows[2].endswith("-") and rows[-1] == "(ms; failed: HTTP 429: busy)"


def test_the_tenants_scenario_puts_priorities_in_the_engines_only_when_asked():
    from pdserve.config.schema import PDServeArgs
    from pdserve_bench.tenants import with_tenants

    args = PDServeArgs.model_validate({})
    plain = with_tenants(args, 2, 1.0)
    assert plain.router.tenants["steady"].priority > plain.router.tenants["flood"].priority
    assert "scheduling_policy" not in plain.prefill_config.engine_kwargs
    both = with_tenants(args, 2, 1.0, engine_priority=True)
    assert {both.prefill_config.engine_kwargs["scheduling_policy"],
            both.decode_config.engine_kwargs["scheduling_policy"]} == {"priority"}


def test_scenarios_start_engines_in_the_dtype_serve_would_pick(tmp_path, nothing_starts, monkeypatch):
    """A scenario's own engines compute in ``cpu.dtype: auto``'s choice (the packaged model's own dtype is
    bfloat16, 7.8x slower than float32 on an AVX2 host), not whatever the model's config says."""
    import json

    from pdserve.config.schema import PDServeArgs
    from pdserve_bench import engine_dtype, scenarios

    assert scenarios.DECIDE_DTYPE_THEMSELVES <= set(scenarios.SCENARIOS)
    seen = []

    def decided(args, *, dry_run):
        seen.append(dry_run)
        args = args.model_copy(deep=True)
        for cfg in (args.prefill_config, args.decode_config):
            cfg.engine_kwargs["dtype"] = "float32"
        return args, "float32 (test)"

    monkeypatch.setattr(engine_dtype, "with_dtype", decided)
    plan = scenarios.run_scenario("handoff", PDServeArgs(cache_dir=str(tmp_path)), dict(SMALL), dry_run=True)
    assert seen == [True] and plan["settings"]["engine_dtype"] == "float32 (test)"
    systems = json.dumps(plan["systems"])
    assert systems.count('"--dtype", "float32"') == 4, systems[:500]  # both systems' two engines


def test_a_scenario_prepares_the_model_before_auto_decides_the_dtype(tmp_path, monkeypatch):
    """``cpu.dtype: auto`` takes bf16 only where it is faithful to the model, which needs the model on the host:
    on a fresh host a scenario decided before the packaged model was converted, so speed alone chose bf16."""
    import pdserve.engine.cpu_dtype as cpu_dtype
    import pdserve.model.resolve as resolve
    from pdserve.config.schema import PDServeArgs
    from pdserve_bench import engine_dtype

    order = []
    monkeypatch.setattr(resolve, "resolve_model", lambda *a, **k: order.append("model") or str(tmp_path))
    monkeypatch.setattr(cpu_dtype, "resolve_cpu_dtype", lambda args, **k: order.append("dtype") or (args, "test"))
    engine_dtype.with_dtype(PDServeArgs(cache_dir=str(tmp_path)), dry_run=False)
    assert order == ["model", "dtype"]
    order.clear()  # a dry run prepares nothing
    monkeypatch.setattr(engine_dtype, "_cached_probe", lambda cache_dir: None)
    engine_dtype.with_dtype(PDServeArgs(cache_dir=str(tmp_path)), dry_run=True)
    assert order == []
