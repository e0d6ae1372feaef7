"""The systems a scenario compares, each started on the same cores, one after the other, then stopped.

- :class:`EnginePair`: two plain vLLM OpenAI servers with the exact command lines pdserve would give its
  prefill and decode replicas (or two single engines without KV transfer, for colocated baselines).
- :class:`ServedApp`: ``pdserve serve`` as a subprocess, the way a user runs it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from pdserve.config.schema import PDServeArgs
from pdserve.engine.allocator import free_ephemeral_port, usable_cores
from pdserve.engine.launcher import EngineCommand, EnginePlacement, build_engine_command
from pdserve.engine.process import EngineProcess
from pdserve.errors import EngineStartError
from pdserve.model.resolve import resolve_model


def _say(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


class EnginePair:
    """Prefill + decode engines (``disaggregated=True``) or two independent engines (``False``)."""

    def __init__(self, args: PDServeArgs, *, disaggregated: bool = True, log_dir: Path | None = None,
                 variants: list[tuple[dict[str, str], dict[str, Any]]] | None = None) -> None:
        """``variants``: per engine (in start order), extra environment and engine_kwargs."""
        self.args = args
        self.variants = variants or []
        self.disaggregated = disaggregated
        self.log_dir = log_dir or Path(tempfile.gettempdir()) / "pdserve-bench-logs"
        self.procs: list[EngineProcess] = []
        self.urls: list[str] = []

    def _command(self, role: str, model: str, core: int, side_port: int, index: int = 0) -> EngineCommand:
        pl = EnginePlacement(http_port=free_ephemeral_port(), side_channel_port=side_port,
                             side_channel_host="127.0.0.1", engine_id=f"bench-{role}-{core}", cores=[core],
                             on_cpu=True)
        args = self.args
        env: dict[str, str] = {}
        if index < len(self.variants):
            env, kwargs = self.variants[index]
            args = args.model_copy(deep=True)
            for cfg in (args.prefill_config, args.decode_config):
                cfg.engine_kwargs.update(kwargs)
        cmd = build_engine_command(role, args, model, pl)  # type: ignore[arg-type]
        cmd.env.update(env)
        if not self.disaggregated:
            i = cmd.argv.index("--kv-transfer-config")
            del cmd.argv[i:i + 2]
        return cmd

    def __enter__(self) -> EnginePair:
        model = resolve_model(self.args.prefill_config.model_loading_config.model_source,
                              cache_dir=self.args.cache_dir)
        cores = usable_cores()
        roles = ("prefill", "decode")
        t0 = time.monotonic()
        for i, role in enumerate(roles):
            cmd = self._command(role, model, cores[i % len(cores)], 5700 + 10 * i, i)
            port = cmd.argv[cmd.argv.index("--port") + 1]
            name = role if self.disaggregated else f"engine{i}"
            proc = EngineProcess(cmd, f"http://127.0.0.1:{port}", self.log_dir / f"{name}.log", name)
            proc.start()
            self.procs.append(proc)
        try:
            for p in self.procs:
                p.wait_ready(600)
        except EngineStartError:
            self.__exit__()
            raise
        self.urls = [p.url for p in self.procs]
        kind = "prefill+decode (plain vLLM, bare handoff)" if self.disaggregated else "2 colocated engines"
        _say(f"{kind} ready in {time.monotonic() - t0:.0f}s: {self.urls}")
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self.procs:
            p.stop()
        self.procs.clear()


class ServedApp:
    """``pdserve serve`` with the given args, as a subprocess."""

    def __init__(self, args: PDServeArgs) -> None:
        self.args = args
        self.port = free_ephemeral_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[str] | None = None
        self._cfg: Path | None = None

    def __enter__(self) -> ServedApp:
        data: dict[str, Any] = self.args.model_dump(mode="json", exclude_defaults=True)
        fd, name = tempfile.mkstemp(suffix=".yaml", prefix="pdserve-bench-")
        with os.fdopen(fd, "w") as f:
            yaml.safe_dump(data, f)
        self._cfg = Path(name)
        exe = str(Path(sys.executable).parent / "pdserve")
        t0 = time.monotonic()
        self.proc = subprocess.Popen([exe, "serve", name, "--port", str(self.port)], stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, text=True)
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("pdserve ready:"):
                break
        else:
            raise EngineStartError("pdserve serve exited before it was ready")
        _say(f"pdserve endpoint ready in {time.monotonic() - t0:.0f}s: {self.url}")
        return self

    def engines(self) -> dict[str, str]:
        import json
        import urllib.request

        with urllib.request.urlopen(self.url + "/pdserve/status", timeout=10) as r:
            return {e["role"]: e["url"] for e in json.load(r)["engines"]}

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        if self._cfg is not None:
            self._cfg.unlink(missing_ok=True)
