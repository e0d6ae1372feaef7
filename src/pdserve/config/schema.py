"""The typed configuration of a pdserve app.

The sections live in their own modules (:mod:`.llm`: an engine role, :mod:`.router`, :mod:`.host`: http, cpu,
nixl); this module holds the top level and names them all. The top level (:class:`PDServeArgs`) accepts the argument shape of Ray Serve LLM's
``build_pd_openai_app`` (``prefill_config`` / ``decode_config``, each an :class:`LLMConfig`) so a file
written for Ray Serve LLM runs with only its ``import_path`` changed. pdserve's own settings live in
their own sections (``router``, ``http``, ``cpu``, ``nixl``). ``engine_kwargs`` is the one pass-through
dict: it holds vLLM's own engine arguments, which pdserve forwards and does not interpret, except
``kv_transfer_config`` (filled in by :mod:`pdserve.config.kv_transfer` when omitted).
"""

from __future__ import annotations

import os
from typing import Any

from pydantic import Field, field_validator, model_validator

from pdserve.config.base import EMBEDDED_MODEL_ID, EMBEDDED_MODEL_SOURCE, _Strict
from pdserve.config.host import CpuConfig, HttpConfig, NixlConfig, check_pin_s
from pdserve.config.kubernetes import KubernetesConfig
from pdserve.config.llm import (
    AutoscalingConfig,
    DeploymentConfig,
    LLMConfig,
    LoraConfig,
    ModelLoadingConfig,
    PlacementGroupConfig,
)
from pdserve.config.router import RouterConfig
from pdserve.config.tracing import TracingConfig

__all__ = ["EMBEDDED_MODEL_ID", "EMBEDDED_MODEL_SOURCE", "AutoscalingConfig", "CpuConfig", "DeploymentConfig",
           "HttpConfig", "LLMConfig", "LoraConfig", "ModelLoadingConfig", "NixlConfig", "PDServeArgs",
           "PlacementGroupConfig", "RouterConfig", "TracingConfig"]


class PDServeArgs(_Strict):
    """Arguments of :func:`pdserve.build_pd_openai_app` (the `args:` of a Serve application)."""

    prefill_config: LLMConfig = Field(default_factory=LLMConfig, description="The prefill engines.")
    decode_config: LLMConfig = Field(default_factory=LLMConfig, description="The decode engines.")
    router: RouterConfig = Field(default_factory=RouterConfig, description="The OpenAI-compatible router.")
    http: HttpConfig = Field(default_factory=HttpConfig, description="Listen address for `pdserve serve`.")
    cpu: CpuConfig = Field(default_factory=CpuConfig, description="Engine settings on CPU-only hosts.")
    nixl: NixlConfig = Field(default_factory=NixlConfig, description="KV transfer settings.")
    tracing: TracingConfig = Field(default_factory=TracingConfig,
                                   description="OpenTelemetry traces of each request (off unless an endpoint is set).")
    cache_dir: str | None = Field(
        None,
        description=(
            "Weight cache on each engine host: prepared models, hub downloads (the engines' HF_HOME) and "
            "vLLM's compile caches (VLLM_CACHE_ROOT, with Inductor's and Triton's under it) in one "
            "directory, reused on every restart. Empty: $PDSERVE_CACHE_DIR likewise (where the environment "
            "names HF_HOME or VLLM_CACHE_ROOT, those win); neither set: only prepared models, in "
            "$XDG_CACHE_HOME/pdserve (~/.cache/pdserve), while Hugging Face and vLLM keep their own caches. "
            "`pdserve render` leaves it out: pods use the `kubernetes.cache` volume."
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
        for role, k in (("prefill", pk), ("decode", dk)):
            kv = k.get("kv_transfer_config")
            if kv is not None and not (isinstance(kv, dict) and isinstance(kv.get("kv_connector_extra_config", {}), dict)):
                raise ValueError(f"{role}_config.engine_kwargs.kv_transfer_config (and its kv_connector_extra_config) "
                                 "must be a mapping")
        both = [_extra(k).get("bidirectional_kv_xfer", self.nixl.bidirectional) for k in (pk, dk)]
        if bool(both[0]) != bool(both[1]):
            raise ValueError(
                "kv_transfer_config.kv_connector_extra_config.bidirectional_kv_xfer must be equal on prefill and "
                f"decode (got {both[0]!r} and {both[1]!r}): decode keeps the blocks, prefill reads them; set "
                "nixl.bidirectional instead (both sides, with the CPU engines' read threshold)"
            )
        ttl = _extra(dk).get("decoder_kv_blocks_ttl")
        if both[1] and ttl is not None:
            check_pin_s(ttl, "decode_config.engine_kwargs.kv_transfer_config.kv_connector_extra_config."
                             "decoder_kv_blocks_ttl (or set nixl.decode_blocks_ttl_s)")
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


def _extra(engine_kwargs: dict[str, Any]) -> dict[str, Any]:
    """An engine's ``kv_transfer_config.kv_connector_extra_config`` as given ({} when absent or not a mapping)."""
    cfg = engine_kwargs.get("kv_transfer_config")
    extra = cfg.get("kv_connector_extra_config") if isinstance(cfg, dict) else None
    return extra if isinstance(extra, dict) else {}
