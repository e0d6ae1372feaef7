"""The real CPU probe: it times matmuls in a subprocess (about 2 s) and caches what it measured."""

import json
import sys

import pytest

from pdserve.engine import cpu_host
from pdserve.engine.cpu_host import probe_matmul as real_probe_matmul  # tests/component/conftest.py fakes it


def test_the_real_probe_runs_in_a_subprocess(tmp_path):
    had_torch = "torch" in sys.modules
    p = real_probe_matmul(tmp_path)
    assert had_torch or "torch" not in sys.modules
    isa = cpu_host.cpu_isa()
    assert p.cpu_model == isa["model"] and p.isa == isa["flags"]
    assert p.fp32_ms > 0 and p.bf16_ms > 0
    assert p.ratio == pytest.approx(p.bf16_ms / p.fp32_ms, rel=1e-2)
    assert p.dtype == ("bfloat16" if p.bf16_ms <= p.fp32_ms else "float32")
    assert p.torch_version and p.measured_at and p.shape == [1500, 576, 1536]
    assert cpu_host.probe_key() in json.loads((tmp_path / "host" / "cpu-probe.json").read_text())["probes"]
