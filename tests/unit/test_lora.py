"""LoRA adapters through P/D: config, engine command and the engines' resolver (the router with fake engines:
tests/component/test_lora.py)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from pdserve.config.schema import PDServeArgs
from pdserve.engine import lora


def adapter_dir(root: Path, name: str) -> Path:
    d = root / name
    d.mkdir(parents=True)
    (d / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
    return d


def safetensors(shapes: dict[str, list[int]]) -> bytes:
    """A safetensors file of zeros (float32) with these tensors."""
    import struct

    header, offset = {}, 0
    for name, shape in shapes.items():
        n = 4 * shape[0] * shape[1]
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + b"\0" * offset


def lora_args(path: str, decode_path: str | None = None) -> dict:
    return {"prefill_config": {"lora_config": {"dynamic_lora_loading_path": path}},
            "decode_config": {"lora_config": {"dynamic_lora_loading_path": decode_path or path}}}


def test_lora_config_as_ray_serve_llm_writes_it(tmp_path):
    args = PDServeArgs.model_validate(lora_args(str(tmp_path) + "/"))
    assert args.prefill_config.lora_config.dynamic_lora_loading_path == str(tmp_path)
    assert args.prefill_config.lora_config.max_num_adapters_per_replica == 16
    assert PDServeArgs.model_validate(lora_args(f"file://{tmp_path}")).decode_config.lora_config \
        .dynamic_lora_loading_path == str(tmp_path)
    s3 = PDServeArgs.model_validate(lora_args("s3://bucket/adapters"))
    assert s3.prefill_config.lora_config.dynamic_lora_loading_path == "s3://bucket/adapters"
    for bad, match in ((lora_args("relative/dir"), "must be absolute"), (lora_args("ftp://x/y"), "unknown scheme"),
                       (lora_args("/a", "/b"), "same dynamic_lora_loading_path"),
                       ({"prefill_config": {"lora_config": {"dynamic_lora_loading_path": "/a"}}},
                        "same dynamic_lora_loading_path"),
                       (lora_args(""), "is required")):
        with pytest.raises(ValidationError, match=match):
            PDServeArgs.model_validate(bad)


def test_engines_load_adapters_on_first_use(tmp_path):
    from pdserve.engine.launcher import EnginePlacement, build_engine_command

    args = PDServeArgs.model_validate({**lora_args(str(tmp_path)), "cache_dir": str(tmp_path / "cache")})
    pl = EnginePlacement(http_port=8100, side_channel_port=5600, side_channel_host="127.0.0.1",
                         engine_id="e-prefill", cores=[0], on_cpu=True)
    for role in ("prefill", "decode"):
        cmd = build_engine_command(role, args, "/models/m", pl)  # type: ignore[arg-type]
        argv = " ".join(cmd.argv)
        assert "--enable-lora" in cmd.argv and "--max-cpu-loras 16" in argv and "--max-loras 4" in argv
        assert cmd.env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
        assert cmd.env[lora.ENV_PATH] == str(tmp_path) and cmd.env[lora.ENV_MODEL] == args.model_id
        assert cmd.env[lora.ENV_CACHE] == str(tmp_path / "cache")
        assert "pdserve_lora" in cmd.env["VLLM_PLUGINS"].split(",")
    plain = build_engine_command("decode", PDServeArgs(), "/models/m", pl)
    assert "--enable-lora" not in plain.argv and lora.ENV_PATH not in plain.env


def test_adapter_names_resolve_to_directories_and_never_outside(tmp_path):
    adapter_dir(tmp_path, "sql")
    adapter_dir(tmp_path, "team:v2")  # Ray's ids may hold colons
    (tmp_path / "notes").mkdir()
    assert lora.adapter_of("m", "m:sql") == "sql" and lora.adapter_of("m", "m:team:v2") == "team:v2"
    for bad in ("m", "other:sql", "m:", "m:../x", "m:a/b", "m:.hidden", "m:..", "m:a\\b",
                # meaningful to remote stores and URL or glob parsers
                "m:sql?versionId=1", "m:sql#x", "m:sq*", "m:sql%2F", "m:a b", "m:" + "a" * 129):
        assert lora.adapter_of("m", bad) is None, bad
    assert lora.list_local_adapters(str(tmp_path)) == ["sql", "team:v2"]
    r = lora.AdapterResolver(str(tmp_path), "m", str(tmp_path / "cache"))
    assert r.path_of("m:sql") == str(tmp_path / "sql")
    assert r.path_of("m:notes") is None and r.path_of("m:missing") is None and r.path_of("m:../sql") is None
    pytest.importorskip("vllm")
    got = asyncio.run(r.resolve_lora("/models/m", "m:sql"))
    assert got.lora_name == "m:sql" and got.lora_path == str(tmp_path / "sql")
    assert asyncio.run(r.resolve_lora("/models/m", "m:missing")) is None


def test_remote_stores_are_copied_once_checked_again_and_bounded(tmp_path, monkeypatch):
    import fsspec

    fs = fsspec.filesystem("memory")
    weights = safetensors({"x.q_proj.lora_A.weight": [8, 16], "x.q_proj.lora_B.weight": [16, 8]})
    fs.pipe("/store/sql/adapter_config.json", json.dumps({"peft_type": "LORA", "r": 8}).encode())
    fs.pipe("/store/sql/adapter_model.safetensors", weights)
    r = lora.AdapterResolver("memory://store", "m", str(tmp_path))
    path = r.path_of("m:sql")
    assert path is not None and Path(path, "adapter_model.safetensors").read_bytes() == weights
    copies: list[str] = []
    get = fs.get
    monkeypatch.setattr(fs, "get", lambda *a, **kw: (copies.append(a[0]), get(*a, **kw))[1])
    assert r.path_of("m:sql") == path and copies == []  # unchanged in the store: the copy is reused
    bigger = safetensors({"x.q_proj.lora_A.weight": [8, 32], "x.q_proj.lora_B.weight": [16, 8]})
    fs.pipe("/store/sql/adapter_model.safetensors", bigger)
    assert r.path_of("m:sql") == path and len(copies) == 1  # changed in the store: copied again
    assert Path(path, "adapter_model.safetensors").read_bytes() == bigger
    fs.rm("/store/sql", recursive=True)
    assert r.path_of("m:sql") is None  # gone from the store: gone for the engines
    assert r.path_of("m:gone") is None
    # at most CACHE_MAX_ADAPTERS copies per store, the least recently resolved evicted, never one a running
    # engine resolved (vLLM loads it from there again whenever its worker evicted it: a missing one is fatal)
    monkeypatch.setattr(lora, "CACHE_MAX_ADAPTERS", 2)
    for name in ("a", "b", "c", "d"):
        fs.pipe(f"/store/{name}/adapter_config.json", json.dumps({"peft_type": "LORA", "r": 8}).encode())
        fs.pipe(f"/store/{name}/adapter_model.safetensors", weights)
    pa = r.path_of("m:a")
    r.path_of("m:b")
    import os
    import time as _t
    os.utime(Path(pa, lora.SOURCE_FILE), (_t.time() + 5, _t.time() + 5))  # a: resolved last
    r.path_of("m:c")

    def copies_kept() -> list[str]:
        return sorted(n for n in os.listdir(Path(pa).parent) if not n.startswith("."))

    assert copies_kept() == ["a", "b", "c", "sql"]  # this engine resolved them all: none goes while it runs
    for f in lora._IN_USE.values():  # the engine that resolved them ends
        f.close()
    lora._IN_USE.clear()
    r.path_of("m:d")
    assert copies_kept() == ["a", "d"]
    for f in lora._IN_USE.values():
        f.close()
    lora._IN_USE.clear()
    fs.rm("/store", recursive=True)


def test_an_adapter_whose_tensors_exceed_its_stated_rank_is_refused(tmp_path):
    """vLLM checks the config's rank only; bigger tensors killed engines."""
    good = adapter_dir(tmp_path, "good")
    (good / "adapter_model.safetensors").write_bytes(
        safetensors({"l.q_proj.lora_A.weight": [8, 16], "l.q_proj.lora_B.weight": [16, 8]}))
    bad = adapter_dir(tmp_path, "bad")
    (bad / "adapter_model.safetensors").write_bytes(
        safetensors({"l.q_proj.lora_A.weight": [64, 16], "l.q_proj.lora_B.weight": [16, 64]}))
    patterned = adapter_dir(tmp_path, "patterned")
    cfg = json.loads((patterned / "adapter_config.json").read_text())
    (patterned / "adapter_config.json").write_text(json.dumps({**cfg, "rank_pattern": {"v_proj": 4}}))
    (patterned / "adapter_model.safetensors").write_bytes(
        safetensors({"l.q_proj.lora_A.weight": [8, 16], "l.v_proj.lora_A.weight": [4, 16],
                     "l.v_proj.lora_B.weight": [16, 4]}))
    r = lora.AdapterResolver(str(tmp_path), "m", str(tmp_path / "cache"))
    assert r.path_of("m:good") == str(good) and r.path_of("m:patterned") == str(patterned)
    assert r.path_of("m:bad") is None
    from pdserve.config.lora import check_adapter_shapes

    assert "not rank 8" in check_adapter_shapes(str(bad))
