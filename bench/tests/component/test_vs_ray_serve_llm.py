"""``--scenario vs-ray-serve-llm`` with real servers and processes: paired rounds against fake engines on
loopback, Ray Serve LLM's own check of the CPU config and the replicas' thread setup, each in a child process
(its plan and figures: bench/tests/test_vs_ray_serve_llm.py)."""

import json
import subprocess
import sys

from pdserve.config.schema import PDServeArgs


def _args(tmp_path, **extra):
    # A pinned dtype: nothing to probe (tests/test_vs_ray_serve_llm.py plans with the same arguments).
    return PDServeArgs.model_validate({"cache_dir": str(tmp_path), "cpu": {"dtype": "float32"}, **extra})

def test_paired_rounds_alternate_and_keep_each_sides_prompts(tmp_path):
    from pdserve.testing.fake_engine import FakeEngine, build_fake_engine
    from pdserve.testing.thread_server import ThreadServer
    from pdserve_bench.runner import Load
    from pdserve_bench.vs_ray_serve_llm import _paired
    from pdserve_bench.workload import BenchRequest

    seen: list[str] = []

    class Log(list):
        def __init__(self, tag: str) -> None:
            super().__init__()
            self.tag = tag

        def append(self, body) -> None:
            seen.append(self.tag)
            super().append(body)

    a, b, c = FakeEngine("decode", "m"), FakeEngine("prefill", "m"), FakeEngine("decode", "m")
    a.requests, b.requests, c.requests = Log("pd"), Log("colo0"), Log("colo1")
    mine = [BenchRequest(prompt_ids=[100 + i], max_tokens=2) for i in range(8)]
    own = [BenchRequest(prompt_ids=[200 + i], max_tokens=2) for i in range(8)]
    with ThreadServer(build_fake_engine(a)) as sa, ThreadServer(build_fake_engine(b)) as sb, \
            ThreadServer(build_fake_engine(c)) as sc:
        pd, colo = _paired(sa.url, [sb.url, sc.url], None, "m", mine, own, Load("concurrency", 2), rounds=4)
    assert pd["requests"] == colo["requests"] == 8 and pd["failed"] == colo["failed"] == 0
    assert set(pd["phases"]) == set(colo["phases"]) == {"router", "engine_queue", "engine_prefill",
                                                        "engine_decode", "rounds_unread"}
    # Four rounds of 2 requests each side, pdserve first on even rounds, the engines alone taking turns.
    assert seen == (["pd"] * 2 + ["colo0"] * 2 + ["colo1"] * 2 + ["pd"] * 4 + ["colo0"] * 2 + ["colo1"] * 2
                    + ["pd"] * 2)
    assert sorted(r["prompt"][0] for r in a.requests) == [100 + i for i in range(8)]
    assert sorted(r["prompt"][0] for r in b.requests + c.requests) == [200 + i for i in range(8)]


def test_ray_serve_llm_accepts_the_config_as_cpu_only(tmp_path):
    """Ray Serve LLM's own validation of the config (no Ray started): the CPU backend, no GPU anywhere,
    vLLM's mp executor."""
    from pdserve_bench.vs_ray_serve_llm import RayServeLLMApp, missing_ray_llm_modules

    # pdserve-bench's dependencies (make setup) install them: a missing one is a broken setup, not a reason
    # to skip.
    assert not missing_ray_llm_modules(), "reinstall with `make setup` (pip install -e bench)"
    from pdserve.engine.cpu_dtype import resolve_cpu_dtype

    args, _ = resolve_cpu_dtype(_args(tmp_path))
    serving = RayServeLLMApp(args).serving_args(str(tmp_path / "model"), (5901, 5902))
    check = r"""
import json, sys
from ray.llm._internal.serve.serving_patterns.prefill_decode.builder import PDServingArgs
from ray.llm._internal.serve.core.configs.accelerators import CPUAccelerator
from ray.llm._internal.serve.core.server.llm_server import _merge_replica_actor_and_child_actor_bundles
pd = PDServingArgs.model_validate(json.load(sys.stdin))
out = {}
for role in ("prefill", "decode"):
    cfg = getattr(pd, role + "_config")
    ec = cfg.get_engine_config()
    bundles = _merge_replica_actor_and_child_actor_bundles(ec.placement_bundles, {"CPU": 1, "GPU": 0})
    out[role] = {"cpu": isinstance(ec.accelerator, CPUAccelerator), "accelerator_type": cfg.accelerator_type,
                 "bundles": bundles, "init": ec.get_initialization_kwargs()}
print("RESULT " + json.dumps(out, default=str))
"""
    r = subprocess.run([sys.executable, "-c", check], input=json.dumps(serving), capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(next(x for x in r.stdout.splitlines() if x.startswith("RESULT "))[7:])
    for role in ("prefill", "decode"):
        got = out[role]
        assert got["cpu"] is True and got["accelerator_type"] is None
        assert all(b.get("GPU", 0) == 0 for b in got["bundles"]) and got["bundles"][0]["CPU"] == 2
        init = got["init"]
        assert init["distributed_executor_backend"] == "mp"
        assert init["dtype"] == "float32" and init["max_model_len"] == 4096 and init["enforce_eager"] is True
        assert init["kv_transfer_config"]["kv_role"] == ("kv_producer" if role == "prefill" else "kv_consumer")


def test_replica_setup_pins_every_thread_like_the_engine_guard():
    import os

    core = sorted(os.sched_getaffinity(0))[-1]
    code = r"""
import os, threading
ev = threading.Event()
t = threading.Thread(target=ev.wait)
t.start()
from pdserve_bench.vs_ray_serve_llm import replica_setup
before = os.getpriority(os.PRIO_PROCESS, t.native_id)
replica_setup()
print(sorted(os.sched_getaffinity(t.native_id)), sorted(os.sched_getaffinity(0)),
      os.getpriority(os.PRIO_PROCESS, t.native_id) - before)
ev.set()
"""
    env = {**os.environ, "PDSERVE_ENGINE_CORES": str(core), "PDSERVE_ENGINE_NICE": "1"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split("\n")[-2] == f"[{core}] [{core}] 1"
