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


def test_an_adapter_the_decode_batch_cannot_start_is_refused_at_once(served: ServeProcess, lora_store):
    """vLLM's batch runs ``max_loras`` adapters at once (4 here) and a request for a fifth waits inside the
    engine until a stream holding one ends. With streams on four adapters running, the router answers a
    fifth adapter's request 429 ``lora_slots`` at once (before, it was sent and waited there), still sends
    one on a running adapter, and takes the fifth once the streams have ended."""
    import shutil
    import threading
    import time

    names = [f"slot{i}" for i in range(4)]
    for name in names:
        shutil.copytree(lora_store / LORA_ADAPTER, lora_store / name, dirs_exist_ok=True)
    codes: list[int] = []
    stop = threading.Event()

    def hold(name: str) -> None:
        """Streams on ``name``, one after another, until ``stop``. (Short answers: admission bounds what a
        fourth stream slows the others by.)"""
        body = {"model": f"{MODEL}:{name}", "prompt": _prompt(40, 7), "max_tokens": 40, "ignore_eos": True,
                "temperature": 0, "stream": True}
        while not stop.is_set():
            with httpx.stream("POST", served.url + "/v1/completions", json=body, timeout=300) as r:
                if r.status_code == 429:  # admission asks it to wait while the others run
                    time.sleep(min(2.0, float(r.headers.get("retry-after", 1))))
                    continue
                codes.append(r.status_code)
                for _ in r.iter_lines():
                    pass

    def running() -> int:
        return max((e.get("lora_adapters_running", 0) for e in served.status()["engines"]
                    if e["role"] == "decode"), default=0)

    fifth = {"model": ADAPTED, "prompt": _prompt(40, 8), "max_tokens": 4, "temperature": 0}
    threads = [threading.Thread(target=hold, args=(name,)) for name in names]
    refused = None
    try:
        for name in names:  # both engines load the four adapters first: the streams then start together
            post_ok(served.url + "/v1/completions", {**fifth, "model": f"{MODEL}:{name}", "max_tokens": 2})
        for t in threads:
            t.start()
        deadline = time.monotonic() + 240
        while refused is None and time.monotonic() < deadline:
            if running() < 4:
                time.sleep(0.1)
                continue
            # Four adapters run: the fifth must be refused, unless a stream ended between the two calls.
            r = httpx.post(served.url + "/v1/completions", json=fifth, timeout=60)
            if r.status_code == 429 and "max_loras" in r.json()["error"]["message"]:
                refused = r
        assert refused is not None, f"no fifth adapter was refused while four ran ({len(codes)} streams)"
        same = post_ok(served.url + "/v1/completions", {**fifth, "model": f"{MODEL}:{names[0]}"})
        assert same["choices"][0]["text"] is not None
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=300)
        for name in names:
            shutil.rmtree(lora_store / name, ignore_errors=True)
    assert codes and set(codes) == {200}
    deadline = time.monotonic() + 60  # (the slots come back as the router sees each stream end)
    while running() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert running() == 0
    assert post_ok(served.url + "/v1/completions", fifth)["model"] == ADAPTED
