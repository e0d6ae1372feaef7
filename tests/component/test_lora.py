"""LoRA adapters through P/D: the router with fake engines on loopback (config, engine command and the
engines' resolver: tests/unit/test_lora.py)."""

from __future__ import annotations

from pathlib import Path

from pdserve.testing.fake_engine import expected_words
from tests.component.test_router import MODEL, System
from tests.unit.test_lora import adapter_dir


def LoraSystem(root: Path, adapters: set[str]) -> System:
    return System(adapters=adapters, lora_root=str(root))


def test_a_request_naming_an_adapter_runs_both_legs_with_it(tmp_path):
    adapter_dir(tmp_path, "sql")
    with LoraSystem(tmp_path, {"sql"}) as s:
        r = s.client.post("/v1/completions", json={"model": f"{MODEL}:sql", "prompt": "a b c", "max_tokens": 5})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == " ".join(expected_words("[sql] a b c", 5))
        assert [q["model"] for q in s.prefill[0].requests + s.decode[0].requests] == [f"{MODEL}:sql"] * 2
        assert s.decode[0].counters["pulled"] == 1  # the KV decode pulled was the adapter's
        base = s.client.post("/v1/completions", json={"model": MODEL, "prompt": "a b c", "max_tokens": 5})
        assert base.json()["choices"][0]["text"] == " ".join(expected_words("a b c", 5))
        with s.client.stream("POST", "/v1/chat/completions",
                             json={"model": f"{MODEL}:sql", "messages": [{"role": "user", "content": "a b c"}],
                                   "max_tokens": 4, "stream": True}) as st:
            assert st.status_code == 200
            list(st.iter_lines())
        assert s.prefill[0].requests[-1]["model"] == s.decode[0].requests[-1]["model"] == f"{MODEL}:sql"


def test_unknown_adapters_are_404_before_any_engine_and_models_lists_adapters(tmp_path):
    adapter_dir(tmp_path, "sql")
    with LoraSystem(tmp_path, {"sql"}) as s:
        for name in (f"{MODEL}:nope", f"{MODEL}:../sql", "other:sql"):
            r = s.client.post("/v1/completions", json={"model": name, "prompt": "a", "max_tokens": 2})
            assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", name
        assert s.prefill[0].requests == [] and s.decode[0].requests == []
        ids = [m["id"] for m in s.client.get("/v1/models").json()["data"]]
        assert ids == [MODEL, f"{MODEL}:sql"]
        card = s.client.get(f"/v1/models/{MODEL}:sql").json()
        assert card["parent"] == MODEL and card["root"] == str(tmp_path / "sql")
        assert s.client.get(f"/v1/models/{MODEL}:nope").status_code == 404
