"""The router without engines: API keys from the environment, what decode's metrics say, the HTTP surface
(against fake engines: tests/component/test_router.py)."""

from __future__ import annotations

from pdserve.config.schema import RouterConfig
from pdserve.router.build import build_router

MODEL = "fake-model"


def test_env_keys_split_on_commas_and_newlines():
    from pdserve.router.auth import env_keys

    assert env_keys("") == [] and env_keys(" , \n") == []
    assert env_keys("a,b\nc\r\n d ,") == ["a", "b", "c", "d"]


def test_decode_token_sources_reads_only_decode_engines():
    from pdserve.router.effect import decode_token_sources

    text = "\n".join([
        "# TYPE vllm:prompt_tokens_by_source_total counter",
        'vllm:prompt_tokens_by_source_total{pdserve_role="decode",source="external_kv_transfer"} 900.0',
        'vllm:prompt_tokens_by_source_total{pdserve_role="decode",source="local_compute"} 100.0',
        'vllm:prompt_tokens_by_source_total{pdserve_role="prefill",source="local_compute"} 5000.0',
        ""])
    assert decode_token_sources(text) == (900.0, 100.0)


def test_the_http_surface_is_the_documented_one():
    """The routes users call, by path and method: the API's split into routers per concern kept every one."""
    app = build_router(RouterConfig(), MODEL).app
    got = {(r.path, m) for r in app.routes if hasattr(r, "methods") and r.path not in ("/openapi.json",)
           for m in r.methods if m != "HEAD"}
    assert got == {
        ("/v1/chat/completions", "POST"), ("/v1/completions", "POST"), ("/v1/responses", "POST"),
        ("/v1/responses/{response_id}", "GET"), ("/v1/responses/{response_id}/cancel", "POST"),
        ("/v1/messages", "POST"), ("/v1/models", "GET"), ("/v1/models/{model:path}", "GET"),
        ("/tokenize", "POST"), ("/detokenize", "POST"), ("/v1/embeddings", "POST"), ("/v1/score", "POST"),
        ("/health", "GET"), ("/metrics", "GET"), ("/pdserve/status", "GET"),
    }


def test_the_tests_sse_reader():
    from tests import sse

    lines = [b'data: {"choices": [{"text": "Pa"}]}', "", ": keep-alive", "event: x",
             'data: {"choices": [{"delta": {"content": "ris"}}], "usage": {"completion_tokens": 2}}',
             'data: {"error": {"message": "cut"}}', "data: [DONE]"]
    got = sse.read(lines)
    assert got.done and got.text == "Paris" and got.usage == {"completion_tokens": 2}
    assert got.error == {"message": "cut"} and len(got.events) == 3
    assert not sse.read(lines[:-1]).done and sse.read(lines[:1]).error is None
