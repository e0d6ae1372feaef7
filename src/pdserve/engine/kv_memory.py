"""A CPU engine's KV cache takes memory as it fills, not all at start (``cpu.kv_cache_lazy``).

vLLM allocates a CPU engine's whole KV cache when the engine starts, as one ``torch.zeros`` buffer
(``vllm/v1/worker/utils.py: allocate_kv_cache``): zeroing writes every page, so all of it is resident
from the first second (the embedded default: 0.70 GiB per engine, before any request). Here that one
buffer is an anonymous private mapping instead: the kernel hands out zero pages on first touch, so the
buffer reads as zeros exactly as ``torch.zeros`` would, and a page becomes resident only once the engine
writes a block there. Memory grows with use up to the configured size (vLLM hands blocks out
least-recently-used first, so a busy engine touches all of them); nothing else changes.

Installed by pdserve's general vLLM plugin when the launcher sets :data:`ENV_LAZY` (CPU engines). The
trade: vLLM refuses to start an engine whose cache exceeds the host's free memory, and a lazy cache leaves
that memory free for the next engine's check too; so a cache is lazy only where the host has
:data:`ROOM_FACTOR` times its size available (the engine's own and another's: 1 prefill + 1 decode on a
host), else vLLM's eager cache and check stand. ``pdserve doctor`` counts the whole cache per engine.
"""

from __future__ import annotations

import logging
import mmap
import operator
from typing import Any

from pdserve.settings import KV_LAZY_ENV

#: Set to ``1`` by the launcher for CPU engines with ``cpu.kv_cache_lazy``.
ENV_LAZY = KV_LAZY_ENV
log = logging.getLogger(__name__)

#: Smaller buffers are left to torch (only the KV cache's backing buffer is this large).
MIN_BYTES = 16 << 20
#: A cache is lazy only where the host has this many times its size available (``MemAvailable``).
ROOM_FACTOR = 2


def available_bytes(path: str = "/proc/meminfo") -> int | None:
    """The host's ``MemAvailable``, or None where it cannot be read."""
    try:
        with open(path, encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


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
        if (len(size) == 1 and dtype is torch.int8 and device is not None and set(kw) <= {"device", "dtype"}
                and torch.device(device).type == "cpu"):
            try:
                nbytes = operator.index(size[0])
            except TypeError:
                nbytes = 0
            if nbytes >= MIN_BYTES:
                room = available_bytes()
                if room is not None and room >= ROOM_FACTOR * nbytes:
                    log.info("KV cache: %.2f GiB, taking memory as it fills (cpu.kv_cache_lazy)", nbytes / 2**30)
                    return lazy_zeros(nbytes)
                log.info("KV cache: %.2f GiB taken at start: the host has %s available, under %d times that "
                         "(cpu.kv_cache_lazy)", nbytes / 2**30,
                         "?" if room is None else f"{room / 2**30:.2f} GiB", ROOM_FACTOR)
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
