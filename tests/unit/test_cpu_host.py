"""Host-aware CPU engines: the matmul probe, its cache, the dtype choice and where it is applied.

Every test here replaces the probe; tests/component/test_cpu_host.py times real matmuls once (about 2 s).
"""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest

from pdserve.config.schema import PDServeArgs
from pdserve.doctor import probes
from pdserve.doctor.checks import DoctorContext, check_cpu_dtype
from pdserve.engine import cpu_host
from pdserve.engine.cpu_dtype import resolve_cpu_dtype
from pdserve.engine.cpu_host import (
    CpuProbeError,
    MatmulProbe,
    choose_dtype,
    dtype_reason,
)
from pdserve.engine.cpu_host import probe_matmul as real_probe_matmul  # tests/unit/conftest.py fakes it
from pdserve.errors import ConfigError
from tests.unit.test_builder import _deployments

EPYC_CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7B13
flags\t\t: fpu vme sse sse2 avx fma f16c avx2 bmi2 sha_ni
processor\t: 1
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7B13
flags\t\t: fpu vme sse sse2 avx fma f16c avx2 bmi2 sha_ni
"""
_real_cpu_isa = cpu_host.cpu_isa  # some tests pretend to be another CPU
SPR_CPUINFO = """vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8488C
flags\t\t: fpu avx fma avx2 avx512f avx512bw avx512vl avx512_vnni avx512_bf16 amx_bf16 amx_tile amx_int8
"""


def avx2_probe(**kw) -> MatmulProbe:
    """The figures DESIGN.md quotes for the 2-core AMD EPYC (AVX2): bf16 6.4x slower."""
    return MatmulProbe(cpu_model="AMD EPYC 7B13", isa=["avx", "avx2", "fma", "f16c"], torch_version="2.13.0+cpu",
                       fp32_ms=75.0, bf16_ms=480.0, measured_at="2026-01-01T00:00:00+00:00", **kw)


def amx_probe() -> MatmulProbe:
    return MatmulProbe(cpu_model="Intel(R) Xeon(R) Platinum 8488C", isa=["avx2", "avx512f", "avx512_bf16", "amx_bf16"],
                       torch_version="2.13.0+cpu", fp32_ms=16.0, bf16_ms=6.4, measured_at="2026-01-01T00:00:00+00:00")


# -- the ISA and the choice ----------------------------------------------------------------------------


def test_cpu_isa_reads_model_vendor_and_the_flags_that_matter():
    epyc = cpu_host.cpu_isa(EPYC_CPUINFO)
    assert epyc == {"model": "AMD EPYC 7B13", "vendor": "AuthenticAMD", "flags": ["avx", "avx2", "fma", "f16c"],
                    "label": "AVX2"}
    spr = cpu_host.cpu_isa(SPR_CPUINFO)
    assert spr["vendor"] == "GenuineIntel" and spr["label"] == "AMX"
    assert {"avx512_bf16", "amx_bf16", "amx_tile"} <= set(spr["flags"]) and "fpu" not in spr["flags"]
    assert cpu_host.cpu_isa("") == {"model": "", "vendor": "", "flags": [], "label": "?"}
    # This host, whatever it is: a dict of the same shape, with no torch imported.
    assert set(cpu_host.cpu_isa()) == {"model", "vendor", "flags", "label"}


def test_slow_bf16_chooses_float32_and_says_why():
    p = avx2_probe()
    assert p.ratio == 6.4 and choose_dtype(p) == p.dtype == "float32"
    assert dtype_reason(p) == "bf16 matmul 6.4x slower than fp32 on this CPU (AMD EPYC 7B13, AVX2; 480 vs 75.0 ms) " \
                              "-> float32"


def test_fast_bf16_chooses_bfloat16_and_a_tie_goes_to_bf16():
    p = amx_probe()
    assert p.ratio == 0.4 and p.dtype == "bfloat16"
    assert dtype_reason(p) == ("bf16 matmul 2.5x faster than fp32 on this CPU (Intel(R) Xeon(R) Platinum 8488C, AMX; "
                               "6.4 vs 16.0 ms) -> bfloat16")
    tie = dataclasses.replace(p, bf16_ms=16.0)
    assert tie.dtype == "bfloat16" and "about as fast as" in dtype_reason(tie)
    assert dataclasses.replace(p, bf16_ms=16.5).dtype == "float32"


# -- applying it to a config ---------------------------------------------------------------------------


def _args(**sections) -> PDServeArgs:
    return PDServeArgs.model_validate(sections)


def test_auto_takes_the_probes_choice_for_both_roles_and_leaves_the_input_alone():
    args = _args(prefill_config={"engine_kwargs": {"max_model_len": 1024}})
    out, reason = resolve_cpu_dtype(args, probe=avx2_probe)
    assert out.prefill_config.engine_kwargs == {"max_model_len": 1024, "dtype": "float32"}
    assert out.decode_config.engine_kwargs == {"dtype": "float32"}
    assert reason.startswith("bf16 matmul 6.4x slower")
    assert "dtype" not in args.prefill_config.engine_kwargs and "dtype" not in args.decode_config.engine_kwargs
    out, reason = resolve_cpu_dtype(args, probe=amx_probe)
    assert out.prefill_config.engine_kwargs["dtype"] == out.decode_config.engine_kwargs["dtype"] == "bfloat16"
    # The resolved args are still a valid config (the replicas re-validate what the builder hands them).
    PDServeArgs.model_validate(out.model_dump(mode="json"))


def test_explicit_engine_kwargs_dtype_wins_without_probing():
    def no_probe() -> MatmulProbe:
        raise AssertionError("the probe must not run when the config decides")

    args = _args(prefill_config={"engine_kwargs": {"dtype": "bfloat16"}},
                 decode_config={"engine_kwargs": {"dtype": "bfloat16"}}, cpu={"dtype": "float32"})
    out, reason = resolve_cpu_dtype(args, probe=no_probe)
    assert out.prefill_config.engine_kwargs["dtype"] == out.decode_config.engine_kwargs["dtype"] == "bfloat16"
    assert reason == "engine_kwargs.dtype bfloat16 (set in the config)"

    out, reason = resolve_cpu_dtype(_args(cpu={"dtype": "bfloat16"}), probe=no_probe)
    assert out.prefill_config.engine_kwargs["dtype"] == out.decode_config.engine_kwargs["dtype"] == "bfloat16"
    assert reason == "cpu.dtype bfloat16 (set in the config)"


def test_cpu_dtype_accepts_only_the_three_values():
    from pdserve.config.loader import parse_args

    with pytest.raises(ConfigError, match="dtype"):
        parse_args({"cpu": {"dtype": "float16"}}, source="t")


def test_a_failed_probe_falls_back_to_the_cpu_flags(monkeypatch):
    def broken() -> MatmulProbe:
        raise CpuProbeError("the CPU matmul probe failed (exit 1): ModuleNotFoundError: No module named 'torch'")

    monkeypatch.setattr(cpu_host, "cpu_isa", lambda cpuinfo=None: _real_cpu_isa(EPYC_CPUINFO))
    out, reason = resolve_cpu_dtype(_args(), probe=broken)
    assert out.decode_config.engine_kwargs["dtype"] == "float32"
    assert "No module named 'torch'" in reason and reason.endswith("(AVX2) -> float32")
    monkeypatch.setattr(cpu_host, "cpu_isa", lambda cpuinfo=None: _real_cpu_isa(SPR_CPUINFO))
    out, reason = resolve_cpu_dtype(_args(), probe=broken)
    assert out.prefill_config.engine_kwargs["dtype"] == "bfloat16" and reason.endswith("-> bfloat16")
    assert "chose from the CPU flags (AMX)" in reason


@pytest.mark.parametrize("cpu_only", [True, False])
def test_builder_resolves_the_dtype_once_for_every_replica(monkeypatch, cpu_only):
    from pdserve.app import builder, placement

    calls = []

    def probe(cache_dir=None, *, refresh=False):
        calls.append(cache_dir)
        return avx2_probe()

    monkeypatch.setattr(placement, "cpu_only_cluster", lambda args=None: cpu_only)
    monkeypatch.setattr(cpu_host, "probe_matmul", probe)
    deps = _deployments(builder.build_pd_openai_app({"decode_config": {"deployment_config": {"num_replicas": 3}}}))
    plains = [deps["prefill"].init_args[1], deps["decode"].init_args[1], deps["router"].init_args[0]]
    for plain in plains:
        kws = [plain["prefill_config"]["engine_kwargs"], plain["decode_config"]["engine_kwargs"]]
        assert [k.get("dtype") for k in kws] == (["float32", "float32"] if cpu_only else [None, None])
    assert len(calls) == (1 if cpu_only else 0)


def test_builder_keeps_an_explicit_engine_dtype(monkeypatch):
    from pdserve.app import builder, placement

    monkeypatch.setattr(placement, "cpu_only_cluster", lambda args=None: True)
    monkeypatch.setattr(cpu_host, "probe_matmul", lambda cache_dir=None, *, refresh=False: amx_probe())
    kw = {"engine_kwargs": {"dtype": "float32"}}
    deps = _deployments(builder.build_pd_openai_app({"prefill_config": kw, "decode_config": kw}))
    plain = deps["prefill"].init_args[1]
    assert plain["prefill_config"]["engine_kwargs"]["dtype"] == plain["decode_config"]["engine_kwargs"]["dtype"] \
        == "float32"


def test_validate_show_engines_prints_the_dtype_and_why(tmp_path, capsys):
    from pdserve.cli.main import main

    cfg = tmp_path / "c.yaml"
    cfg.write_text("router: {policy: round_robin}\n")
    assert main(["validate", str(cfg), "--show-engines"]) == 0
    out = capsys.readouterr().out
    # tests/unit/conftest.py's probe: an AVX2-like host.
    assert "  dtype      float32 on CPU: bf16 matmul 6.4x slower than fp32" in out
    engines = [line for line in out.splitlines() if line.startswith(("  prefill:", "  decode:"))]
    assert len(engines) == 2 and all("--dtype float32" in line for line in engines)
    assert main(["validate", str(cfg), "--show-engines", "--gpu"]) == 0
    out = capsys.readouterr().out
    assert "--dtype" not in out and "  dtype " not in out


# -- the probe's cache ---------------------------------------------------------------------------------


@pytest.fixture
def counted_probe(monkeypatch):
    """Replaces the subprocess with a counter; returns the list of probes it made."""
    made: list[MatmulProbe] = []

    def run() -> MatmulProbe:
        made.append(avx2_probe())
        return made[-1]

    monkeypatch.setattr(cpu_host, "_run_probe", run)
    return made


def test_cache_miss_probes_and_a_hit_reads_the_file(tmp_path, counted_probe):
    first = real_probe_matmul(tmp_path)
    assert len(counted_probe) == 1 and first.dtype == "float32"
    stored = json.loads((tmp_path / "host" / "cpu-probe.json").read_text())
    assert stored["probes"][cpu_host.probe_key()]["bf16_ms"] == 480.0
    again = real_probe_matmul(tmp_path)
    assert len(counted_probe) == 1 and again == first
    real_probe_matmul(tmp_path, refresh=True)
    assert len(counted_probe) == 2


def test_default_cache_dir_is_pdserves_cache_root(tmp_path, monkeypatch, counted_probe):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "root"))
    real_probe_matmul()
    assert (tmp_path / "root" / "host" / "cpu-probe.json").is_file()


def test_another_cpu_or_torch_probes_again_and_keeps_both(tmp_path, monkeypatch, counted_probe):
    real_probe_matmul(tmp_path)
    monkeypatch.setattr(cpu_host, "cpu_isa", lambda cpuinfo=None: _real_cpu_isa(SPR_CPUINFO))
    real_probe_matmul(tmp_path)
    assert len(counted_probe) == 2
    monkeypatch.setattr(cpu_host, "_torch_version", lambda: "9.9.9")
    real_probe_matmul(tmp_path)
    real_probe_matmul(tmp_path)
    assert len(counted_probe) == 3
    # A cache shared by several hosts (a shared filesystem) keeps one entry per host and torch.
    assert len(json.loads((tmp_path / "host" / "cpu-probe.json").read_text())["probes"]) == 3


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", '{"probes": {"KEY": {"fp32_ms": -1}}}',
                                     '{"probes": "nope"}'])
def test_a_corrupt_cache_warns_and_probes_again(tmp_path, counted_probe, caplog, content):
    path = tmp_path / "host" / "cpu-probe.json"
    path.parent.mkdir(parents=True)
    path.write_text(content.replace("KEY", cpu_host.probe_key()))
    with caplog.at_level(logging.WARNING, logger="pdserve"):
        p = real_probe_matmul(tmp_path)
    assert p.dtype == "float32" and len(counted_probe) == 1
    if content != '{"probes": "nope"}':
        assert str(path) in caplog.text
    # Rewritten: the next call is a hit.
    real_probe_matmul(tmp_path)
    assert len(counted_probe) == 1


def test_an_unwritable_cache_still_answers(tmp_path, counted_probe, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with caplog.at_level(logging.WARNING, logger="pdserve"):
        assert real_probe_matmul(blocker).dtype == "float32"
    assert "cannot write" in caplog.text


# -- the engines' measured speed -----------------------------------------------------------------------


def test_engine_speed_round_trip(tmp_path, caplog):
    assert cpu_host.last_engine_speed(tmp_path) is None
    cpu_host.record_engine_speed(tmp_path, dtype="float32", prompt_tokens_per_s=190.26, role="prefill",
                                 model="smollm2-135m-instruct")
    rec = cpu_host.last_engine_speed(tmp_path)
    assert rec is not None and rec["prompt_tokens_per_s"] == 190.3 and rec["dtype"] == "float32"
    assert rec["role"] == "prefill" and rec["model"] == "smollm2-135m-instruct" and rec["measured_at"]
    (tmp_path / "host" / "engine-speed.json").write_text("{oops")
    with caplog.at_level(logging.WARNING, logger="pdserve"):
        assert cpu_host.last_engine_speed(tmp_path) is None
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    cpu_host.record_engine_speed(blocker, dtype="float32", prompt_tokens_per_s=1, role="prefill", model="m")


# -- pdserve doctor ------------------------------------------------------------------------------------


def _doctor_rows(monkeypatch, args: PDServeArgs, *, probe: MatmulProbe | None, speed=None, gpus=None):
    monkeypatch.setattr(probes, "nvidia_gpus", lambda: gpus)
    monkeypatch.setattr(probes, "cpu_matmul", lambda cache_dir=None: {
        "probe": probe, "error": None if probe else "the CPU matmul probe failed (exit 1): no torch"})
    monkeypatch.setattr(probes, "engine_speed", lambda cache_dir=None: speed)
    return {r.name: r for r in check_cpu_dtype(DoctorContext(args=args))}


def test_doctor_says_which_dtype_and_why(monkeypatch):
    rows = _doctor_rows(monkeypatch, _args(), probe=avx2_probe())
    row = rows["cpu: dtype"]
    assert row.status == "ok" and row.detail.startswith("bf16 matmul 6.4x slower than fp32 on this CPU")
    assert row.detail.endswith("-> float32") and row.data["dtype"] == "float32"
    speed = rows["cpu: prefill speed"]
    assert speed.status == "ok" and "not measured yet" in speed.detail and "pdserve serve" in speed.detail


def test_doctor_shows_the_last_measured_engine_speed(monkeypatch):
    rec = {"dtype": "float32", "prompt_tokens_per_s": 190.3, "role": "prefill", "model": "smollm2-135m-instruct",
           "cpu_model": "AMD EPYC 7B13", "isa": "AVX2", "measured_at": "2026-01-01T00:00:00+00:00"}
    row = _doctor_rows(monkeypatch, _args(), probe=avx2_probe(), speed=rec)["cpu: prefill speed"]
    assert row.status == "ok"
    assert row.detail == ("190 prompt tokens/s on one prefill engine (smollm2-135m-instruct, float32, "
                          "AMD EPYC 7B13, AVX2; measured 2026-01-01T00:00:00+00:00)")


def test_doctor_warns_when_the_config_pins_slow_bf16(monkeypatch):
    for args in (_args(cpu={"dtype": "bfloat16"}),
                 _args(prefill_config={"engine_kwargs": {"dtype": "bfloat16"}},
                       decode_config={"engine_kwargs": {"dtype": "bfloat16"}})):
        row = _doctor_rows(monkeypatch, args, probe=avx2_probe())["cpu: dtype"]
        assert row.status == "warn" and "6.4x slower" in row.detail and "auto" in row.fix
    # Pinned bf16 where bf16 is fast, or pinned fp32 anywhere: information only.
    assert _doctor_rows(monkeypatch, _args(cpu={"dtype": "bfloat16"}), probe=amx_probe())["cpu: dtype"].status == "ok"
    row = _doctor_rows(monkeypatch, _args(cpu={"dtype": "float32"}), probe=amx_probe())["cpu: dtype"]
    assert row.status == "ok" and row.detail.startswith("cpu.dtype float32") and "(auto: bfloat16)" in row.detail


def test_doctor_on_a_failed_probe_and_on_a_gpu_host(monkeypatch):
    row = _doctor_rows(monkeypatch, _args(), probe=None)["cpu: dtype"]
    assert row.status == "warn" and "no torch" in row.detail and "import torch" in row.fix
    gpu = [{"index": "0", "name": "L4", "memory_mib": 23034, "driver": "550"}]
    rows = _doctor_rows(monkeypatch, _args(), probe=avx2_probe(), gpus=gpu)
    assert [r.status for r in rows.values()] == ["skip"]
