"""``cpu.kv_cache_lazy``: a CPU engine's KV cache buffer reads as zeros and takes memory as it is written
(engine/kv_memory.py), with a stand-in for vLLM's allocation module; and the launcher's variable."""

from __future__ import annotations

import importlib.util
import re
import sys
import types
from pathlib import Path

import pytest
import torch

from pdserve.config.schema import PDServeArgs
from pdserve.engine import kv_memory
from pdserve.engine.launcher import EnginePlacement, engine_env
from pdserve.settings import KV_LAZY_ENV

MIB = 1 << 20


def resident_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / MIB


def test_the_buffer_reads_as_zeros_and_takes_memory_only_where_written():
    before = resident_mib()
    buf = kv_memory.lazy_zeros(256 * MIB)
    assert buf.dtype is torch.int8 and buf.numel() == 256 * MIB and buf.device.type == "cpu"
    assert buf.data_ptr() % 4096 == 0
    # Zeros (its first and last MiB read: reading maps the kernel's zero page, or with transparent huge
    # pages at most a few 2 MiB pages).
    assert int(buf[:MIB].abs().sum()) == 0 and int(buf[-MIB:].abs().sum()) == 0
    untouched = resident_mib() - before
    buf[: 32 * MIB] = 7
    written = resident_mib() - before
    assert untouched < 16, untouched  # reading zeros maps (nearly) nothing
    assert 32 <= written < 64, written  # writing 32 MiB makes those pages resident
    assert int(buf[32 * MIB - 1]) == 7 and int(buf[32 * MIB]) == 0


class Index:
    """A size as vLLM may compute it (a number type that is not ``int`` but can be one)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __index__(self) -> int:
        return self.n


def test_only_the_large_cpu_byte_buffer_is_lazy_everything_else_is_torchs(monkeypatch):
    made: list[int] = []
    real = kv_memory.lazy_zeros
    monkeypatch.setattr(kv_memory, "lazy_zeros", lambda n: made.append(n) or real(n))
    monkeypatch.setattr(kv_memory, "available_bytes", lambda: 1 << 40)
    t = kv_memory._LazyZerosTorch(torch)
    assert t.float32 is torch.float32 and t.Tensor is torch.Tensor  # every other name is torch's own
    big = kv_memory.MIN_BYTES
    lazy = t.zeros(big, dtype=torch.int8, device=torch.device("cpu"))
    assert lazy.numel() == big and not lazy.is_pinned() and int(lazy[-1]) == 0
    assert int(t.zeros(big, dtype=torch.int8, device="cpu")[0]) == 0  # a device named by a string too
    assert t.zeros(Index(big), dtype=torch.int8, device="cpu").numel() == big  # a size that is not an int
    assert made == [big, big, big]
    # torch's own: small, another dtype, two dimensions, another device, other options.
    assert t.zeros(16, dtype=torch.int8, device="cpu").numel() == 16
    assert t.zeros(big // 4, dtype=torch.float32, device="cpu").dtype is torch.float32
    assert t.zeros(2, big // 2, dtype=torch.int8, device="cpu").shape == (2, big // 2)
    assert t.zeros(big, dtype=torch.int8, device="meta").device.type == "meta"
    assert t.zeros(big, dtype=torch.int8, device="cpu", requires_grad=False).numel() == big
    assert t.zeros(3).tolist() == [0.0, 0.0, 0.0]
    assert made == [big, big, big]  # none of those


def test_a_host_without_room_for_two_caches_gets_vllms_eager_cache(monkeypatch, tmp_path):
    """A lazy cache leaves its memory free for the next engine's start-up check (vLLM's: the cache within
    the host's free memory), so a host with less than twice the cache available gets vLLM's own."""
    made: list[int] = []
    read = kv_memory.available_bytes
    monkeypatch.setattr(kv_memory, "lazy_zeros", lambda n: made.append(n))
    t = kv_memory._LazyZerosTorch(torch)
    big = kv_memory.MIN_BYTES
    monkeypatch.setattr(kv_memory, "available_bytes", lambda: 2 * big - 1)
    eager = t.zeros(big, dtype=torch.int8, device="cpu")
    assert made == [] and eager.numel() == big
    monkeypatch.setattr(kv_memory, "available_bytes", lambda: None)  # unknown: eager
    t.zeros(big, dtype=torch.int8, device="cpu")
    assert made == []
    monkeypatch.setattr(kv_memory, "available_bytes", lambda: 2 * big)
    t.zeros(big, dtype=torch.int8, device="cpu")
    assert made == [big]
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24576000 kB\nMemFree:  100 kB\nMemAvailable:   20480000 kB\n")
    assert read(str(meminfo)) == 20480000 * 1024
    meminfo.write_text("MemTotal: 1 kB\n")
    assert read(str(meminfo)) is None
    assert read(str(tmp_path / "none")) is None


def test_install_swaps_torch_in_vllms_allocation_module_once_and_only_when_asked(monkeypatch):
    stand_in = types.ModuleType("vllm.v1.worker.utils")
    stand_in.torch = torch
    stand_in.allocate_kv_cache = lambda *a, **k: None
    monkeypatch.setitem(sys.modules, "vllm.v1.worker.utils", stand_in)
    assert kv_memory.install(None) is False and stand_in.torch is torch
    assert kv_memory.install("0") is False and stand_in.torch is torch
    assert kv_memory.install("1") is True and isinstance(stand_in.torch, kv_memory._LazyZerosTorch)
    first = stand_in.torch
    assert kv_memory.install("1") is True and stand_in.torch is first  # not wrapped twice
    del stand_in.allocate_kv_cache
    other = types.ModuleType("vllm.v1.worker.utils")  # a vLLM without that allocation: left alone
    other.torch = torch
    monkeypatch.setitem(sys.modules, "vllm.v1.worker.utils", other)
    assert kv_memory.install("1") is False and other.torch is torch


def test_vllm_still_allocates_the_kv_cache_as_one_zeroed_byte_buffer():
    """What the swap relies on, read from the installed vLLM's source (importing it needs torch and more):
    its KV allocation makes one ``torch.zeros(size, dtype=torch.int8, device=device)`` buffer, and the CPU
    model runner allocates its cache through it (it does not override the GPU runner's allocation)."""
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.submodule_search_locations
    worker = Path(next(iter(spec.submodule_search_locations))) / "v1" / "worker"
    gpu, cpu = (worker / "gpu_model_runner.py").read_text(), (worker / "cpu_model_runner.py").read_text()
    alloc = gpu[gpu.index("    def initialize_kv_cache_tensors("):]
    assert "allocate_kv_cache(" in alloc[: alloc.index("\n    def ", 10)]
    assert "class CPUModelRunner(GPUModelRunner)" in cpu and "def initialize_kv_cache_tensors" not in cpu
    src = (worker / "utils.py").read_text()
    body = src[src.index("def allocate_kv_cache("):]
    body = body[: body.index("\ndef ")]
    assert re.search(r"^import torch$", src, re.M)
    assert len(re.findall(r"torch\.zeros\(", body)) == 1
    assert "torch.zeros(buf_size, dtype=torch.int8, device=device)" in body


def place(on_cpu: bool) -> EnginePlacement:
    return EnginePlacement(http_port=8100, side_channel_port=5600, side_channel_host="127.0.0.1",
                           engine_id="prefill-1", cores=[0] if on_cpu else [], on_cpu=on_cpu)


@pytest.mark.parametrize("lazy", [True, False])
def test_the_launcher_asks_for_it_on_cpu_engines_as_configured(lazy: bool):
    args = PDServeArgs.model_validate({"cpu": {"kv_cache_lazy": lazy}})
    env = engine_env(args, place(on_cpu=True), api_key="k")
    assert (env.get(KV_LAZY_ENV) == "1") is lazy
    gpu = engine_env(args, place(on_cpu=False), api_key="k")
    assert KV_LAZY_ENV not in gpu
