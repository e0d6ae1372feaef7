"""KV cache events beyond loopback travel behind CURVE: only a router holding the engine's key reads them
(real ZeroMQ sockets on 127.0.0.1; the engine side is pdserve's vLLM plugin patching vLLM's publisher).
What each side asks for, without sockets: tests/unit/test_kv_events_auth.py."""

from __future__ import annotations

import socket
import time

import zmq

from pdserve.engine import vllm_plugin
from pdserve.settings import kv_events_curve_keys


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _received(sub: zmq.Socket, pub: zmq.Socket, seconds: float = 1.5) -> bool:
    """Publish for ``seconds`` (a subscriber joins late); whether ``sub`` got anything."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        pub.send_multipart([b"", b"\0" * 8, b"hello"])
        if sub.poll(50):
            return True
    return False


def _sub(ctx: zmq.Context, address: str, engine_key: str | None) -> zmq.Socket:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.LINGER, 0)
    if engine_key is not None:
        keys = kv_events_curve_keys(engine_key)
        sub.curve_serverkey = keys["server_public"]
        sub.curve_publickey, sub.curve_secretkey = keys["client_public"], keys["client_secret"]
    sub.connect(address)
    return sub


def test_only_a_subscriber_with_the_engines_key_reads_its_events():
    ctx = zmq.Context()
    try:
        pub = ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        vllm_plugin.curve_bind(pub, "the-engine-key")
        address = f"tcp://127.0.0.1:{_port()}"
        pub.bind(address)
        stranger = _sub(ctx, address, None)
        other_key = _sub(ctx, address, "another-engines-key")
        router = _sub(ctx, address, "the-engine-key")
        assert _received(router, pub)
        assert not _received(stranger, pub, 0.5) and not _received(other_key, pub, 0.5)
        for s in (pub, stranger, other_key, router):
            s.close(linger=0)
    finally:
        vllm_plugin._authenticators.pop(id(ctx)).stop()
        ctx.term()


def test_the_plugin_makes_vllms_publisher_bind_tcp_only_as_a_curve_server(monkeypatch):
    from vllm.distributed import kv_events

    monkeypatch.setenv(vllm_plugin.KV_EVENTS_CURVE_ENV, "1")
    monkeypatch.setenv(vllm_plugin.ENV_KEY, "k")
    monkeypatch.setattr(kv_events.ZmqEventPublisher, "_bind", kv_events.ZmqEventPublisher._bind)
    monkeypatch.setattr(kv_events.ZmqEventPublisher, "_pdserve_curve", False, raising=False)
    vllm_plugin.secure_kv_events()
    vllm_plugin.secure_kv_events()  # once only
    ctx = zmq.Context()
    try:
        tcp, ipc = ctx.socket(zmq.PUB), ctx.socket(zmq.PUB)
        kv_events.ZmqEventPublisher._bind(tcp, f"tcp://127.0.0.1:{_port()}")
        assert tcp.curve_server
        kv_events.ZmqEventPublisher._bind(ipc, "inproc://kv")
        assert not ipc.curve_server  # local endpoints are not touched
        tcp.close(linger=0)
        ipc.close(linger=0)
    finally:
        auth = vllm_plugin._authenticators.pop(id(ctx), None)
        if auth is not None:
            auth.stop()
        ctx.term()
