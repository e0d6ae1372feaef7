"""Turn one role's config into the command line and environment of a vLLM OpenAI server process.

Pure functions: no process is started here (see :mod:`pdserve.engine.process`), so the exact command a
replica would run can be checked in unit tests and printed by ``pdserve validate --show-engines``.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Any

from pdserve.config.kv_transfer import Role, build_kv_transfer_config
from pdserve.config.schema import LLMConfig, PDServeArgs
from pdserve.engine.kv_size import cpu_kv_cache_bytes
from pdserve.engine.vllm_plugin import ENV_FILE as ENV_KV_EVENTS
from pdserve.engine.vllm_plugin import plugins_env
from pdserve.engine.weight_share import directory_for as weight_share_dir
from pdserve.errors import ConfigError
from pdserve.model.cache import cache_root, engine_cache_env
from pdserve.settings import (
    ENGINE_CORES_ENV,
    ENGINE_IDLE_SPIN_MS_ENV,
    ENGINE_NICE_ENV,
    ENGINE_START_METHOD_ENV,
    KV_EVENTS_CURVE_ENV,
    KV_HANDBACK_TTL_ENV,
    KV_LAZY_ENV,
    KV_PIN_FAIR_ENV,
    KV_PIN_SHARE_ENV,
    NIXL_PTHR_DELAY_US_ENV,
    NO_MEDIA_HOST,
    NO_TRITON_ENV,
    PACKED_WEIGHTS_ENV,
    SHARED_WEIGHTS_ENV,
    STORED_BYTES_PER_ENGINE_ENV,
    STORED_BYTES_PER_OWNER_ENV,
    STORED_PER_ENGINE_ENV,
    STORED_PER_OWNER_ENV,
    media_hosts,
)

#: Engine arguments whose vLLM flag is spelled differently from ``--<name-with-dashes>``.
_FLAG_NAMES: dict[str, str] = {}


@dataclass
class EnginePlacement:
    """What the allocator gave one replica on its host."""

    http_port: int
    side_channel_port: int
    side_channel_host: str
    engine_id: str
    cores: list[int] = field(default_factory=list)
    on_cpu: bool = True
    #: Where the engine publishes its KV cache events (a ZMQ endpoint it binds), for the ``kv_cache`` routing
    #: policy; empty: it publishes none.
    kv_events_bind: str = ""


@dataclass
class EngineCommand:
    argv: list[str]
    env: dict[str, str]

    def shell(self) -> str:
        """The command as a shell line, for logs: secrets in the environment are masked."""
        import shlex

        envs = " ".join(f"{k}={'***' if k in SECRET_ENV else shlex.quote(v)}" for k, v in sorted(self.env.items()))
        return f"{envs} {shlex.join(self.argv)}"


def kwargs_to_flags(kwargs: dict[str, Any]) -> list[str]:
    """vLLM engine arguments (Python names) -> CLI flags of ``vllm.entrypoints.openai.api_server``."""
    flags: list[str] = []
    for key, value in kwargs.items():
        if value is None:
            continue
        flag = _FLAG_NAMES.get(key, "--" + key.replace("_", "-"))
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, dict):
            flags += [flag, json.dumps(value, separators=(",", ":"))]
        elif isinstance(value, (list, tuple)):
            flags.append(flag)
            flags += [str(v) for v in value]
        else:
            flags += [flag, str(value)]
    return flags


def engine_kwargs_for(role: Role, args: PDServeArgs, *, on_cpu: bool, model_path: str | None = None
                      ) -> dict[str, Any]:
    """The effective vLLM engine arguments of one role (defaults filled in, kv_transfer_config built).
    ``model_path``: the model's directory, whose config.json sizes a CPU engine's KV cache (engine/kv_size.py;
    without it, ``auto`` gives 1 GiB)."""
    cfg: LLMConfig = args.prefill_config if role == "prefill" else args.decode_config
    kw = dict(cfg.engine_kwargs)
    kw["kv_transfer_config"] = build_kv_transfer_config(
        role, cfg.engine_kwargs.get("kv_transfer_config"), args.nixl, on_cpu=on_cpu
    )
    if cfg.lora_config is not None:
        # Adapters load on first use (engine/lora.py); vLLM keeps max_cpu_loras of them, max_loras per batch.
        kw.setdefault("enable_lora", True)
        kw.setdefault("max_cpu_loras", cfg.lora_config.max_num_adapters_per_replica)
        kw.setdefault("max_loras", min(4, int(kw["max_cpu_loras"])))
    # A multimodal engine fetches every image, audio or video URL it is sent, from inside the cluster, and
    # vLLM allows every host when none is named: only the hosts the config names (router/media.py).
    # vLLM compares a URL's host (lower-case) with each name exactly: the names as the router reads them.
    kw["allowed_media_domains"] = media_hosts(kw.get("allowed_media_domains")) or [NO_MEDIA_HOST]
    if on_cpu:
        # The default 2048-token context of SmolLM2 would be 8192; keep CPU engines bounded and fast to
        # start. Users override with engine_kwargs.max_model_len.
        kw.setdefault("max_model_len", 4096)
        # CUDA graphs and torch.compile do not apply on CPU; eager start is much faster there.
        kw.setdefault("enforce_eager", True)
        if int(kw.get("tensor_parallel_size", 1)) == 1 and int(kw.get("pipeline_parallel_size", 1)) == 1:
            # One engine core process runs the model itself instead of driving a worker process: one process
            # less per engine (start 8 s sooner, 0.4 GiB less, no shared-memory queue to poll while idle;
            # as fast: docs/architecture.md). vLLM lets CPU engines do so only with
            # VLLM_ENABLE_V1_MULTIPROCESSING=0 (build_engine_command sets it), which its OpenAI server does not read.
            kw.setdefault("distributed_executor_backend", "uni")
        if "VLLM_CPU_KVCACHE_SPACE" not in os.environ:  # (vLLM lets that variable win over the argument)
            # By load a prefill engine also answers whole requests and holds their conversations, as decode
            # does: its cache is sized as decode's.
            sized_as = "decode" if args.router.disaggregate_by_load else role
            kw.setdefault("kv_cache_memory_bytes", cpu_kv_cache_bytes(args.cpu.kv_cache_gib, model_path, kw,
                                                                  sized_as))
    return kw


def build_engine_command(
    role: Role,
    args: PDServeArgs,
    model_path: str,
    placement: EnginePlacement,
    *,
    python: str | None = None,
    api_key: str | None = None,
    tokenizer_path: str | None = None,
) -> EngineCommand:
    """The engine's command line and environment. ``api_key``: the bearer key every request but health
    and metrics must carry (the engine answers only the router, which learns the key from the registry)."""
    cfg = args.prefill_config if role == "prefill" else args.decode_config
    mlc = cfg.model_loading_config
    kw = engine_kwargs_for(role, args, on_cpu=placement.on_cpu, model_path=model_path)
    # The replica's engine id names it in NIXL handshakes and in the prefill answer's remote_engine_id.
    kw["kv_transfer_config"].setdefault("engine_id", placement.engine_id)
    tracing = args.tracing
    if tracing.otlp_endpoint and tracing.engines:
        # The engine's own spans join the router's trace of each request (W3C traceparent, router/tracing.py).
        kw.setdefault("otlp_traces_endpoint", tracing.otlp_endpoint)
    if placement.kv_events_bind:
        # The router follows these to route by what each engine has cached (router/kv_index.py).
        kw.setdefault("kv_events_config", {"enable_kv_cache_events": True, "publisher": "zmq",
                                           "endpoint": placement.kv_events_bind, "topic": ""})
    argv = [
        python or sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model_path,
        "--served-model-name",
        mlc.model_id,
        "--host",
        "127.0.0.1" if placement.side_channel_host in LOOPBACK_HOSTS else "0.0.0.0",
        "--port",
        str(placement.http_port),
        # The router sends one id for both legs in X-Request-Id; vLLM echoes it back.
        "--enable-request-id-headers",
        "--disable-uvicorn-access-log",
    ]
    # ``tokenizer_path``: the tokenizer source as resolve_model made it (``pdserve:`` names prepared).
    tokenizer = tokenizer_path or mlc.tokenizer_source
    if tokenizer:
        argv += ["--tokenizer", tokenizer]
    argv += kwargs_to_flags(kw)
    env = engine_env(args, placement, api_key=api_key)
    if placement.on_cpu and args.cpu.share_weights == "mapped":
        # The host's engines map one copy of the weights from the weight cache (engine/weight_share.py).
        env[SHARED_WEIGHTS_ENV] = weight_share_dir(str(cache_root(args.cache_dir)), model_path)
    elif placement.on_cpu and args.cpu.share_weights == "packed" and args.cpu.fork_engines:
        # The engines' forkserver packs the weights once; the engines inherit them (engine/prepack.py).
        env[PACKED_WEIGHTS_ENV] = weight_share_dir(str(cache_root(args.cache_dir)), model_path)
    if placement.on_cpu and kw.get("distributed_executor_backend") == "uni":
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # else vLLM's CPU platform turns "uni" back into "mp"
        # The engine core is forked from the API server, with torch and vLLM imported already (vLLM's CPU
        # platform spawns it, importing them again): ready in 13 s instead of 20, 0.27 GiB less.
        env[ENGINE_START_METHOD_ENV] = "fork"
        # The spin bound (cpu.idle_spin_ms) is a worker process's; with no worker it has nothing to bound.
        env.pop(ENGINE_IDLE_SPIN_MS_ENV, None)
    return EngineCommand(argv=argv, env=env)


# Seconds an engine's HTTP server keeps an idle connection open (longer than the router keeps it).
ENGINE_KEEP_ALIVE_S = 75

LOOPBACK_HOSTS = ("127.0.0.1", "localhost")

#: The engine's bearer key: read by pdserve's endpoint plugin (every path but health and metrics) and by
#: vLLM itself (its /v1 routes). In the environment, not on the command line, where any local user sees it.
ENGINE_KEY_ENV = "PDSERVE_ENGINE_KEY"
SECRET_ENV = frozenset({ENGINE_KEY_ENV, "VLLM_API_KEY"})


def engine_env(args: PDServeArgs, placement: EnginePlacement, *, api_key: str | None = None) -> dict[str, str]:
    """Environment of one engine process (on top of the replica's own)."""
    env = {
        # Each engine on a host needs its own NIXL side channel; the allocator made the port unique.
        "VLLM_NIXL_SIDE_CHANNEL_HOST": placement.side_channel_host,
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(placement.side_channel_port),
        "VLLM_ENGINE_ITERATION_TIMEOUT_S": "300",
        # vLLM's HTTP server drops an idle connection after 5 s by default; the router keeps its pooled
        # ones for ROUTER_KEEP_ALIVE_S, and reusing one the engine is closing fails the request's write.
        "VLLM_HTTP_TIMEOUT_KEEP_ALIVE": str(ENGINE_KEEP_ALIVE_S),
        "VLLM_NO_USAGE_STATS": "1",
        # A redirect from an allowed media host would take the fetch anywhere (router/media.py).
        "VLLM_MEDIA_URL_ALLOW_REDIRECTS": "0",
        "DO_NOT_TRACK": "1",
        "PYTHONUNBUFFERED": "1",
    }
    if args.tracing.otlp_endpoint and args.tracing.engines:
        # OTLP over HTTP, as the router exports (vLLM's default would be gRPC), under the role's name.
        env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] = "http/protobuf"
        env["OTEL_SERVICE_NAME"] = f"{args.tracing.service_name}-{placement.engine_id.split('-', 1)[0]}"
    # Expired KV leases are recorded per engine and served at /pdserve/kv-lease/<id> (engine/vllm_plugin.py).
    env[ENV_KV_EVENTS] = kv_events_path(placement.engine_id)
    env["VLLM_PLUGINS"] = plugins_env(os.environ.get("VLLM_PLUGINS"))
    # vLLM's store of Responses answers, bounded by owner and in all (engine/responses_store.py).
    env[STORED_PER_OWNER_ENV] = str(args.router.stored_responses_per_owner)
    env[STORED_PER_ENGINE_ENV] = str(args.router.stored_responses_per_engine)
    env[STORED_BYTES_PER_OWNER_ENV] = str(args.router.stored_responses_mib_per_owner << 20)
    env[STORED_BYTES_PER_ENGINE_ENV] = str(args.router.stored_responses_mib_per_engine << 20)
    from pdserve.config.kv_transfer import handback_ttl_s

    # nixl.bidirectional: decode engines note the blocks they keep for the next turn (engine/kv_handback.py).
    # Set on every engine of the app alike (prefill's never pins any), so engines forked from one forkserver
    # share it.
    ttl = handback_ttl_s(args.decode_config.engine_kwargs.get("kv_transfer_config"), args.nixl)
    if ttl is not None:
        env[KV_HANDBACK_TTL_ENV] = str(ttl)
        env[KV_PIN_SHARE_ENV] = f"{args.nixl.decode_pin_share:g}"
        if args.router.tenants:
            env[KV_PIN_FAIR_ENV] = "1"  # each tenant's share of the pins (engine/kv_handback.py)
    lora = args.prefill_config.lora_config  # the same on both sides (config/schema.py)
    if lora is not None and lora.dynamic_lora_loading_path:
        from pdserve.engine import lora as lora_mod

        # vLLM asks its LoRA resolvers for a model name it does not know only with runtime updating on.
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
        env[lora_mod.ENV_PATH] = lora.dynamic_lora_loading_path
        env[lora_mod.ENV_MODEL] = args.model_id
        env[lora_mod.ENV_CACHE] = str(cache_root(args.cache_dir))
    if os.environ.get("HF_HUB_OFFLINE") is not None:
        env["HF_HUB_OFFLINE"] = os.environ["HF_HUB_OFFLINE"]
    # The weight cache (pdserve/model/cache.py): hub downloads and vLLM's compile caches go where the
    # prepared models are, so a restart finds all of them.
    env.update(engine_cache_env(args.cache_dir))
    ucx_tls = args.nixl.ucx_tls
    if placement.on_cpu:
        if args.cpu.bind_cores and placement.cores:
            cores = ",".join(str(c) for c in placement.cores)
            env["VLLM_CPU_OMP_THREADS_BIND"] = cores
            # Keeps every thread of the engine on its own cores (see pdserve/engine/_site/sitecustomize.py).
            env[ENGINE_CORES_ENV] = cores
        else:
            env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
        env["OMP_NUM_THREADS"] = str(max(1, len(placement.cores) or args.cpu.cores_per_engine))
        env[NO_TRITON_ENV] = "1"  # no CPU backend; its import only costs memory (_site/sitecustomize.py, 11)
        if args.cpu.kv_cache_lazy:
            env[KV_LAZY_ENV] = "1"  # the KV cache takes memory as it fills (engine/kv_memory.py)
        if args.cpu.engine_nice:
            env[ENGINE_NICE_ENV] = str(args.cpu.engine_nice)
        if "VLLM_USE_AOT_COMPILE" not in os.environ:
            # With torch.compile on (enforce_eager: false), vllm-cpu 0.32 saves an AOT artifact it cannot
            # load back ("'function' object has no attribute 'finalize_loading'") and compiles again on
            # every start; without AOT, Inductor's own cache (TORCHINDUCTOR_CACHE_DIR, in the weight cache
            # when one is configured) is reused.
            env["VLLM_USE_AOT_COMPILE"] = "0"
        if args.cpu.preload_tcmalloc:
            preload = tcmalloc_preload(os.environ.get("LD_PRELOAD", ""))
            if preload is not None:
                env["LD_PRELOAD"] = preload
        if ucx_tls is None:
            ucx_tls = CPU_UCX_TLS
        if args.nixl.cpu_progress_thread_delay_us is not None:
            env[NIXL_PTHR_DELAY_US_ENV] = str(args.nixl.cpu_progress_thread_delay_us)
        if args.cpu.idle_spin_ms is not None:
            env[ENGINE_IDLE_SPIN_MS_ENV] = f"{args.cpu.idle_spin_ms:g}"
        # The engine's Python processes load _site/sitecustomize.py, which applies these settings, and
        # always its fix for seeded prompts computed in several steps (without it they kill CPU engines).
        env["PYTHONPATH"] = os.pathsep.join(p for p in (SITE_DIR, os.environ.get("PYTHONPATH", "")) if p)
    if ucx_tls:
        env["UCX_TLS"] = ucx_tls
    if placement.side_channel_host in LOOPBACK_HOSTS and "UCX_NET_DEVICES" not in os.environ:
        # A local-only app: NIXL's UCX transport listens on the loopback device, not on every interface.
        env["UCX_NET_DEVICES"] = "lo"
    if api_key:
        env[ENGINE_KEY_ENV] = api_key
        env["VLLM_API_KEY"] = api_key
    if placement.kv_events_bind.startswith("tcp://"):
        # Beyond loopback the KV events (every tenant's prompt tokens) are published behind CURVE keys
        # derived from the engine's key (pdserve/engine/vllm_plugin.py:secure_kv_events).
        if not api_key:
            raise ConfigError("an engine that publishes its KV cache events over TCP needs its key")
        env[KV_EVENTS_CURVE_ENV] = "1"
    return env


def routes_by_kv_events(role: Role, args: PDServeArgs) -> bool:
    """Whether the router follows this role's KV cache events: its replicas are picked by them (policy
    ``kv_cache``), or the router is cache-aware (``router.cache_aware_steps``: decode's events say where a
    request may run alone, each engine's how much of a prompt it would compute)."""
    r = args.router
    if r.cache_aware_steps > 0:
        return True
    return ((r.prefill_policy if role == "prefill" else r.decode_policy) or r.policy) == "kv_cache"


def kv_events_endpoints(engine_id: str, host: str, port: int) -> tuple[str, str]:
    """(what the engine binds, what the router connects to) for its KV cache events: a Unix socket when the
    app is local (nothing listens beyond the host), else TCP on every interface of the engine's host."""
    if host in LOOPBACK_HOSTS:
        path = os.path.join(tempfile.gettempdir(), "pdserve-kv-events", f"{engine_id}.sock")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        return f"ipc://{path}", f"ipc://{path}"
    return f"tcp://*:{port}", f"tcp://{host}:{port}"


def kv_events_path(engine_id: str) -> str:
    """Where an engine's expired-lease events go (one file per engine id, on the engine's host)."""
    return os.path.join(tempfile.gettempdir(), "pdserve-kv-events", f"{engine_id}.log")


#: Directory whose sitecustomize.py applies pdserve's CPU engine fixes (core clamp, NIXL poll delay).
SITE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_site")

#: UCX transports for DRAM-to-DRAM transfers on CPU hosts. (measured: `pdserve bench --scenario kv-transfer`).
CPU_UCX_TLS = "tcp,self,sm"




#: Where distributions put gperftools' tcmalloc (Debian/Ubuntu: libtcmalloc-minimal4[t64]; Fedora: gperftools-libs).
TCMALLOC_PATHS = (
    "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib64/libtcmalloc_minimal.so.4",
    "/usr/lib/libtcmalloc_minimal.so.4",
)


def tcmalloc_preload(current: str, paths: tuple[str, ...] | None = None) -> str | None:
    """``LD_PRELOAD`` for a CPU engine with tcmalloc first, or None when it is preloaded already or this host
    has none. vLLM's CPU worker asks for it ("libtcmalloc is not found in LD_PRELOAD"); paired on both
    cores it gave +7.7 % prompt speed and -5.3 % time per output token (`pdserve bench --scenario cpu-env`).
    vLLM adds torch's libgomp itself."""
    if "tcmalloc" in current:
        return None
    found = next((p for p in (paths or TCMALLOC_PATHS) if os.path.exists(p)), None)
    if found is None:
        return None
    return ":".join(p for p in (found, current) if p)
