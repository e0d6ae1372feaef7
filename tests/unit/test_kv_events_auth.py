"""KV cache events beyond loopback travel behind CURVE: the plugin, the router and the launcher ask for it
(the real ZeroMQ sockets on 127.0.0.1: tests/component/test_kv_events_auth.py)."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.engine import vllm_plugin
from pdserve.router.kv_index import KvIndex, follow


def test_without_the_engines_key_the_plugin_refuses_to_publish(monkeypatch):
    monkeypatch.setenv(vllm_plugin.KV_EVENTS_CURVE_ENV, "1")
    monkeypatch.delenv(vllm_plugin.ENV_KEY, raising=False)
    with pytest.raises(RuntimeError, match="needs PDSERVE_ENGINE_KEY"):
        vllm_plugin.secure_kv_events()


def test_the_router_never_follows_tcp_events_without_a_key():
    with pytest.raises(ValueError, match="need the engine's key"):
        asyncio.run(follow(KvIndex(), "e", "tcp://127.0.0.1:1", asyncio.Event()))


def test_the_launcher_asks_for_curve_on_tcp_only():
    from pdserve.config.schema import PDServeArgs
    from pdserve.engine.launcher import EnginePlacement, engine_env
    from pdserve.errors import ConfigError

    args = PDServeArgs()

    def env(bind: str, key: str | None) -> dict[str, str]:
        placement = EnginePlacement(http_port=1, side_channel_port=2, side_channel_host="10.0.0.1",
                                    engine_id="e", cores=[0], on_cpu=True, kv_events_bind=bind)
        return engine_env(args, placement, api_key=key)

    assert env("tcp://*:5000", "k")[vllm_plugin.KV_EVENTS_CURVE_ENV] == "1"
    assert vllm_plugin.KV_EVENTS_CURVE_ENV not in env("ipc:///tmp/x.sock", "k")
    with pytest.raises(ConfigError):
        env("tcp://*:5000", None)
