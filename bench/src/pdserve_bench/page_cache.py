"""The page cache under a startup measurement: dropping it (or evicting the weights where that is refused),
how much of a file it holds, and what reading the weights costs from disk alone."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any


def _cached_mb() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("Cached:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def drop_page_cache(fallback_files: list[Path] | None = None) -> dict[str, Any]:
    """``sync; echo 3 > /proc/sys/vm/drop_caches`` (needs root and a writable /proc/sys); when refused,
    evicts ``fallback_files`` with posix_fadvise(DONTNEED) instead."""
    before = _cached_mb()
    os.sync()
    out: dict[str, Any] = {"cached_mb_before": before}
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        out.update(method="drop_caches", ok=True)
    except OSError as e:
        out.update(method="fadvise", ok=False, error=f"drop_caches: {e.strerror or e}")
        evicted = 0
        for f in fallback_files or []:
            try:
                fd = os.open(f, os.O_RDONLY)
            except OSError:
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                evicted += 1
            finally:
                os.close(fd)
        out["fadvise_files"] = evicted
    out["cached_mb_after"] = _cached_mb()
    return out


def resident_fraction(path: Path) -> float | None:
    """Share of a file's pages in the page cache (mincore), or None where that cannot be asked."""
    import ctypes
    import mmap

    try:
        size = path.stat().st_size
    except OSError:
        return None
    if size == 0:
        return 1.0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                          ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr is None or addr == ctypes.c_void_p(-1).value:
            return None
        try:
            pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
            vec = ctypes.create_string_buffer(pages)
            if libc.mincore(ctypes.c_void_p(addr), size, vec) != 0:
                return None
            return sum(b & 1 for b in vec.raw[:pages]) / pages
        finally:
            libc.munmap(ctypes.c_void_p(addr), size)
    finally:
        os.close(fd)


def weight_files(model_dir: Path) -> list[Path]:
    """The prepared model's weight files."""
    return sorted(model_dir.glob("*.safetensors"))


def raw_read(model_dir: Path) -> dict[str, Any]:
    """Sequential read of the weights right after dropping the page cache: what the disk alone costs."""
    files = weight_files(model_dir)
    drop = drop_page_cache(files)
    t = time.monotonic()
    n = 0
    for f in files:
        with open(f, "rb") as fh:
            while chunk := fh.read(8 << 20):
                n += len(chunk)
    s = time.monotonic() - t
    t = time.monotonic()
    for f in files:
        with open(f, "rb") as fh:
            while fh.read(8 << 20):
                pass
    hot = time.monotonic() - t
    return {"bytes": n, "cold_s": s, "cold_mb_per_s": n / 1e6 / s if s else None, "hot_s": hot,
            "hot_mb_per_s": n / 1e6 / hot if hot else None, "page_cache": drop}
