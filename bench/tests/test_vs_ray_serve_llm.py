"""``--scenario vs-ray-serve-llm``: its plan, the Ray Serve LLM config it builds for CPU, its figures."""

import json
import math

import pytest

from pdserve.config.schema import PDServeArgs
from pdserve.errors import ConfigError

SCENARIO = "vs-ray-serve-llm"


def _args(tmp_path, **extra):
    # A pinned dtype: nothing to probe, and the three systems must all get it.
    return PDServeArgs.model_validate({"cache_dir": str(tmp_path), "cpu": {"dtype": "float32"}, **extra})


def _plan(tmp_path, opts=None, **extra):
    from pdserve_bench.scenarios import run_scenario

    return run_scenario(SCENARIO, _args(tmp_path, **extra), {"requests": "2", **(opts or {})}, dry_run=True)


def test_plan_has_the_three_systems_and_their_phases(tmp_path, nothing_starts):
    plan = _plan(tmp_path, {"paired": "0"})
    names = [s["name"] for s in plan["systems"]]
    assert names == ["ray-serve-llm", "pdserve", "colocated"]
    ray, served, colo = plan["systems"]
    assert ray["argv"][1:] == ["-m", "pdserve_bench.vs_ray_serve_llm", "--serve-ray-llm", "<config.json>"]
    assert served["kind"] == "pdserve serve"
    assert colo["kind"] == "1 colocated engine" and len(colo["engines"]) == 1
    assert "--kv-transfer-config" not in colo["engines"][0]["argv"]
    # Per system: a warm-up, single requests at both sizes, the sweep on the first size.
    for name in names:
        mine = [p for p in plan["phases"] if p["system"] == name]
        assert [p.get("point") for p in mine] == [None, "long_c1", "short_c1", "long_c2", "long_c4"]
        assert [p["load"] for p in mine] == ["concurrency:1"] * 3 + ["concurrency:2", "concurrency:4"]
    w = plan["workloads"]
    assert w["long (600 -> 32 tokens)"]["prompt_tokens"]["max"] == 600
    assert w["long (600 -> 32 tokens)"]["max_tokens"] == {"min": 32, "max": 32}
    assert w["short (16 -> 8 tokens)"]["prompt_tokens"]["max"] == 16
    assert w["long (600 -> 32 tokens), concurrency 4"]["requests"] == 12
    assert plan["settings"]["dtype"] == "float32"
    json.dumps(plan)


def test_paired_plan_measures_the_floor_inside_pdserves_run(tmp_path, nothing_starts):
    plan = _plan(tmp_path)
    assert [s["name"] for s in plan["systems"]] == ["ray-serve-llm", "pdserve"]
    assert plan["settings"]["paired"] is True and plan["settings"]["rounds"] == 4
    floor = [p for p in plan["phases"] if p["system"] == "pdserve" and p["name"].startswith("colocated")]
    assert [p["point"] for p in floor] == ["long_c1", "short_c1", "long_c2", "long_c4"]
    # Without pdserve there is nothing to pair with: the plain engine starts on its own.
    alone = _plan(tmp_path, {"systems": "colocated"})
    assert [s["name"] for s in alone["systems"]] == ["colocated"] and alone["settings"]["paired"] is False


def test_phase_times_are_means_of_what_grew_during_a_ways_rounds():
    """The paired point's histogram means: only the growth within the rounds counts, per label, summed over
    rounds; a round whose metrics could not be read is left out and counted."""
    from pdserve_bench.vs_ray_serve_llm import PhaseTimes

    def samples(prefill_sum: float, prefill_n: float, engine_sum: float, engine_n: float):
        role = (("pdserve_role", "prefill"),)
        return {("pdserve_phase_duration_seconds_sum", (("phase", "prefill"),)): prefill_sum,
                ("pdserve_phase_duration_seconds_count", (("phase", "prefill"),)): prefill_n,
                ("vllm:request_prefill_time_seconds_sum", role): engine_sum,
                ("vllm:request_prefill_time_seconds_count", role): engine_n,
                ("vllm:request_prefill_time_seconds_bucket", role + (("le", "1.0"),)): engine_n}

    t = PhaseTimes()
    t.add(samples(10.0, 5, 4.0, 5), samples(12.0, 7, 5.0, 7))  # 2 prefills of 1 s; engine 0.5 s each
    t.add(samples(12.0, 7, 5.0, 7), samples(14.0, 8, 5.25, 8))  # 1 prefill of 2 s; engine 0.25 s
    t.add(None, samples(99.0, 99, 99.0, 99))  # an unread round teaches nothing
    t.missed += 1
    got = t.as_dict()
    assert got["router"] == {"prefill": {"mean_ms": pytest.approx(4000 / 3, abs=0.1), "n": 3}}
    assert got["engine_prefill"] == {"prefill": {"mean_ms": pytest.approx(1250 / 3, abs=0.1), "n": 3}}
    assert got["engine_queue"] == {} and got["rounds_unread"] == 1


def test_plan_options(tmp_path, nothing_starts):
    plan = _plan(tmp_path, {"systems": "pdserve,colocated", "sizes": "big:100x4", "concurrencies": "1,3",
                            "sweep_requests": "4", "paired": "0"})
    assert [s["name"] for s in plan["systems"]] == ["pdserve", "colocated"]
    assert [p.get("point") for p in plan["phases"] if p["system"] == "pdserve"] == [None, "big_c1", "big_c3"]
    assert plan["workloads"]["big (100 -> 4 tokens), concurrency 3"]["requests"] == 6  # whole rounds of 3
    for bad in ({"systems": "vllm"}, {"sizes": "long=600"}, {"concurrencies": "0"}, {"ray_env": "bare"},
                {"rounds": "0"}):
        with pytest.raises(ConfigError):
            _plan(tmp_path, bad)


def test_all_three_get_the_same_engine_arguments(tmp_path, nothing_starts):
    from pdserve.engine.launcher import kwargs_to_flags
    from pdserve_bench.systems import EnginePair
    from pdserve_bench.vs_ray_serve_llm import RayServeLLMApp, engine_cores

    extra = {"prefill_config": {"engine_kwargs": {"max_num_seqs": 8}},
             "decode_config": {"engine_kwargs": {"max_num_seqs": 8}}}
    plan = _plan(tmp_path, {"paired": "0"}, **extra)
    ray, served, colo = plan["systems"]
    serving = ray["serve_config"]["pd_serving_args"]
    assert served["config"]["prefill_config"]["engine_kwargs"]["dtype"] == "float32"
    assert colo["engines"][0]["argv"][colo["engines"][0]["argv"].index("--dtype") + 1] == "float32"

    from pdserve.engine.cpu_dtype import resolve_cpu_dtype

    args, _ = resolve_cpu_dtype(_args(tmp_path, **extra))
    pdserve_engines = {e["name"]: e for e in EnginePair(args).spec()["engines"]}
    for role, core in zip(("prefill", "decode"), engine_cores()):
        cfg = serving[f"{role}_config"]
        kw = cfg["engine_kwargs"]
        assert kw["dtype"] == "float32" and kw["max_num_seqs"] == 8 and kw["enforce_eager"] is True
        assert kw["kv_transfer_config"]["kv_connector"] == "NixlConnector"
        assert kw["kv_transfer_config"]["kv_buffer_device"] == "cpu"
        # pdserve's engine command line is these arguments (plus the engine id pdserve names its replica by).
        argv = pdserve_engines[role]["argv"]
        engine_id = json.loads(argv[argv.index("--kv-transfer-config") + 1])["engine_id"]
        flags = kwargs_to_flags({**kw, "kv_transfer_config": {**kw["kv_transfer_config"], "engine_id": engine_id}})
        assert argv[-len(flags):] == flags
        # CPU only: no accelerator type, the CPU backend, bundles without a GPU.
        assert "accelerator_type" not in cfg
        assert cfg["accelerator_config"] == {"kind": "cpu"}
        assert cfg["placement_group_config"]["bundle_per_worker"] == {"CPU": 1}
        # One core each, as pdserve's launcher gives its engines.
        env = cfg["runtime_env"]["env_vars"]
        pd_env = pdserve_engines[role]["env"]
        assert env["VLLM_CPU_OMP_THREADS_BIND"] == str(core) == env["PDSERVE_ENGINE_CORES"]
        for key in ("OMP_NUM_THREADS", "UCX_TLS", "VLLM_NIXL_SIDE_CHANNEL_HOST",
                    "PDSERVE_NIXL_PTHR_DELAY_US", "VLLM_USE_AOT_COMPILE"):
            assert env[key] == pd_env[key], key
        assert "PDSERVE_KV_EVENTS_FILE" not in env and "VLLM_PLUGINS" not in env
        assert cfg["runtime_env"]["worker_process_setup_hook"] == "pdserve_bench.vs_ray_serve_llm.replica_setup"
    # vLLM's own environment only: none of pdserve's engine fixes, Ray Serve LLM's own setup hook.
    bare = RayServeLLMApp(args, mode="vllm").serving_args("/m")["decode_config"]
    assert not [k for k in bare["runtime_env"]["env_vars"] if k.startswith("PDSERVE_") or k == "PYTHONPATH"]
    assert "worker_process_setup_hook" not in bare["runtime_env"]
    assert bare["runtime_env"]["env_vars"]["VLLM_CPU_OMP_THREADS_BIND"] == str(engine_cores()[1])


def test_missing_modules_fail_the_run_at_once_not_the_dry_run(tmp_path, monkeypatch, nothing_starts):
    import importlib.util

    from pdserve_bench import vs_ray_serve_llm
    from pdserve_bench.scenarios import run_scenario

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "pyarrow" else real(name, *a))
    with pytest.raises(ConfigError) as e:
        vs_ray_serve_llm.check_ray_llm_modules()
    msg = str(e.value)
    assert "pyarrow" in msg and "pip install -c constraints.txt -e bench" in msg and "make setup" in msg
    with pytest.raises(ConfigError, match=r"pip install -c constraints\.txt -e bench"):
        run_scenario(SCENARIO, _args(tmp_path), {"requests": "2"})  # before the model or any system
    plan = _plan(tmp_path)
    assert plan["requires"]["pyarrow"] is False and plan["settings"]["missing_modules"] == ["pyarrow"]


def _summary(ttft, tpot, e2e, failed=0):
    return {"ttft_ms": {"p50": ttft, "p90": ttft * 1.5}, "tpot_ms": {"p50": tpot}, "e2e_ms": {"p50": e2e, "p90": e2e},
            "request_throughput": 1.0, "failed": failed}


def test_compare_gives_the_three_ratios_where_both_ran():
    from pdserve_bench.vs_ray_serve_llm import compare

    table = compare({
        "ray-serve-llm": {"long_c1": _summary(300, 60, 2000), "long_c2": _summary(float("nan"), 0, 0, failed=4)},
        "pdserve": {"long_c1": _summary(200, 50, 1800), "long_c2": _summary(250, 55, 2000)},
        "colocated": {"long_c1": _summary(100, 50, 1600)},
    })
    r = table["long_c1"]["ratios"]
    assert r["pdserve_over_colocated"]["ttft_p50"] == 2.0
    assert r["ray_serve_llm_over_colocated"]["ttft_p90"] == 3.0
    assert math.isclose(r["ray_serve_llm_over_pdserve"]["tpot_p50"], 1.2)
    assert set(table["long_c2"]["ratios"]) == {"ray_serve_llm_over_pdserve"}
    assert table["long_c2"]["ratios"]["ray_serve_llm_over_pdserve"]["ttft_p50"] is None
    assert table["long_c2"]["figures"]["ray-serve-llm"]["failed"] == 4


def test_plot(tmp_path):
    pytest.importorskip("matplotlib")
    from pdserve_bench.vs_ray_serve_llm import compare, plot

    points = {s: {"long_c1": _summary(300, 60, 2000), "short_c1": _summary(50, 40, 300),
                  "long_c2": _summary(400, 70, 2500), "long_c4": _summary(600, 90, 3500)}
              for s in ("ray-serve-llm", "pdserve", "colocated")}
    result = {"compare": compare(points), "settings": {"sweep_size": "long"}, "host_cpu": "test CPU",
              "points": {"long_c1": "long (600 -> 32 tokens)"}}
    out = plot(result, tmp_path / "p.png")
    assert out.stat().st_size > 1000
