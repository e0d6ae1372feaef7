"""The vLLM plugins that record expired KV leases (engine side) and serve them (API side)."""

from __future__ import annotations

import logging

import httpx
from fastapi import FastAPI

from pdserve.engine import vllm_plugin
from pdserve.engine.vllm_plugin import KvLeaseEndpoint, plugins_env, read_events, record_kv_lease_events

BASE = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker"
PULL = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker"


def test_lease_log_lines_become_events_and_are_served(tmp_path, monkeypatch):
    path = tmp_path / "ev" / "engine.log"
    monkeypatch.setenv(vllm_plugin.ENV_FILE, str(path))
    record_kv_lease_events()
    record_kv_lease_events()  # loaded again in another vLLM phase: still one filter
    assert sum(isinstance(f, vllm_plugin._LeaseEventFilter) for f in logging.getLogger(BASE).filters) == 1
    # The exact messages vLLM's NIXL worker logs.
    logging.getLogger(BASE).warning(
        "Releasing expired KV blocks for request %s which were retrieved by %d remote worker(s) before "
        "lease expired.", "cmpl-a-0", 0)
    logging.getLogger(PULL).error(
        "Potentially invalid KV blocks for unrecognized request %s were retrieved by a decode worker. "
        "They may have expired.", "cmpl-a-0")
    logging.getLogger(BASE).warning("Something else about request %s", "cmpl-b-0")
    assert read_events(str(path), "cmpl-a-0") == {"expired": True, "read_after_expiry": True}
    assert read_events(str(path), "cmpl-b-0") == {"expired": False, "read_after_expiry": False}

    app = FastAPI()
    KvLeaseEndpoint().attach_router(app)
    import asyncio

    async def get(rid: str) -> dict:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://e") as c:
            r = await c.get(f"/pdserve/kv-lease/{rid}")
            assert r.status_code == 200
            return r.json()

    assert asyncio.run(get("cmpl-a-0"))["expired"] is True
    assert asyncio.run(get("cmpl-zz"))["expired"] is False
    for name in (BASE, PULL):
        lg = logging.getLogger(name)
        lg.filters = [f for f in lg.filters if not isinstance(f, vllm_plugin._LeaseEventFilter)]


def test_events_file_rotates_and_old_events_stay_visible(tmp_path, monkeypatch):
    monkeypatch.setattr(vllm_plugin, "MAX_BYTES", 64)
    path = str(tmp_path / "e.log")
    for i in range(10):
        vllm_plugin.append_event(path, "expired", f"req-{i}")
    assert (tmp_path / "e.log.1").exists()
    assert read_events(path, "req-9")["expired"] and read_events(path, "req-5")["expired"]


def test_plugins_env_keeps_other_plugins_loading():
    assert plugins_env("mine,other") == "mine,other,pdserve_kv_lease,pdserve_lora"
    assert plugins_env("pdserve_kv_lease") == "pdserve_kv_lease,pdserve_lora"
    names = plugins_env(None).split(",")
    assert names[-2:] == ["pdserve_kv_lease", "pdserve_lora"]
    # Every installed general plugin is still allowed (naming any plugin makes VLLM_PLUGINS a list).
    from importlib.metadata import entry_points

    assert {e.name for e in entry_points(group="vllm.general_plugins")} <= set(names)


def test_the_engine_key_guard_fails_closed():
    """Only GET/HEAD of health and metrics pass without the key; OPTIONS, other methods on those paths, and
    every other path (the LoRA load/unload routes included) need it."""
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route
    from starlette.testclient import TestClient

    from pdserve.engine.vllm_plugin import EngineKeyGuard

    async def ok(request):
        return PlainTextResponse("ok")

    routes = [Route(p, ok, methods=["GET", "POST", "OPTIONS", "HEAD"])
              for p in ("/health", "/metrics", "/v1/models", "/v1/load_lora_adapter", "/tokenize")]
    client = TestClient(EngineKeyGuard(Starlette(routes=routes), key="k"))
    assert client.get("/health").status_code == 200 and client.get("/metrics").status_code == 200
    for method, path in (("OPTIONS", "/v1/models"), ("OPTIONS", "/health"), ("POST", "/health"),
                         ("POST", "/v1/load_lora_adapter"), ("POST", "/tokenize"), ("GET", "/v1/models")):
        assert client.request(method, path).status_code == 401, (method, path)
    assert client.post("/v1/load_lora_adapter", headers={"Authorization": "Bearer k"}).status_code == 200
    assert client.options("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
