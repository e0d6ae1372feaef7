"""The first token at once: which requests, the events sent, and decode's copy taken off its stream."""

from __future__ import annotations

import asyncio
import json

import pytest

from pdserve.router import early
from pdserve.router.early import FirstToken
from pdserve.router.request import Request

TOK = FirstToken(text=" Paris", id="cmpl-r1", created=7, model="m")


def sse(*events: dict | str) -> bytes:
    return b"".join(b"data: " + (e.encode() if isinstance(e, str) else json.dumps(e).encode()) + b"\n\n"
                    for e in events)


def cmpl(text: str, finish: str | None = None) -> dict:
    return {"id": "cmpl-r1", "choices": [{"index": 0, "text": text, "finish_reason": finish}]}


def chat(delta: dict, finish: str | None = None) -> dict:
    return {"id": "chatcmpl-r1", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def run(route: str, tok: FirstToken, chunks: list[bytes]) -> tuple[list[dict | str], list[str]]:
    told: list[str] = []

    async def decode():
        for c in chunks:
            yield c

    async def collect() -> bytes:
        return b"".join([c async for c in early.splice(route, tok, decode(), told.append)])  # type: ignore[arg-type]

    out = asyncio.run(collect())
    events: list[dict | str] = []
    for ev in out.split(b"\n\n"):
        if ev.strip():
            payload = ev.strip()[6:].decode()
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events, told


def texts(route: str, events: list[dict | str]) -> str:
    got = ""
    for e in events:
        if isinstance(e, dict):
            c = e["choices"][0]
            got += (c.get("text") if route == "completions" else c["delta"].get("content")) or ""
    return got


@pytest.mark.parametrize("split", [1, 3, 7, 1000])
def test_completions_stream_reads_every_token_once_whatever_the_chunking(split: int) -> None:
    raw = sse(cmpl(" Paris"), cmpl(" is"), cmpl(" big", "length"), "[DONE]")
    chunks = [raw[i:i + split] for i in range(0, len(raw), split)]
    events, told = run("completions", TOK, chunks)
    assert texts("completions", events) == " Paris is big"
    assert events[0]["id"] == "cmpl-r1" and events[0]["object"] == "text_completion"  # type: ignore[index]
    assert events[-1] == "[DONE]" and told == ["sent"]


def test_chat_role_event_is_sent_once_and_first_content_removed() -> None:
    raw = sse(chat({"role": "assistant", "content": ""}), chat({"content": " Paris"}), chat({"content": "!"}),
              chat({}, "stop"), "[DONE]")
    events, told = run("chat", TOK, [raw])
    roles = [e for e in events if isinstance(e, dict) and e["choices"][0]["delta"].get("role")]
    assert len(roles) == 1 and events[0] is roles[0]
    assert texts("chat", events) == " Paris!" and told == ["sent"]


def test_text_held_back_over_several_events_or_joined_with_the_next_token() -> None:
    events, told = run("completions", TOK, [sse(cmpl(" Pa"), cmpl("ris"), cmpl(" is"), "[DONE]")])
    assert texts("completions", events) == " Paris is" and told == ["sent"]
    events, told = run("completions", TOK, [sse(cmpl(" Paris is"), "[DONE]")])
    assert texts("completions", events) == " Paris is" and told == ["sent"]


def test_a_different_first_token_without_a_way_on_passes_and_is_counted() -> None:
    events, told = run("completions", TOK, [sse(cmpl(" London"), cmpl(" is"), "[DONE]")])
    assert told == ["mismatch", "mismatch_passed"] and texts("completions", events) == " Paris London is"


def _splice_with_redo(chunks: list[bytes], redo) -> tuple[bytes, list[str], list[str]]:
    told: list[str] = []
    decode_state: list[str] = []

    async def decode():
        try:
            for c in chunks:
                yield c
            decode_state.append("read to its end")
        finally:
            decode_state.append("closed")

    async def collect() -> bytes:
        return b"".join([c async for c in early.splice("completions", TOK, decode(), told.append, redo)])

    return asyncio.run(collect()), told, decode_state


def test_a_different_first_token_goes_on_from_the_prefills_and_decodes_stream_is_closed() -> None:
    started: list[int] = []

    async def redo():
        started.append(1)

        async def again():
            yield sse(cmpl(" is"), cmpl(" big", "length"), "[DONE]")
        return again()

    out, told, state = _splice_with_redo([sse(cmpl(" London")), sse(cmpl(" was"), "[DONE]")], redo)
    assert started == [1] and told == ["mismatch"]
    assert state == ["closed"], "the decode stream is closed at the mismatch, not read on"
    events = [json.loads(e.strip()[6:]) for e in out.split(b"\n\n") if e.strip() and e.strip() != b"data: [DONE]"]
    assert texts("completions", events) == " Paris is big" and out.endswith(b"data: [DONE]\n\n")


@pytest.mark.parametrize("first", [cmpl(" Par"), cmpl(" Paris")])
def test_no_way_on_is_started_when_the_tokens_agree(first: dict) -> None:
    async def redo():
        raise AssertionError("started without a mismatch")

    out, told, state = _splice_with_redo([sse(first), sse(cmpl("is" if first["choices"][0]["text"] == " Par" else "")),
                                          sse(cmpl(" big", "length"), "[DONE]")], redo)
    assert told == ["sent"] and state == ["read to its end", "closed"]


def test_a_way_on_that_fails_to_start_leaves_decodes_stream() -> None:
    async def redo():
        raise ConnectionError("decode engine gone")

    out, told, _ = _splice_with_redo([sse(cmpl(" London"), cmpl(" is"), "[DONE]")], redo)
    assert told == ["mismatch", "mismatch_passed"] and b" London" in out and out.endswith(b"data: [DONE]\n\n")


def test_error_events_pass_unchanged() -> None:
    err = {"error": {"message": "decode engine failed mid-stream", "code": 502}}
    events, told = run("completions", TOK, [sse(err, "[DONE]")])
    assert events[1] == err and events[-1] == "[DONE]" and told == []


def eligible(route: str, body: dict, **kw) -> bool:
    return early.eligible(Request.parse(route, body), **kw)  # type: ignore[arg-type]


def seeded(body: dict) -> dict:
    req = early.seeded(Request.parse("completions", body))
    assert req.seed == req.body.get("seed")  # the decided value follows the body sent
    return req.body


def test_which_requests_start_with_the_prefill_token() -> None:
    base = {"stream": True, "temperature": 0}
    assert eligible("completions", base)
    assert eligible("chat", {**base, "tools": [{"type": "function"}], "tool_choice": "none"})
    for extra in ({"stream": False}, {"n": 2}, {"logprobs": 2}, {"top_logprobs": 1}, {"logit_bias": {"5": 1}},
                  {"min_tokens": 3}, {"stop": ["\n"]}, {"return_token_ids": True}, {"stream_options": {"continuous_usage_stats": True}}):
        assert not eligible("completions", {**base, **extra}), extra
    assert not eligible("chat", {**base, "tools": [{"type": "function"}]})
    assert not eligible("chat", base, chat_parsers=True)
    assert eligible("completions", base, chat_parsers=True)
    # Only where a different first token could be gone on from: a grammar's state, an image, embeddings or a
    # prompt the engine cut are not in the ids a continuation sends (the client got prefill's token and then
    # decode's whole stream: JSON such as '{{"name": ...').
    for extra in ({"response_format": {"type": "json_object"}}, {"structured_outputs": {"regex": "a+"}},
                  {"truncate_prompt_tokens": 8}, {"prompt": ["a", "b"]}, {"prompt_embeds": "AAAA"}):
        assert not eligible("completions", {**base, **extra}), extra
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    seen = {**base, "messages": [{"role": "user", "content": [{"type": "text", "text": "What is it?"}, image]}]}
    assert not eligible("chat", seen)
    assert eligible("chat", {**base, "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]})


def test_unseeded_sampling_gets_one_seed_for_both_legs() -> None:
    assert "seed" not in seeded({"temperature": 0})
    assert seeded({"temperature": 0.7, "seed": 5})["seed"] == 5
    seeds = {seeded({"temperature": 0.7})["seed"] for _ in range(20)}
    assert len(seeds) > 10 and all(0 <= x < 2**31 for x in seeds)
    assert "seed" in seeded({})  # the engine's default temperature samples


def test_first_token_from_the_prefill_answer() -> None:
    ans = {"id": "cmpl-x", "created": 3, "model": "m", "choices": [{"text": " Hi", "finish_reason": "length"}]}
    assert early.from_prefill("completions", ans) == FirstToken(" Hi", "cmpl-x", 3, "m")
    chat_ans = {"id": "c", "choices": [{"message": {"content": "Hi"}, "finish_reason": "length"}]}
    assert early.from_prefill("chat", chat_ans).text == "Hi"  # type: ignore[union-attr]
    for bad in ({"choices": [{"text": " Hi", "finish_reason": "stop"}]},
                {"choices": [{"text": "", "finish_reason": "length"}]},
                {"choices": [{"text": "\ufffd", "finish_reason": "length"}]},
                {"choices": []}, {}):
        assert early.from_prefill("completions", bad) is None
    assert early.from_prefill("chat", {"choices": [{"message": {"content": None}, "finish_reason": "length"}]}) is None


def test_first_token_keeps_the_ids_the_prefill_engine_returned() -> None:
    ans = {"id": "cmpl-x", "choices": [{"text": " Hi", "finish_reason": "length", "token_ids": [42],
                                        "prompt_token_ids": [1, 2, 3]}]}
    tok = early.from_prefill("completions", ans)
    assert tok is not None and tok.token_id == 42 and tok.prompt_ids == (1, 2, 3)
    chat_ans = {"id": "c", "prompt_token_ids": [7, 8],
                "choices": [{"message": {"content": "Hi"}, "finish_reason": "length", "token_ids": [9]}]}
    tok = early.from_prefill("chat", chat_ans)
    assert tok is not None and tok.token_id == 9 and tok.prompt_ids == (7, 8)
    for odd in ({"token_ids": [1, 2]}, {"token_ids": ["a"]}, {"token_ids": None}):
        tok = early.from_prefill("completions", {"choices": [{"text": " Hi", "finish_reason": "length", **odd,
                                                              "prompt_token_ids": [1]}]})
        assert tok is not None and tok.token_id is None


def test_decodes_events_carry_the_first_events_created() -> None:
    """The first events are stamped when prefill started (``created`` 7), decode's a second or more later:
    one stream keeps one ``created``, as one engine's does; text that spells the field is left alone."""
    later = [{**cmpl(" Paris"), "created": 9}, {**cmpl(' "created":9 is text'), "created": 9},
             {**cmpl("", "length"), "created": 9}]
    events, told = run("completions", TOK, [sse(*later, "[DONE]")])
    assert told == ["sent"]
    assert {e["created"] for e in events if isinstance(e, dict)} == {7}
    assert texts("completions", events) == ' Paris "created":9 is text'
