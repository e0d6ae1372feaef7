"""vLLM's packed weights made once per host, in the engines' forkserver, and inherited by every CPU engine it
forks (``cpu.share_weights: packed``, the default).

As a CPU engine loads its model, vLLM packs each linear layer's weight, and the output head's, into a private
oneDNN buffer (``dispatch_cpu_unquantized_gemm``): the embedded default's two engines held the same 0.5 GiB of
packed float32 each. Here the forkserver (engine/forkserver.py), asked for an engine's server, first packs
every weight file of that engine's model and dtype in the weight cache (:data:`ENV_DIR`; the files are the
loaded weights in their final layout, written by the engines at their first start, engine/weight_share.py)
into oneDNN buffers of its own. The servers it forks, and the engine cores they fork, inherit those buffers
copy-on-write and only read them: one copy for the host's engines. An engine whose loaded weight equals a
packed file's (compared, and the file as it was when packed) computes with the inherited buffer, the same
oneDNN GEMM vLLM would have made, so the same speed and the same numbers, and hands what it loaded back;
any other weight goes vLLM's own way and is written to the cache for the next start.

Packing runs on one thread: a forkserver that had started OpenMP's thread pool would fork engines that hang
at their first parallel region (GNU libgomp).
"""

from __future__ import annotations

import logging
import mmap
import os
import re
import sys
import time
from dataclasses import dataclass
from typing import Any

from pdserve.settings import PACKED_WEIGHTS_ENV

#: The weight cache's directory of the engine's model; unset: no packed weights to inherit or files to write.
ENV_DIR = PACKED_WEIGHTS_ENV
#: oneDNN's primitive cache per packed weight, as vLLM asks for it.
PRIMITIVE_CACHE = 32
log = logging.getLogger(__name__)

_FILE = re.compile(r"^(?P<prefix>.+)\.(?P<dtype>[a-z0-9]+)\.(?P<shape>\d+x\d+)\.bin$")


@dataclass(frozen=True)
class Packed:
    """One weight file packed by the forkserver: oneDNN's handle and the file's identity when packed."""

    handler: Any
    stamp: tuple[int, int, int, int]


#: Path of a weight file -> its packed copy (filled in the forkserver, inherited by the engines).
_packed: dict[str, Packed] = {}


def _stamp(path: str) -> tuple[int, int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def dtype_of(args: list[str]) -> str | None:
    """The ``--dtype`` of an engine's command line (None when absent or ``auto``)."""
    for i, a in enumerate(args):
        if a == "--dtype" and i + 1 < len(args):
            value = args[i + 1]
        elif a.startswith("--dtype="):
            value = a.partition("=")[2]
        else:
            continue
        return None if value in ("", "auto") else value.removeprefix("torch.")
    return None


def _onednn_gemm(n: int, k: int, dtype: Any) -> bool:
    """Whether vLLM packs an N x K weight of ``dtype`` for oneDNN on this host (not its zentorch or small-GEMM
    kernels: those keep vLLM's own path)."""
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers import utils
    from vllm.platforms import current_platform

    if not getattr(ops, "_supports_onednn", False):
        return False
    if getattr(current_platform, "is_zen_cpu", lambda: False)():
        return False
    check = getattr(utils, "check_cpu_sgl_kernel", None)
    return not (check is not None and check(n, k, dtype))


def prepare(env: dict[str, str], args: list[str]) -> None:
    """In the forkserver, before it forks an engine's server: pack the weight files of the engine's model
    (``env``'s :data:`ENV_DIR`) and dtype (``args``' ``--dtype``) not packed yet (none at a model's first
    start; those its engines wrote since, at the next engine's fork)."""
    directory, dtype_name = env.get(ENV_DIR), dtype_of(args)
    if not directory or not dtype_name:
        return
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return  # no files yet: the engines write them at this first start
    import torch

    dtype = getattr(torch, dtype_name, None)
    if not isinstance(dtype, torch.dtype):
        return
    t0, total = time.monotonic(), 0
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # no OpenMP thread pool in the forkserver (module text)
    try:
        for name in names:
            m = _FILE.match(name)
            if m is None or m["dtype"] != dtype_name:
                continue
            path = os.path.join(directory, name)
            rows, cols = (int(s) for s in m["shape"].split("x"))
            # A linear layer's file holds its weight transposed (K x N); a vocabulary's as it is (N x K).
            linear = m["prefix"].endswith(".T")
            n, k = (cols, rows) if linear else (rows, cols)
            stamp = _stamp(path)
            if (stamp is None or stamp[2] != n * k * dtype.itemsize or getattr(_packed.get(path), "stamp", None)
                    == stamp or not _onednn_gemm(n, k, dtype)):
                continue
            from vllm import _custom_ops as ops

            with open(path, "rb") as f:
                buf = mmap.mmap(f.fileno(), stamp[2], access=mmap.ACCESS_COPY)
            weight = torch.frombuffer(buf, dtype=dtype).view(rows, cols)
            handler = ops.create_onednn_mm(weight if linear else weight.t(), PRIMITIVE_CACHE)
            del weight
            buf.close()
            _packed[path] = Packed(handler, stamp)
            total += stamp[2]
    finally:
        torch.set_num_threads(threads)
    if total:
        print(f"[pdserve] engine forkserver: {total / (1 << 30):.2f} GiB of {os.path.basename(directory)}'s "
              f"weights packed for the engines ({dtype_name}) in {time.monotonic() - t0:.1f}s",
              file=sys.stderr, flush=True)


def inherited(path: str) -> Any | None:
    """The packed copy of the weight file at ``path`` this engine inherited, when the file is still the one
    that was packed (the caller has compared its content with the engine's weight)."""
    packed = _packed.get(path)
    if packed is None or _stamp(path) != packed.stamp:
        return None
    return packed.handler


def gemm(handler: Any) -> Any:
    """A layer's ``cpu_linear`` computing with a packed copy, as vLLM's own oneDNN dispatch does."""
    from vllm import _custom_ops as ops

    return lambda x, weight, bias: ops.onednn_mm(handler, x, bias)


def packed_count() -> int:
    """Weight files packed in this process or inherited from the forkserver."""
    return len(_packed)
