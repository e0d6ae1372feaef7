"""The engine forkserver's rules (engine/forkserver.py): which settings must match, its messages, and how a
forked server's command line is read (the processes themselves: tests/component/test_forkserver.py)."""

from __future__ import annotations

import pytest

from pdserve.config.loader import load_config
from pdserve.engine import forked, forkserver
from pdserve.engine.launcher import EnginePlacement, build_engine_command
from pdserve.engine.process import _port_of
from pdserve.settings import ENGINE_CORES_ENV, ENGINE_KEY_ENV, FORKSERVER_CHECKED_ENV


def _env(role: str, port: int, cores: list[int]) -> dict[str, str]:
    args = load_config(None).args
    place = EnginePlacement(http_port=port, side_channel_port=port + 1, side_channel_host="127.0.0.1",
                            engine_id=f"{role}-x", cores=cores, on_cpu=True)
    return build_engine_command(role, args, "/m", place, api_key=f"key-{role}").env  # type: ignore[arg-type]


def test_two_engines_of_one_app_differ_only_in_per_engine_settings():
    """The prefill and decode engines of the embedded default, on their own cores and ports, with their own
    keys: a forkserver started with one's common settings forks both; the per-engine ones stay out."""
    prefill, decode = _env("prefill", 8100, [0]), _env("decode", 8200, [1])
    common = forkserver.common_env(decode)
    started = {**common, FORKSERVER_CHECKED_ENV: ",".join(sorted(common))}
    assert forkserver.mismatched(prefill, started) == [] and forkserver.mismatched(decode, started) == []
    assert ENGINE_KEY_ENV not in common and "VLLM_API_KEY" not in common and ENGINE_CORES_ENV not in common
    assert "PYTHONPATH" in common  # the engine fixes are loaded at the interpreter's start
    changed = {**prefill, "PYTHONPATH": "/elsewhere"}
    assert forkserver.mismatched(changed, started) == ["PYTHONPATH"]
    assert forkserver.mismatched({}, started) == sorted(common)


def test_messages_are_framed_by_their_length():
    body = b'{"pid": 7}'
    framed = forked.LEN.pack(len(body)) + body
    assert forked.message(framed[:3]) is None and forked.message(framed[:-1]) is None
    assert forked.message(framed + b"xy") == ({"pid": 7}, b"xy")
    with pytest.raises(OSError):
        forked.message(forked.LEN.pack(1 << 30))


@pytest.mark.parametrize("cmd, port", [
    (b"python\x00-m\x00vllm.entrypoints.openai.api_server\x00--port\x00123\x00", b"123"),
    (b"python -m vllm.entrypoints.openai.api_server --model /m --port 123 --x\0", b"123"),  # retitled
    (b"python\0-m\0vllm.entrypoints.openai.api_server\0--port\0", None),
    (b"python\0-m\0x\0", None),
])
def test_a_servers_port_is_read_from_either_form_of_command_line(cmd, port):
    assert _port_of(cmd) == port
