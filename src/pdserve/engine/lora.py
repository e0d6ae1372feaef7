"""LoRA adapters by name: ``<model_id>:<adapter>`` (Ray Serve LLM's convention) is the adapter stored at
``<dynamic_lora_loading_path>/<adapter>``.

The engines load an adapter the first time a request names it: vLLM asks its registered LoRA resolvers for
an unknown model name when ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` is on, and :func:`register_resolver` (a
``vllm.general_plugins`` entry, inert unless pdserve's launcher sets :data:`ENV_PATH`) registers
:class:`AdapterResolver`. Both legs of a request name the same adapter, so prefill computes the adapter's KV
cache and decode continues with the same adapter over it. vLLM keeps ``max_cpu_loras`` adapters and evicts
the least recently used.

Stores on ``s3://``, ``gs://``, ``abfss://`` or ``azure://`` are copied to the engine's cache directory
through fsspec (its backend for the scheme must be installed on the engine host). A copy is checked against
the store whenever vLLM resolves the adapter (a new one, or one it evicted): when the store's files changed
(size, ETag or modification time), it is copied again. The cache keeps at most :data:`CACHE_MAX_ADAPTERS`
copies per store; the least recently resolved go first, but never one a running engine has resolved: vLLM
resolves a name once and keeps its path for good, loading the adapter from there again whenever its worker
evicted it, and a load from a missing directory is fatal to the engine (one tenant naming 33 adapters
deleted another's copy, and that tenant's next request would have ended the engine). An engine holds a
shared lock on each copy it resolved (``.<name>.inuse`` beside it) for its life; eviction passes over them,
so the copies can outgrow the bound, up to the adapters the host's running engines have used: disk, not an
engine, is what a tenant naming many adapters costs.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from typing import IO, Any

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


#: Copies of remote adapters an engine host keeps per store (least recently resolved evicted first).
CACHE_MAX_ADAPTERS = 32
SOURCE_FILE = ".pdserve-source.json"


def _source_state(fs: Any, src: str) -> dict[str, Any]:
    """What identifies the store's copy of an adapter: each file's size, ETag and modification time."""
    state: dict[str, Any] = {}
    for info in fs.ls(src, detail=True):
        name = str(info.get("name", "")).rsplit("/", 1)[-1]
        state[name] = [info.get("size"), info.get("ETag") or info.get("etag"),
                       str(info.get("LastModified") or info.get("mtime") or info.get("created") or "")]
    return state


def _evict(store_dir: str, keep: str) -> None:
    """Keep at most :data:`CACHE_MAX_ADAPTERS` copies under ``store_dir``: the least recently resolved go."""
    try:
        names = [n for n in os.listdir(store_dir) if not n.startswith(".")]
    except OSError:
        return
    if len(names) <= CACHE_MAX_ADAPTERS:
        return
    def used(n: str) -> float:
        try:
            return os.stat(os.path.join(store_dir, n, SOURCE_FILE)).st_mtime
        except OSError:
            return 0.0
    for n in sorted((n for n in names if n != keep), key=used):
        if len(names) <= CACHE_MAX_ADAPTERS:
            break
        lock = _in_use_path(store_dir, n)
        try:
            f = open(lock, "a+")  # noqa: SIM115 - closed below
        except OSError:
            continue
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # a running engine resolved it: vLLM may load it from there again
            f.close()
            continue
        shutil.rmtree(os.path.join(store_dir, n), ignore_errors=True)
        try:
            os.unlink(lock)
        except OSError:
            pass
        f.close()
        names.remove(n)


#: The copies this engine resolved, each with its shared lock held for the engine's life.
_IN_USE: dict[str, IO[str]] = {}


def _in_use_path(store_dir: str, name: str) -> str:
    return os.path.join(store_dir, f".{name}.inuse")


def hold(store_dir: str, name: str) -> None:
    """Mark ``store_dir/name`` as resolved by this engine: no eviction removes it while the engine runs."""
    path = _in_use_path(store_dir, name)
    if path in _IN_USE:
        return
    f = open(path, "a+")  # noqa: SIM115 - held for the process's life
    fcntl.flock(f.fileno(), fcntl.LOCK_SH)
    _IN_USE[path] = f


def copy_remote(root: str, name: str, cache_dir: str) -> str | None:
    """The local copy of ``root/name`` (fsspec), copied again when the store's files changed since; ``None``
    if the store has no such adapter."""
    import fsspec

    key = hashlib.sha256(root.encode()).hexdigest()[:16]
    store_dir = os.path.join(cache_dir, "lora", key)
    dest = os.path.join(store_dir, name)
    scheme = root.split("://", 1)[0]
    fs = fsspec.filesystem(scheme)  # ImportError names the backend to install (s3fs, gcsfs, adlfs)
    src = f"{root}/{name}"
    if not fs.exists(f"{src}/adapter_config.json"):
        return None
    state = _source_state(fs, src)
    marker = os.path.join(dest, SOURCE_FILE)
    if local_adapter_dir(store_dir, name):
        try:
            with open(marker, encoding="utf-8") as f:
                if json.load(f) == json.loads(json.dumps(state)):
                    os.utime(marker, (time.time(), time.time()))  # recently resolved
                    hold(store_dir, name)
                    if local_adapter_dir(store_dir, name):  # (not evicted before the hold)
                        return dest
        except (OSError, ValueError):
            pass
        log.info("LoRA adapter %s changed in %s: copying it again", name, root)
    os.makedirs(store_dir, exist_ok=True)
    hold(store_dir, name)  # before the copy exists: an eviction meanwhile passes over it
    tmp = tempfile.mkdtemp(prefix=f".{name}-", dir=store_dir)
    try:
        fs.get(src + "/", tmp + "/", recursive=True)
        with open(os.path.join(tmp, SOURCE_FILE), "w", encoding="utf-8") as f:
            json.dump(state, f)
        old = None
        if os.path.exists(dest):
            old = tempfile.mkdtemp(prefix=f".{name}-old-", dir=store_dir)
            os.replace(dest, os.path.join(old, name))
        os.replace(tmp, dest)
        if old:
            shutil.rmtree(old, ignore_errors=True)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not local_adapter_dir(store_dir, name):  # another engine copied it meanwhile
            raise
    _evict(store_dir, name)
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
