"""The benchmarks' unit tests: self-contained, on pdserve's test harnesses (pdserve.testing). Nothing here
reaches a model hub or times real matmuls."""

from __future__ import annotations

import os

import pytest

from pdserve.testing.cpu_probe import stub_cpu_probes

# Never reach a model hub from tests: everything runs on the packaged model or fakes.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(autouse=True)
def _no_real_cpu_probe(monkeypatch):
    """A scenario's dry run resolves ``cpu.dtype: auto``; the probes would time matmuls in a subprocess."""
    stub_cpu_probes(monkeypatch)
