"""How LoRA adapters are named and stored (``lora_config``): ``<model_id>:<adapter>`` names the directory
``<dynamic_lora_loading_path>/<adapter>``. Used by the router (which checks names) and the engines' resolver
(:mod:`pdserve.engine.lora`, which loads them)."""

from __future__ import annotations

import json
import os


def adapter_of(model_id: str, requested: str) -> str | None:
    """The adapter a request's ``model`` names, or ``None`` when it names none (or is not a safe directory
    name: no path separators, no ``.``/``..``, nothing hidden)."""
    prefix = model_id + ":"
    if not requested.startswith(prefix):
        return None
    name = requested[len(prefix):]
    if not name or name.startswith(".") or "/" in name or "\\" in name or "\x00" in name or len(name) > 200:
        return None
    return name


def is_remote(root: str) -> bool:
    return "://" in root


def local_adapter_dir(root: str, name: str) -> str | None:
    """The adapter's directory under a local store when it holds a LoRA adapter, else ``None``."""
    path = os.path.join(root, name)
    try:
        with open(os.path.join(path, "adapter_config.json"), encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return None
    return path if isinstance(cfg, dict) and str(cfg.get("peft_type", "LORA")).upper() == "LORA" else None


def list_local_adapters(root: str) -> list[str]:
    """Names of the adapters in a local store (directories with a LoRA ``adapter_config.json``)."""
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return []
    return [n for n in names if not n.startswith(".") and local_adapter_dir(root, n)]
