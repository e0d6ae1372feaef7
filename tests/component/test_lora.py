"""LoRA adapters through P/D: the router with fake engines on loopback (config, engine command and the
engines' resolver: tests/unit/test_lora.py)."""

from __future__ import annotations

from pathlib import Path

import httpx

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


def test_one_tenants_long_streams_on_adapters_leave_a_batch_slot_for_another(tmp_path, monkeypatch):
    """vLLM's batch runs ``max_loras`` adapters at once and a request for another waits inside the engine
    until one ends. With tenants, a tenant alone holds at most all but one of an engine's slots: its request
    for one more adapter is a 429 ``lora_slots`` at once, a request on an adapter it already runs still goes,
    and another tenant's adapter takes the slot kept free."""
    import threading
    import time

    from pdserve.config.schema import RouterConfig
    from pdserve.router.build import build_router
    from pdserve.router.validate import EngineLimits
    from pdserve.testing.thread_server import ThreadServer

    for name in ("a1", "a2", "b1"):
        adapter_dir(tmp_path, name)
    monkeypatch.setenv("KEYS_BIG", "kbig")
    monkeypatch.setenv("KEYS_SMALL", "ksmall")
    with LoraSystem(tmp_path, {"a1", "a2", "b1"}) as s:
        s.decode[0].faults.delay_s = 3.0  # long answers hold their adapters' slots
        cfg = RouterConfig(prefill_timeout_s=5, decode_timeout_s=10, local_prefill_below_tokens=0, api_keys=["kop"],
                           tenants={"big": {"keys_env": "KEYS_BIG"}, "small": {"keys_env": "KEYS_SMALL"}})
        built = build_router(cfg, MODEL, endpoints=s.pool.endpoints(), limits=EngineLimits(max_loras=2),
                             lora_root=str(tmp_path))
        decode = next(e for e in s.pool.endpoints() if e.role == "decode")
        big, small = {"Authorization": "Bearer kbig"}, {"Authorization": "Bearer ksmall"}

        def body(adapter: str) -> dict:
            return {"model": f"{MODEL}:{adapter}", "prompt": "one two three", "max_tokens": 4}

        with ThreadServer(built.app) as srv, httpx.Client(base_url=srv.url, timeout=20) as c:
            codes: list[int] = []
            held = threading.Thread(target=lambda: codes.append(
                c.post("/v1/completions", json=body("a1"), headers=big).status_code))
            held.start()
            deadline = time.monotonic() + 10
            while decode.loras.running() < 1 and time.monotonic() < deadline:
                time.sleep(0.02)
            r = c.post("/v1/completions", json=body("a2"), headers=big)
            assert r.status_code == 429 and "LoRA batch slots" in r.json()["error"]["message"], r.text
            assert int(r.headers["retry-after"]) >= 1
            assert c.post("/v1/completions", json=body("b1"), headers=small).status_code == 200
            assert c.post("/v1/completions", json=body("a1"), headers=big).status_code == 200  # already running
            held.join()
            assert codes == [200] and decode.loras.running() == 0  # every slot given back
            assert c.post("/v1/completions", json=body("a2"), headers=big).status_code == 200
            metrics = c.get("/metrics?engines=0", headers={"Authorization": "Bearer kop"}).text
            assert 'pdserve_admission_refused_total{cause="lora_slots"} 1.0' in metrics


def test_a_continued_response_takes_the_adapter_slots_of_the_engine_that_keeps_it(tmp_path):
    """A Responses request that continues a stored one runs only where that one is kept: that engine's batch
    must be able to start its adapter, whatever the other engines run (it was checked against the others and
    then sent there anyway, to wait inside the engine)."""
    from pdserve.config.schema import RouterConfig
    from pdserve.router.build import build_router
    from pdserve.router.validate import EngineLimits
    from pdserve.testing.thread_server import ThreadServer

    adapter_dir(tmp_path, "sql")
    with System(n_decode=2, adapters={"sql"}, lora_root=str(tmp_path)) as s:
        cfg = RouterConfig(prefill_timeout_s=5, decode_timeout_s=10, local_prefill_below_tokens=0)
        built = build_router(cfg, MODEL, endpoints=s.pool.endpoints(), limits=EngineLimits(max_loras=2),
                             lora_root=str(tmp_path))
        body = {"model": f"{MODEL}:sql", "input": "a b", "max_output_tokens": 3}
        with ThreadServer(built.app) as srv, httpx.Client(base_url=srv.url, timeout=20) as c:
            first = c.post("/v1/responses", json=body)
            assert first.status_code == 200, first.text
            keeper = next(e for e in built.pool.endpoints("decode") if e.loras.running() == 0
                          and any(r.get("model") == f"{MODEL}:sql" for f in s.decode
                                  if f.engine_id == e.engine_id for r in f.requests))
            other = next(e for e in built.pool.endpoints("decode") if e is not keeper)
            gone = [keeper.loras.claim(name, "t") for name in ("z1", "z2")]  # its batch is full
            follow = {**body, "input": "more", "previous_response_id": first.json()["id"]}
            r = c.post("/v1/responses", json=follow)
            assert r.status_code == 429 and "LoRA" in r.json()["error"]["message"], r.text
            for give_back in gone:
                give_back()
            for name in ("z1", "z2"):
                other.loras.claim(name, "t")  # the other engine's batch is full: no matter
            assert c.post("/v1/responses", json=follow).status_code == 200
