"""Mid-stream decode failure: the stream goes on on another engine (router/migrate.py), against fake engines
on loopback (the pure parts: tests/unit/test_migrate.py)."""

from __future__ import annotations

import json

import pytest

from pdserve.testing.fake_engine import expected_words, token_ids
from tests.component.test_router import System
from tests.unit.test_migrate import PROMPT, body_for


def events(client, path: str, body: dict) -> list[dict]:
    with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200, r.read()
        lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]" and lines.count("[DONE]") == 1
    return [json.loads(ln) for ln in lines[:-1]]


def text_of(evs: list[dict], route: str) -> str:
    key = "text" if route == "completions" else "content"
    return "".join((c if route == "completions" else c.get("delta", {})).get(key) or ""
                   for e in evs for c in e.get("choices", []))


def by_label(s: System, counter: str) -> dict[str, float]:
    """A labelled counter of the router's, by its one label's value."""
    out = {}
    for line in s.client.get("/metrics").text.splitlines():
        if line.startswith(counter + "{"):
            out[line.split('"')[1]] = float(line.rsplit(" ", 1)[1])
    return out


def migrations(s: System) -> dict[str, float]:
    return by_label(s, "pdserve_stream_migrations_total")


@pytest.mark.parametrize("route,path", [("completions", "/v1/completions"), ("chat", "/v1/chat/completions")])
def test_a_broken_stream_goes_on_on_another_decode_replica_then_on_prefill(route, path):
    with System(n_decode=2) as s:
        s.decode[0].faults.die_mid_stream_after = 4
        s.decode[1].faults.die_mid_stream_after = 4
        body = body_for(route)
        evs = events(s.client, path, body)
        # each token once, in order: the answer one engine gives
        assert text_of(evs, route) == " ".join(expected_words(PROMPT, 12))
        assert not any("error" in e for e in evs)
        assert [e["choices"][0]["finish_reason"] for e in evs if e.get("choices")][-1] == "length"
        assert {e["id"] for e in evs} == {evs[0]["id"]}, "the continuation speaks under the first stream's id"
        assert {e["object"] for e in evs} == {"chat.completion.chunk" if route == "chat" else "text_completion"}
        # the ids the router asked for are not shown to a client that did not ask
        assert not any("token_ids" in c or "prompt_token_ids" in c for e in evs for c in e["choices"])
        assert not any("prompt_token_ids" in e for e in evs)
        # it died on one replica and went on on the other, from prompt + the 4 tokens sent, 8 left
        broken = next(e for e in s.decode if e.requests and e.requests[-1].get("kv_transfer_params"))
        other = next(e for e in s.decode if e is not broken)
        cont = other.requests[-1]
        words = PROMPT.split() if route == "completions" else [PROMPT]
        assert cont["prompt"][-4:] == token_ids(expected_words(PROMPT, 4))
        assert cont["max_tokens"] == 8 and "kv_transfer_params" not in cont
        assert len(cont["prompt"]) == len(" ".join(words).split()) + 4
        # that one died after 4 more tokens too: the prefill engine took the last 4
        last = s.prefill[0].requests[-1]
        assert last["prompt"][-8:] == token_ids(expected_words(PROMPT, 8)) and last["max_tokens"] == 4
        assert migrations(s)["migrated"] == 2


def test_with_one_decode_replica_the_stream_goes_on_on_a_prefill_engine():
    with System(n_decode=1) as s:
        s.decode[0].faults.die_mid_stream_after = 3
        evs = events(s.client, "/v1/chat/completions",
                     body_for("chat", stream_options={"include_usage": True}, return_token_ids=True))
        assert text_of(evs, "chat") == " ".join(expected_words(PROMPT, 12))
        assert s.prefill[0].requests[-1]["prompt"][-3:] == token_ids(expected_words(PROMPT, 3))
        usage = [e["usage"] for e in evs if e.get("usage")]
        assert usage == [{"prompt_tokens": len(PROMPT.split()), "completion_tokens": 12,
                          "total_tokens": len(PROMPT.split()) + 12}]
        # a client that asked for ids gets every one, once
        ids = [i for e in evs for c in e.get("choices", []) for i in c.get("token_ids") or []]
        assert ids == token_ids(expected_words(PROMPT, 12))


def test_a_stream_broken_before_its_first_event_runs_again():
    with System(n_decode=1) as s:
        s.decode[0].faults.die_mid_stream_after = 0
        evs = events(s.client, "/v1/completions", body_for("completions"))
        # the first token was the prefill leg's (sent early); the rerun's copy of it is not repeated
        assert text_of(evs, "completions") == " ".join(expected_words(PROMPT, 12))
        assert migrations(s)["restarted"] == 1
        assert "kv_transfer_params" not in s.prefill[0].requests[-1]


def test_when_no_engine_can_take_it_the_stream_ends_with_an_error_event():
    with System(n_decode=1) as s:
        s.decode[0].faults.die_mid_stream_after = 2
        s.prefill[0].faults.die_mid_stream_after = 1
        with s.client.stream("POST", "/v1/completions", json=body_for("completions")) as r:
            lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
        assert lines[-1] == "data: [DONE]" and '"error"' in lines[-2]
        got = "".join(json.loads(ln[6:])["choices"][0]["text"] for ln in lines[:-2])
        # what was sent is a prefix of the answer: nothing repeated
        assert " ".join(expected_words(PROMPT, 12)).startswith(got) and got
        m = migrations(s)
        assert m["migrated"] == 1 and m["failed"] == 1


def test_streams_that_cannot_move_end_with_an_error_event_as_before():
    with System(n_decode=2) as s:
        for e in s.decode:
            e.faults.die_mid_stream_after = 2
        with s.client.stream("POST", "/v1/completions", json=body_for("completions", stop=["zz"])) as r:
            lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
        assert lines[-1] == "data: [DONE]" and '"error"' in lines[-2]
        assert all("return_token_ids" not in b for e in s.decode for b in e.requests)
        assert migrations(s)["migrated"] == 0


def early_outcomes(s: System) -> dict[str, float]:
    return by_label(s, "pdserve_early_first_token_total")


@pytest.mark.parametrize("route,path", [("completions", "/v1/completions"), ("chat", "/v1/chat/completions")])
def test_decode_computing_another_first_token_goes_on_from_the_prefills(route, path):
    """The client was sent the prefill leg's first token; decode computed another (a near-tie broken the other
    way). The answer goes on from the token the client has, on the same decode engine, every token once."""
    with System(n_decode=1) as s:
        s.prefill[0].faults.first_word = "wX"
        evs = events(s.client, path, body_for(route, stream_options={"include_usage": True}))
        assert text_of(evs, route) == " ".join(["wX", *expected_words(PROMPT + " wX", 11)])
        usage = [e["usage"] for e in evs if e.get("usage")]
        assert usage == [{"prompt_tokens": len(PROMPT.split()), "completion_tokens": 12,
                          "total_tokens": len(PROMPT.split()) + 12}]
        assert [e["choices"][0]["finish_reason"] for e in evs if e.get("choices")][-1] == "length"
        assert {e["id"] for e in evs} == {evs[0]["id"]}
        assert not any("token_ids" in c or "prompt_token_ids" in c for e in evs for c in e["choices"])
        # the prefill leg was asked for the ids; the decode engine got the P/D request, then the way on
        assert s.prefill[0].requests[-1]["return_token_ids"] is True
        pd_leg, way_on = s.decode[0].requests[-2:]
        assert pd_leg.get("kv_transfer_params") and "kv_transfer_params" not in way_on
        assert way_on["prompt"] == token_ids(PROMPT.split()) + token_ids(["wX"]) and way_on["max_tokens"] == 11
        assert early_outcomes(s) == {"sent": 0, "mismatch": 1, "mismatch_passed": 0}
        assert migrations(s)["migrated"] == 0


def test_a_two_token_answer_from_another_first_token():
    """(One-token requests do not run P/D: the prefill leg would be the whole answer.)"""
    with System(n_decode=1) as s:
        s.prefill[0].faults.first_word = "wX"
        evs = events(s.client, "/v1/completions", body_for("completions", n=2, stream_options={"include_usage": True}))
        assert text_of(evs, "completions") == " ".join(["wX", *expected_words(PROMPT + " wX", 1)])
        assert [e["usage"]["completion_tokens"] for e in evs if e.get("usage")] == [2]
        assert s.decode[0].requests[-1]["max_tokens"] == 1


def test_a_stream_that_could_not_go_on_from_another_first_token_gets_no_early_token():
    """A grammar's state is not in the ids a continuation sends: had the prefill's first token gone ahead and
    decode computed another, the client would hold it and then decode's stream whole (JSON such as
    '{{"a": ...'). Such a stream reads decode's tokens only."""
    with System(n_decode=1) as s:
        s.prefill[0].faults.first_word = "wX"
        body = body_for("completions", response_format={"type": "json_object"})
        evs = events(s.client, "/v1/completions", body)
        assert text_of(evs, "completions") == " ".join(expected_words(PROMPT, 12))
        assert sum(early_outcomes(s).values()) == 0


def test_the_way_on_from_the_prefills_token_moves_when_its_engine_fails():
    with System(n_decode=2) as s:
        s.prefill[0].faults.first_word = "wX"
        for e in s.decode:
            e.faults.die_mid_stream_after = 3  # the P/D leg and the way on both break after 3 tokens
        evs = events(s.client, "/v1/completions", body_for("completions"))
        assert text_of(evs, "completions") == " ".join(["wX", *expected_words(PROMPT + " wX", 11)])
        assert migrations(s)["migrated"] >= 1
