"""``cpu.share_weights: packed``: what the forkserver packs and when an engine may use an inherited copy
(engine/prepack.py). vLLM's real packing, across a real fork: tests/component/test_launcher.py."""

from __future__ import annotations

import os

import pytest

from pdserve.config.schema import PDServeArgs
from pdserve.engine import prepack


@pytest.mark.parametrize(("args", "dtype"), [
    (["--model", "m", "--dtype", "float32"], "float32"), (["--dtype=bfloat16"], "bfloat16"),
    (["--dtype", "auto"], None), (["--model", "m"], None), (["--dtype"], None), (["--dtype="], None)])
def test_the_engines_dtype_is_read_from_its_command_line(args, dtype):
    assert prepack.dtype_of(args) == dtype


def test_nothing_is_packed_without_a_directory_a_dtype_or_files(tmp_path, monkeypatch):
    monkeypatch.setattr(prepack, "_packed", {})
    (tmp_path / "l.T.float32.4x4.bin").write_bytes(b"\0" * 64)
    prepack.prepare({}, ["--dtype", "float32"])
    prepack.prepare({prepack.ENV_DIR: str(tmp_path)}, ["--dtype", "auto"])
    prepack.prepare({prepack.ENV_DIR: str(tmp_path / "absent")}, ["--dtype", "float32"])
    prepack.prepare({prepack.ENV_DIR: str(tmp_path)}, ["--dtype", "bfloat16"])  # (the file is float32)
    assert prepack.packed_count() == 0


def test_an_inherited_copy_is_used_only_while_its_file_is_the_one_packed(tmp_path, monkeypatch):
    path = tmp_path / "l.T.float32.4x4.bin"
    path.write_bytes(b"\0" * 64)
    handler = object()
    monkeypatch.setattr(prepack, "_packed", {str(path): prepack.Packed(handler, prepack._stamp(str(path)))})
    assert prepack.inherited(str(path)) is handler
    assert prepack.inherited(str(tmp_path / "other.bin")) is None
    os.unlink(path)
    path.write_bytes(b"\1" * 64)  # another engine replaced the file: another inode
    assert prepack.inherited(str(path)) is None


@pytest.mark.parametrize(("given", "read"), [(True, "mapped"), (False, "off"), ("packed", "packed"),
                                             ("mapped", "mapped"), ("off", "off"), (None, "packed")])
def test_share_weights_takes_the_three_modes_and_the_old_booleans(given, read):
    cpu = {} if given is None else {"share_weights": given}
    assert PDServeArgs.model_validate({"cpu": cpu}).cpu.share_weights == read


def test_share_weights_refuses_other_values():
    with pytest.raises(ValueError, match="share_weights"):
        PDServeArgs.model_validate({"cpu": {"share_weights": "both"}})
