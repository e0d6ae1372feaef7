"""Real systems for the integration tests: `pdserve serve` (Ray Serve + vLLM CPU engines + NIXL), started the
way a user starts it, as a subprocess, and stopped with SIGINT.

One system is alive at a time (:class:`SystemSlot`): the shared one (``served``, pd-test.yaml) that most
modules use, or a module's own (autoscaling, multi-node), or one that a few modules keep (handback). A module
that brings its own system stops the shared one first, and the next module that needs the shared one starts it
again; the tests that stop the shared system (``test_zz_...``), then modules with their own system, run after
the others (``pytest_collection_modifyitems``), so the shared system starts once in a full run. Two systems at
once on a 24 GiB host is how Ray's memory monitor came to kill replicas mid-test. Before any system starts,
the host's available memory is checked against what that system needs, and a test fails with that figure
instead of letting Ray kill its replicas later."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx
import psutil
import pytest

from pdserve.engine.process import GUARD_MARK, SERVER_MARK, find_processes, local_engine_auth, server_pid
from pdserve.testing.served import ServedProcess
from pdserve.testing.thread_server import ThreadServer, free_port
from tests.otlp import Collector

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 600
GIB = 1024**3
#: Available memory a system needs before it starts, GiB, per engine it may run at once (a float32 engine
#: of the packaged model with a 1 GiB KV cache: ~2.5 GiB PSS in its processes), plus Ray and the router.
ENGINE_GIB = 3.0
BASE_GIB = 1.5
#: Modules that start a system of their own (the shared one is stopped while they run), in the order they run:
#: modules that use one kept system (:meth:`SystemSlot.kept`) next to each other.
OWN_SYSTEM_MODULES = ("test_autoscaling.py", "test_multinode.py", "test_handback.py", "test_shared_weights.py",
                      "test_handback_bound.py")
#: The shared system's ``tracing.service_name``: its engines export as ``-prefill`` / ``-decode`` of it.
TRACED_SERVICE = "pdserve-it"


def require_memory(engines: int, what: str) -> None:
    """Fail now, with the figures, when this host has not the memory for ``engines`` more engines."""
    need = BASE_GIB + engines * ENGINE_GIB
    vm = psutil.virtual_memory()
    if vm.available < need * GIB:
        pytest.fail(f"{what} needs about {need:.1f} GiB of free memory ({engines} engines); this host has "
                    f"{vm.available / GIB:.1f} GiB available of {vm.total / GIB:.1f} GiB. Ray's memory monitor "
                    f"would kill its replicas mid-test: stop other work (another pdserve, a benchmark) first.",
                    pytrace=False)


def engine_processes() -> list[int]:
    return [pid for pid, _ in find_processes(SERVER_MARK, GUARD_MARK)]


# An engine answers only with its key; tests on the engine's host read it as the benchmarks do.
engine_server_pid = server_pid
engine_auth = local_engine_auth


class ServeProcess(ServedProcess):
    """``pdserve serve`` for a test module (the same helper the benchmarks use), its output echoed to the
    test's stderr, plus the router's status."""

    def __init__(self, config: Path | None, port: int, *, prefix: Sequence[str] = (), args: Sequence[str] = (),
                 host: str = "127.0.0.1") -> None:
        """``prefix`` runs the command under another one (e.g. ``ip netns exec NS``); ``args`` are more
        ``pdserve serve`` options; ``host`` is where this process reaches the endpoint."""
        self.preexisting = set(engine_processes())
        super().__init__(config, port=port, argv=args, prefix=prefix, host=host, cwd=ROOT,
                         echo=lambda line: sys.stderr.write("  | " + line + "\n"))
        self.start()

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S, poll=None) -> float:  # type: ignore[override]
        return super().wait_ready(timeout_s, poll)

    def status(self) -> dict:
        return httpx.get(self.url + "/pdserve/status", timeout=10).json()

    def engine_url(self, role: str) -> str:
        return next(e["url"] for e in self.status()["engines"] if e["role"] == role)


def descendants(pid: int) -> list[psutil.Process]:
    """Every process under ``pid`` now (Ray's own processes, its workers, the engines and their guards)."""
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def cmdline(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())
    except psutil.Error:
        return ""


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def stop_mid_request(sp: ServeProcess, sig: int, model: str) -> None:
    """Send ``sig`` to ``pdserve serve``'s process group (what a terminal's Ctrl-C, ``timeout`` or ``kill --
    -PGID`` reach: Ray's own processes keep out of it) while an engine is busy with a long streamed request,
    then check that it stops in order (says "stopped", Serve's controller answered, exit status 0), and that
    no process it started is left (and the port is free)."""
    got_token = threading.Event()

    def long_request() -> None:
        body = {"model": model, "prompt": "Count slowly:", "max_tokens": 1500, "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", sp.url + "/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        got_token.set()
        except httpx.HTTPError:
            pass  # the app goes away under it

    t = threading.Thread(target=long_request, daemon=True)
    t.start()
    assert got_token.wait(120), "the long request never streamed a token"
    started = descendants(sp.proc.pid)
    assert any(GUARD_MARK.decode() in cmdline(p) for p in started), "no engine process under pdserve serve"
    assert sp.stop(sig=sig, group=True) == 0, "\n".join(list(sp.lines)[-40:])
    assert any("stopped" in ln for ln in sp.lines), "no 'stopped' line"
    # (Where the signal reached Ray's GCS and raylet too, Serve waited 30 s for its controller in vain.)
    assert not any("failed to shut down" in ln for ln in sp.lines), "\n".join(list(sp.lines)[-20:])
    # Engines stop with their replicas and Ray's own processes with ray.shutdown(); allow them to exit.
    deadline = time.monotonic() + 60
    while True:
        left = [p for p in started if _alive(p)]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert not left, "left running: " + "; ".join(f"{p.pid} {cmdline(p)[:120]}" for p in left)
    assert not set(engine_processes()) - sp.preexisting
    with pytest.raises(httpx.HTTPError):
        httpx.get(sp.url + "/health", timeout=2)
    t.join(timeout=30)


#: The LoRA adapter the session's system serves as ``<model_id>:<LORA_ADAPTER>`` (tests/lora_adapter.py).
LORA_ADAPTER = "random-r8"


@pytest.fixture(scope="session")
def lora_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An adapter store holding one random LoRA adapter for the packaged model, made offline."""
    from pdserve.config.schema import PDServeArgs
    from pdserve.model.resolve import resolve_model
    from tests.lora_adapter import write_random_adapter

    root = tmp_path_factory.mktemp("adapters")
    args = PDServeArgs()
    write_random_adapter(resolve_model(args.prefill_config.model_loading_config.model_source,
                                       cache_dir=args.cache_dir), root / LORA_ADAPTER)
    return root


class SystemSlot:
    """The one real system alive at a time: the shared one, started when a test asks for it, or a module's
    own, for which the shared one is stopped first."""

    def __init__(self, shared_config: Path) -> None:
        self.shared_config = shared_config
        self.shared: ServeProcess | None = None
        #: An own system that more than one module uses (:meth:`kept`), with its config.
        self.kept_system: tuple[Path, ServeProcess] | None = None
        self.starts = 0

    def get_shared(self) -> ServeProcess:
        sp = self.shared
        if sp is not None and sp.proc is not None and sp.proc.poll() is None:
            return sp
        self.release_kept()
        if sp is not None:
            sp.stop()  # it exited (a test stopped it): reap it before starting another
        self.shared = None
        require_memory(2, "the shared test system (1 prefill + 1 decode engine)")
        sp = ServeProcess(self.shared_config, free_port())
        sp.wait_ready()
        self.starts += 1
        self.shared = sp
        return sp

    def release_shared(self) -> None:
        """Stop the shared system (if it runs) so that a module can start its own."""
        if self.shared is not None:
            self.shared.stop()
            self.shared = None

    def release_kept(self) -> None:
        if self.kept_system is not None:
            self.kept_system[1].stop()
            self.kept_system = None

    def own(self, config: Path, *, engines: int, what: str, **kwargs: object) -> ServeProcess:
        """Start a module's own system (not waited for) once the shared one (and a kept one) is stopped."""
        self.release_shared()
        self.release_kept()
        require_memory(engines, what)
        port = kwargs.pop("port", None) or free_port()
        return ServeProcess(config, port, **kwargs)  # type: ignore[arg-type]

    def kept(self, config: Path, *, engines: int, what: str) -> ServeProcess:
        """An own system that several modules use, one after the other (OWN_SYSTEM_MODULES orders them):
        started and waited for by the first, left running for the next, stopped when another system starts
        or the session ends. A module that uses it must leave it as it found it."""
        if self.kept_system is not None:
            path, sp = self.kept_system
            if path == config and sp.proc is not None and sp.proc.poll() is None:
                return sp
        sp = self.own(config, engines=engines, what=what)
        self.kept_system = (config, sp)
        sp.wait_ready()
        return sp


@pytest.fixture(scope="session")
def otlp_collector() -> Iterator[tuple[Collector, str]]:
    """The OTLP/HTTP receiver the shared system exports its traces to (router and engines): (collector, URL)."""
    collector = Collector()
    with ThreadServer(collector.app()) as srv:
        yield collector, srv.url + "/v1/traces"


#: Responses answers each engine of the shared system keeps for one owner (test_apis.py fills it past this).
STORED_PER_OWNER = 6


@pytest.fixture(scope="session")
def system_slot(lora_store: Path, otlp_collector: tuple[Collector, str],
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[SystemSlot]:
    """pd-test.yaml as the shared system, serving the LoRA adapters in ``lora_store`` too (Ray Serve LLM's
    ``lora_config``), with the decode engines keeping Responses API answers, and traced: the router and both
    engines export their spans to ``otlp_collector``."""
    import yaml

    cfg = yaml.safe_load((ROOT / "tests" / "integration" / "pd-test.yaml").read_text())
    cfg["tracing"] = {"otlp_endpoint": otlp_collector[1], "service_name": TRACED_SERVICE}
    for side in ("prefill_config", "decode_config"):
        cfg[side]["lora_config"] = {"dynamic_lora_loading_path": str(lora_store), "max_num_adapters_per_replica": 4}
    # vLLM keeps Responses API answers (store) only with this set; the decode engines are where they live.
    cfg["decode_config"]["runtime_env"] = {"env_vars": {"VLLM_ENABLE_RESPONSES_API_STORE": "1"}}
    cfg["router"]["stored_responses_per_owner"] = STORED_PER_OWNER
    path = tmp_path_factory.mktemp("config") / "pd-test.yaml"
    path.write_text(yaml.safe_dump(cfg))
    slot = SystemSlot(path)
    yield slot
    slot.release_shared()
    slot.release_kept()


@pytest.fixture
def served(system_slot: SystemSlot) -> ServeProcess:
    """The shared system, started when the first test asks for it (and again after a test stopped it)."""
    return system_slot.get_shared()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The shared system starts once in a full run: the tests that stop it (named ``test_zz_...``) run after
    every other test that uses it, and modules with a system of their own after those, in the order of
    OWN_SYSTEM_MODULES; the order inside each module stays as collected."""
    here = Path(__file__).parent

    def own(item: pytest.Item) -> bool:
        return item.path.name in OWN_SYSTEM_MODULES and item.path.parent == here

    def stops_shared(item: pytest.Item) -> bool:
        return item.path.parent == here and not own(item) and item.name.startswith("test_zz_")

    moved = [i for i in items if stops_shared(i)]
    moved += sorted((i for i in items if own(i)), key=lambda i: OWN_SYSTEM_MODULES.index(i.path.name))
    rest = [i for i in items if not own(i) and not stops_shared(i)]
    last = max((n for n, i in enumerate(rest) if i.path.parent == here), default=len(rest) - 1)
    items[:] = rest[:last + 1] + moved + rest[last + 1:]
