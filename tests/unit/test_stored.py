"""The Responses API's stored answers: which engine holds each id, and the one reader of a stream's id."""

from __future__ import annotations

import asyncio
import json

from pdserve.router.endpoint import Endpoint
from pdserve.router.stored import SNIFF_BYTES, IdReader, StoredResponses, body_id
from pdserve.settings import ANONYMOUS_TAG
from pdserve.settings import response_owner_tag as owner_tag

CREATED = (b'event: response.created\ndata: {"type": "response.created", "response": {"id": "resp_7f", '
           b'"status": "in_progress"}}\n\n')
DELTA = b'event: response.output_text.delta\ndata: {"type": "response.output_text.delta", "delta": "Hi"}\n\n'
COMPLETED = (b'event: response.completed\ndata: {"type": "response.completed", "response": {"id": "resp_7f", '
             b'"usage": {"input_tokens": 12, "output_tokens": 5, "total_tokens": 17}}}\n\n')


def _drain(stream) -> list[bytes]:
    async def run():
        return [c async for c in stream]
    return asyncio.run(run())


def _stream(*chunks: bytes):
    async def gen():
        for c in chunks:
            yield c
    return gen()


def test_the_id_is_read_across_chunks_and_what_follows_its_event_is_handed_on():
    ids = IdReader()
    whole = CREATED + DELTA
    cut = 40  # inside the response.created event
    assert ids.feed(whole[:cut]) == b"" and ids.id is None and not ids.done
    assert ids.feed(whole[cut:]) == DELTA  # the events after the one that carried the id
    assert (ids.id, ids.done) == ("resp_7f", True)
    assert ids.feed(COMPLETED) == COMPLETED  # once found, chunks pass whole


def test_a_stream_without_an_id_is_given_up_after_a_bounded_read():
    ids = IdReader()
    event = b'data: {"type": "other", "response": {"id": ""}}\n\n'
    read = 0
    while not ids.done:
        assert ids.feed(event) == b""
        read += len(event)
    assert ids.id is None and SNIFF_BYTES < read <= SNIFF_BYTES + len(event)


def test_a_whole_answer_id_is_read_from_its_body_and_bad_bodies_give_none():
    assert body_id(b'{"id": "resp_q9", "object": "response"}') == "resp_q9"
    for raw in (None, b"", b"not json", b"[1, 2]", b'{"id": 7}', b'{"id": ""}'):
        assert body_id(raw) is None


def test_a_streamed_answer_is_remembered_with_its_engine_and_its_conversation_length():
    d = Endpoint(role="decode", url="http://d")
    stored = StoredResponses()
    chunks = [CREATED[:25], CREATED[25:] + DELTA, COMPLETED[:30], COMPLETED[30:]]
    assert _drain(stored.sniff(_stream(*chunks), d, owner="alice")) == chunks  # the stream passes unchanged
    assert stored.where("resp_7f", [d], owner="alice") is d
    assert stored.where("resp_7f", [d], owner="bob") is None  # another key finds nothing
    assert stored.context_tokens("resp_7f", owner="alice") == 17


def test_a_whole_answer_is_remembered_from_its_body():
    d = Endpoint(role="decode", url="http://d")
    stored = StoredResponses()
    stored.from_body(b'{"id": "resp_w", "usage": {"input_tokens": 3, "output_tokens": 4}}', d)
    assert stored.known("resp_w") and stored.context_tokens("resp_w") == 7
    stored.from_body(b"oops", d)
    assert len(stored._at) == 1


def test_one_key_creating_many_responses_forgets_its_own_not_anothers():
    """Past its share of the record a key's own oldest responses are forgotten, never another key's: a key
    cannot push another's response out of the router's memory (and so its ownership) by making many."""
    ep = Endpoint("http://127.0.0.1:1", "decode")
    s = StoredResponses(keep=10, keep_per_owner=3)
    s.remember("resp_acme", ep, "acme")
    for i in range(20):
        s.remember(f"resp_evil_{i}", ep, "evil")
    assert s.where("resp_acme", [ep], "acme") is ep
    assert [s.known(f"resp_evil_{i}") for i in (16, 17, 18, 19)] == [False, True, True, True]
    for i in range(8):  # the whole record bounds everyone together: the key keeping the most gives way first
        s.remember(f"resp_k{i}", ep, f"key{i}")
    assert s.known("resp_acme") and s.known("resp_k7") and len(s._at) == 10
    assert [s.known(f"resp_evil_{i}") for i in (17, 18, 19)] == [False, False, True]
    anon = StoredResponses(keep=5, keep_per_owner=2)  # without keys the one owner has the whole record
    for i in range(5):
        anon.remember(f"resp_{i}", ep)
    assert all(anon.known(f"resp_{i}") for i in range(5))


def test_an_id_made_for_one_owner_is_told_from_anothers_and_from_a_forged_one():
    """Router replicas sharing the secret tell an id made for the caller without having seen it; another
    owner, another app's secret, or an id changed by a digit are not it."""
    one, other = StoredResponses(secret=b"s" * 32), StoredResponses(secret=b"s" * 32)
    rid = one.new_id("tenant:acme")
    assert rid.startswith("resp_") and len(rid) == 69 and rid != one.new_id("tenant:acme")
    assert other.made_for(rid, "tenant:acme")  # another replica of the same app
    assert not other.made_for(rid, "tenant:evil")
    assert not StoredResponses(secret=b"t" * 32).made_for(rid, "tenant:acme")
    flipped = rid[:-1] + ("0" if rid[-1] != "0" else "1")
    assert not other.made_for(flipped, "tenant:acme")
    for bad in ("", "resp_", "resp_" + "0" * 68, rid + "0", "msg_" + rid[4:], "resp_" + "é" * 64, rid[:-1] + "\udc80"):
        assert not other.made_for(bad, "tenant:acme")


def test_an_id_carries_its_owners_tag_the_same_in_every_replica_and_apart_from_others():
    """The engines bound what each owner keeps by the tag in its ids (engine/responses_store.py): one owner's
    ids carry one tag in every replica of the app; another owner's, another; no owner, the anonymous tag."""
    one, other = StoredResponses(secret=b"s" * 32), StoredResponses(secret=b"s" * 32)
    acme = {owner_tag(one.new_id("tenant:acme")) for _ in range(3)} | {owner_tag(other.new_id("tenant:acme"))}
    assert len(acme) == 1 and acme != {ANONYMOUS_TAG}
    assert owner_tag(one.new_id("tenant:evil")) not in acme
    assert owner_tag(StoredResponses(secret=b"t" * 32).new_id("tenant:acme")) not in acme  # another app
    assert owner_tag(one.new_id()) == owner_tag(StoredResponses().new_id()) == ANONYMOUS_TAG
    assert other.made_for(one.new_id("tenant:acme"), "tenant:acme")  # the tag is under the seal
    forged = ANONYMOUS_TAG.join((lambda r: (r[:5], r[21:]))(one.new_id("tenant:evil")))  # another's tag taken off
    assert not other.made_for(forged, "tenant:evil")


def test_a_response_another_replica_made_is_found_on_the_engine_that_keeps_it():
    d1, d2 = Endpoint(role="decode", url="http://d1"), Endpoint(role="decode", url="http://d2")
    maker = StoredResponses(secret=b"k" * 32)
    rid = maker.new_id("tenant:acme")
    asked: list[str] = []

    async def fetch(ep: Endpoint, response_id: str):
        asked.append(ep.url)
        if ep is d2 and response_id == rid:
            return 200, json.dumps({"id": rid, "usage": {"total_tokens": 40}}).encode(), "application/json"
        if ep is d1:
            raise OSError("connection refused")  # an engine that cannot answer is passed over
        return 404, b'{"error": {}}', "application/json"

    here = StoredResponses(secret=b"k" * 32, fetch=fetch)
    assert asyncio.run(here.locate(rid, [d1, d2], "tenant:evil")) is None and asked == []  # not made for it
    assert asyncio.run(here.locate(rid, [d1, d2], "tenant:acme")) is d2
    assert sorted(asked) == ["http://d1", "http://d2"]
    assert here.context_tokens(rid, "tenant:acme") == 40  # its length, from the engine's answer
    assert asyncio.run(here.locate(rid, [d1, d2], "tenant:acme")) is d2 and len(asked) == 2  # noted: not asked again
    assert asyncio.run(here.locate(rid, [d1, d2], "tenant:evil")) is None
    assert asyncio.run(here.locate(maker.new_id("tenant:acme"), [d1, d2], "tenant:acme")) is None  # kept nowhere
    anon = StoredResponses(fetch=fetch)  # without keys any id is looked for
    assert asyncio.run(anon.locate(rid, [d2], "")) is d2
