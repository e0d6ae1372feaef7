"""The one place where pdserve's KV-transfer settings become vLLM's ``kv_transfer_config``."""

from __future__ import annotations

import copy
from typing import Any, Literal

from pdserve.config.schema import NixlConfig
from pdserve.errors import ConfigError

Role = Literal["prefill", "decode"]

#: Connectors that speak the NIXL handoff protocol pdserve drives.
NIXL_CONNECTORS = ("NixlConnector",)

_ROLE_FOR = {"prefill": "kv_producer", "decode": "kv_consumer"}
_ACCEPTED_ROLES = {"prefill": {"kv_producer", "kv_both"}, "decode": {"kv_consumer", "kv_both"}}


def build_kv_transfer_config(
    role: Role, user: dict[str, Any] | None, nixl: NixlConfig, *, on_cpu: bool
) -> dict[str, Any]:
    """Return the ``kv_transfer_config`` for one engine.

    ``user`` is what the YAML put in ``engine_kwargs.kv_transfer_config`` (may be ``None``). Roles are
    always made explicit: ``kv_both`` (deprecated in vLLM, but what Ray Serve LLM examples use) is turned
    into ``kv_producer`` on prefill and ``kv_consumer`` on decode. On CPU hosts the buffer must be ``cpu``.
    """
    cfg: dict[str, Any] = copy.deepcopy(user) if user else {}
    connector = cfg.setdefault("kv_connector", "NixlConnector")
    if connector not in NIXL_CONNECTORS:
        raise ConfigError(
            f"{role}_config.engine_kwargs.kv_transfer_config.kv_connector: {connector!r} is not supported; "
            f"valid: {', '.join(NIXL_CONNECTORS)}"
        )
    kv_role = cfg.get("kv_role")
    if kv_role is not None and kv_role not in _ACCEPTED_ROLES[role]:
        raise ConfigError(
            f"{role}_config.engine_kwargs.kv_transfer_config.kv_role: {kv_role!r} cannot serve the "
            f"{role} role; use {_ROLE_FOR[role]!r}"
        )
    cfg["kv_role"] = _ROLE_FOR[role]
    if on_cpu:
        if cfg.get("kv_buffer_device", "cpu") != "cpu":
            raise ConfigError(
                f"{role}_config.engine_kwargs.kv_transfer_config.kv_buffer_device must be 'cpu' on a host "
                "without a GPU"
            )
        cfg["kv_buffer_device"] = "cpu"
    cfg.setdefault("kv_load_failure_policy", nixl.kv_load_failure_policy)
    extra = cfg.setdefault("kv_connector_extra_config", {})
    extra.setdefault("backends", [nixl.backend])
    if nixl.kv_lease_duration_s is not None:
        extra.setdefault("kv_lease_duration", nixl.kv_lease_duration_s)
    if nixl.bidirectional:
        # Both sides: decode pins finished requests' blocks, prefill reads them for the next turn.
        extra.setdefault("bidirectional_kv_xfer", True)
        extra.setdefault("decoder_kv_blocks_ttl", nixl.decode_blocks_ttl_s)
        if on_cpu:
            # vLLM computes fewer than 64 such tokens rather than read them (a GPU's prefill is that quick); a
            # CPU engine computes a follow-up token in milliseconds (~10 ms for the embedded model on 2.5k
            # tokens of history, AVX2), a read costs about one step: a turn's answer and the history's last
            # partial block (~100 tokens) are usually under 64 on their own.
            extra.setdefault("kv_recompute_threshold", CPU_RECOMPUTE_BELOW_TOKENS)
    return cfg


#: CPU engines with ``nixl.bidirectional``: fewer tokens than this are computed rather than read from decode.
CPU_RECOMPUTE_BELOW_TOKENS = 16


def handback_ttl_s(user: dict[str, Any] | None, nixl: NixlConfig) -> float | None:
    """Seconds a decode engine keeps a finished request's blocks for the next turn's prefill, or ``None``
    when it keeps none (``nixl.bidirectional`` off and not turned on in the engine's own settings)."""
    extra = (user or {}).get("kv_connector_extra_config") or {}
    if not extra.get("bidirectional_kv_xfer", nixl.bidirectional):
        return None
    return float(extra.get("decoder_kv_blocks_ttl", nixl.decode_blocks_ttl_s))


#: vLLM's NIXL ``kv_lease_duration`` when none is given.
VLLM_DEFAULT_KV_LEASE_S = 30


def prefill_kv_lease_s(user: dict[str, Any] | None, nixl: NixlConfig) -> float:
    """Seconds a prefill engine keeps a finished request's blocks for decode (before renewals)."""
    extra = (user or {}).get("kv_connector_extra_config") or {}
    lease = extra.get("kv_lease_duration", nixl.kv_lease_duration_s)
    return float(lease if lease is not None else VLLM_DEFAULT_KV_LEASE_S)
