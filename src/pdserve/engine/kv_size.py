"""How much memory a CPU engine gives its KV cache (``cpu.kv_cache_gib``).

vLLM on CPU takes the size as given (``kv_cache_memory_bytes``, or the whole GiB of ``VLLM_CPU_KVCACHE_SPACE``)
and fills it when it starts. ``auto`` sizes it to the model: room for :data:`AUTO_KV_CONTEXTS` prompts of the
engine's whole context (``max_model_len``) at the bytes per token the model's ``config.json`` and the engine's
dtype give (2 × layers × KV heads × head size × element size): four for a decode engine, which holds the
streams it runs and, in its prefix cache, the conversations it answered; two for a prefill engine, which
holds a prompt only until its decode engine has read it, and shared prefixes (system prompts) in its
prefix cache; four for a prefill engine too under ``router.disaggregate_by_load``, where it also answers
whole requests and holds their conversations (the launcher sizes it as decode's). The packaged
SmolLM2-135M in float32 at 4,096 tokens: 45 KiB a token, 0.70 GiB for four contexts, 0.35 for two
(bfloat16: half).
A size given in GiB may be a fraction (0.25).
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

GIB = 1 << 30
MIB = 1 << 20
#: Whole contexts the ``auto`` size holds, by role: a decode engine's streams and its prefix cache of the
#: conversations it answered; a prefill engine's prompts on their way to decode and its shared prefixes.
AUTO_KV_CONTEXTS = {"decode": 4, "prefill": 2}
#: What ``auto`` falls back to when the model's shape is unknown (vLLM's CPU default before, 1 GiB).
FALLBACK_BYTES = GIB
#: ``auto`` rounds up to this and never goes below it.
GRAIN = 16 * MIB
_ELEMENT = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2, "fp8": 1, "fp8_e4m3": 1,
            "fp8_e5m2": 1}


def bytes_per_token(model_path: str | None, kw: dict[str, Any]) -> int | None:
    """KV bytes one token takes in this engine (``kw``: its vLLM arguments); None when the model's shape or
    the dtype is unknown."""
    if not model_path:
        return None
    try:
        with open(os.path.join(model_path, "config.json"), encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return None
    cfg = cfg.get("text_config", cfg) if isinstance(cfg, dict) else {}
    try:
        layers = int(cfg["num_hidden_layers"])
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None
    cache_dtype = str(kw.get("kv_cache_dtype") or "auto")
    dtype = str(kw.get("dtype") or cfg.get("torch_dtype") or "")
    size = _ELEMENT.get(cache_dtype) or _ELEMENT.get(dtype)
    if size is None:
        return None
    return 2 * layers * kv_heads * head_dim * size


def cpu_kv_cache_bytes(setting: float | str, model_path: str | None, kw: dict[str, Any],
                       role: str = "decode") -> int:
    """The KV cache of one CPU engine of ``role``, in bytes, for ``cpu.kv_cache_gib`` (``"auto"`` or GiB)."""
    if setting != "auto":
        return max(int(float(setting) * GIB), GRAIN)
    per = bytes_per_token(model_path, kw)
    if per is None:
        return FALLBACK_BYTES
    context = int(kw.get("max_model_len") or 0)
    if context <= 0:
        return FALLBACK_BYTES
    want = AUTO_KV_CONTEXTS.get(role, AUTO_KV_CONTEXTS["decode"]) * context * per
    return max(GRAIN, math.ceil(want / GRAIN) * GRAIN)


def estimate_gib(setting: float | str) -> float:
    """A size to plan memory with before any model is at hand (doctor): the setting, or 1 GiB for ``auto``."""
    return FALLBACK_BYTES / GIB if setting == "auto" else float(setting)
