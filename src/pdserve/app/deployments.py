"""The Ray Serve deployments: engine replicas (one vLLM server each) and the OpenAI router.

Why engines are vLLM OpenAI servers that the router calls directly over HTTP instead of in-process
engines behind Serve handles: the handle path adds an actor hop, serialisation and (in Ray Serve LLM)
a 50 ms stream-batching timer per request, and measured 8x slower than the bare two-call handoff here.
With direct HTTP the router's data path is the bare handoff itself; Ray Serve still owns placement,
replica lifecycle, health checks, restarts and autoscaling.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import time
import uuid
from typing import Any

from pdserve.app import placement
from pdserve.app.ray_compat import keep_serve_grpc_local
from pdserve.config.resources import engine_ranks
from pdserve.config.schema import PDServeArgs
from pdserve.settings import settings

log = logging.getLogger("pdserve")


def _node_ip() -> str:
    try:
        import ray

        return str(ray.util.get_node_ip_address())
    except Exception:  # noqa: BLE001
        return socket.gethostbyname(socket.gethostname())


def _app_name() -> str:
    from ray import serve

    try:
        return str(serve.get_replica_context().app_name)
    except Exception:  # noqa: BLE001
        return "default"


def _replica_id() -> str:
    from ray import serve

    try:
        return str(serve.get_replica_context().replica_id.unique_id)
    except Exception:  # noqa: BLE001
        return uuid.uuid4().hex[:8]


class EngineServer:
    """One engine replica: claims ports and cores on its host, runs a vLLM server, registers it."""

    def __init__(self, role: str, args: dict[str, Any]) -> None:
        from pdserve.engine.allocator import (
            Claim,
            claim_cores,
            claim_free_port,
            claim_port_block,
            usable_cores,
        )
        from pdserve.engine.launcher import (
            EnginePlacement,
            build_engine_command,
            kv_events_endpoints,
            routes_by_kv_events,
        )
        from pdserve.engine.process import EngineProcess
        from pdserve.model.resolve import resolve_model

        keep_serve_grpc_local()
        self.role = role
        self.args = PDServeArgs.model_validate(args)
        cfg = self.args.prefill_config if role == "prefill" else self.args.decode_config
        self.replica_id = _replica_id()
        self.app_name = _app_name()
        on_cpu = not placement.replica_on_gpu()
        host_ip = _node_ip()
        t0 = time.monotonic()
        model_path = resolve_model(cfg.model_loading_config.model_source,
                                   lambda m: log.info("[%s %s] %s", role, self.replica_id, m),
                                   cache_dir=self.args.cache_dir)
        self.claim = Claim()
        ranks = engine_ranks(cfg)
        side_port = claim_port_block(self.claim, self.args.nixl.side_channel_port_base, max(1, ranks))
        cores: list[int] = []
        if on_cpu and self.args.cpu.bind_cores:
            # Decode engines take cores from the end, prefill from the start, so a 1+1 app on two
            # cores gets one core each whatever order the replicas start in.
            avail = usable_cores()
            order = avail if role == "prefill" else list(reversed(avail))
            cores = claim_cores(self.claim, self.args.cpu.cores_per_engine, order, role)
        bind_host = "127.0.0.1" if host_ip in ("127.0.0.1",) else host_ip
        http_port = claim_free_port(self.claim, "0.0.0.0")
        self.engine_id = f"{role}-{self.replica_id}-{uuid.uuid4().hex[:6]}"
        kv_bind, self.kv_events = "", ""
        if routes_by_kv_events(role, self.args):  # type: ignore[arg-type]
            events_port = claim_free_port(self.claim, "0.0.0.0")
            kv_bind, self.kv_events = kv_events_endpoints(self.engine_id, bind_host, events_port)
        self.placement = EnginePlacement(
            http_port=http_port, side_channel_port=side_port, side_channel_host=bind_host,
            engine_id=self.engine_id, cores=cores, on_cpu=on_cpu, kv_events_bind=kv_bind,
        )
        # A key of this engine's own: it answers only callers that read it from the app's registry.
        self.api_key = secrets.token_urlsafe(32)
        tok = cfg.model_loading_config.tokenizer_source
        tokenizer_path = resolve_model(tok, cache_dir=self.args.cache_dir) if tok else None
        cmd = build_engine_command(role, self.args, model_path, self.placement,  # type: ignore[arg-type]
                                   api_key=self.api_key, tokenizer_path=tokenizer_path)
        self.url = f"http://{bind_host}:{http_port}"
        log_dir = settings().log_dir
        self.proc = EngineProcess(cmd, self.url, log_dir / f"{self.app_name}-{role}-{self.replica_id}.log",
                                  f"{role} engine {self.replica_id}")
        log.info("starting %s engine %s on %s (cores %s, NIXL port %d): %s", role, self.replica_id, self.url,
                 cores or "all", side_port, cmd.shell())
        self.proc.start()
        took = self.proc.wait_ready(timeout_s=settings().engine_start_timeout_s)
        self.proc.check_own(self.api_key)
        self.proc.check_guarded()
        if cores:
            from pdserve.engine.core_share import settle
            from pdserve.engine.process import server_pid

            pid = server_pid(self.url) or self.proc.proc.pid  # type: ignore[union-attr]
            settle(self.claim, role, pid, self.args.cpu.shared_core_nice, f"{role} engine {self.replica_id}")
        log.info("%s engine %s ready in %.1fs (total %.1fs)", role, self.replica_id, took, time.monotonic() - t0)
        self._register()
        self.proc.watch(self._engine_exited)

    def _entry(self) -> dict[str, Any]:
        return {
            "role": self.role, "url": self.url, "replica_id": self.replica_id, "engine_id": self.engine_id,
            "node": _node_ip(), "side_channel_port": self.placement.side_channel_port,
            "cores": self.placement.cores, "log": str(self.proc.log_path), "pid": os.getpid(),
            "api_key": self.api_key, "kv_events": self.kv_events,
        }

    def _register(self) -> None:
        from pdserve.app import registry

        registry.register(self.app_name, self.replica_id, self._entry())

    def _engine_exited(self, returncode: int) -> None:
        """The engine exited by itself (killed, crashed, out of memory): this replica has nothing left to
        serve. It leaves the registry, so routers stop picking it now, and ends its own actor: Serve marks a
        crashed replica unhealthy at its next health check and replaces it, where an engine that fails its
        checks is replaced only after three in a row (two health-check periods more)."""
        import ray

        from pdserve.app import registry

        if _app_stopping(self.app_name):
            return  # the whole app stops: Serve is stopping this replica too
        log.error("%s engine %s exited with code %s; ending its replica so that Serve replaces it; log: %s",
                  self.role, self.replica_id, returncode, getattr(self.proc, "log_path", "?"))
        try:
            registry.unregister(self.app_name, self.replica_id)
        except Exception:  # noqa: BLE001 - the replacement registers afresh either way
            pass
        ray.kill(ray.get_runtime_context().current_actor, no_restart=True)

    async def check_health(self) -> None:
        """Ray Serve calls this; raising makes Serve replace the replica (and restart the engine)."""
        if not self.proc.alive():
            raise RuntimeError(f"{self.role} engine process exited; log: {self.proc.log_path}")
        ok = await asyncio.get_running_loop().run_in_executor(None, self.proc.healthy, 10.0)
        if not ok:
            raise RuntimeError(f"{self.role} engine at {self.url} failed its health check")
        # Re-announce: a router may have forgotten it (down for a minute), or Ray's store lost it.
        from pdserve.app import registry

        await registry.register_async(self.app_name, self.replica_id, self._entry())

    def info(self) -> dict[str, Any]:
        return self._entry()

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Ray Serve's custom autoscaling metrics: this engine's running/waiting requests and KV use, and
        on prefill with ``target_ttft_s`` the recent TTFT against it."""
        import urllib.request

        from pdserve.app.autoscaling import TTFT_PRESSURE, TtftWindow, parse_engine_stats

        def fetch() -> str:
            with urllib.request.urlopen(self.url + "/metrics", timeout=5) as r:
                return r.read().decode()

        stats = parse_engine_stats(await asyncio.get_running_loop().run_in_executor(None, fetch))
        total, count = stats.pop("ttft_sum"), stats.pop("ttft_count")
        auto = self.args.prefill_config.deployment_config.autoscaling_config
        if self.role == "prefill" and auto is not None and auto.target_ttft_s:
            if getattr(self, "_ttft", None) is None:
                self._ttft = TtftWindow(auto.target_ttft_s)
            pressure = self._ttft.pressure(total, count)
            if pressure is not None:
                stats[TTFT_PRESSURE] = pressure
        return stats

    def __del__(self) -> None:
        self.shutdown()

    def _drain(self) -> None:
        """Let the engine's requests finish before it stops (engine/drain.py): out of the registry already,
        wait out the router's refresh, then until the engine is idle, within the graceful-shutdown bound."""
        import urllib.request

        from pdserve.app.autoscaling import RUNNING, WAITING, parse_engine_stats
        from pdserve.engine.drain import STOP_MARGIN_S, wait_until_idle

        def busy() -> float | None:
            if not self.proc.alive():
                return None
            try:
                with urllib.request.urlopen(self.url + "/metrics", timeout=2) as r:
                    stats = parse_engine_stats(r.read().decode())
            except Exception:  # noqa: BLE001 - an engine that cannot answer has nothing left to finish
                return None
            return stats[RUNNING] + stats[WAITING]

        cfg = self.args.prefill_config if self.role == "prefill" else self.args.decode_config
        budget = cfg.deployment_config.graceful_shutdown_timeout_s - STOP_MARGIN_S
        if budget <= 0:
            return
        # The router's refresh is waited out only where routers go on (a scale-down, a redeploy): when the
        # whole app stops, Serve has stopped its routers already.
        refresh = 0.0 if _app_stopping(self.app_name) else 2 * self.args.router.engine_refresh_s
        drained, waited = wait_until_idle(busy, min_s=min(refresh, budget), max_s=budget)
        log.info("%s engine %s %s after %.1fs; stopping it", self.role, self.replica_id,
                 "drained" if drained else "still busy", waited)

    def shutdown(self) -> None:
        proc = getattr(self, "proc", None)
        if proc is not None:
            try:
                from pdserve.app import registry

                registry.unregister(self.app_name, self.replica_id)
            except Exception:  # noqa: BLE001 - best effort while going down
                pass
            self._drain()
            proc.stop()
            self.proc = None  # type: ignore[assignment]
        claim = getattr(self, "claim", None)
        if claim is not None:
            claim.release()


def _app_stopping(app_name: str) -> bool:
    try:
        from pdserve.app import registry

        return registry.stopping(app_name)
    except Exception:  # noqa: BLE001 - unknown: drain as for a scale-down
        return False


class RouterServer:
    """The OpenAI-compatible ingress. Its FastAPI app is built per config at replica start."""

    def __init__(self, args: dict[str, Any], prefill: Any = None, decode: Any = None,
                 direct_ingress: dict[str, Any] | None = None) -> None:
        keep_serve_grpc_local()
        self.args = PDServeArgs.model_validate(args)
        self.direct_ingress = direct_ingress
        self.app_name = _app_name()
        # The handles keep the engine deployments part of this application's graph.
        self._handles = (prefill, decode)
        self._probe: asyncio.Task[None] | None = None

    def __serve_build_asgi_app__(self) -> Any:
        from pdserve.router.build import build_router
        from pdserve.router.endpoint import Endpoint
        from pdserve.router.pool import ProbeSchedule, probe_forever
        from pdserve.router.prompt_length import PromptLength

        r = self.args.router
        # Prompt lengths drive admission by work and conditional disaggregation: count them with the
        # model's own tokenizer when the router's host has it.
        from pdserve.model.resolve import resolve_model

        src = self.args.prefill_config.model_loading_config
        try:
            lengths = PromptLength(resolve_model(src.tokenizer_source or src.model_source,
                                                 cache_dir=self.args.cache_dir))
        except Exception as e:  # noqa: BLE001 - an estimate still admits sensibly
            log.warning("no tokenizer for the router (%s); estimating prompt lengths", e)
            lengths = PromptLength()
        from pdserve.config.kv_transfer import handback_ttl_s, prefill_kv_lease_s

        lease_s = prefill_kv_lease_s(self.args.prefill_config.engine_kwargs.get("kv_transfer_config"),
                                     self.args.nixl)
        # A lease cannot run out in less than its duration; half of it leaves room for clock skew
        # between the prefill engine's lease start and the router's receipt of its answer.
        lease_check = 0.5 * lease_s if r.kv_lease_check else None
        cache_dir = self.args.cache_dir
        dtype = self.args.prefill_config.engine_kwargs.get("dtype")

        def calibrated(ep: Endpoint, rate: float) -> None:
            try:
                from pdserve.engine.cpu_host import record_engine_speed

                record_engine_speed(cache_dir, dtype=str(dtype or "auto"), prompt_tokens_per_s=rate,
                                    role=ep.role, model=self.args.model_id)
            except Exception as e:  # noqa: BLE001 - a note for `pdserve doctor`, never worth a failure
                log.debug("cannot record the engine speed: %s", e)

        lora = self.args.prefill_config.lora_config
        # Ray Serve's proxy already returns X-Request-Id (the client's, or one it made and passed to us).
        router = build_router(r, self.args.model_id, lengths=lengths, limits=self._engine_limits(),
                              lease_s=lease_s, lease_check_after_s=lease_check, on_calibrated=calibrated,
                              chat_parsers=self._chat_parsers(), echo_request_id=False, tracing=self.args.tracing,
                              lora_root=lora.dynamic_lora_loading_path if lora else None,
                              handback_ttl_s=handback_ttl_s(
                                  self.args.decode_config.engine_kwargs.get("kv_transfer_config"), self.args.nixl))
        self.orchestrator, pool, app = router.orchestrator, router.pool, router.app
        # The router renders chat prompts to route them by cached prefix, and to find the decode replica that
        # holds a conversation (router.cache_aware_steps); the same `lengths` object.
        if pool.follows("prefill") or pool.follows("decode"):
            try:
                lengths.load_chat_template()
            except Exception as e:  # noqa: BLE001 - chat prompts are then routed by load
                log.warning("no chat template for the router (%s); chat prompts are routed by load", e)
        # Everything alive now (the router's modules, the chat template) leaves the garbage collector's scans:
        # a full scan took 300+ ms with vLLM's request models imported here, with the event loop stopped.
        from pdserve.router import heap

        heap.settle()
        app_name = self.app_name

        async def discover() -> list[Endpoint]:
            from pdserve.app import registry

            entries = await registry.entries(app_name)
            return [Endpoint(role=e["role"], url=e["url"], replica_id=e["replica_id"], engine_id=e["engine_id"],
                             node=e.get("node", ""), api_key=e.get("api_key", ""),
                             kv_events=e.get("kv_events", "")) for e in entries]

        async def forget(ep: Endpoint) -> None:
            from pdserve.app import registry

            log.warning("forgetting %s engine %s at %s: down for a minute", ep.role, ep.replica_id, ep.url)
            await registry.unregister_async(app_name, ep.replica_id)

        direct = None
        if self.direct_ingress:
            from pdserve.router.edge import EdgeLimits
            from pdserve.router.ingress import DirectIngress

            d = self.direct_ingress
            direct = DirectIngress(app, str(d["host"]), int(d["port"]), str(d.get("route_prefix") or "/"),
                                   limits=EdgeLimits.from_config(self.args.http))
            app.state.ingress = {"mode": "direct", "port": int(d["port"]), "proxy_port": d.get("proxy_port"),
                                 "refused": direct.counters.refused,
                                 "closed": direct.counters.closed}
        else:
            app.state.ingress = {"mode": "proxy"}

        @app.on_event("startup")
        async def _start_probe() -> None:
            self._probe = asyncio.get_running_loop().create_task(
                probe_forever(pool, self.orchestrator.check, discover=discover,
                              interval_s=self.args.router.engine_refresh_s, forget=forget,
                              schedule=ProbeSchedule(self.args.router.engine_refresh_s,
                                                     roles=("prefill", "decode"))))
            if direct is not None:
                # On the loop that serves the app through Ray's proxy: the app's sessions and state live here.
                await direct.start()

        @app.on_event("shutdown")
        async def _stop_direct() -> None:
            if direct is not None:
                await direct.stop()

        return app

    def _chat_parsers(self) -> bool:
        """Whether the engines parse chat output (reasoning, tool calls): content may then be withheld, so a
        chat stream does not start with the prefill leg's token."""
        kw = {**self.args.prefill_config.engine_kwargs, **self.args.decode_config.engine_kwargs}
        return any(kw.get(k) for k in ("reasoning_parser", "tool_call_parser", "enable_auto_tool_choice"))

    def _engine_limits(self) -> Any:
        """The context and logprob limits the engines run with (the effective engine arguments: on CPU a
        max_model_len is always set), so the router refuses what decode would refuse before prefill runs."""
        from pdserve.router.validate import EngineLimits

        try:
            from pdserve.engine.launcher import engine_kwargs_for

            on_cpu = placement.cpu_only_cluster(self.args)
            return EngineLimits.from_engine_kwargs(
                *(engine_kwargs_for(role, self.args, on_cpu=on_cpu) for role in ("prefill", "decode")))  # type: ignore[arg-type]
        except Exception as e:  # noqa: BLE001 - the configured values still bound what they can
            log.warning("engine limits from the effective engine arguments failed (%s); using the config's", e)
            return EngineLimits.from_engine_kwargs(self.args.prefill_config.engine_kwargs,
                                                   self.args.decode_config.engine_kwargs)

    async def check_health(self) -> None:
        return None
