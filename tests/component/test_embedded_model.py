"""The packaged model prepared from nothing, as on a fresh host: every library the conversion needs is
installed by `make setup` (transformers reads GGUF only with accelerate present, which nothing imports by
name)."""

from __future__ import annotations

import json

from pdserve.model.embedded import is_prepared, prepare_embedded_model


def test_the_packaged_model_converts_into_an_empty_cache(tmp_path):
    said: list[str] = []
    out = prepare_embedded_model(said.append, root=tmp_path)
    assert is_prepared(out) and out.is_relative_to(tmp_path)
    assert said and "safetensors" in " ".join(said)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 30
    assert any(p.suffix == ".safetensors" for p in out.iterdir())
    import gguf  # the conversion's reader read the file once, and is gguf's own again after it

    assert isinstance(gguf.GGUFReader, type) and not hasattr(gguf.get_tensor_name_map, "cache_info")
