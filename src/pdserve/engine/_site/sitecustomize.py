"""Loaded by every Python process of a pdserve CPU engine (the engine's PYTHONPATH starts here).

Fixes for CPU engines: the first four, for small hosts, driven by environment variables the launcher sets;
the last six always:

1. ``PDSERVE_ENGINE_CORES``: vLLM's NIXL connector on CPU moves the worker's main thread to "the last
   core of each NUMA node" with ``os.sched_setaffinity``, ignoring the cores the process may use. With
   two engines on one host both workers land on the same core, where each one's idle busy-loop steals
   the other's compute. Every affinity request is clamped into the engine's own cores.

2. ``PDSERVE_NIXL_PTHR_DELAY_US``: NIXL's Python agent starts its progress thread with a poll delay of
   0, i.e. the thread spins and takes a whole core for itself. On a host where an engine has one core,
   that halves the engine's speed (decode TPOT 2x, measured). A positive delay makes the thread sleep
   in ``poll()`` between wake-ups. ``PDSERVE_NIXL_PROG_THREAD=0`` turns the thread off instead.

3. ``PDSERVE_ENGINE_IDLE_SPIN_MS``: vLLM's worker waits for its next step on a shared-memory queue and
   spins (``sched_yield``) for 1 s after every read before it sleeps on the queue's notification socket
   (``SpinCondition.busy_loop_s``, not configurable). On a host with one core per engine that is a whole
   core for a second after every request, taken from whatever else runs there (measured: the next
   prompt on the neighbouring prefill engine +23 %). Here the reader spins at most this many
   milliseconds from the moment it started waiting, then sleeps in ``poll()``: a notification wakes it at
   once, and one that never comes costs at most one sleep (with no spin at all, vLLM's reader was seen
   waiting out its 5 s recheck). The sleep is 5 ms at first and doubles with each second of idleness up to
   50 ms (``pdserve/idle.py``): an engine
   that was just busy looks every 5 ms, one idle for seconds every 50 ms (200 wake-ups a second -> 20;
   each engine's idle share of a core measured by ``pdserve bench --scenario footprint``).

4. ``PDSERVE_ENGINE_START_METHOD``: a one-core engine runs its model in its engine core process (the
   ``uni`` executor), which vLLM's API server starts with the multiprocessing method its CPU platform
   forces to ``spawn`` (for worker processes, whose OpenMP setup must come from a fresh interpreter). An
   engine core started by ``fork`` inherits the API server's imported torch and vLLM instead of importing
   them again: ready in 13 s instead of 20 and 0.27 GiB less per engine, as fast (alternating runs, one
   engine alone). Set only for ``uni`` engines, and applied only while the executor is ``uni``. The API
   server freezes its objects as it forks (``gc.freeze``), so the engine core's collector never writes to
   the pages it shares with its parent: about 50 MiB per engine stays shared instead of being copied.

5. Always: vLLM makes about a dozen gloo process groups even for one engine on one core (tensor, pipeline,
   data, expert, context parallel, each twice), and torch gives each its own gloo device, whose event-loop
   thread wakes every 10 ms: ~1,300 wake-ups a second, 0.8 % of a core per idle engine. Here the groups
   of a process share one device (torch's own option for it, ``_Options._devices``): one loop thread. An
   engine of one rank (no tensor, pipeline or data parallelism: every CPU engine pdserve starts by
   default) needs no transport at all: its groups are torch's ``FakeProcessGroup``, whose collectives do
   on one rank exactly what one rank's do (a reduce or broadcast leaves the tensor, a gather copies it), and
   no gloo device or loop thread is made (0.3-0.4 % of a core per idle engine).

6. Always: a request with a ``seed`` whose prompt is computed in more than one step (chunked prefill: the
   prompts of one step exceed its token budget) killed the engine. vLLM samples every request of a step,
   throws away the token of a prompt that is not finished yet, and rewinds that request's generator with
   ``set_offset``, which torch's CPU generator does not have ("CPU Generator does not use offset"): the
   EngineCore died, and every request on the engine failed. pdserve's router gives sampled requests a
   seed of its own (router/early.py), so ordinary traffic met it under load. Here the generators of such
   requests are saved before the step samples and restored after it (:func:`_patch_seeded_rewind`): the
   rewind vLLM means, done the CPU generator's way, so a seeded answer is the same chunked or not.

7. Always: the engine's HTTP server (uvicorn) wakes ten times a second to look whether it should stop; here
   once a second (``pdserve.idle.uvicorn_main_loop``): an engine stops at most a second later.

8. Always: the thread that publishes an engine's KV events (the router's cache index follows them) takes
   its next batch off a queue with a 0.1-s timeout, only so that it looks at its replay socket between
   batches. pdserve configures no replay socket; there the thread now waits until a batch comes (vLLM's stop
   puts a sentinel on the queue, which wakes it): ten wake-ups a second of an idle engine fewer.

9. Always: vLLM's sampler ranks the sampled (or prompt) token of a request that asks for logprobs with a
   ``torch.compile``'d helper (``batched_count_greater_than``: how many logprobs of each row are at least
   the token's), compiled in each engine at its first such request: that request took 14.4 s instead of
   1.3 on a 2-core AMD EPYC (AVX2) with Inductor's cache empty, 2.7 s with it warm. vLLM compiles it to
   spare a GPU a batch x vocabulary temporary; on CPU that temporary is a few MB, and the same comparison
   and sum run eagerly here (the same counts), compiled by no one.

10. Always: vLLM packs a vocabulary's weight for oneDNN as it loads it, for an output head's GEMM, and so
   also an input embedding's, which only looks rows up: with tied embeddings (the packaged model) the same
   113 MB of float32 twice, one copy used by no one. Here a vocabulary is packed at its first GEMM (the
   head's at the engine's warm-up) and an input embedding never. With ``PDSERVE_SHARED_WEIGHTS``
   (``cpu.share_weights: mapped``) the host's engines also map one copy of every large weight
   (engine/weight_share.py); with ``PDSERVE_PACKED_WEIGHTS`` (``packed``, the default) they compute with the
   packed copies their forkserver made once (engine/prepack.py).

11. CPU engines (``PDSERVE_NO_TRITON``): Triton is hidden (``sys.modules["triton"] = None``: vLLM's and
   torch's checks find no such module; an import raises ImportError). It has no CPU backend (vLLM says so
   and disables it), and importing it relocated 71 MiB of its library in each process that imports vLLM.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time


def _load_idle():  # type: ignore[no-untyped-def]
    """pdserve/idle.py, loaded from its file: the engine's processes import no pdserve package."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "idle.py")
    spec = importlib.util.spec_from_file_location("pdserve_idle", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_idle = _load_idle()
idle_poll_ms, uvicorn_main_loop = _idle.idle_poll_ms, _idle.uvicorn_main_loop


def _clamp_affinity() -> None:
    cores = os.environ.get("PDSERVE_ENGINE_CORES")
    if not cores or not hasattr(os, "sched_setaffinity"):
        return
    allowed = frozenset(int(c) for c in cores.split(",") if c.strip().isdigit())
    if not allowed:
        return
    original = os.sched_setaffinity

    def clamped(pid: int, mask: object) -> None:
        want = {int(c) for c in mask}  # type: ignore[attr-defined]
        original(pid, (want & allowed) or allowed)

    os.sched_setaffinity = clamped  # type: ignore[assignment]


def _patch_nixl_api(api: object) -> None:
    delay = os.environ.get("PDSERVE_NIXL_PTHR_DELAY_US")
    prog = os.environ.get("PDSERVE_NIXL_PROG_THREAD")
    if prog is not None:
        cfg_cls = api.nixl_agent_config  # type: ignore[attr-defined]
        orig_cfg_init = cfg_cls.__init__

        def cfg_init(self: object, *a: object, **kw: object) -> None:
            orig_cfg_init(self, *a, **kw)
            self.enable_pthread = prog == "1"  # type: ignore[attr-defined]

        cfg_cls.__init__ = cfg_init
    if delay is not None:
        bind = api.nixlBind  # type: ignore[attr-defined]
        make_agent = bind.nixlAgent

        def agent(name: str, config: object) -> object:
            config.pthrDelay = int(delay)  # type: ignore[attr-defined]
            return make_agent(name, config)

        # nixl_agent.__init__ looks the constructor up on the module at call time.
        bind.nixlAgent = agent


def _patch_shm_spin(module: object) -> None:
    spin_s = float(os.environ["PDSERVE_ENGINE_IDLE_SPIN_MS"]) / 1000.0
    cond = module.SpinCondition  # type: ignore[attr-defined]
    vllm_wait = cond.wait

    def wait(self: object, timeout_ms: int | None = None) -> None:
        if not self.is_reader:  # type: ignore[attr-defined]
            return vllm_wait(self, timeout_ms)
        now = time.monotonic()
        if getattr(self, "_pdserve_read", None) != self.last_read:  # type: ignore[attr-defined]
            # The first wait since the last read: a new idle stretch starts now.
            self._pdserve_read = self.last_read  # type: ignore[attr-defined]
            self._pdserve_idle_from = now  # type: ignore[attr-defined]
        idle_s = now - self._pdserve_idle_from  # type: ignore[attr-defined]
        if idle_s <= spin_s:
            os.sched_yield()
            return None
        self.busy_loop_s = -1.0  # type: ignore[attr-defined]  # vLLM's wait: straight to poll()
        sleep_ms = idle_poll_ms(idle_s - spin_s)
        return vllm_wait(self, sleep_ms if timeout_ms is None else min(timeout_ms, sleep_ms))

    cond.wait = wait


def _patch_seeded_rewind(module: object) -> None:
    runner = module.GPUModelRunner  # type: ignore[attr-defined]
    vllm_sample, vllm_bookkeeping = runner.sample_tokens, runner._bookkeeping_sync

    def sample_tokens(self: object, *a: object, **kw: object) -> object:
        # The step's unfinished prompts are known once its inputs are prepared (execute_model), before
        # anything is sampled: save their CPU generators' states now.
        batch = self.input_batch  # type: ignore[attr-defined]
        gens = batch.generators
        saved = None  # most steps have no seeded request: nothing to look at
        if gens:
            for i in self.discard_request_mask.np[: batch.num_reqs].nonzero()[0]:  # type: ignore[attr-defined]
                g = gens.get(int(i))
                if g is not None and g.device.type == "cpu":
                    saved = saved or {}
                    saved[int(i)] = (g, g.get_state())
        self._pdserve_rewind = saved  # type: ignore[attr-defined]
        return vllm_sample(self, *a, **kw)

    def bookkeeping(self: object, *a: object, **kw: object) -> object:
        saved = getattr(self, "_pdserve_rewind", None)
        if not saved:
            return vllm_bookkeeping(self, *a, **kw)
        gens = self.input_batch.generators  # type: ignore[attr-defined]
        for i in saved:
            gens.pop(i, None)  # vLLM's own rewind (set_offset) skips them...
        try:
            return vllm_bookkeeping(self, *a, **kw)
        finally:
            for i, (g, state) in saved.items():
                g.set_state(state)  # ... and this one puts them back where they were before the step
                gens[i] = g
            self._pdserve_rewind = None  # type: ignore[attr-defined]

    runner.sample_tokens = sample_tokens
    runner._bookkeeping_sync = bookkeeping


def _patch_start_method(module: object) -> None:
    method = os.environ["PDSERVE_ENGINE_START_METHOD"]
    platform = module.CpuPlatform  # type: ignore[attr-defined]
    vllm_check = platform.check_and_update_config.__func__

    def check_and_update_config(cls: object, vllm_config: object) -> None:
        vllm_check(cls, vllm_config)
        if vllm_config.parallel_config.distributed_executor_backend == "uni":  # type: ignore[attr-defined]
            os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = method

    platform.check_and_update_config = classmethod(check_and_update_config)


def _patch_gloo_device(module: object) -> None:
    torch_gloo = module.ProcessGroupGloo  # type: ignore[attr-defined]
    device: list[object] = []

    class ProcessGroupGloo(torch_gloo):  # type: ignore[misc, valid-type]
        def __init__(self, store: object, rank: int, size: int, *rest: object, timeout: object = None) -> None:
            if rest:  # options (or a timeout) given by position: as given
                super().__init__(store, rank, size, *rest)
                return
            if not device:
                device.append(torch_gloo.create_default_device())
            opts = torch_gloo._Options()
            opts._devices = [device[0]]
            if timeout is not None:
                opts._timeout = timeout
            super().__init__(store, rank, size, opts)

    module.ProcessGroupGloo = ProcessGroupGloo  # type: ignore[attr-defined]


def _one_rank_group(opts: object, backend_opts: object) -> object:
    from torch._C._distributed_c10d import FakeProcessGroup

    return FakeProcessGroup._create_internal(opts.group_rank, opts.group_size)  # type: ignore[attr-defined]


def _patch_one_rank_world(module: object) -> None:
    """Process groups of a one-rank world are made by torch's fake backend instead of gloo's (5.)."""
    module.Backend.register_backend("fake", _one_rank_group, extended_api=True,  # type: ignore[attr-defined]
                                    devices=["cpu"])
    init, new = module.init_process_group, module.new_group  # type: ignore[attr-defined]

    def init_process_group(backend: object = None, *a: object, **kw: object) -> object:
        if kw.get("world_size") == 1 and backend in (None, "gloo"):
            backend = "fake"
        return init(backend, *a, **kw)

    def new_group(ranks: object = None, *a: object, **kw: object) -> object:
        if (not a and kw.get("backend") in (None, "gloo", "fake") and module.is_initialized()  # type: ignore[attr-defined]
                and module.get_world_size() == 1):  # type: ignore[attr-defined]
            kw["backend"] = "fake"
        return new(ranks, *a, **kw)

    module.init_process_group, module.new_group = init_process_group, new_group  # type: ignore[attr-defined]


def _patch_c10d(module: object) -> None:
    _patch_gloo_device(module)
    _patch_one_rank_world(module)


def _patch_uvicorn_tick(module: object) -> None:
    module.Server.main_loop = uvicorn_main_loop  # type: ignore[attr-defined]


def _patch_kv_events_wait(module: object) -> None:
    publisher = module.ZmqEventPublisher  # type: ignore[attr-defined]
    init = publisher.__init__

    class PatientQueue(module.Queue):  # type: ignore[misc, name-defined]
        def get(self, block: bool = True, timeout: float | None = None) -> object:
            return super().get(block, None if block else timeout)

    def patient_init(self: object, *a: object, **kw: object) -> None:
        init(self, *a, **kw)
        if self._replay is None:  # type: ignore[attr-defined]
            self._event_queue.__class__ = PatientQueue  # type: ignore[attr-defined]

    publisher.__init__ = patient_init


def _count_at_least(x: object, values: object) -> object:
    """``batched_count_greater_than`` of vLLM's sampler, eager: per row of ``x``, how many entries are at
    least that row's value."""
    return (x >= values).sum(-1)  # type: ignore[operator]


def _patch_logprob_ranks(module: object) -> None:
    # The sampler imported the compiled helper by name; its functions look the name up here at call time.
    if not hasattr(module, "batched_count_greater_than"):
        raise AttributeError("vLLM's sampler has no batched_count_greater_than")
    module.batched_count_greater_than = _count_at_least  # type: ignore[attr-defined]


def _patch_weight_packing(module: object) -> None:
    from pdserve.engine import weight_share  # (imported now, in an engine that imports vLLM's layers)

    if not weight_share.patch(module, os.environ.get(weight_share.ENV_DIR)):
        raise AttributeError("vLLM's layers have no dispatch_cpu_unquantized_gemm")


def _patches() -> dict[str, object]:
    """Modules to patch once imported -> how, for the settings this process was started with."""
    out: dict[str, object] = {"vllm.model_executor.layers.utils": _patch_weight_packing,
                              "vllm.v1.worker.gpu_model_runner": _patch_seeded_rewind,
                              "torch.distributed.distributed_c10d": _patch_c10d,
                              "uvicorn.server": _patch_uvicorn_tick,
                              "vllm.distributed.kv_events": _patch_kv_events_wait,
                              "vllm.v1.sample.sampler": _patch_logprob_ranks}
    if os.environ.get("PDSERVE_NIXL_PTHR_DELAY_US") is not None or os.environ.get("PDSERVE_NIXL_PROG_THREAD"):
        out["nixl_cu12._api"] = out["nixl_cu13._api"] = _patch_nixl_api
    if os.environ.get("PDSERVE_ENGINE_START_METHOD"):
        out["vllm.platforms.cpu"] = _patch_start_method
    if os.environ.get("PDSERVE_ENGINE_IDLE_SPIN_MS"):
        out["vllm.distributed.device_communicators.shm_broadcast"] = _patch_shm_spin
    return out


class _AfterImport:
    """Patch a module right after it is first imported (without importing it ourselves)."""

    def __init__(self, targets: dict[str, object]) -> None:
        self.targets = targets

    def find_spec(self, name: str, path: object, target: object = None) -> object:
        patch = self.targets.get(name)
        if patch is None:
            return None
        import importlib.machinery

        for finder in sys.meta_path:
            if finder is self:
                continue
            spec = getattr(finder, "find_spec", lambda *a: None)(name, path, target)
            if spec is not None and spec.loader is not None:
                loader = spec.loader
                exec_module = loader.exec_module

                def exec_and_patch(module: object, _exec=exec_module, _patch=patch) -> None:
                    _exec(module)
                    try:
                        _patch(module)  # type: ignore[operator]
                    except Exception as e:  # noqa: BLE001 - never break the engine over a patch
                        print(f"[pdserve] engine fix not applied to {name}: {e}", file=sys.stderr)

                loader.exec_module = exec_and_patch  # type: ignore[method-assign]
                return spec
        return importlib.machinery.PathFinder.find_spec(name, path, target)  # type: ignore[arg-type]


def _freeze_before_fork() -> None:
    if os.environ.get("PDSERVE_ENGINE_START_METHOD") == "fork" and hasattr(os, "register_at_fork"):
        import gc

        os.register_at_fork(before=gc.freeze)


def _hide_triton() -> None:
    if os.environ.get("PDSERVE_NO_TRITON") == "1" and "triton" not in sys.modules:
        sys.modules["triton"] = None  # type: ignore[assignment]


_hide_triton()
_clamp_affinity()
_freeze_before_fork()
_TARGETS = _patches()
if _TARGETS:
    sys.meta_path.insert(0, _AfterImport(_TARGETS))  # type: ignore[arg-type]
