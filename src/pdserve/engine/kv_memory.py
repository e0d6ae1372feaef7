"""A CPU engine's KV cache takes memory as it fills, not all at start (``cpu.kv_cache_lazy``).

vLLM allocates a CPU engine's whole KV cache when the engine starts, as one ``torch.zeros`` buffer
(``vllm/v1/worker/utils.py: allocate_kv_cache``): zeroing writes every page, so all of it is resident
from the first second (the embedded default: 0.70 GiB per engine, before any request). Here that one
buffer is an anonymous private mapping instead: the kernel hands out zero pages on first touch, so the
buffer reads as zeros exactly as ``torch.zeros`` would, and a page becomes resident only once the engine
writes a block there. Memory grows with use up to the configured size (vLLM hands blocks out
least-recently-used first, so a busy engine touches all of them); nothing else changes.

Installed by pdserve's general vLLM plugin when the launcher sets :data:`ENV_LAZY` (CPU engines). The
trade: an engine whose host runs short of memory later fails when it fills its cache, not when it starts;
``pdserve doctor`` counts the whole cache per engine.
"""

from __future__ import annotations

import mmap
from typing import Any

from pdserve.settings import KV_LAZY_ENV

#: Set to ``1`` by the launcher for CPU engines with ``cpu.kv_cache_lazy``.
ENV_LAZY = KV_LAZY_ENV
#: Smaller buffers are left to torch (only the KV cache's backing buffer is this large).
MIN_BYTES = 16 << 20


def lazy_zeros(nbytes: int) -> Any:
    """An ``int8`` CPU tensor of ``nbytes`` zeros whose pages take memory when first written."""
    import torch

    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)
    return torch.frombuffer(buf, dtype=torch.int8)  # (the tensor keeps the mapping alive)


class _LazyZerosTorch:
    """``torch`` as vLLM's KV allocation sees it: the same module, but a large one-dimensional ``int8``
    ``zeros`` on the CPU is :func:`lazy_zeros`. Every other name is torch's own."""

    def __init__(self, torch: Any) -> None:
        self._torch = torch

    def __getattr__(self, name: str) -> Any:
        return getattr(self._torch, name)

    def zeros(self, *size: Any, **kw: Any) -> Any:
        torch = self._torch
        device, dtype = kw.get("device"), kw.get("dtype")
        if (len(size) == 1 and isinstance(size[0], int) and size[0] >= MIN_BYTES and dtype is torch.int8
                and device is not None and torch.device(device).type == "cpu"
                and set(kw) <= {"device", "dtype"}):
            return lazy_zeros(size[0])
        return torch.zeros(*size, **kw)


def install(enabled: str | None) -> bool:
    """Make vLLM's KV allocation lazy in this process when ``enabled`` (:data:`ENV_LAZY`'s value) is
    ``"1"``; ``False`` when off or when this vLLM has no such allocation. Safe to call repeatedly."""
    if enabled != "1":
        return False
    import importlib

    try:
        utils = importlib.import_module("vllm.v1.worker.utils")
    except Exception:  # noqa: BLE001 - not a vLLM with this allocator: nothing to do
        return False
    if not hasattr(utils, "allocate_kv_cache"):
        return False
    if not isinstance(utils.torch, _LazyZerosTorch):
        utils.torch = _LazyZerosTorch(utils.torch)
    return True
