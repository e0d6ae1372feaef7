"""How LoRA adapters are named and stored (``lora_config``): ``<model_id>:<adapter>`` names the directory
``<dynamic_lora_loading_path>/<adapter>``. Used by the router (which checks names) and the engines' resolver
(:mod:`pdserve.engine.lora`, which loads them)."""

from __future__ import annotations

import json
import os
import re
import struct

#: An adapter's name: letters, digits, ``.``, ``_``, ``-``, ``:`` (Ray Serve LLM's ids may hold colons),
#: starting with a letter or digit, at most 128 characters. Anything else could mean something to a remote store (``?versionId=1`` aliases another
#: object on S3 and Azure, ``#``, ``*``, ``%`` are read by URL and glob parsers) or to a file system.
ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")


def adapter_of(model_id: str, requested: str) -> str | None:
    """The adapter a request's ``model`` names, or ``None`` when it names none (or is not a safe directory
    name: no path separators, no ``.``/``..``, nothing hidden)."""
    prefix = model_id + ":"
    if not requested.startswith(prefix):
        return None
    name = requested[len(prefix):]
    return name if ADAPTER_NAME.fullmatch(name) else None


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


def check_adapter_shapes(path: str) -> str | None:
    """Why the adapter at ``path`` must not be loaded, or ``None``: every ``lora_A`` tensor must have the
    rank its config states as rows and every ``lora_B`` tensor as columns (``rank_pattern`` per module
    taken into account). vLLM checks the config's rank only; a file whose tensors exceed it killed engines.
    Reads the safetensors header (JSON), never the tensors."""
    try:
        with open(os.path.join(path, "adapter_config.json"), encoding="utf-8") as f:
            cfg = json.load(f)
        rank = int(cfg.get("r", 0))
    except (OSError, ValueError, TypeError):
        return "unreadable adapter_config.json"
    pattern = cfg.get("rank_pattern") or {}
    weights = os.path.join(path, "adapter_model.safetensors")
    if not os.path.exists(weights):
        return None  # a .bin adapter: vLLM reads it with its own checks
    try:
        with open(weights, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size > 100 * 1024 * 1024:
                return "a safetensors header over 100 MiB"
            header = json.loads(f.read(size))
    except (OSError, ValueError, struct.error):
        return "unreadable adapter_model.safetensors"
    for name, meta in header.items():
        if name == "__metadata__" or not isinstance(meta, dict):
            continue
        shape = meta.get("shape") or []
        want = next((int(r) for key, r in pattern.items() if key in name), rank) if isinstance(pattern, dict) else rank
        if ".lora_A" in name and (len(shape) != 2 or shape[0] != want):
            return f"{name} has shape {shape}, not rank {want} as its config states"
        if ".lora_B" in name and (len(shape) != 2 or shape[1] != want):
            return f"{name} has shape {shape}, not rank {want} as its config states"
    return None


def list_local_adapters(root: str) -> list[str]:
    """Names of the adapters in a local store (directories with a LoRA ``adapter_config.json``)."""
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return []
    return [n for n in names if not n.startswith(".") and local_adapter_dir(root, n)]
