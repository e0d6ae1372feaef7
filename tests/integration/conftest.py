"""One real system per test session: `pdserve serve` (Ray Serve + 2 vLLM CPU engines + NIXL), started the
way a user starts it, as a subprocess, and stopped with SIGINT at the end."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import httpx
import psutil
import pytest

from pdserve.engine.process import GUARD_MARK, SERVER_MARK, find_processes, local_engine_auth, server_pid
from pdserve.served import ServedProcess
from tests.servers import free_port

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 600


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


def _cmdline(p: psutil.Process) -> str:
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
    """Send ``sig`` to ``pdserve serve`` while an engine is busy with a long streamed request, then check that
    it says "stopped", exits 0, and that no process it started is left (and the port is free)."""
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
    assert any(GUARD_MARK.decode() in _cmdline(p) for p in started), "no engine process under pdserve serve"
    assert sp.stop(sig=sig) == 0, "\n".join(list(sp.lines)[-40:])
    assert any("stopped" in ln for ln in sp.lines), "no 'stopped' line"
    # Engines stop with their replicas and Ray's own processes with ray.shutdown(); allow them to exit.
    deadline = time.monotonic() + 60
    while True:
        left = [p for p in started if _alive(p)]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert not left, "left running: " + "; ".join(f"{p.pid} {_cmdline(p)[:120]}" for p in left)
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


@pytest.fixture(scope="session")
def served(lora_store: Path, tmp_path_factory: pytest.TempPathFactory) -> ServeProcess:
    """pd-test.yaml, serving the LoRA adapters in ``lora_store`` too (Ray Serve LLM's ``lora_config``), with
    the decode engines keeping Responses API answers."""
    import yaml

    cfg = yaml.safe_load((ROOT / "tests" / "integration" / "pd-test.yaml").read_text())
    for side in ("prefill_config", "decode_config"):
        cfg[side]["lora_config"] = {"dynamic_lora_loading_path": str(lora_store), "max_num_adapters_per_replica": 4}
    # vLLM keeps Responses API answers (store) only with this set; the decode engines are where they live.
    cfg["decode_config"]["runtime_env"] = {"env_vars": {"VLLM_ENABLE_RESPONSES_API_STORE": "1"}}
    path = tmp_path_factory.mktemp("config") / "pd-test.yaml"
    path.write_text(yaml.safe_dump(cfg))
    sp = ServeProcess(path, free_port())
    sp.wait_ready()
    yield sp
    sp.stop()
