"""A request's body from its bytes (router/body.py): bounds read off the bytes before parsing, big bodies
parsed off the event loop, nesting checked without recursion."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from pdserve.errors import BadRequest
from pdserve.router import body


def nested(depth: int) -> list:
    v: list = []
    for _ in range(depth - 1):
        v = [v]
    return v


def test_depth_is_checked_without_recursion():
    body.check_depth({"a": nested(body.MAX_DEPTH - 1)})
    with pytest.raises(BadRequest):
        body.check_depth({"a": nested(body.MAX_DEPTH)})
    with pytest.raises(BadRequest) as e:
        body.check_depth({"a": 1, "b": {"c": nested(100_000)}})
    assert e.value.param == "b"


def test_a_body_of_too_many_arrays_is_refused_before_it_is_parsed(monkeypatch):
    """A 16 MiB body of empty arrays took 7 s of the event loop to parse and walk: the count of its '[' and
    '{' bytes refuses it first, without parsing."""
    n = body.MAX_CONTAINERS
    raw = b'{"model":"m","prompt":[' + b"[]," * n + b'[]]}'

    def no_parse(*a: Any, **kw: Any) -> Any:
        raise AssertionError("parsed")

    monkeypatch.setattr(body.json, "loads", no_parse)
    with pytest.raises(BadRequest, match=f"holds {n + 3} arrays and objects.*at most {n}"):
        body.parse_body(raw)
    monkeypatch.undo()
    many = b'{"model":"m","prompt":[' + b"1," * body.MAX_ITEMS + b"1]}"
    with pytest.raises(BadRequest, match=f"holds {body.MAX_ITEMS + 1} items.*at most"):
        body.parse_body(many)  # (8.4 million numbers held the event loop 1.1 s in json.loads)
    ok = b'{"model":"m","prompt":[' + b"[1]," * (n - 10) + b"[1]]}"
    assert len(body.parse_body(ok)["prompt"]) == n - 9
    for raw, needle in ((b"", "empty"), (b"[1]", "must be a JSON object"), (b"{x", "not valid JSON"),
                        (b"\xff", "not valid UTF-8"), (b'{"a":' + b"[" * 100 + b"]" * 100 + b"}", "deeper")):
        with pytest.raises(BadRequest, match=needle):
            body.parse_body(raw)


def test_a_big_body_is_parsed_off_the_event_loop_one_at_a_time(monkeypatch):
    """Past BIG_BODY_BYTES a body is parsed in a worker thread, one at a time; a small one on the loop
    itself. The others wait for their turn on the loop, not in worker threads (a thread waiting its turn held
    one of the few that chat rendering and the engines' metrics need too)."""
    import threading

    seen: list[bool] = []
    in_threads = [0, 0]  # (now, most at once)
    real_parse, real_to_thread = body.parse_body, asyncio.to_thread

    def spy(raw: bytes) -> dict[str, Any]:
        seen.append(threading.current_thread() is threading.main_thread())
        return real_parse(raw)

    async def counted(fn: Any, *a: Any) -> Any:
        in_threads[0] += 1
        in_threads[1] = max(in_threads[1], in_threads[0])
        try:
            return await real_to_thread(fn, *a)
        finally:
            in_threads[0] -= 1

    monkeypatch.setattr(body, "parse_body", spy)
    monkeypatch.setattr(body.asyncio, "to_thread", counted)
    big = b'{"prompt":"' + b"x" * (body.BIG_BODY_BYTES + 1) + b'"}'
    assert asyncio.run(body.parse_body_off_loop(b'{"prompt":"hi"}')) == {"prompt": "hi"}

    async def three() -> list[dict[str, Any]]:
        return await asyncio.gather(*(body.parse_body_off_loop(big) for _ in range(3)))

    assert all(len(got["prompt"]) == body.BIG_BODY_BYTES + 1 for got in asyncio.run(three()))
    assert seen == [True, False, False, False] and in_threads[1] == 1
