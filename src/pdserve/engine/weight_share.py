"""The weight cache's files of a model's weights, and the CPU engines that use them instead of their own copy
(``cpu.share_weights``: ``mapped`` here; ``packed``, the default, with engine/prepack.py).

A CPU engine loads the model's weights into its own memory, and vLLM then packs every linear layer's weight
into a private oneDNN buffer (``dispatch_cpu_unquantized_gemm``): the embedded default's two engines held
0.65 GiB each of the same numbers in float32 (SmolLM2-135M: the linear layers, the embedding, and the
embedding packed twice more, as the output head and as the input embedding, whose copy no one uses). Here
each such weight, once loaded and in its final layout, goes to a file of the weight cache (:data:`ENV_DIR`,
one directory per model) and the engine maps that file copy-on-write (``MAP_PRIVATE``) instead of keeping
its own copy: every engine of the host maps the same page-cache pages, counted once between them, which the
kernel may also drop and read back under memory pressure rather than kill a process. A linear layer's file
holds its weight transposed, the layout ``torch.nn.functional.linear`` streams fastest (one sequence: as
fast as oneDNN's packed copy; four: 1.3x slower); a vocabulary's holds it as it is (for lookups), and
vLLM packs its own copy at the layer's first GEMM only: the output head's, at warm-up (oneDNN there is
1.2-2x faster than ``F.linear``), and never the tied input embedding's.

The first engine to get here writes the file (a temporary name, then a hard link: a file is never seen
half-written, and two engines starting together end up mapping the same one); every engine compares the
file with what it loaded before it maps it, so a file left by another model or version is replaced, and
a layer whose file cannot be written (disk full, read-only cache) keeps vLLM's own path. The memory the
loaded copies held is handed back to the system (tcmalloc's or glibc's release call).

With ``packed`` (:data:`prepack.ENV_DIR`) the files are written the same way, the vocabulary is mapped from
its file as here, and a linear layer whose weight equals its file computes with the copy the engines'
forkserver packed from that file (:func:`use_packed`), else with vLLM's own.

Applied by the engine fixes (``_site/sitecustomize.py``, 10) as vLLM's module is imported, in CPU engines;
files only where the launcher sets :data:`ENV_DIR` (``mapped``) or :data:`prepack.ENV_DIR` (``packed``).
Without either, one part applies to every CPU engine: a vocabulary is packed at its first GEMM, so the
packaged model's tied input embedding (113 MB in float32) is not packed a second time for nothing.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import mmap
import os
import re
import shutil
from typing import Any

from pdserve.engine import prepack
from pdserve.settings import SHARED_WEIGHTS_ENV

#: The directory of this engine's model and dtype in the weight cache; unset: vLLM's own weights.
ENV_DIR = SHARED_WEIGHTS_ENV
#: Weights smaller than this stay private (norms, biases): too small to matter, one file each.
MIN_BYTES = 1 << 20
#: A file is written only while the cache's disk keeps this much free besides it.
DISK_MARGIN_BYTES = 1 << 30
log = logging.getLogger(__name__)

_said: list[str] = []


def directory_for(root: str, model_path: str) -> str:
    """The directory of one model (its real path) under the cache's ``root``; each file's name has its
    layer, dtype and shape. Not the dtype: the engines' forkserver starts before ``cpu.dtype: auto`` is
    decided, and its environment must equal theirs (engine/forkserver.py)."""
    digest = hashlib.sha256(os.path.realpath(model_path).encode()).hexdigest()[:16]
    name = re.sub(r"[^A-Za-z0-9._-]", "_", os.path.basename(os.path.realpath(model_path)))[:64] or "model"
    return os.path.join(root, "shared-weights", f"{name}-{digest}")


def _file_name(prefix: str, t: Any) -> str:
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", prefix)
    shape = "x".join(str(s) for s in t.shape)
    return f"{safe}.{str(t.dtype).removeprefix('torch.')}.{shape}.bin"


def _raw(t: Any) -> Any:
    """The tensor's bytes as a flat ``uint8`` array (no copy for a contiguous tensor)."""
    import torch

    return t.contiguous().view(-1).view(torch.uint8).numpy()


def _write(path: str, t: Any) -> bool:
    """Write ``t``'s bytes to ``path`` unless another process did first; False when it cannot be written."""
    tmp = f"{path}.{os.getpid()}.tmp"
    nbytes = t.numel() * t.element_size()
    try:
        if shutil.disk_usage(os.path.dirname(path)).free < nbytes + DISK_MARGIN_BYTES:
            return False
        with open(tmp, "wb") as f:
            f.write(memoryview(_raw(t)))
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass  # another engine's copy: compared before use
        return True
    except OSError as e:
        log.warning("shared weights: cannot write %s (%s): this layer keeps its own copy", path, e)
        return False
    finally:
        try:
            os.unlink(tmp)
        except OSError:
            pass


def _map(path: str, t: Any) -> Any | None:
    """``path`` mapped copy-on-write as a tensor like ``t``, when the file holds exactly ``t``'s values."""
    import torch

    nbytes = t.numel() * t.element_size()
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size != nbytes:
                return None
            buf = mmap.mmap(f.fileno(), nbytes, access=mmap.ACCESS_COPY)
    except (OSError, ValueError):
        return None
    mapped = torch.frombuffer(buf, dtype=t.dtype).view(t.shape)  # (the tensor keeps the mapping alive)
    return mapped if torch.equal(mapped, t) else None


def file_holding(directory: str, prefix: str, t: Any) -> str | None:
    """The path of ``t``'s file in ``directory`` (``t``: a contiguous CPU tensor), written first when absent
    or different; None when it cannot be had."""
    path = os.path.join(directory, _file_name(prefix, t))
    if _map(path, t) is not None:
        return path
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        if os.path.exists(path):
            os.unlink(path)  # another model's or a torn file: replaced below
    except OSError:
        return None
    return path if _write(path, t) and _map(path, t) is not None else None


def shared_copy(directory: str, prefix: str, t: Any) -> Any | None:
    """A copy of ``t`` (a contiguous CPU tensor) backed by its file in ``directory``, written there first
    when absent or different; None when the file cannot be had (``t`` then stays as it is)."""
    path = file_holding(directory, prefix, t)
    return _map(path, t) if path else None


@functools.lru_cache(maxsize=1)
def _release_call() -> Any:
    """tcmalloc's call that hands free memory back (when it is preloaded, as for CPU engines), else glibc's
    ``malloc_trim(0)``; None where neither is found."""
    lib = ctypes.CDLL(None)
    tcmalloc = getattr(lib, "MallocExtension_ReleaseFreeMemory", None)
    if tcmalloc is not None:
        return tcmalloc
    trim = getattr(lib, "malloc_trim", None)
    return (lambda: trim(0)) if trim is not None else None


def _release_free_memory() -> None:
    """Hand the memory a replaced copy held back to the system."""
    call = _release_call()
    if call is not None:
        call()


def share_weight(layer: Any, directory: str, *, transposed: bool = False) -> bool:
    """Back ``layer``'s weight by its shared file (``transposed``: the file holds the weight's transpose and
    the layer sees a transposed view of it, same shape); False where it stays as loaded (not a plain 2-D
    weight, too small, unnamed, or no file to be had)."""
    weight = _loaded(layer)
    if weight is None:
        return False
    prefix = layer.prefix
    if getattr(weight, "_pdserve_shared", False):  # (a tied head meets the embedding's weight again)
        return True
    loaded = weight.data.t().contiguous() if transposed else weight.data
    mapped = shared_copy(directory, prefix + (".T" if transposed else ""), loaded)
    del loaded
    if mapped is None:
        return False
    weight.data = mapped.t() if transposed else mapped
    weight._pdserve_shared = True
    if not _said:
        _said.append(directory)
        log.info("weights mapped from %s, shared with the host's other engines", directory)
    _release_free_memory()
    return True


def share_layer(layer: Any, directory: str) -> bool:
    """A linear layer (vLLM would replace its weight by a packed copy): the weight shared, stored transposed,
    and computed with ``F.linear`` on the transposed view; False to leave the layer to vLLM."""
    import torch

    if not share_weight(layer, directory, transposed=True):
        return False
    layer.cpu_linear = lambda x, w, bias: torch.nn.functional.linear(x, w, bias)
    return True


def _loaded(layer: Any) -> Any | None:
    """``layer``'s weight when it is a large 2-D CPU tensor of a named layer (what this module handles)."""
    import torch

    weight = getattr(layer, "weight", None)
    if (not isinstance(weight, torch.Tensor) or weight.is_meta or weight.ndim != 2 or weight.device.type != "cpu"
            or not getattr(layer, "prefix", "") or weight.numel() * weight.element_size() < MIN_BYTES):
        return None
    return weight


def use_packed(layer: Any, directory: str) -> bool:
    """A linear layer whose weight the forkserver packed (engine/prepack.py): computed with the inherited
    copy, the weight handed back; False to leave the layer to vLLM (its file is then written for the next
    start, when absent)."""
    import torch

    weight = _loaded(layer)
    if weight is None:
        return False
    loaded = weight.data.t().contiguous()
    path = file_holding(directory, layer.prefix + ".T", loaded)
    del loaded
    handler = prepack.inherited(path) if path else None
    if handler is None:
        return False
    layer.cpu_linear = prepack.gemm(handler)
    layer.weight = torch.nn.Parameter(torch.empty(0, dtype=weight.dtype), requires_grad=False)
    del weight
    _release_free_memory()
    return True


def _packed_vocabulary(layer: Any, directory: str) -> Any | None:
    weight = _loaded(layer)
    path = file_holding(directory, layer.prefix, weight.data) if weight is not None else None
    return prepack.inherited(path) if path else None


def pack_at_first_gemm(layer: Any, pack: Any, packed: str | None = None) -> None:
    """A vocabulary's GEMM packed by vLLM (``pack``) at the layer's first GEMM, not when it is loaded: an
    input embedding tied to the output head (it only looks rows up) is packed never, the head at the
    engine's warm-up, before it is ready. ``packed``: the model's directory of weight files, whose packed
    copy, inherited from the forkserver, is used when there is one."""

    def first(x: Any, w: Any, bias: Any) -> Any:
        handler = _packed_vocabulary(layer, packed) if packed else None
        if handler is not None:
            layer.cpu_linear = prepack.gemm(handler)
        else:
            pack(layer, False)  # sets vLLM's own cpu_linear on the layer
        if layer.cpu_linear is first:  # (a vLLM that did not: its plain GEMM)
            import torch

            layer.cpu_linear = torch.nn.functional.linear
        return layer.cpu_linear(x, w, bias)

    layer.cpu_linear = first


def patch(utils: Any, directory: str | None) -> bool:
    """Route vLLM's CPU weight packing in ``utils`` (``vllm.model_executor.layers.utils``, patched as it is
    imported by the engine fixes, ``_site/sitecustomize.py``) through this module: a vocabulary packed at
    its first GEMM, always; with ``directory`` (:data:`ENV_DIR`'s value) every large weight shared.
    False when this vLLM has no such step. Safe to call repeatedly."""
    original = getattr(utils, "dispatch_cpu_unquantized_gemm", None)
    if original is None:
        return False
    if getattr(original, "_pdserve_packing", False):
        return True

    def dispatch(layer: Any, remove_weight: bool) -> None:
        # (read here, in the engine: it may differ between the engines forked from one forkserver)
        packed = None if directory else os.environ.get(prepack.ENV_DIR) or None
        if remove_weight:  # a linear layer: vLLM replaces its weight by a packed copy
            if not ((directory and share_layer(layer, directory)) or (packed and use_packed(layer, packed))):
                original(layer, remove_weight)
            return
        if directory or packed:  # a vocabulary: vLLM keeps its weight (lookups) and packs a copy (logits)
            share_weight(layer, directory or packed)
        pack_at_first_gemm(layer, original, packed)

    dispatch._pdserve_packing = True  # type: ignore[attr-defined]
    utils.dispatch_cpu_unquantized_gemm = dispatch
    return True
