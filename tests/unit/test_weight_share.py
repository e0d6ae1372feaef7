"""``cpu.share_weights``: the CPU engines of a host map one copy of each large weight from a file of the
weight cache (engine/weight_share.py), with stand-ins for vLLM's layers and its packing step; the
launcher's variable; and what the patch relies on in the installed vLLM's source."""

from __future__ import annotations

import importlib.util
import os
import types
from pathlib import Path

import pytest
import torch

from pdserve.config.schema import PDServeArgs
from pdserve.engine import weight_share
from pdserve.engine.launcher import EnginePlacement, build_engine_command
from pdserve.settings import PACKED_WEIGHTS_ENV, SHARED_WEIGHTS_ENV

MIB = 1 << 20


def weight(seed: int = 0, rows: int = 512, cols: int = 1024) -> torch.Tensor:  # 2 MiB of float32
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))


def test_two_engines_map_one_file_with_the_values_they_loaded(tmp_path):
    w = weight()
    a = weight_share.shared_copy(str(tmp_path), "model.layers.0.mlp.down_proj", w.clone())
    b = weight_share.shared_copy(str(tmp_path), "model.layers.0.mlp.down_proj", w.clone())
    assert a is not None and b is not None
    assert torch.equal(a, w) and torch.equal(b, w) and a.dtype == w.dtype and a.shape == w.shape
    files = [p for p in tmp_path.iterdir()]
    assert len(files) == 1 and files[0].stat().st_size == w.numel() * 4  # written once, no temporary left
    assert a.data_ptr() != b.data_ptr()  # two mappings (of the same page-cache pages)


def test_a_write_to_a_mapped_weight_stays_in_that_process_copy(tmp_path):
    w = weight()
    a = weight_share.shared_copy(str(tmp_path), "lm", w.clone())
    a[0, 0] = 1e6  # copy-on-write: neither the file nor another engine sees it
    b = weight_share.shared_copy(str(tmp_path), "lm", w.clone())
    assert b is not None and torch.equal(b, w) and float(a[0, 0]) == 1e6


@pytest.mark.parametrize("stale", ["other values", "other size"])
def test_a_file_left_by_another_model_is_replaced_not_used(tmp_path, stale: str):
    old = weight(seed=1) if stale == "other values" else weight(seed=1, rows=256)
    path = tmp_path / weight_share._file_name("x", weight())
    path.write_bytes(old.numpy().tobytes())
    w = weight()
    got = weight_share.shared_copy(str(tmp_path), "x", w.clone())
    assert got is not None and torch.equal(got, w)
    assert path.read_bytes() == w.numpy().tobytes()


def test_no_room_on_disk_leaves_the_weight_as_loaded(tmp_path, monkeypatch):
    monkeypatch.setattr(weight_share.shutil, "disk_usage", lambda p: types.SimpleNamespace(free=MIB))
    assert weight_share.shared_copy(str(tmp_path), "x", weight()) is None
    assert list(tmp_path.iterdir()) == []


class Layer(torch.nn.Module):
    """vLLM's linear layer as the packing step sees it: a named module with a 2-D weight parameter."""

    def __init__(self, prefix: str, w: torch.Tensor) -> None:
        super().__init__()
        self.prefix = prefix
        self.weight = torch.nn.Parameter(w, requires_grad=False)
        self.weight.weight_loader = "vLLM's attribute"


def test_a_shared_layer_computes_the_same_linear_on_its_mapped_weight(tmp_path):
    w = weight()
    layer = Layer("model.layers.3.self_attn.qkv_proj", w.clone())
    param = layer.weight
    assert weight_share.share_layer(layer, str(tmp_path)) is True
    assert layer.weight is param and param.weight_loader == "vLLM's attribute"  # same parameter, new storage
    assert torch.equal(layer.weight, w) and layer.weight.shape == w.shape
    assert layer.weight.t().is_contiguous()  # stored transposed: the layout F.linear streams fastest
    x = torch.randn(3, w.shape[1])
    assert torch.allclose(layer.cpu_linear(x, layer.weight, None), torch.nn.functional.linear(x, w), rtol=1e-5, atol=1e-3)
    (f,) = tmp_path.iterdir()
    assert f.name.endswith(".T.float32.1024x512.bin")
    tied = Layer("lm_head", w)
    tied.weight = param  # a tied output head meets the embedding's parameter again: nothing written twice
    writes = []
    real = weight_share._write
    weight_share._write = lambda *a: writes.append(a) or real(*a)  # type: ignore[assignment]
    try:
        assert weight_share.share_layer(tied, str(tmp_path)) is True
    finally:
        weight_share._write = real  # type: ignore[assignment]
    assert writes == [] and hasattr(tied, "cpu_linear")


@pytest.mark.parametrize("case", ["small", "unnamed", "3-D", "meta"])
def test_layers_it_does_not_share_are_left_to_vllm(tmp_path, case: str):
    w = {"small": torch.zeros(8, 8), "unnamed": weight(), "3-D": torch.zeros(64, 64, 64),
         "meta": torch.empty(512, 1024, device="meta")}[case]
    layer = Layer("" if case == "unnamed" else "model.norm", w)
    assert weight_share.share_layer(layer, str(tmp_path)) is False
    assert not hasattr(layer, "cpu_linear") and list(tmp_path.iterdir()) == []


def stand_in_utils(packed: list) -> types.ModuleType:
    """vLLM's ``layers/utils.py`` as the patch sees it: its packing step records the layer and sets its GEMM."""
    utils = types.ModuleType("vllm.model_executor.layers.utils")

    def pack(layer, remove_weight):
        packed.append(layer)
        layer.cpu_linear = torch.nn.functional.linear

    utils.dispatch_cpu_unquantized_gemm = pack
    return utils


def test_sharing_routes_vllms_packing_step_once(tmp_path):
    packed: list[object] = []
    utils = stand_in_utils(packed)
    assert weight_share.patch(utils, str(tmp_path)) is True
    patched = utils.dispatch_cpu_unquantized_gemm
    assert weight_share.patch(utils, str(tmp_path)) is True and utils.dispatch_cpu_unquantized_gemm is patched
    linear = Layer("model.layers.0.mlp.down_proj", weight(1))
    small = Layer("model.layers.0.o_proj", torch.zeros(4, 4))
    vocab = Layer("model.embed_tokens", weight(2))
    patched(linear, True)  # vLLM would drop its weight for a packed copy: shared (transposed), F.linear
    patched(small, True)
    patched(vocab, False)  # a vocabulary keeps its weight: shared for lookups, packed by vLLM at its first GEMM
    assert packed == [small]
    assert len(list(tmp_path.iterdir())) == 2 and getattr(vocab.weight, "_pdserve_shared", False)
    x = torch.randn(2, 1024)
    assert torch.equal(vocab.cpu_linear(x, vocab.weight, None), torch.nn.functional.linear(x, vocab.weight))
    assert packed == [small, vocab] and vocab.cpu_linear is torch.nn.functional.linear  # packed once, then vLLM's


def test_without_sharing_only_a_vocabularys_packing_waits_for_its_first_gemm():
    """Every CPU engine: vLLM packed the tied input embedding of the packaged model too, a copy no one used."""
    packed: list[object] = []
    utils = stand_in_utils(packed)
    assert weight_share.patch(utils, None) is True
    linear, embedding, head = Layer("l", weight(1)), Layer("model.embed_tokens", weight(2)), Layer("lm_head", weight(2))
    for layer, remove in ((linear, True), (embedding, False), (head, False)):
        utils.dispatch_cpu_unquantized_gemm(layer, remove)
    assert packed == [linear]  # linear layers as vLLM does it, at load
    x = torch.randn(2, 1024)
    head.cpu_linear(x, head.weight, None)  # the head's first GEMM (the engine's warm-up)
    assert packed == [linear, head] and not getattr(embedding.weight, "_pdserve_shared", False)
    assert weight_share.patch(types.ModuleType("other"), None) is False  # a vLLM without the step: untouched


def test_the_engine_fixes_patch_vllms_layers_as_they_are_imported():
    """sitecustomize (loaded by every CPU engine process) names the module; its patch applies this one."""
    from pdserve.engine.launcher import SITE_DIR

    src = (Path(SITE_DIR) / "sitecustomize.py").read_text()
    assert '"vllm.model_executor.layers.utils": _patch_weight_packing' in src
    assert "weight_share.patch(module, os.environ.get(weight_share.ENV_DIR))" in src


def test_directories_differ_by_model_not_by_dtype(tmp_path):
    a = weight_share.directory_for("/c", str(tmp_path / "m1"))
    assert a.startswith("/c/shared-weights/m1-") and a != weight_share.directory_for("/c", str(tmp_path / "m2"))
    # The dtype is in each file's name: one model's float32 and bfloat16 files do not meet.
    w = torch.zeros(4, 4)
    assert weight_share._file_name("x", w) != weight_share._file_name("x", w.to(torch.bfloat16))


def test_the_forkserver_gets_the_engines_value_before_the_dtype_is_decided(tmp_path):
    """The forkserver starts before ``cpu.dtype: auto`` is decided; an engine whose value differed from its
    own would start afresh (unforked, hundreds of MiB more)."""
    from pdserve.engine.local_forkserver import forkserver_env

    args = PDServeArgs.model_validate({"cpu": {"share_weights": True}, "cache_dir": str(tmp_path)})
    early = forkserver_env(args, "/models/m", local_only=True)
    for cfg in (args.prefill_config, args.decode_config):
        cfg.engine_kwargs["dtype"] = "float32"
    engine = build_engine_command("decode", args, "/models/m", place(on_cpu=True), api_key="k").env
    assert early[SHARED_WEIGHTS_ENV] == engine[SHARED_WEIGHTS_ENV]


def place(on_cpu: bool) -> EnginePlacement:
    return EnginePlacement(http_port=8100, side_channel_port=5600, side_channel_host="127.0.0.1",
                           engine_id="prefill-1", cores=[0] if on_cpu else [], on_cpu=on_cpu)


@pytest.mark.parametrize(("share", "fork", "expect"), [
    (True, True, SHARED_WEIGHTS_ENV), ("mapped", True, SHARED_WEIGHTS_ENV), ("packed", True, PACKED_WEIGHTS_ENV),
    (None, True, PACKED_WEIGHTS_ENV), ("packed", False, None), (False, True, None), ("off", True, None)])
def test_the_launcher_asks_for_it_on_cpu_engines_as_configured(tmp_path, share, fork: bool, expect):
    cpu = {"fork_engines": fork} | ({} if share is None else {"share_weights": share})
    args = PDServeArgs.model_validate({"cpu": cpu, "cache_dir": str(tmp_path),
                                       "prefill_config": {"engine_kwargs": {"dtype": "float32"}},
                                       "decode_config": {"engine_kwargs": {"dtype": "float32"}}})
    env = build_engine_command("prefill", args, "/models/m", place(on_cpu=True), api_key="k").env
    for var in (SHARED_WEIGHTS_ENV, PACKED_WEIGHTS_ENV):
        if var == expect:
            assert env[var] == weight_share.directory_for(str(tmp_path), "/models/m")
        else:
            assert var not in env
    gpu = build_engine_command("prefill", args, "/models/m", place(on_cpu=False), api_key="k").env
    assert SHARED_WEIGHTS_ENV not in gpu and PACKED_WEIGHTS_ENV not in gpu


def test_vllm_packs_cpu_weights_through_the_patched_step_and_computes_through_cpu_linear():
    """What the patch relies on, read from the installed vLLM's source: the unquantized linear and the
    vocabulary embedding (also the output head) look the packing step up in ``layers/utils.py`` when they
    process their weights on CPU, and the CPU GEMM calls ``layer.cpu_linear(x, weight, bias)``."""
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.submodule_search_locations
    layers = Path(next(iter(spec.submodule_search_locations))) / "model_executor" / "layers"
    for name in ("linear.py", "vocab_parallel_embedding.py"):
        src = (layers / name).read_text()
        assert "from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm" in src, name
        assert "dispatch_cpu_unquantized_gemm(layer, remove_weight=" in src, name
    utils = (layers / "utils.py").read_text()
    assert "def dispatch_cpu_unquantized_gemm(" in utils
    assert "return layer.cpu_linear(x, weight, bias)" in utils
    assert os.path.basename(weight_share.__file__) == "weight_share.py"
