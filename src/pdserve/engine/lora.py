"""LoRA adapters by name: ``<model_id>:<adapter>`` (Ray Serve LLM's convention) is the adapter stored at
``<dynamic_lora_loading_path>/<adapter>``.

The engines load an adapter the first time a request names it: vLLM asks its registered LoRA resolvers for
an unknown model name when ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` is on, and :func:`register_resolver` (a
``vllm.general_plugins`` entry, inert unless pdserve's launcher sets :data:`ENV_PATH`) registers
:class:`AdapterResolver`. Both legs of a request name the same adapter, so prefill computes the adapter's KV
cache and decode continues with the same adapter over it. vLLM keeps ``max_cpu_loras`` adapters and evicts
the least recently used.

Stores on ``s3://``, ``gs://``, ``abfss://`` or ``azure://`` are copied once to the engine's cache directory
through fsspec (its backend for the scheme must be installed on the engine host).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from typing import Any

from pdserve.config.lora import (
    adapter_of,
    check_adapter_shapes,
    is_remote,
    list_local_adapters,
    local_adapter_dir,
)
from pdserve.settings import LORA_CACHE_ENV as ENV_CACHE
from pdserve.settings import LORA_MODEL_ENV as ENV_MODEL
from pdserve.settings import LORA_PATH_ENV as ENV_PATH

__all__ = ["ENV_CACHE", "ENV_MODEL", "ENV_PATH", "AdapterResolver", "adapter_of", "copy_remote", "is_remote",
           "list_local_adapters", "local_adapter_dir", "register_resolver"]
PLUGIN_NAME = "pdserve_lora"

log = logging.getLogger(__name__)


def copy_remote(root: str, name: str, cache_dir: str) -> str | None:
    """Copy ``root/name`` to ``cache_dir`` once (fsspec); the local directory, or ``None`` if it is not there."""
    import fsspec

    key = hashlib.sha256(root.encode()).hexdigest()[:16]
    dest = os.path.join(cache_dir, "lora", key, name)
    if local_adapter_dir(os.path.dirname(dest), name):
        return dest
    scheme = root.split("://", 1)[0]
    fs = fsspec.filesystem(scheme)  # ImportError names the backend to install (s3fs, gcsfs, adlfs)
    src = f"{root}/{name}"
    if not fs.exists(f"{src}/adapter_config.json"):
        return None
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{name}-", dir=os.path.dirname(dest))
    try:
        fs.get(src + "/", tmp + "/", recursive=True)
        os.replace(tmp, dest)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not local_adapter_dir(os.path.dirname(dest), name):  # another engine copied it meanwhile
            raise
    return dest


class AdapterResolver:
    """vLLM LoRA resolver for ``<model_id>:<adapter>`` names (see the module's description)."""

    def __init__(self, root: str, model_id: str, cache_dir: str) -> None:
        self.root, self.model_id, self.cache_dir = root, model_id, cache_dir

    def path_of(self, lora_name: str) -> str | None:
        name = adapter_of(self.model_id, lora_name)
        if name is None:
            return None
        path = copy_remote(self.root, name, self.cache_dir) if is_remote(self.root) else local_adapter_dir(self.root, name)
        if path is not None and (why := check_adapter_shapes(path)) is not None:
            log.error("LoRA adapter %r refused: %s", lora_name, why)
            return None
        return path

    async def resolve_lora(self, base_model_name: str, lora_name: str) -> Any:
        import asyncio

        from vllm.lora.request import LoRARequest

        try:
            path = await asyncio.to_thread(self.path_of, lora_name)
        except Exception as e:  # noqa: BLE001 - vLLM answers 404 for an adapter no resolver finds
            log.error("cannot fetch LoRA adapter %r from %s: %s", lora_name, self.root, e)
            return None
        if path is None:
            return None
        log.info("LoRA adapter %r from %s", lora_name, path)
        return LoRARequest(lora_name=lora_name, lora_int_id=1, lora_path=path)  # vLLM renumbers it


def register_resolver() -> None:
    """``vllm.general_plugins`` entry: registers :class:`AdapterResolver` when :data:`ENV_PATH` is set."""
    root = os.environ.get(ENV_PATH)
    if not root:
        return
    from vllm.lora.resolver import LoRAResolver, LoRAResolverRegistry

    resolver = AdapterResolver(root, os.environ.get(ENV_MODEL, ""),
                               os.environ.get(ENV_CACHE) or os.path.join(tempfile.gettempdir(), "pdserve-lora"))
    LoRAResolver.register(AdapterResolver)  # a virtual subclass: this module stays importable without vLLM
    LoRAResolverRegistry.register_resolver("pdserve", resolver)
