"""One engine role's config, in Ray Serve LLM's ``LLMConfig`` shape: the model, vLLM's engine arguments,
the Serve deployment (replicas, autoscaling, placement), LoRA adapters."""

from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from pdserve.config.base import EMBEDDED_MODEL_ID, EMBEDDED_MODEL_SOURCE, _Strict


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


#: Most replicas of ``num_replicas: auto`` unless its ``autoscaling_config`` says (Ray Serve's default).
AUTO_MAX_REPLICAS = 100


#: Ray Serve's defaults for the two autoscaling periods that pdserve passes on when set.
RAY_METRICS_INTERVAL_S, RAY_LOOK_BACK_PERIOD_S = 10.0, 30.0


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
    metrics_interval_s: float | None = Field(
        None, gt=0,
        description=("Seconds between an engine replica's reports of its load to Serve's controller (Ray's "
                     "default: 10)."),
    )
    look_back_period_s: float | None = Field(
        None, gt=0,
        description=("Seconds over which Serve averages the load it is sent (Ray's default: 30); more than "
                     "`metrics_interval_s`. Shorter reacts sooner, and follows the load's dips more."),
    )
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
        interval = self.metrics_interval_s if self.metrics_interval_s is not None else RAY_METRICS_INTERVAL_S
        look_back = self.look_back_period_s if self.look_back_period_s is not None else RAY_LOOK_BACK_PERIOD_S
        if look_back <= interval:
            raise ValueError(f"look_back_period_s ({look_back:g}) must be more than metrics_interval_s "
                             f"({interval:g}): Serve averages the load over the first, sent every the second")
        return self


class DeploymentConfig(_Strict):
    """Ray Serve deployment options for one role."""

    num_replicas: int | Literal["auto"] | None = Field(
        None,
        description=(
            "Fixed number of replicas (default 1). Mutually exclusive with a number in autoscaling_config. "
            "`auto`: autoscaling with Ray Serve's defaults for it (1 to 100 replicas) on pdserve's per-role "
            "signals, or with `autoscaling_config` where given (its `max_replicas` then 100 unless set). "
            "`pdserve render` needs bounds: set `autoscaling_config` instead."
        ),
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
    graceful_shutdown_wait_loop_s: float = Field(
        0.25, gt=0,
        description=(
            "How often Ray Serve looks whether a stopping replica still holds requests made through Serve "
            "(Serve's default 2 s, and it waits once before its first look). An engine's requests come over "
            "HTTP, not through Serve, and its replica drains them itself within `graceful_shutdown_timeout_s`: "
            "Serve's wait only delayed every stop."
        ),
    )
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

    @model_validator(mode="before")
    @classmethod
    def _auto_is_autoscaling(cls, data: Any) -> Any:
        """Ray Serve's meaning of ``num_replicas: auto``: autoscaling, 1 to 100 replicas unless the config bounds
        it. Left to Ray it would scale on requests through Serve handles, which engine replicas never get."""
        if not isinstance(data, dict) or data.get("num_replicas") != "auto":
            return data
        auto = data.get("autoscaling_config")
        if auto is None:
            auto = {}
        if isinstance(auto, dict) and "max_replicas" not in auto:
            auto = {**auto, "max_replicas": AUTO_MAX_REPLICAS}
        return {**data, "autoscaling_config": auto}


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

    def replicas_text(self) -> str:
        """How many replicas, as ``pdserve validate`` says it: ``2 replica(s)`` or ``1-4 replicas (autoscaling)``."""
        a = self.deployment_config.autoscaling_config
        if a is None:
            return f"{self.num_replicas()} replica(s)"
        return f"{a.min_replicas}-{a.max_replicas} replicas (autoscaling)"

    def num_replicas(self) -> int:
        dc = self.deployment_config
        if isinstance(dc.num_replicas, int):
            return dc.num_replicas
        if dc.autoscaling_config is not None:
            a = dc.autoscaling_config
            return a.initial_replicas if a.initial_replicas is not None else a.min_replicas
        return 1
