"""``--scenario router``: the router alone. How many P/D requests per second one core of router carries,
its CPU time per request, and the latency it adds to the two calls it makes.

Three processes. The router (uvicorn + pdserve's app, a static pool of one prefill and one decode
endpoint, built the way the router deployment builds it: request checks, admission by work, engine keys)
is pinned to one core. Minimal fake engines and the load generator share another core: the fakes are a
bare asyncio HTTP/1.1 keep-alive responder with canned answers, because aiohttp's or FastAPI's server
costs more per call than the router does and would be the limit instead. The load comes from ``wrk``
when it is installed (C, one thread), else from a Python client.

Per mode (non-streaming, streaming with 8 chunks): 1 s of warm-up, then ``seconds`` of closed-loop load
at ``concurrency``. Before that, the added latency: at concurrency 1, one request through the router
against the same two calls made straight to the fakes, alternating which goes first so drift hits both.

Options (``--opt``): ``seconds`` (10), ``concurrency`` (32), ``latency_requests`` (300 pairs).

The scenario's parts: :mod:`pdserve_bench.router_fakes` (the fake engines and the request sent) and
:mod:`pdserve_bench.router_load` (the closed loop from wrk or Python, the added latency). This module builds
the router's app, starts the processes on their cores, measures, and is the processes' entry point
(``python -m pdserve_bench.router_bench fakes|router``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve_bench.router_fakes import (
    ENGINE_KEY,
    MODEL,
    STREAM_CHUNKS,
    answer,
    canned,
    client_body,
    serve_fakes,
)
from pdserve_bench.router_load import Drive, added_latency, closed_loop, parse_wrk, wrk

#: The scenario, and the names callers found here before the module's split (each lives in the module it is
#: imported from; ``_answer`` and ``_canned`` are router_fakes' ``answer`` and ``canned``).
__all__ = ["ENGINE_KEY", "STREAM_CHUNKS", "Drive", "Setup", "client_body", "main", "measure_router", "parse_wrk",
           "router_app", "serve_fakes", "serve_router"]
_answer, _canned = answer, canned

#: The fakes answer at once; admission by work has its own tests (tests/unit/test_admission.py).
CALIBRATED_RATE = 1e6
WARMUP_S = 1.0
START_TIMEOUT_S = 180.0  # the router imports vLLM's request models at start: seconds on a busy host


# --- the router -----------------------------------------------------------------------------------------


def router_app(prefill: str, decode: str, *, key: str = ENGINE_KEY, tokenizer: str | None = None) -> Any:
    """The router's app as the router deployment builds it (pdserve/app/deployments.py) for the default
    config, with a static pool of two calibrated endpoints instead of the registry."""
    from pdserve.config.kv_transfer import prefill_kv_lease_s
    from pdserve.config.schema import PDServeArgs
    from pdserve.engine.launcher import engine_kwargs_for
    from pdserve.router.build import build_router
    from pdserve.router.endpoint import Endpoint
    from pdserve.router.prompt_length import PromptLength
    from pdserve.router.validate import EngineLimits

    args = PDServeArgs()
    r = args.router
    eps = [Endpoint(role="prefill", url=prefill, engine_id="bench-prefill", api_key=key),
           Endpoint(role="decode", url=decode, engine_id="bench-decode", api_key=key)]
    for ep in eps:
        ep.load.calibrated(CALIBRATED_RATE)
    lease_s = prefill_kv_lease_s(args.prefill_config.engine_kwargs.get("kv_transfer_config"), args.nixl)
    roles = ("prefill", "decode")
    kwargs = [engine_kwargs_for(role, args, on_cpu=True) for role in roles]  # type: ignore[arg-type]
    router = build_router(r, MODEL, endpoints=eps, lengths=PromptLength(tokenizer), lease_s=lease_s,
                          limits=EngineLimits.from_engine_kwargs(*kwargs),
                          lease_check_after_s=0.5 * lease_s if r.kv_lease_check else None)
    app, orch = router.app, router.orchestrator
    app.state.bench_checks = orch.gate.validator.summary()  # after build_app: it loads vLLM's request models
    return app


def serve_router(port: int, prefill: str, decode: str, *, tokenizer: str | None, facts: str | None) -> None:
    import uvicorn

    app = router_app(prefill, decode, tokenizer=tokenizer)
    if facts:
        Path(facts).write_text(json.dumps(app.state.bench_checks))
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


# --- the measurement ----------------------------------------------------------------------------------


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (/proc/PID/stat fields 14 and 15)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _wait_up(url: str, proc: subprocess.Popen[bytes], what: str, timeout_s: float = START_TIMEOUT_S) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the {what} exited with {proc.returncode} before answering /health")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"the {what} at {url} did not answer /health within {timeout_s:.0f}s")


@dataclass
class Setup:
    """Everything :func:`measure_router` starts and runs, decided before anything starts."""

    seconds: float
    concurrency: int
    latency_pairs: int
    router_core: int
    other_core: int
    fake_port: int
    router_port: int
    tokenizer: str | None
    wrk: str | None

    @classmethod
    def make(cls, seconds: float, concurrency: int, latency_pairs: int) -> Setup:
        from pdserve.engine.allocator import free_ephemeral_port, usable_cores
        from pdserve.model.embedded import embedded_model_dir, is_prepared

        cores = usable_cores()
        # The router counts prompts with the model's tokenizer where it has one, as deployed (never
        # prepared here).
        tok = embedded_model_dir()
        return cls(seconds, concurrency, latency_pairs, router_core=cores[0], other_core=cores[-1],
                   fake_port=free_ephemeral_port(), router_port=free_ephemeral_port(),
                   tokenizer=str(tok) if is_prepared(tok) else None, wrk=shutil.which("wrk"))

    @property
    def fake_url(self) -> str:
        return f"http://127.0.0.1:{self.fake_port}"

    @property
    def router_url(self) -> str:
        return f"http://127.0.0.1:{self.router_port}"

    def fakes_argv(self) -> list[str]:
        return [sys.executable, "-m", "pdserve_bench.router_bench", "fakes", str(self.fake_port)]

    def router_argv(self, facts: str | None = None) -> list[str]:
        argv = [sys.executable, "-m", "pdserve_bench.router_bench", "router", str(self.router_port),
                self.fake_url, self.fake_url]
        if self.tokenizer:
            argv += ["--tokenizer", self.tokenizer]
        if facts:
            argv += ["--facts", facts]
        return argv

    def record(self, plan: Any) -> None:
        client = "wrk" if self.wrk else "python"
        plan.set(seconds=self.seconds, concurrency=self.concurrency, latency_requests=self.latency_pairs,
                 client=client, shared_core=self.router_core == self.other_core)
        plan.require("uvicorn", "fastapi", "vllm", executables=("wrk",))
        plan.workload("completion", body=client_body(False), stream_chunks=STREAM_CHUNKS)
        plan.system("fake engines", {"kind": "process", "argv": self.fakes_argv(), "core": self.other_core,
                                     "roles": ["prefill", "decode"], "engine_key": "required"})
        plan.system("router", {"kind": "process", "argv": self.router_argv(), "core": self.router_core,
                               "config": "the default router config, static pool, calibrated endpoints",
                               "prompt_lengths": "tokenizer" if self.tokenizer else "estimate"})
        plan.phase("added latency", system="router", load="concurrency:1", workload="completion",
                   pairs=self.latency_pairs, against="the same two calls straight to the fakes")
        for mode in ("non_streaming", "streaming"):
            plan.phase(mode, system="router", load=f"concurrency:{self.concurrency}", workload="completion",
                       client=client, warmup_s=WARMUP_S, seconds=self.seconds, client_core=self.other_core)


def measure_router(seconds: float = 10, concurrency: int = 32, *, latency_requests: int = 300,
                   plan: Any = None) -> dict[str, Any]:
    """The figures of ``--scenario router``. With a dry-run ``plan``, returns it without starting
    anything."""
    setup = Setup.make(seconds, concurrency, latency_requests)
    if plan is not None:
        setup.record(plan)
        if plan.dry_run:
            return dict(plan.as_dict())
    from pdserve_bench.overload_long import host_cpu

    before = os.sched_getaffinity(0)
    facts = tempfile.NamedTemporaryFile(prefix="pdserve-router-bench-", suffix=".json", delete=False)
    facts.close()
    fakes = subprocess.Popen(setup.fakes_argv())
    router = subprocess.Popen(setup.router_argv(facts.name))
    try:
        os.sched_setaffinity(fakes.pid, {setup.other_core})
        os.sched_setaffinity(router.pid, {setup.router_core})
        os.sched_setaffinity(0, {setup.other_core})  # this thread drives the load
        _wait_up(setup.fake_url, fakes, "fake engines")
        _wait_up(setup.router_url, router, "router")
        out: dict[str, Any] = {"host_cpu": host_cpu(), "router_core": setup.router_core,
                               "shared_core": setup.router_core == setup.other_core,
                               "concurrency": concurrency, "seconds": seconds,
                               "request_checks": json.loads(Path(facts.name).read_text() or "{}"),
                               "prompt_lengths": "tokenizer" if setup.tokenizer else "estimate"}
        out["added_latency"] = asyncio.run(added_latency(setup.router_url, setup.fake_url, latency_requests))
        for stream in (False, True):
            asyncio.run(closed_loop(setup.router_url, WARMUP_S, concurrency, stream))
            c0 = _cpu_s(router.pid)
            got = wrk(setup.wrk, setup.router_url, seconds, concurrency, stream) if setup.wrk else None
            if got is None:
                got = asyncio.run(closed_loop(setup.router_url, seconds, concurrency, stream))
            cpu = _cpu_s(router.pid) - c0
            ms = 1000 * cpu / got.done if got.done else 0.0
            # When the load generator (sharing its core with the fakes) cannot saturate the router, the
            # router's CPU per request still gives what its one core would carry.
            out["streaming" if stream else "non_streaming"] = {
                "client": got.client, "requests_per_s": got.done / got.wall_s if got.wall_s else 0.0,
                "errors": got.errors, "failed": got.failed, "router_cpu_ms_per_request": ms,
                "router_cpu_utilisation": cpu / got.wall_s if got.wall_s else 0.0,
                "one_core_capacity_rps": 1000 / ms if ms else 0.0}
        return out
    finally:
        os.sched_setaffinity(0, before)
        for p in (router, fakes):
            p.terminate()
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        os.unlink(facts.name)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m pdserve_bench.router_bench",
                                description="the processes of --scenario router")
    sub = p.add_subparsers(dest="what", required=True)
    f = sub.add_parser("fakes")
    f.add_argument("port", type=int)
    r = sub.add_parser("router")
    r.add_argument("port", type=int)
    r.add_argument("prefill")
    r.add_argument("decode")
    r.add_argument("--tokenizer")
    r.add_argument("--facts", help="write the router's request checks here once it is built")
    ns = p.parse_args(argv)
    if ns.what == "fakes":
        serve_fakes(ns.port)
    else:
        serve_router(ns.port, ns.prefill, ns.decode, tokenizer=ns.tokenizer, facts=ns.facts)


if __name__ == "__main__":
    main()
