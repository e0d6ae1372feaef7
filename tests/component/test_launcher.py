"""What the engine launcher sets up, seen in real child processes: sitecustomize's core clamp, NIXL
patch, shared gloo device (none for one rank), eager logprob ranks and objects frozen at fork, the guard's
niceness, and the bounded spin of vLLM's shared-memory queue (the commands and environments themselves:
tests/unit/test_launcher.py)."""

import json

from pdserve.config.schema import PDServeArgs
from pdserve.engine.launcher import EnginePlacement, build_engine_command


def test_sitecustomize_clamps_affinity_and_patches_nixl_and_uvicorn():
    import os
    import subprocess
    import sys

    from pdserve.engine.launcher import SITE_DIR

    code = (
        "import os, sys\n"
        "os.sched_setaffinity(0, {1})\n"  # what vLLM's NIXL worker does: the host's last core
        "print(sorted(os.sched_getaffinity(0)))\n"
        "import nixl._api as api\n"
        "print(getattr(api.nixlBind.nixlAgent, '__name__', ''))\n"
        "import uvicorn\n"
        "print(uvicorn.Server.main_loop.__name__)\n"
    )
    env = {**os.environ, "PYTHONPATH": SITE_DIR, "PDSERVE_ENGINE_CORES": "0", "PDSERVE_NIXL_PTHR_DELAY_US": "1000"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    lines = out.stdout.split()
    assert lines[0] == "[0]"  # clamped into the engine's own core
    assert lines[1] == "agent"  # NIXL agents are created through pdserve's poll-delay wrapper
    assert lines[2] == "uvicorn_main_loop"  # the engine's HTTP server ticks once a second


_LOGPROB_RANKS = """
import torch
from torch._dynamo.utils import counters
from vllm.v1.sample import sampler
logits = torch.tensor([[0.5, 2.0, 2.0, -1.0, 3.0], [1.0, 1.0, 1.0, 1.0, 0.0]])
got = sampler.Sampler.gather_logprobs(sampler.Sampler.compute_logprobs(logits), 2, torch.tensor([2, 4]))
print(sampler.batched_count_greater_than.__name__, got.selected_token_ranks.tolist(), counters["stats"]["unique_graphs"])
"""


def test_cpu_engines_rank_logprobs_without_compiling_anything():
    """vLLM's sampler ranks a logprobs request's token with a torch.compile'd helper (13 s of compile at an
    engine's first such request on a cold cache); under the engine site hook it runs eagerly, with the
    ranks vLLM's gives: how many logprobs of the row are at least the token's (ties count)."""
    import os
    import subprocess
    import sys

    from pdserve.engine.launcher import SITE_DIR

    out = subprocess.run([sys.executable, "-c", _LOGPROB_RANKS], env={**os.environ, "PYTHONPATH": SITE_DIR},
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["_count_at_least", "[3,", "5]", "0"], out.stdout


_VOCAB_PACKING = """
import torch
from vllm.model_executor.layers import utils
torch.manual_seed(0)
layer = torch.nn.Module()
layer.weight = torch.nn.Parameter(torch.randn(4096, 64), requires_grad=False)
utils.dispatch_cpu_unquantized_gemm(layer, remove_weight=False)
lazy = layer.cpu_linear.__name__
x = torch.randn(3, 64)
out = layer.cpu_linear(x, layer.weight, None)
print(getattr(utils.dispatch_cpu_unquantized_gemm, "_pdserve_packing", False), lazy,
      layer.cpu_linear.__name__ != "first", torch.allclose(out, x @ layer.weight.t(), atol=1e-4))
"""


def test_cpu_engines_pack_a_vocabulary_at_its_first_gemm():
    """Under the engine site hook vLLM's CPU packing step is pdserve's as its module is imported: a
    vocabulary (kept weight) gets vLLM's real packed GEMM at its first call, not at load, and computes it."""
    import os
    import subprocess
    import sys

    from pdserve.engine.launcher import SITE_DIR

    env = {k: v for k, v in os.environ.items() if k != "PDSERVE_SHARED_WEIGHTS"}
    out = subprocess.run([sys.executable, "-c", _VOCAB_PACKING], env={**env, "PYTHONPATH": SITE_DIR},
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", "first", "True", "True"], out.stdout


_PREPACKED = """
import os, sys, torch
from vllm.model_executor.layers import utils
from pdserve.engine import prepack
torch.manual_seed(0)

def layer(prefix, w):
    m = torch.nn.Module()
    m.prefix = prefix
    m.weight = torch.nn.Parameter(w.clone(), requires_grad=False)
    return m

w, head, other = torch.randn(1536, 576), torch.randn(4096, 64), torch.randn(1536, 576)
x = torch.randn(5, 576)
first = layer("model.l0.proj", w)  # the first start: vLLM's own packing; the file written for the next
utils.dispatch_cpu_unquantized_gemm(first, remove_weight=True)
own = first.cpu_linear(x, first.weight, None)
print("first", sorted(os.listdir(os.environ["PDSERVE_PACKED_WEIGHTS"])), first.weight.numel() == 0)
voc = layer("lm_head", head)
utils.dispatch_cpu_unquantized_gemm(voc, remove_weight=False)
voc.cpu_linear(torch.randn(2, 64), voc.weight, None)
prepack.prepare(dict(os.environ), ["--dtype", "float32"])  # the forkserver, before it forks
print("packed", prepack.packed_count(), torch.get_num_threads())
pid = os.fork()
if pid == 0:
    torch.set_num_threads(2)
    again, changed = layer("model.l0.proj", w), layer("model.l0.proj", other)
    utils.dispatch_cpu_unquantized_gemm(again, remove_weight=True)
    out = again.cpu_linear(x, again.weight, None)
    print("child", again.weight.numel() == 0, again.cpu_linear.__module__ == prepack.__name__, torch.equal(out, own))
    voc2 = layer("lm_head", head)
    utils.dispatch_cpu_unquantized_gemm(voc2, remove_weight=False)
    y = torch.randn(3, 64)
    got = voc2.cpu_linear(y, voc2.weight, None)
    print("head", voc2.cpu_linear.__module__ == prepack.__name__, torch.allclose(got, y @ head.t(), atol=1e-4))
    utils.dispatch_cpu_unquantized_gemm(changed, remove_weight=True)  # not what was packed: vLLM's own
    out = changed.cpu_linear(x, changed.weight, None)
    print("changed", changed.cpu_linear.__module__ == prepack.__name__, torch.allclose(out, x @ other.t(), atol=1e-4))
    sys.stdout.flush()
    os._exit(0)
os.waitpid(pid, 0)
"""


def test_engines_forked_after_the_forkserver_packed_compute_with_its_copy(tmp_path):
    """``cpu.share_weights: packed`` with vLLM's real packing and a real fork: a first engine writes its
    weights' files; the forkserver packs them on one thread; an engine forked after it computes with the
    inherited copy (the same numbers as vLLM's own) and drops its own weight, the output head too; a weight
    other than the file's goes vLLM's own way. (The process that packs computes on one thread, as the
    forkserver: one that had started OpenMP's pool would fork children that hang.)"""
    import os
    import subprocess
    import sys

    from pdserve.engine.launcher import SITE_DIR

    env = {k: v for k, v in os.environ.items() if k != "PDSERVE_SHARED_WEIGHTS"}
    env |= {"PYTHONPATH": SITE_DIR, "PDSERVE_PACKED_WEIGHTS": str(tmp_path), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", _PREPACKED], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [ln for ln in out.stdout.splitlines() if ln.split()[0] in ("first", "packed", "child", "head", "changed")]
    assert lines == [
        "first ['model.l0.proj.T.float32.576x1536.bin'] True",
        "packed 2 1", "child True True True", "head True True", "changed False True"], out.stdout


_GLOO_GROUPS = """
import os, sys, torch, torch.distributed as dist
rank, world, path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo", init_method="file://" + path, rank=rank, world_size=world)
groups = [dist.new_group(list(range(world)), backend="gloo") for _ in range(4)]
t = torch.ones(2)
for g in groups:
    dist.all_reduce(t, group=g)
gathered = [None] * world
dist.all_gather_object(gathered, rank, group=groups[0])
out = [torch.zeros(2)] * world
dist.all_gather(out, t, group=groups[1])
dist.barrier()
loops = sum(open(f"/proc/self/task/{tid}/comm").read().strip() == "gloo_tcp_loop" for tid in os.listdir("/proc/self/task"))
print(loops, dist.get_backend(groups[0]), t.tolist(), gathered, [o.tolist() for o in out])
"""


def _gloo_world(pythonpath: str, world: int, tmp_path) -> list[str]:
    """Run _GLOO_GROUPS as every rank of a world of ``world`` processes; each rank's line."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": pythonpath}
    store = str(tmp_path / f"store-{world}-{bool(pythonpath)}")
    procs = [subprocess.Popen([sys.executable, "-c", _GLOO_GROUPS, str(r), str(world), store], env=env,
                              stdout=subprocess.PIPE, text=True) for r in range(world)]
    return [p.communicate(timeout=120)[0].strip() for p in procs]


def test_an_engines_gloo_groups_share_one_event_loop_and_a_one_rank_engine_needs_none(tmp_path):
    """vLLM's dozen gloo groups: under the engine site hook a one-rank engine's groups are torch's fake
    backend, whose collectives on one rank give what gloo's give (no gloo loop thread at all); ranks of a
    larger world share one gloo device and loop thread (waking every 10 ms) instead of one per group."""
    from pdserve.engine.launcher import SITE_DIR

    assert _gloo_world(SITE_DIR, 1, tmp_path) == ["0 fake [1.0, 1.0] [0] [[1.0, 1.0]]"]
    assert _gloo_world("", 1, tmp_path) == ["5 gloo [1.0, 1.0] [0] [[1.0, 1.0]]"]
    two = "gloo [16.0, 16.0] [0, 1] [[16.0, 16.0], [16.0, 16.0]]"
    assert _gloo_world(SITE_DIR, 2, tmp_path) == ["1 " + two] * 2


_FORK_FREEZE = """
import gc, os
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    os.write(w, str(gc.get_freeze_count()).encode())
    os._exit(0)
os.waitpid(pid, 0)
print(int(os.read(r, 64)) > 0, gc.get_freeze_count() > 0)
"""


def test_an_engine_started_by_fork_shares_its_parents_objects_frozen():
    """Under ``PDSERVE_ENGINE_START_METHOD=fork`` the parent freezes its objects as it forks (the engine
    core's collector then leaves the shared pages alone); otherwise nothing is frozen."""
    import os
    import subprocess
    import sys

    from pdserve.engine.launcher import SITE_DIR

    def frozen(method: str | None) -> str:
        env = {**os.environ, "PYTHONPATH": SITE_DIR}
        env.pop("PDSERVE_ENGINE_START_METHOD", None)
        if method:
            env["PDSERVE_ENGINE_START_METHOD"] = method
        return subprocess.run([sys.executable, "-c", _FORK_FREEZE], env=env, capture_output=True, text=True,
                              check=True, timeout=60).stdout.strip()

    assert frozen("fork") == "True True"
    assert frozen(None) == "False False"


def test_cpu_engines_run_at_the_configured_niceness(tmp_path):
    import subprocess
    import sys

    placement = EnginePlacement(http_port=1, side_channel_port=2, side_channel_host="127.0.0.1", engine_id="e")
    assert "PDSERVE_ENGINE_NICE" not in build_engine_command("prefill", PDServeArgs(), "/m", placement).env
    nicer = PDServeArgs.model_validate({"cpu": {"engine_nice": 5}})
    assert build_engine_command("prefill", nicer, "/m", placement).env["PDSERVE_ENGINE_NICE"] == "5"
    # The guard applies it to itself before starting the engine, which inherits it.
    out = tmp_path / "nice"
    code = f"import os; open({str(out)!r}, 'w').write(str(os.nice(0)))"
    subprocess.run([sys.executable, "-m", "pdserve.engine.guard", str(__import__("os").getpid()), "--",
                    sys.executable, "-c", code], env={**__import__("os").environ, "PDSERVE_ENGINE_NICE": "3"},
                   check=True, timeout=60, start_new_session=True)  # the guard signals its own process group
    assert int(out.read_text()) == __import__("os").nice(0) + 3


#: Run in a fresh interpreter: a real vLLM shared-memory queue (the one between a CPU engine's core and
#: its worker), a reader thread, and a writer that sends after idle stretches and right after a read.
_SHM_READER = r"""
import json, threading, time
from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

writer = MessageQueue(n_reader=1, n_local_reader=1, max_chunk_bytes=1 << 16, max_chunks=4)
reader = MessageQueue.create_from_handle(writer.export_handle(), 0)
idle_cpu, got = [], []

def read():
    reader.wait_until_ready()
    for i in range(6):
        t0 = time.thread_time()
        got.append(reader.dequeue(indefinite=True))
        if i % 2 == 0:
            idle_cpu.append(time.thread_time() - t0)

t = threading.Thread(target=read)
t.start()
writer.wait_until_ready()
for i in range(6):
    time.sleep(0.001 if i % 2 else 0.4)
    writer.enqueue(i)
t.join()
print(json.dumps({"got": got, "idle_cpu_s": sum(idle_cpu)}))
"""


def test_engine_worker_stops_spinning_soon_after_its_last_step():
    """vLLM's reader spins a whole core for 1 s after every read; with ``cpu.idle_spin_ms`` it spins that
    long and then sleeps, and still gets every message (side by side: the same queue without the hook)."""
    import os
    import subprocess
    import sys

    from pdserve.engine.launcher import SITE_DIR, engine_env

    pl = EnginePlacement(1, 2, "127.0.0.1", "e", [0], on_cpu=True)
    hooked = engine_env(PDServeArgs(), pl)
    assert hooked["PDSERVE_ENGINE_IDLE_SPIN_MS"] == "20"
    assert "PDSERVE_ENGINE_IDLE_SPIN_MS" not in engine_env(
        PDServeArgs.model_validate({"cpu": {"idle_spin_ms": None}}), pl)

    def start(extra: dict[str, str]) -> subprocess.Popen:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}
        return subprocess.Popen([sys.executable, "-c", _SHM_READER], env={**env, **extra}, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    def result(p: subprocess.Popen) -> dict:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-2000:]
        return json.loads(out.strip().splitlines()[-1])

    # Side by side (each process counts its own CPU time, so running both at once changes neither count).
    procs = [start({}), start({"PYTHONPATH": SITE_DIR,
                               "PDSERVE_ENGINE_IDLE_SPIN_MS": hooked["PDSERVE_ENGINE_IDLE_SPIN_MS"]})]
    vllm_own, bounded = (result(p) for p in procs)
    assert vllm_own["got"] == bounded["got"] == list(range(6))
    # Three idle stretches of 0.4 s: vLLM's reader spins through them, the bounded one for 20 ms of each.
    assert bounded["idle_cpu_s"] < vllm_own["idle_cpu_s"] / 3, (bounded, vllm_own)


def test_ray_serve_works_in_a_process_of_an_own_ray_instance_without_pandas_and_pyarrow():
    """A process with the own instance's PYTHONPATH (app/_ray_site): Ray Serve imports, without either."""
    import os
    import subprocess
    import sys

    from pdserve.app.ray_compat import RAY_SITE_DIR

    code = ("import sys, ray, ray.serve, ray.serve._private.utils as u, ray._private.arrow_serialization as a; "
            "print(u.pd is None, sys.modules.get('pandas'), sys.modules.get('pyarrow'))")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": RAY_SITE_DIR},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", "None", "None"], out.stdout
