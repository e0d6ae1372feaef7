"""Mid-stream decode failure: which streams may go on, the tape of what was sent, the continuation request
(router/migrate.py; the streams themselves, against fake engines: tests/component/test_migrate.py)."""

from __future__ import annotations

import json

from pdserve.router import migrate
from pdserve.router.migrate import Tape
from pdserve.router.request import Request

MODEL = "fake-model"  # the fakes' model (tests/component/test_router.py)
PROMPT = "tell me a long story about the sea"


def body_for(route: str, n: int = 12, **kw) -> dict:
    if route == "chat":
        return {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": n, "stream": True,
                "temperature": 0, **kw}
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": n, "stream": True, "temperature": 0, **kw}


def eligible(route: str, body: dict, **kw) -> bool:
    return migrate.eligible(Request.parse(route, body), **kw)  # type: ignore[arg-type]


def continuation(route: str, body: dict, tape: Tape) -> dict | None:
    return migrate.continuation(Request.parse(route, body), tape)  # type: ignore[arg-type]


def test_eligibility():
    assert eligible("chat", body_for("chat"))
    assert eligible("completions", body_for("completions"))
    assert not eligible("chat", body_for("chat"), chat_parsers=True)
    assert not eligible("completions", {**body_for("completions"), "stream": False})
    for extra in ({"logprobs": 2}, {"logprobs": 0}, {"prompt_logprobs": 0}, {"truncate_prompt_tokens": 8},
                  {"stop": ["."]}, {"n": 2}, {"echo": True},
                  {"response_format": {"type": "json_object"}}, {"structured_outputs": {"regex": "a+"}},
                  {"stream_options": {"continuous_usage_stats": True}}):
        assert not eligible("completions", {**body_for("completions"), **extra}), extra
    assert eligible("chat", {**body_for("chat"), "response_format": {"type": "text"}})
    # A prompt whose ids are not all the engine saw: the continuation, a completion of ids, would go on without
    # its audio, images or embeddings.
    image = {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}
    assert not eligible("chat", {**body_for("chat"), "messages": [{"role": "user", "content": [image]}]})
    assert not eligible("completions", {**body_for("completions"), "prompt_embeds": "AAAA"})
    assert not eligible("chat", {**body_for("chat"), "tools": [{"type": "function"}]})
    assert not eligible("responses", {"input": "x", "stream": True})
    assert not eligible("messages", {"messages": [], "max_tokens": 3, "stream": True})


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def test_tape_records_ids_strips_them_and_closes_a_spent_budget():
    tape = Tape(Request.parse("chat", {"max_tokens": 2, "stream": True, "stream_options": {"include_usage": True}}))
    head = {"id": "c1", "object": "chat.completion.chunk", "created": 5, "model": "m"}
    out = tape.feed(_sse({**head, "prompt_token_ids": [7, 8, 9],
                          "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}))
    out += tape.feed(_sse({**head, "choices": [{"index": 0, "delta": {"content": "a"}, "token_ids": [11]}]})[:20])
    assert b"prompt_token_ids" not in out and tape.prompt_ids == [7, 8, 9] and tape.ids == []
    out += tape.feed(_sse({**head, "choices": [{"index": 0, "delta": {"content": "a"}, "token_ids": [11]}]})[20:])
    # an event that carries only ids (a token whose text is held back) is not passed on
    assert tape.feed(_sse({**head, "choices": [{"index": 0, "delta": {}, "token_ids": [12]}]})) == b""
    assert tape.ids == [11, 12] and b"token_ids" not in out
    assert migrate.continuation(tape.req, tape) is None  # 2 of 2 generated
    tail = tape.closing().decode().split("\n\n")
    assert json.loads(tail[0][6:])["choices"][0]["finish_reason"] == "length"
    assert json.loads(tail[1][6:])["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    assert tail[2] == "data: [DONE]"


def test_continuation_keeps_sampling_and_reduces_budgets():
    tape = Tape(Request.parse("chat", {}))
    tape.prompt_ids, tape.ids = [1, 2], [3]
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 5,
            "temperature": 0.7, "seed": 3, "min_tokens": 2, "tools": None, "stream": True,
            "stream_options": {"include_usage": True}}
    c = continuation("chat", body, tape)
    assert c == {"model": "m", "prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0.7, "seed": 3,
                 "min_tokens": 1, "stream": True, "return_token_ids": True,
                 "stream_options": {"include_usage": True}}
    # Without a budget of the client's, what is left of the one an engine would have given.
    def unbounded(route: str, output_budget: int | None) -> dict | None:
        body = {"model": "m", "prompt": "x"} if route == "completions" else {"model": "m", "messages": []}
        return migrate.continuation(Request.parse(route, body, output_budget=output_budget), tape)

    # Chat: the context left (the router's mirror: ``output_budget``); a completion's max_tokens left out is 16.
    assert unbounded("chat", 2000)["max_tokens"] == 1999  # type: ignore[index]
    assert "max_tokens" not in unbounded("chat", None)  # type: ignore[operator]  # (the router cannot tell)
    assert unbounded("completions", 16)["max_tokens"] == 15  # type: ignore[index]
    assert unbounded("completions", None)["max_tokens"] == 15  # type: ignore[index]
    assert unbounded("completions", 1) is None  # spent
    # a tenant's cache_salt goes on with the request: its context is cached and found only under it
    assert continuation("completions", {"model": "m", "prompt": "x", "cache_salt": "t"}, tape)["cache_salt"] == "t"
