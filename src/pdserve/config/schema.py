"""The typed configuration of a pdserve app.

The top level (:class:`PDServeArgs`) accepts the argument shape of Ray Serve LLM's
``build_pd_openai_app`` (``prefill_config`` / ``decode_config``, each an :class:`LLMConfig`) so a file
written for Ray Serve LLM runs with only its ``import_path`` changed. pdserve's own settings live in
their own sections (``router``, ``http``, ``cpu``, ``nixl``). ``engine_kwargs`` is the one pass-through
dict: it holds vLLM's own engine arguments, which pdserve forwards and does not interpret, except
``kv_transfer_config`` (filled in by :mod:`pdserve.config.kv_transfer` when omitted).
"""

from __future__ import annotations

import os
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pdserve.config.kubernetes import KubernetesConfig
from pdserve.config.routing import PLUGIN_NAMES, PluginSettings, check_policy_name
from pdserve.config.tenants import TENANT_NAME, TenantConfig

#: The name under which the packaged SmolLM2 model is known in ``model_source``.
EMBEDDED_MODEL_SOURCE = "pdserve:smollm2-135m-instruct"
EMBEDDED_MODEL_ID = "smollm2-135m-instruct"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True)


class ModelLoadingConfig(_Strict):
    """Which model to serve and under which name."""

    model_id: str = Field(
        EMBEDDED_MODEL_ID, description="The name clients put in the `model` field of their requests."
    )
    model_source: str | None = Field(
        None,
        description=(
            "Where the weights come from: a local directory, a Hugging Face hub id, or "
            f"`{EMBEDDED_MODEL_SOURCE}` for the packaged SmolLM2-135M-Instruct. "
            "Empty means the packaged model."
        ),
    )
    tokenizer_source: str | None = Field(
        None, description="A different tokenizer location; defaults to the model's own."
    )

    @field_validator("model_source", "tokenizer_source")
    @classmethod
    def _known_packaged(cls, v: str | None) -> str | None:
        if v and v.startswith("pdserve:") and v != EMBEDDED_MODEL_SOURCE:
            raise ValueError(f"unknown packaged model {v!r}: the packaged one is {EMBEDDED_MODEL_SOURCE!r}; "
                             "anything else is a local directory or a Hugging Face hub id")
        return v

    def source(self) -> str:
        return self.model_source or EMBEDDED_MODEL_SOURCE


class AutoscalingConfig(_Strict):
    """Ray Serve autoscaling for one role (same keys as Ray Serve's `autoscaling_config`)."""

    min_replicas: int = Field(1, ge=0, description="Fewest replicas.")
    max_replicas: int = Field(1, ge=1, description="Most replicas.")
    initial_replicas: int | None = Field(None, ge=0, description="Replicas at start; default min_replicas.")
    target_ongoing_requests: float = Field(
        2.0, gt=0, description="Average in-flight requests per replica that autoscaling aims for."
    )
    upscale_delay_s: float = Field(30.0, ge=0, description="How long load must stay high before adding.")
    downscale_delay_s: float = Field(600.0, ge=0, description="How long load must stay low before removing.")
    metrics_interval_s: float | None = Field(None, description="Accepted for compatibility; Ray's default.")
    look_back_period_s: float | None = Field(None, description="Accepted for compatibility; Ray's default.")
    upscaling_factor: float | None = Field(None, description="Multiplier on scale-up decisions.")
    downscaling_factor: float | None = Field(None, description="Multiplier on scale-down decisions.")
    policy: dict[str, Any] | None = Field(
        None,
        description=(
            "Ray Serve autoscaling policy ({policy_function: 'module:function'}). Default: pdserve's per-phase "
            "policy (prefill: running + waiting requests; decode: running sequences and KV cache use)."
        ),
    )
    target_ttft_s: float | None = Field(
        None, gt=0,
        description=(
            "Prefill only (pdserve's policy): also scale up when the mean time to first token of the "
            "prompts the replicas finished since their last report exceeds this many seconds; "
            "replicas wanted = current x mean TTFT / target. Unset: the queue signal alone."
        ),
    )

    @model_validator(mode="after")
    def _bounds(self) -> AutoscalingConfig:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) > max_replicas ({self.max_replicas})")
        return self


class DeploymentConfig(_Strict):
    """Ray Serve deployment options for one role."""

    num_replicas: int | Literal["auto"] | None = Field(
        None, description="Fixed number of replicas (default 1). Mutually exclusive with autoscaling_config."
    )
    autoscaling_config: AutoscalingConfig | None = Field(None, description="Autoscaling bounds and target.")
    max_ongoing_requests: int = Field(
        64, ge=1, description="Requests Ray Serve lets one replica hold at once (engine health/control only)."
    )
    max_queued_requests: int | None = Field(None, description="Accepted for compatibility.")
    health_check_period_s: float = Field(10.0, gt=0, description="How often the engine is probed.")
    health_check_timeout_s: float = Field(30.0, gt=0, description="How long a probe may take.")
    graceful_shutdown_timeout_s: float = Field(
        20.0, ge=0, description="How long a stopping replica waits for its requests."
    )
    graceful_shutdown_wait_loop_s: float | None = Field(None, description="Accepted for compatibility.")
    ray_actor_options: dict[str, Any] | None = Field(
        None, description="Ray actor options for each replica (num_cpus, num_gpus, resources, ...)."
    )
    name: str | None = Field(None, description="Deployment name; default `prefill` / `decode`.")
    user_config: dict[str, Any] | None = Field(None, description="Accepted for compatibility; unused.")
    logging_config: dict[str, Any] | None = Field(None, description="Ray Serve logging options.")
    request_router_config: dict[str, Any] | None = Field(
        None, description="Accepted for compatibility; pdserve routes with `router.policy`."
    )
    max_constructor_retry_count: int | None = Field(None, description="Ray Serve constructor retries.")

    @model_validator(mode="after")
    def _replicas_xor_autoscaling(self) -> DeploymentConfig:
        if isinstance(self.num_replicas, int) and self.autoscaling_config is not None:
            raise ValueError("set either num_replicas or autoscaling_config, not both")
        if isinstance(self.num_replicas, int) and self.num_replicas < 1:
            raise ValueError("num_replicas must be >= 1")
        return self


class PlacementGroupConfig(_Strict):
    """Resources of one engine replica as a Ray placement group (Ray Serve LLM's shape)."""

    bundles: list[dict[str, float]] = Field(description="One resource dict per bundle.")
    strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK", description="Ray placement strategy."
    )


class LoraConfig(_Strict):
    """LoRA adapters, as Ray Serve LLM's ``lora_config``: a request whose ``model`` is
    ``<model_id>:<adapter>`` runs both legs with the adapter stored at ``<dynamic_lora_loading_path>/<adapter>``
    (a PEFT directory: ``adapter_config.json`` and the weights), loaded by each engine on first use."""

    dynamic_lora_loading_path: str | None = Field(
        None,
        description=(
            "Where adapters are stored, one directory per adapter: a path every engine host sees (local disk, "
            "an EFS/FSx mount; `file://` allowed), or `s3://`, `gs://`, `abfss://`, `azure://` (copied to the "
            "engine's cache dir on first use through fsspec; the matching fsspec backend, e.g. `s3fs`, must be "
            "installed on the engine hosts). The same on prefill and decode."
        ),
    )
    max_num_adapters_per_replica: int = Field(
        16, ge=1,
        description="Adapters each engine keeps loaded (vLLM's `max_cpu_loras`); the least recently used goes first.",
    )
    download_timeout_s: float | None = Field(None, description="Ray Serve LLM compat; a copy takes what it takes.")
    max_download_tries: int | None = Field(None, description="Ray Serve LLM compat; unused.")

    @field_validator("dynamic_lora_loading_path")
    @classmethod
    def _path(cls, v: str | None) -> str | None:
        if not v:
            raise ValueError("lora_config.dynamic_lora_loading_path is required: where the adapters are stored")
        v = v.rstrip("/") or "/"
        scheme = v.split("://", 1)[0] if "://" in v else ""
        if scheme and scheme not in LORA_REMOTE_SCHEMES + ("file",):
            raise ValueError(f"lora_config.dynamic_lora_loading_path: unknown scheme {scheme}:// "
                             f"(use a path, file://, or one of {', '.join(s + '://' for s in LORA_REMOTE_SCHEMES)})")
        if scheme == "file":
            v = v[len("file://"):]
        if not scheme or scheme == "file":
            if not os.path.isabs(os.path.expanduser(v)):
                raise ValueError(f"lora_config.dynamic_lora_loading_path must be absolute (engines run elsewhere): {v!r}")
            v = os.path.expanduser(v)
        return v


#: Adapter stores copied to the engine on first use (Ray Serve LLM's schemes).
LORA_REMOTE_SCHEMES = ("s3", "gs", "abfss", "azure")


class LLMConfig(_Strict):
    """One role's engine: the shape of Ray Serve LLM's `LLMConfig`."""

    model_loading_config: ModelLoadingConfig = Field(
        default_factory=ModelLoadingConfig, description="Model name and weights location."
    )
    llm_engine: Literal["vLLM"] = Field("vLLM", description="The engine; only vLLM.")
    engine_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description=(
            "vLLM engine arguments, as vLLM names them (`max_model_len`, `tensor_parallel_size`, "
            "`kv_transfer_config`, ...). Omit `kv_transfer_config` to get NixlConnector with the right "
            "role and buffer device."
        ),
    )
    deployment_config: DeploymentConfig = Field(
        default_factory=DeploymentConfig, description="Ray Serve options: replicas, autoscaling, ..."
    )
    accelerator_type: str | None = Field(
        None, description="Ray accelerator type to place replicas on (e.g. `L4`, `H100`)."
    )
    placement_group_config: PlacementGroupConfig | None = Field(
        None, description="Resources per replica as placement-group bundles."
    )
    runtime_env: dict[str, Any] | None = Field(None, description="Ray runtime_env for the replicas.")
    accelerator_config: dict[str, Any] | None = Field(
        None, description="Accepted for compatibility with Ray Serve LLM; use accelerator_type."
    )
    server_cls: str | None = Field(None, description="Not supported: pdserve runs its own engine server.")
    callback_config: dict[str, Any] | None = Field(None, description="Accepted for compatibility; unused.")
    experimental_configs: dict[str, Any] = Field(
        default_factory=dict, description="Accepted for compatibility with Ray Serve LLM; unused."
    )
    log_engine_metrics: bool = Field(True, description="Expose the engine's `vllm:*` metrics.")
    lora_config: LoraConfig | None = Field(
        None, description="LoRA adapters (Ray Serve LLM's field): requests name them as `<model_id>:<adapter>`."
    )

    @field_validator("engine_kwargs")
    @classmethod
    def _no_model_in_kwargs(cls, v: dict[str, Any]) -> dict[str, Any]:
        for key in ("model", "served_model_name"):
            if key in v:
                raise ValueError(
                    f"`engine_kwargs.{key}` is set from model_loading_config; remove it from engine_kwargs"
                )
        for key in ("host", "port"):
            if key in v:
                raise ValueError(f"`engine_kwargs.{key}` is chosen by pdserve per replica; remove it")
        return v

    @field_validator("server_cls")
    @classmethod
    def _no_server_cls(cls, v: str | None) -> str | None:
        if v:
            raise ValueError("a custom server_cls is not supported; pdserve runs vLLM's OpenAI server")
        return v

    def num_replicas(self) -> int:
        dc = self.deployment_config
        if isinstance(dc.num_replicas, int):
            return dc.num_replicas
        if dc.autoscaling_config is not None:
            a = dc.autoscaling_config
            return a.initial_replicas if a.initial_replicas is not None else a.min_replicas
        return 1


class RouterConfig(_Strict):
    """The OpenAI-compatible front: timeouts and replica choice."""

    policy: str = Field(
        "least_loaded",
        description=(
            f"How a replica of each role is picked: one of {', '.join(f'`{n}`' for n in PLUGIN_NAMES)} (a routing "
            "plugin, pdserve/router/routing/; its settings under `router.plugins.<name>`)."
        ),
    )
    prefill_policy: str | None = Field(None, description="Policy for prefill replicas only; default `policy`.")
    decode_policy: str | None = Field(None, description="Policy for decode replicas only; default `policy`.")
    prefix_affinity_tokens: int | None = Field(
        None, ge=1,
        description="Older spelling of `router.plugins.prefix_affinity.tokens` (still accepted; null: that one).",
    )
    plugins: PluginSettings = Field(
        default_factory=PluginSettings,
        description="Settings of the routing plugins, by policy name; each block is optional.",
    )
    prefill_timeout_s: float = Field(120.0, gt=0, description="Longest wait for the prefill leg.")
    decode_timeout_s: float = Field(600.0, gt=0, description="Longest time the decode leg may take in all.")
    connect_timeout_s: float = Field(5.0, gt=0, description="Longest wait to open a connection to an engine.")
    max_body_bytes: int = Field(
        16 * 1024 * 1024, ge=1024, description="Largest accepted request body; larger gets 413."
    )
    num_replicas: int = Field(1, ge=1, description="Router replicas.")
    early_first_token: bool = Field(
        True,
        description=(
            "Streamed P/D requests get the first token from the prefill leg's answer at once, instead of after "
            "the KV pull and decode's first step; decode's copy of it is removed from its stream. Unseeded "
            "sampling gets a router-chosen seed on both legs. If the two engines break a near-tie differently "
            "(measured: 2 of 84 greedy bfloat16 streams), decode's stream is dropped and the decode engine goes "
            "on from the prefill's token (`pdserve_early_first_token_total{outcome=\"mismatch\"}`), so greedy "
            "answers still equal one engine's; a stream that cannot be continued so (structured outputs, echo) "
            "passes as decode computed it, one token longer "
            "(`outcome=\"mismatch_passed\"`): set false where such answers must equal one engine's."
        ),
    )
    migrate_streams: bool = Field(
        True,
        description=(
            "A chat or completions stream whose decode engine fails mid-stream goes on on another engine "
            "(another decode replica, else a prefill engine) from the prompt and the tokens already sent: the "
            "client reads one stream, each token once; greedy answers equal one engine's where the numerics "
            "allow (the continuation recomputes the context in one prefill; in bfloat16 a near-tie may then "
            "break the other way). Streams with "
            "logprobs, stop strings, tools or structured outputs are not moved (they end with an error event)."
        ),
    )
    engine_refresh_s: float = Field(1.0, gt=0, description="How often the router refreshes the engine list.")
    prefill_fallback: Literal["decode", "error"] = Field(
        "decode",
        description=(
            "When no prefill replica can take a request: `decode` prefills it on the decode replica "
            "(the client sees no error), `error` answers 503."
        ),
    )
    kv_lease_check: bool = Field(
        True,
        description=(
            "Guard against expired KV leases: when a handoff takes longer than half the prefill engine's "
            "`kv_lease_duration`, the router asks that engine whether the request's blocks were freed "
            "before decode pulled them, and if so (or if it cannot tell) answers from a recompute instead "
            "of possibly wrong tokens. Costs nothing on fast handoffs."
        ),
    )
    local_prefill_below_tokens: Annotated[int, Field(ge=0)] | Literal["auto"] = Field(
        "auto",
        description=(
            "Conditional disaggregation: prompts shorter than this many tokens are prefilled on the "
            "decode replica itself, skipping the hop. 0 disaggregates every request. `auto`: the tokens a "
            "decode engine computes in two of its idle decode steps, from its measured prompt speed and "
            "time per token (a prompt that short holds decode's streams up less than the handoff costs; "
            "0 until both are measured), and only while a decode replica is idle (nothing queued, "
            "streaming or on its way): under load such prompts are disaggregated like the rest, so they "
            "never queue on decode. `/pdserve/status` shows the value in use."
        ),
    )
    disaggregate_by_load: bool = Field(
        False,
        description=(
            "Conditional disaggregation by load: each request's prompt goes to the engine that would start it "
            "sooner (the prefill replica, or the decode replica computing it itself, while streams run there "
            "only if the stall costs the shortest of them at most 8 % of its decode time), and its tokens to the "
            "engine with the lower expected time per token (the decode replica, or the prefill replica "
            "answering the whole request), each engine's measured speed slowed by its share of time spent "
            "on prompts. Idle, every request is disaggregated; loaded, engines share both phases as "
            "colocated ones do. For hosts where one decode engine cannot take every stream (small CPU "
            "deployments)."
        ),
    )
    max_queue_wait_s: float = Field(
        8.0, gt=0,
        description=(
            "Admission by work: a request is admitted only if the prompts already queued on the engines it "
            "would use (in tokens, at each engine's measured speed) let it start within this many seconds; "
            "else 429 at once, with Retry-After from the estimate. Keep it well under the KV lease "
            "(nixl.kv_lease_duration_s) and prefill_timeout_s."
        ),
    )
    max_tpot_s: float | None = Field(
        1.0, gt=0,
        description=(
            "A decode engine takes one more stream only if its measured time per output token, scaled to "
            "one more stream, stays within this many seconds; else 429. null: no bound."
        ),
    )
    max_inflight_per_prefill_engine: int = Field(
        32, ge=1,
        description="Hard cap on requests in flight per healthy prefill engine (beside max_queue_wait_s); then 429.",
    )
    max_inflight_per_decode_engine: int = Field(
        128, ge=1,
        description="Hard cap on requests in flight per healthy decode engine (beside max_queue_wait_s); then 429.",
    )
    max_inflight: int = Field(
        512, ge=1,
        description="Requests one router replica holds at once; past that it answers 429 with Retry-After.",
    )
    api_keys: list[str] = Field(
        default_factory=list,
        description=(
            "Accepted API keys (`Authorization: Bearer KEY`), for `pdserve serve`. Empty and no "
            "PDSERVE_API_KEYS in the environment: no authentication. `/health` stays open for probes. "
            "`pdserve render` refuses them (they would be in the manifests in clear): use "
            "`kubernetes.api_keys_secret`."
        ),
    )
    api_keys_env: str = Field(
        "PDSERVE_API_KEYS",
        pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description=(
            "Environment variable with more accepted keys, separated by commas or newlines; read at the "
            "router's start. Rendered pods get it from `kubernetes.api_keys_secret`."
        ),
    )
    tenants: dict[str, TenantConfig] = Field(
        default_factory=dict,
        description=(
            "Tenants by name: each names the environment variable with its API keys and may set a priority "
            "and limits (requests/s, prompt and output tokens per minute, concurrent requests); see "
            "pdserve/config/tenants.py. A tenant's stored responses and prefix cache are its own."
        ),
    )

    @field_validator("tenants")
    @classmethod
    def _tenant_names(cls, v: dict[str, TenantConfig]) -> dict[str, TenantConfig]:
        for name in v:
            if not TENANT_NAME.fullmatch(name):
                raise ValueError(f"tenant name {name!r}: letters, digits, '.', '_', '-', at most 64")
        return v

    @field_validator("policy", "prefill_policy", "decode_policy")
    @classmethod
    def _known_policy(cls, v: str | None) -> str | None:
        return v if v is None else check_policy_name(v)

    @model_validator(mode="after")
    def _fold_prefix_affinity_tokens(self) -> RouterConfig:
        """The older flat spelling sets the prefix_affinity plugin's ``tokens`` (both given: they must agree)."""
        n = self.prefix_affinity_tokens
        block = self.plugins.prefix_affinity
        if n is not None and n != block.tokens:
            if "tokens" in block.model_fields_set:
                raise ValueError(f"prefix_affinity_tokens ({n}) and plugins.prefix_affinity.tokens "
                                 f"({block.tokens}) disagree; set only plugins.prefix_affinity.tokens")
            self.plugins = self.plugins.model_copy(
                update={"prefix_affinity": block.model_copy(update={"tokens": n})})
        return self


class HttpConfig(_Strict):
    """Where the endpoint listens (`pdserve serve`; with `serve run` Ray's `http_options` apply)."""

    host: str = Field("127.0.0.1", description="Listen address. Use 0.0.0.0 to accept remote clients.")
    port: int = Field(8000, ge=1, le=65535, description="Listen port.")
    ingress: Literal["direct", "proxy"] = Field(
        "direct",
        description=(
            "Who serves `port` under `pdserve serve`: `direct`, the router replicas themselves (SO_REUSEPORT; "
            "a request skips Ray Serve's HTTP proxy hop), or `proxy`, Ray Serve's proxy. With `direct` the "
            "proxy still serves the app on `proxy_port`. `serve run` and KubeRay always use Ray's proxy."
        ),
    )
    proxy_port: int | None = Field(
        None, ge=1, le=65535,
        description="Ray Serve's proxy port with `ingress: direct` (null: a free port, shown at start).",
    )
    # The public port's limits (direct ingress; pdserve/router/edge.py). Ray Serve's proxy has its own.
    max_header_bytes: int = Field(
        32 * 1024, ge=1024, le=16 * 1024 * 1024,
        description="Request line and headers, bytes, at most; beyond: 431 and the connection closed.")
    header_timeout_s: float = Field(
        10.0, gt=0, le=3600,
        description="Seconds from a request's first byte (or the connection's opening) to the end of its "
                    "headers; beyond: 408 and the connection closed.")
    body_timeout_s: float = Field(
        60.0, gt=0, le=3600,
        description="Seconds from the end of a request's headers to the end of its body; beyond: 408 and "
                    "the connection closed.")
    max_connections: int = Field(
        512, ge=1, le=1_000_000,
        description="Open client connections per router replica; beyond: 503 and the new connection closed "
                    "(the router needs file descriptors for its engine connections too).")
    max_requests_per_connection: int = Field(
        1000, ge=1,
        description="Requests one keep-alive connection may carry; the last answer says `Connection: close`.")


class CpuConfig(_Strict):
    """Engine settings used only on hosts without a GPU."""

    kv_cache_gib: int = Field(1, ge=1, description="KV cache per engine, GiB (VLLM_CPU_KVCACHE_SPACE).")
    cores_per_engine: int = Field(
        1, ge=1, description="Cores each engine is bound to (VLLM_CPU_OMP_THREADS_BIND)."
    )
    bind_cores: bool = Field(
        True, description="Give each engine on a host its own cores so engines don't fight over them."
    )
    preload_tcmalloc: bool = Field(
        True,
        description=(
            "Preload gperftools' tcmalloc into CPU engines when the host has it (Debian/Ubuntu: "
            "libtcmalloc-minimal4; `make setup` installs it when it can): vLLM's CPU worker asks for it, and "
            "it measured +7.7 % prompt speed, -5.3 % time per output token."
        ),
    )
    engine_nice: int = Field(
        0, ge=0, le=19,
        description=(
            "Scheduling niceness CPU engine processes add to their own (0: none). A positive value lets the "
            "router, Ray Serve's proxy and Ray run ahead of engines that keep every core busy, but it is not "
            "free: at 10, on a 2-core host, a decode engine's time per output token at low load went from 53 "
            "to 95 ms (Ray's and the router's wake-ups on the engine's core preempt it), and refusals under "
            "overload stayed within 100 ms without it."
        ),
    )
    idle_spin_ms: float | None = Field(
        20, ge=0, le=1000,
        description=(
            "How long a CPU engine's worker spins (yields the core in a loop) waiting for its next step "
            "before it sleeps until the step comes. vLLM's own is a second after every step, not settable: "
            "a second of a whole core after every request, taken from the other engine on a small host "
            "null keeps vLLM's."
        ),
    )
    dtype: Literal["auto", "bfloat16", "float32"] = Field(
        "auto",
        description=(
            "What CPU engines compute in (both roles get the same: the KV layout must match). `auto` takes "
            "bfloat16 only where it is no slower than float32 (one matmul of each, timed on this host) "
            "and faithful to the model (bf16 predicts the same next token as float32 at >= 99 % of the "
            "positions of a fixed text); both are measured once per host, torch and model and cached in "
            "`<cache_dir>/host/`. On AVX2-only CPUs bf16 can be 6x slower; small models such as the "
            "packaged one (~98 %) answer differently in bf16. `engine_kwargs.dtype`, when set, wins."
        ),
    )


class NixlConfig(_Strict):
    """How the KV cache moves from prefill to decode (feeds vLLM's `kv_transfer_config`)."""

    backend: Literal["UCX", "LIBFABRIC"] = Field(
        "UCX", description="NIXL backend. LIBFABRIC for AWS EFA; UCX elsewhere."
    )
    side_channel_port_base: int = Field(
        5600, ge=1024, le=65000, description="First NIXL side-channel port tried on each host."
    )
    kv_lease_duration_s: int | None = Field(
        None, ge=1,
        description=(
            "Seconds prefill keeps a request's blocks for decode to pull before freeing them "
            "(vLLM's kv_lease_duration; decode renews it while waiting). Default: vLLM's (30)."
        ),
    )
    kv_load_failure_policy: Literal["recompute", "fail"] = Field(
        "recompute",
        description="When a KV pull fails: `recompute` the prompt on decode (correct, slower) or `fail` it.",
    )
    cpu_progress_thread_delay_us: int | None = Field(
        1000, ge=0,
        description=(
            "CPU hosts: how long NIXL's progress thread sleeps in poll() between wake-ups. NIXL's own 0 "
            "makes it spin on a whole core, halving a one-core engine's speed. null keeps NIXL's value."
        ),
    )
    ucx_tls: str | None = Field(
        None,
        description=(
            "UCX transports (UCX_TLS). Default: pdserve picks shared memory + TCP on CPU hosts, UCX's own "
            "choice on GPU hosts."
        ),
    )


class PDServeArgs(_Strict):
    """Arguments of :func:`pdserve.build_pd_openai_app` (the `args:` of a Serve application)."""

    prefill_config: LLMConfig = Field(default_factory=LLMConfig, description="The prefill engines.")
    decode_config: LLMConfig = Field(default_factory=LLMConfig, description="The decode engines.")
    router: RouterConfig = Field(default_factory=RouterConfig, description="The OpenAI-compatible router.")
    http: HttpConfig = Field(default_factory=HttpConfig, description="Listen address for `pdserve serve`.")
    cpu: CpuConfig = Field(default_factory=CpuConfig, description="Engine settings on CPU-only hosts.")
    nixl: NixlConfig = Field(default_factory=NixlConfig, description="KV transfer settings.")
    cache_dir: str | None = Field(
        None,
        description=(
            "Weight cache on each engine host: prepared models, hub downloads (the engines' HF_HOME) and "
            "vLLM's compile caches (VLLM_CACHE_ROOT, with Inductor's and Triton's under it) in one "
            "directory, reused on every restart. Empty: "
            "$PDSERVE_CACHE_DIR, else ~/.cache/pdserve. `pdserve render` leaves it out: pods use the "
            "`kubernetes.cache` volume."
        ),
    )
    kubernetes: KubernetesConfig = Field(
        default_factory=KubernetesConfig,
        description="Cluster values for `pdserve render` (KubeRay on EKS); engines and router ignore them.",
    )
    # Ray Serve LLM's PDServingArgs has these; accepted so its files validate. The router is ours.
    proxy_cls_config: dict[str, Any] | None = Field(None, description="Ray Serve LLM compat; ignored.")
    proxy_deployment_config: dict[str, Any] | None = Field(
        None, description="Ray Serve LLM compat: `num_replicas` maps to router.num_replicas."
    )
    ingress_cls_config: dict[str, Any] | None = Field(None, description="Ray Serve LLM compat; ignored.")
    ingress_deployment_config: dict[str, Any] | None = Field(
        None, description="Ray Serve LLM compat: `num_replicas` maps to router.num_replicas."
    )

    @field_validator("cache_dir")
    @classmethod
    def _absolute_cache_dir(cls, v: str | None) -> str | None:
        # Replicas run in other working directories (Ray workers): a relative path is fixed here.
        return os.path.abspath(os.path.expanduser(v)) if v else None

    @model_validator(mode="after")
    def _same_model(self) -> PDServeArgs:
        p, d = self.prefill_config.model_loading_config, self.decode_config.model_loading_config
        if p.model_id != d.model_id:
            raise ValueError(
                f"prefill and decode must serve the same model_id (got {p.model_id!r} and {d.model_id!r})"
            )
        if p.source() != d.source():
            raise ValueError(
                "prefill and decode must load the same model_source "
                f"(got {p.source()!r} and {d.source()!r}); the KV cache layout must match"
            )
        pk, dk = self.prefill_config.engine_kwargs, self.decode_config.engine_kwargs
        for key in ("kv_cache_dtype", "dtype"):
            if pk.get(key) != dk.get(key):
                raise ValueError(
                    f"engine_kwargs.{key} must be equal on prefill and decode (the KV layout must match): "
                    f"{pk.get(key)!r} vs {dk.get(key)!r}"
                )
        # vLLM's NIXL connector maps ranks and blocks between unequal layouts only by whole multiples.
        ptp, dtp = int(pk.get("tensor_parallel_size", 1)), int(dk.get("tensor_parallel_size", 1))
        if ptp < 1 or dtp < 1 or max(ptp, dtp) % min(ptp, dtp):
            raise ValueError(
                f"tensor_parallel_size: the larger of prefill ({ptp}) and decode ({dtp}) must be a multiple "
                "of the smaller (NIXL maps each decode rank onto whole prefill ranks)"
            )
        pbs, dbs = pk.get("block_size"), dk.get("block_size")
        if (pbs is None) != (dbs is None) or (pbs and dbs and int(dbs) % int(pbs)):
            raise ValueError(
                f"block_size: decode's ({dbs}) must be a multiple of prefill's ({pbs}); set both or neither"
            )
        pl, dl = self.prefill_config.lora_config, self.decode_config.lora_config
        if (pl is None) != (dl is None) or (pl and dl and pl.dynamic_lora_loading_path != dl.dynamic_lora_loading_path):
            raise ValueError(
                "lora_config: prefill and decode must have the same dynamic_lora_loading_path (both legs run "
                f"with the adapter; the KV handed over is the adapter's): {pl and pl.dynamic_lora_loading_path!r} "
                f"vs {dl and dl.dynamic_lora_loading_path!r}"
            )
        auto = self.decode_config.deployment_config.autoscaling_config
        if auto is not None and auto.target_ttft_s is not None:
            raise ValueError(
                "decode_config.deployment_config.autoscaling_config.target_ttft_s: TTFT is a prefill signal; "
                "decode scales on running sequences and KV cache use"
            )
        for extra in (self.proxy_deployment_config, self.ingress_deployment_config):
            if extra and isinstance(extra.get("num_replicas"), int):
                self.router.num_replicas = extra["num_replicas"]
        return self

    @property
    def model_id(self) -> str:
        return self.prefill_config.model_loading_config.model_id
