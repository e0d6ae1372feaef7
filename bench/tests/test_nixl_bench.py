"""The kv-transfer scenario's plan: host memory by default, GPU memory with ``memory=VRAM``."""

from __future__ import annotations

import pytest

from pdserve_bench.nixl_bench import SIZES_MB, VRAM_SIZES_MB, measure_kv_transfer
from pdserve_bench.plan import Plan


def test_vram_transfers_are_planned_larger_against_the_gpus_own_copy_and_bad_memory_is_refused():
    dram = measure_kv_transfer(plan=Plan("kv-transfer", dry_run=True))
    vram = measure_kv_transfer(plan=Plan("kv-transfer", dry_run=True), memory="VRAM")
    assert dram["settings"]["sizes_mb"] == list(SIZES_MB) and dram["settings"]["memory"] == "DRAM"
    assert vram["settings"]["sizes_mb"] == list(VRAM_SIZES_MB) and vram["settings"]["memory"] == "VRAM"
    assert all(s["argv"][-1] == "VRAM" for s in vram["systems"])
    assert all("device-to-device" in p["against"] for p in vram["phases"])
    with pytest.raises(ValueError, match="DRAM, VRAM"):
        measure_kv_transfer(plan=Plan("kv-transfer", dry_run=True), memory="HBM")
