"""LoRA through P/D with real engines: a random adapter made offline for the packaged model, named as Ray
Serve LLM names them (``<model_id>:<adapter>``), loaded by both engines on first use."""

from __future__ import annotations

import json
import random

import httpx
import pytest

from tests import sse
from tests.integration.conftest import LORA_ADAPTER, ServeProcess, engine_auth
from tests.integration.test_pd_real import MODEL, post_ok

pytestmark = pytest.mark.integration

ADAPTED = f"{MODEL}:{LORA_ADAPTER}"


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(200, 40000) for _ in range(n)]


def _ids(answer: dict) -> list[int]:
    return answer["choices"][0]["token_ids"]


def test_pd_with_an_adapter_equals_one_engine_with_it_and_differs_from_the_base(served: ServeProcess):
    prefill_url = served.engine_url("prefill")
    for n, seed in ((40, 1), (300, 2)):
        body = {"model": ADAPTED, "prompt": _prompt(n, seed), "max_tokens": 16, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True}
        # The reference first: the prefill engine alone computes the whole answer with the adapter, so the
        # P/D request's decode leg has never seen this prompt and must pull the adapter's KV.
        single = post_ok(prefill_url + "/v1/completions", body)
        pd = post_ok(served.url + "/v1/completions", body)
        base = post_ok(served.url + "/v1/completions", {**body, "model": MODEL})
        assert _ids(pd) == _ids(single), f"{n}-token prompt: P/D with the adapter != one engine with it"
        assert _ids(pd) != _ids(base), "the adapter changed nothing: the test would not see a lost adapter"
        assert pd["model"] == ADAPTED


def test_streamed_chat_with_an_adapter_equals_the_whole_answer(served: ServeProcess):
    body = {"model": ADAPTED, "messages": [{"role": "user", "content": "Name three rivers."}], "max_tokens": 12,
            "temperature": 0}
    whole = post_ok(served.url + "/v1/chat/completions", body)["choices"][0]["message"]["content"]
    with httpx.stream("POST", served.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=300) as r:
        assert r.status_code == 200
        assert sse.read(r.iter_lines()).text == whole


def test_adapters_are_listed_and_unknown_ones_are_404(served: ServeProcess):
    ids = [m["id"] for m in httpx.get(served.url + "/v1/models", timeout=30).json()["data"]]
    assert ids == [MODEL, ADAPTED]
    assert httpx.get(f"{served.url}/v1/models/{ADAPTED}", timeout=30).json()["parent"] == MODEL
    r = httpx.post(served.url + "/v1/completions", json={"model": f"{MODEL}:missing", "prompt": "a",
                                                         "max_tokens": 2}, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    # An engine asked for an adapter that is not in the store answers 404 itself (its resolver finds none).
    url = served.engine_url("decode")
    r = httpx.post(url + "/v1/completions", json={"model": f"{MODEL}:missing", "prompt": "a", "max_tokens": 2},
                   headers=engine_auth(url), timeout=30)
    assert r.status_code == 404


def test_hostile_adapter_names_and_files_are_refused_and_engines_live_on(served: ServeProcess, lora_store):
    """Names that mean something to a store or a URL parser never reach an engine; an adapter whose tensors
    are bigger than the rank its config states (vLLM checks only the config; such a file killed engines)
    is refused by the engines' resolver, and both engines go on answering."""
    import shutil

    from tests.unit.test_lora import safetensors

    before = {e["url"] for e in served.status()["engines"]}
    for name in ("random-r8?versionId=1", "random-r8#x", "rand*", "random%2Dr8"):
        r = httpx.post(served.url + "/v1/completions", timeout=30,
                       json={"model": f"{MODEL}:{name}", "prompt": "a", "max_tokens": 2})
        assert r.status_code == 404, (name, r.text)
    cfg = json.loads((lora_store / LORA_ADAPTER / "adapter_config.json").read_text())
    bad = lora_store / "oversized"
    bad.mkdir()
    try:
        (bad / "adapter_config.json").write_text(json.dumps({**cfg, "r": 8}))
        hidden, layers = 576, 30  # SmolLM2-135M
        shapes = {}
        for layer in range(layers):
            key = f"base_model.model.model.layers.{layer}.self_attn.q_proj"
            shapes[f"{key}.lora_A.weight"] = [64, hidden]
            shapes[f"{key}.lora_B.weight"] = [hidden, 64]
        (bad / "adapter_model.safetensors").write_bytes(safetensors(shapes))
        r = httpx.post(served.url + "/v1/completions", timeout=60,
                       json={"model": f"{MODEL}:oversized", "prompt": "a", "max_tokens": 2})
        assert r.status_code == 404, r.text
    finally:
        shutil.rmtree(bad)
    ok = post_ok(served.url + "/v1/completions", {"model": ADAPTED, "prompt": "Hello", "max_tokens": 4})
    assert ok["choices"][0]["text"] is not None
    assert {e["url"] for e in served.status()["engines"]} == before, "an engine was replaced"
