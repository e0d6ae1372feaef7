"""The first token at once: which requests, the events sent, and decode's copy taken off its stream."""

from __future__ import annotations

import asyncio
import json

import pytest

from pdserve.router import early
from pdserve.router.early import FirstToken

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


def test_a_different_first_token_is_counted_and_the_stream_passes() -> None:
    events, told = run("completions", TOK, [sse(cmpl(" London"), cmpl(" is"), "[DONE]")])
    assert told == ["mismatch"] and texts("completions", events) == " Paris London is"


def test_error_events_pass_unchanged() -> None:
    err = {"error": {"message": "decode engine failed mid-stream", "code": 502}}
    events, told = run("completions", TOK, [sse(err, "[DONE]")])
    assert events[1] == err and events[-1] == "[DONE]" and told == []


def test_which_requests_start_with_the_prefill_token() -> None:
    base = {"stream": True, "temperature": 0}
    assert early.eligible("completions", base)
    assert early.eligible("chat", {**base, "tools": [{"type": "function"}], "tool_choice": "none"})
    for extra in ({"stream": False}, {"n": 2}, {"logprobs": 2}, {"top_logprobs": 1}, {"logit_bias": {"5": 1}},
                  {"min_tokens": 3}, {"stop": ["\n"]}, {"return_token_ids": True}, {"stream_options": {"continuous_usage_stats": True}}):
        assert not early.eligible("completions", {**base, **extra}), extra
    assert not early.eligible("chat", {**base, "tools": [{"type": "function"}]})
    assert not early.eligible("chat", base, chat_parsers=True)
    assert early.eligible("completions", base, chat_parsers=True)


def test_unseeded_sampling_gets_one_seed_for_both_legs() -> None:
    assert "seed" not in early.seeded({"temperature": 0})
    assert early.seeded({"temperature": 0.7, "seed": 5})["seed"] == 5
    seeds = {early.seeded({"temperature": 0.7})["seed"] for _ in range(20)}
    assert len(seeds) > 10 and all(0 <= x < 2**31 for x in seeds)
    assert "seed" in early.seeded({})  # the engine's default temperature samples


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
