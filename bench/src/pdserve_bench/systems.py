"""The systems a scenario compares, each started on the same cores, one after the other, then stopped.

- :class:`EnginePair`: two plain vLLM OpenAI servers with the exact command lines pdserve would give its
  prefill and decode replicas (or one or two single engines without KV transfer, for colocated baselines).
- :class:`ServedApp`: ``pdserve serve`` as a subprocess, the way a user runs it.
- Ray Serve LLM's own P/D app: :class:`pdserve_bench.ray_serve_llm.RayServeLLMApp`.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from pdserve.config.schema import PDServeArgs
from pdserve.engine.allocator import Claim, claim_free_port, usable_cores
from pdserve.engine.launcher import SECRET_ENV, EngineCommand, EnginePlacement, build_engine_command
from pdserve.engine.process import EngineProcess
from pdserve.errors import EngineStartError
from pdserve.model.resolve import resolve_model


def _say(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def model_path(args: PDServeArgs) -> str:
    """What :func:`resolve_model` gives the engines, found without preparing or downloading anything."""
    from pdserve.config.schema import EMBEDDED_MODEL_SOURCE
    from pdserve.model.embedded import embedded_model_dir

    source = args.prefill_config.model_loading_config.model_source
    if not source or source == EMBEDDED_MODEL_SOURCE:
        return str(embedded_model_dir(args.cache_dir))
    path = Path(source).expanduser()
    return str(path.resolve()) if path.exists() else source


def model_ready(args: PDServeArgs) -> bool:
    """Whether :func:`model_path` is a model directory already (the packaged model prepared, a local
    directory); a hub id is not."""
    from pdserve.config.schema import EMBEDDED_MODEL_SOURCE
    from pdserve.model.embedded import embedded_model_dir, is_prepared

    source = args.prefill_config.model_loading_config.model_source
    if not source or source == EMBEDDED_MODEL_SOURCE:
        return is_prepared(embedded_model_dir(args.cache_dir))
    return (Path(model_path(args)) / "config.json").exists()


def _public_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k not in SECRET_ENV}


def _redacted(data: Any) -> Any:
    """A config as shown in a plan: inline API keys replaced."""
    if isinstance(data, dict):
        return {k: (["<redacted>"] * len(v) if k == "api_keys" and isinstance(v, list) else _redacted(v))
                for k, v in data.items()}
    return data


class EnginePair:
    """Prefill + decode engines (``disaggregated=True``) or two independent engines (``False``; one with
    ``engines=1``)."""

    def __init__(self, args: PDServeArgs, *, disaggregated: bool = True, log_dir: Path | None = None,
                 variants: list[tuple[dict[str, str], dict[str, Any]]] | None = None, engines: int = 2) -> None:
        """``variants``: per engine (in start order), extra environment and engine_kwargs. ``engines``: 1
        starts only the first colocated engine (on the first core), the compute floor of one request."""
        if engines not in (1, 2) or (disaggregated and engines != 2):
            raise ValueError("EnginePair: 2 engines, or 1 colocated engine")
        self.args = args
        self.engines = engines
        self.variants = variants or []
        self.disaggregated = disaggregated
        self.log_dir = log_dir or Path(tempfile.gettempdir()) / "pdserve-bench-logs"
        self.procs: list[EngineProcess] = []
        self.urls: list[str] = []
        self.claim = Claim()  # the engines' ports, held while they run (not another engine's on this host)

    def _command(self, role: str, model: str, core: int, side_port: int, index: int = 0) -> EngineCommand:
        pl = EnginePlacement(http_port=claim_free_port(self.claim, "127.0.0.1"), side_channel_port=side_port,
                             side_channel_host="127.0.0.1", engine_id=f"bench-{role}-{core}", cores=[core],
                             on_cpu=True)
        args = self.args
        env: dict[str, str] = {}
        if index < len(self.variants):
            env, kwargs = self.variants[index]
            args = args.model_copy(deep=True)
            for cfg in (args.prefill_config, args.decode_config):
                cfg.engine_kwargs.update(kwargs)
        # Colocated engines each run whole requests: a decode engine's arguments (its KV cache size too).
        cmd = build_engine_command(role if self.disaggregated else "decode", args, model, pl)  # type: ignore[arg-type]
        cmd.env.update(env)
        if not self.disaggregated:
            i = cmd.argv.index("--kv-transfer-config")
            del cmd.argv[i:i + 2]
        return cmd

    def _commands(self, model: str) -> list[tuple[str, int, EngineCommand]]:
        """(name, core, command) of each engine, in start order."""
        cores = usable_cores()
        out = []
        for i, role in enumerate(("prefill", "decode")[:self.engines]):
            core = cores[i % len(cores)]
            out.append((role if self.disaggregated else f"engine{i}", core,
                        self._command(role, model, core, 5700 + 10 * i, i)))
        return out

    def spec(self) -> dict[str, Any]:
        """What ``__enter__`` would start, without preparing the model (ports are picked again at start)."""
        model = model_path(self.args)
        return {"kind": "prefill + decode engines, bare handoff" if self.disaggregated else self._colocated(),
                "model": model, "model_ready": model_ready(self.args),
                "engines": [{"name": name, "core": core, "argv": cmd.argv, "env": _public_env(cmd.env)}
                            for name, core, cmd in self._commands(model)]}

    def _colocated(self) -> str:
        return f"{self.engines} colocated engine{'s' if self.engines > 1 else ''}"

    def __enter__(self) -> EnginePair:
        model = resolve_model(self.args.prefill_config.model_loading_config.model_source,
                              cache_dir=self.args.cache_dir)
        t0 = time.monotonic()
        for name, _, cmd in self._commands(model):
            port = cmd.argv[cmd.argv.index("--port") + 1]
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
        kind = "prefill+decode (plain vLLM, bare handoff)" if self.disaggregated else self._colocated()
        _say(f"{kind} ready in {time.monotonic() - t0:.0f}s: {self.urls}")
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self.procs:
            p.stop()
        self.procs.clear()
        self.claim.release()


class ServedApp:
    """``pdserve serve`` with the given args, as a subprocess (:class:`pdserve.testing.served.ServedProcess`, the
    helper the integration tests use too)."""

    def __init__(self, args: PDServeArgs) -> None:
        self.args = args
        self.port = 0  # picked at start
        self.url = ""
        self.served: Any = None
        self._auth: dict[str, dict[str, str]] = {}

    def spec(self) -> dict[str, Any]:
        """What ``__enter__`` would run: the command and the config it writes for it (non-default fields)."""
        from pdserve.testing.served import ServedProcess

        a = self.args
        argv = ServedProcess("<config.yaml>", port=1).command()
        argv[argv.index("--port") + 1] = "<free port>"
        return {"kind": "pdserve serve", "argv": argv,
                "replicas": {role: cfg.deployment_config.num_replicas or "default"
                             for role, cfg in (("prefill", a.prefill_config), ("decode", a.decode_config))},
                "config": _redacted(a.model_dump(mode="json", exclude_defaults=True))}

    def __enter__(self) -> ServedApp:
        from pdserve.testing.served import ServedProcess

        self.served = ServedProcess(self.args).start()
        self.port, self.url = self.served.port, self.served.url
        took = self.served.wait_ready()
        _say(f"pdserve endpoint ready in {took:.0f}s: {self.url}")
        return self

    def engines(self) -> dict[str, str]:
        import json
        import urllib.request

        with urllib.request.urlopen(self.url + "/pdserve/status", timeout=10) as r:
            return {e["role"]: e["url"] for e in json.load(r)["engines"]}

    def auth(self, url: str) -> dict[str, str]:
        """Headers for calling one of this app's engines directly (the bare-handoff baseline); looked up
        once per engine, off the timed path after the first call."""
        from urllib.parse import urlsplit

        from pdserve.engine.process import local_engine_auth

        base = urlsplit(url)._replace(path="", query="", fragment="").geturl()
        if base not in self._auth:
            self._auth[base] = local_engine_auth(base)
        return self._auth[base]

    def __exit__(self, *exc: object) -> None:
        if self.served is not None:
            self.served.stop(timeout_s=90)
