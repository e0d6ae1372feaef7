"""The bf16 fidelity probe on the packaged model, for real (a subprocess loads it in float32 and bf16),
and the dtype `cpu.dtype: auto` picks from it on this host. Needs no running system."""

from __future__ import annotations

import pytest

from pdserve.config.schema import PDServeArgs
from pdserve.engine import cpu_host, dtype_fidelity
from pdserve.engine.cpu_dtype import model_fidelity, resolve_cpu_dtype
from pdserve.model.resolve import resolve_model

pytestmark = pytest.mark.integration


def test_the_packaged_model_is_measured_and_auto_takes_bf16_only_where_it_is_fast_and_faithful():
    args = PDServeArgs()
    resolve_model(None, cache_dir=args.cache_dir)  # prepared (the first start does the same)
    f = model_fidelity(args)
    assert f.tokens >= 300 and 0 <= f.disagreements <= f.tokens
    assert model_fidelity(args) == f  # cached: the same figures, not measured again
    speed = cpu_host.probe_matmul(args.cache_dir)
    out, reason = resolve_cpu_dtype(args)
    dtype = out.prefill_config.engine_kwargs["dtype"]
    fast = speed.bf16_ms <= speed.fp32_ms
    assert dtype == ("bfloat16" if fast and f.faithful else "float32"), reason
    if fast:
        assert dtype_fidelity.sentence(f) in reason
    print(f"{cpu_host.isa_label(speed.isa)}: {reason}")
