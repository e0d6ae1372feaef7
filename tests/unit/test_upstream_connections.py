"""The router's pooled connections to engines: an engine closing a kept-alive connection as the router reuses
it costs the request nothing (the race that failed requests under load when vLLM's 5 s keep-alive ran out): the keep-alive times here,
the race on real connections in tests/component/test_upstream_connections.py."""

from __future__ import annotations

from pdserve.config.schema import PDServeArgs
from pdserve.engine.launcher import ENGINE_KEEP_ALIVE_S, EnginePlacement, engine_env
from pdserve.router.engine_client import ROUTER_KEEP_ALIVE_S


def test_engines_keep_connections_longer_than_the_router():
    env = engine_env(PDServeArgs(), EnginePlacement(http_port=1, side_channel_port=2, side_channel_host="127.0.0.1",
                                                    engine_id="e", cores=[], on_cpu=True))
    assert int(env["VLLM_HTTP_TIMEOUT_KEEP_ALIVE"]) == ENGINE_KEEP_ALIVE_S > ROUTER_KEEP_ALIVE_S


def test_a_big_answers_usage_is_read_without_parsing_the_whole_answer(monkeypatch):
    """Prompt logprobs of a long prompt make answers of tens of megabytes, whose whole parse holds the
    interpreter for seconds: past BIG_ANSWER_BYTES only the usage object is parsed."""
    import json

    from pdserve.router import engine_client

    tokens = [{"1": {"logprob": -0.5, "rank": 1, "decoded_token": 'say "usage": {"prompt_tokens": 1}'}}] * 30_000
    answer = {"id": "cmpl-1", "choices": [{"text": "hi"}],
              "usage": {"prompt_tokens": 30_000, "completion_tokens": 4, "total_tokens": 30_004,
                        "prompt_tokens_details": {"cached_tokens": 0}},
              "prompt_logprobs": tokens}
    raw = json.dumps(answer).encode()
    assert len(raw) > engine_client.BIG_ANSWER_BYTES
    small = engine_client.usage(json.dumps({**answer, "prompt_logprobs": None}).encode())

    def whole(*a, **kw):
        raise AssertionError("the whole answer was parsed")

    monkeypatch.setattr(json, "loads", whole)
    assert engine_client.usage(raw) == small == {"prompt_tokens": 30_000, "completion_tokens": 4,
                                                 "total_tokens": 30_004}
    assert engine_client.usage(b'{"x": "' + b"y" * engine_client.BIG_ANSWER_BYTES + b'"}') == {}
