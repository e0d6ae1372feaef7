"""The Responses API and Anthropic Messages through P/D, against fake engines."""

from __future__ import annotations

import json

import pytest

from pdserve.testing.fake_engine import expected_words
from tests.component.test_router import MODEL, System


@pytest.fixture
def pd():
    with System() as s:
        yield s


def _events(r) -> list[tuple[str, dict]]:
    out, kind = [], ""
    for line in r.iter_lines():
        if line.startswith("event: "):
            kind = line[7:]
        elif line.startswith("data: "):
            out.append((kind, json.loads(line[6:])))
    return out


def test_responses_run_both_legs_and_stream_as_the_api_streams(pd):
    body = {"model": MODEL, "input": "one two three", "max_output_tokens": 6}
    r = pd.client.post("/v1/responses", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["output"][0]["content"][0]["text"] == " ".join(expected_words("one two three", 6))
    p, d = pd.prefill[0].requests[0], pd.decode[0].requests[0]
    # The prefill leg: one token, not stored, not in the background, not streamed; KV kept for decode.
    assert (p["max_output_tokens"], p["store"], p["background"], p["stream"]) == (1, False, False, False)
    assert "max_tokens" not in p and p["kv_transfer_params"]["do_remote_decode"] is True
    assert d["max_output_tokens"] == 6 and d["kv_transfer_params"]["remote_engine_id"] == pd.prefill[0].engine_id
    assert pd.decode[0].counters["pulled"] == 1
    with pd.client.stream("POST", "/v1/responses", json={**body, "stream": True}) as st:
        events = _events(st)
    assert events[0][0] == "response.created" and events[-1][0] == "response.completed"
    assert "".join(e["delta"] for k, e in events if k == "response.output_text.delta") == \
        " ".join(expected_words("one two three", 6))


def test_a_stored_response_is_continued_and_read_where_it_is_kept(pd):
    first = pd.client.post("/v1/responses", json={"model": MODEL, "input": "a b", "max_output_tokens": 3}).json()
    with pd.client.stream("POST", "/v1/responses", json={"model": MODEL, "input": "c d", "max_output_tokens": 3,
                                                         "stream": True}) as st:
        streamed_id = _events(st)[0][1]["response"]["id"]
    for rid in (first["id"], streamed_id):
        got = pd.client.get(f"/v1/responses/{rid}")
        assert got.status_code == 200 and got.json()["id"] == rid
    n_prefill = len(pd.prefill[0].requests)
    follow = pd.client.post("/v1/responses", json={"model": MODEL, "input": "more", "max_output_tokens": 3,
                                                   "previous_response_id": first["id"]})
    assert follow.status_code == 200, follow.text
    assert len(pd.prefill[0].requests) == n_prefill  # only decode holds the conversation: no prefill leg
    assert pd.decode[0].requests[-1]["previous_response_id"] == first["id"]
    missing = pd.client.get("/v1/responses/resp_unknown")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"


def test_a_stored_response_belongs_to_the_key_that_made_it():
    """Another key can neither read, cancel, continue nor take over a stored response: to it the id does not
    exist (404), and a request naming a known id as its own is refused."""
    with System(api_keys=["key-a", "key-b"]) as s:
        a = {"Authorization": "Bearer key-a"}
        b = {"Authorization": "Bearer key-b"}
        mine = s.client.post("/v1/responses", headers=a,
                             json={"model": MODEL, "input": "a b", "max_output_tokens": 3}).json()["id"]
        assert s.client.get(f"/v1/responses/{mine}", headers=a).status_code == 200
        assert s.client.get(f"/v1/responses/{mine}", headers=b).status_code == 404
        assert s.client.post(f"/v1/responses/{mine}/cancel", headers=b).status_code == 404
        n_decode = len(s.decode[0].requests)
        cont = s.client.post("/v1/responses", headers=b, json={"model": MODEL, "input": "more", "max_output_tokens": 3,
                                                                "previous_response_id": mine})
        assert cont.status_code == 404 and cont.json()["error"]["param"] == "previous_response_id"
        squat = s.client.post("/v1/responses", headers=b, json={"model": MODEL, "input": "x", "max_output_tokens": 3,
                                                                 "request_id": mine})
        assert squat.status_code == 400 and squat.json()["error"]["param"] == "request_id"
        assert len(s.decode[0].requests) == n_decode  # none of B's attempts reached an engine
        ok = s.client.post("/v1/responses", headers=a, json={"model": MODEL, "input": "more", "max_output_tokens": 3,
                                                             "previous_response_id": mine})
        assert ok.status_code == 200, ok.text
        # An id this router does not know (made through another router replica, or forgotten) could be
        # another key's on the engine: with keys it does not exist, and no id is a client's to choose.
        n_decode = len(s.decode[0].requests)
        unknown = s.client.post("/v1/responses", headers=a, json={"model": MODEL, "input": "x", "max_output_tokens": 3,
                                                                  "previous_response_id": "resp_elsewhere"})
        assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "previous_response_id"
        chosen = s.client.post("/v1/responses", headers=a, json={"model": MODEL, "input": "x", "max_output_tokens": 3,
                                                                 "request_id": "resp_mine_now"})
        assert chosen.status_code == 400 and "router's to choose" in chosen.json()["error"]["message"]
        assert len(s.decode[0].requests) == n_decode


def test_a_conversation_goes_on_through_another_router_replica_and_stays_its_keys():
    """Router replicas share nothing but the app's keys: a response made through one is read, continued and
    cancelled through another (which asks the engines where it is kept), and still by its own key only."""
    import httpx

    from pdserve.config.schema import RouterConfig
    from pdserve.testing.thread_server import ThreadServer

    with System(api_keys=["key-a", "key-b"], n_decode=2) as s:
        a = {"Authorization": "Bearer key-a"}
        b = {"Authorization": "Bearer key-b"}
        first = s.client.post("/v1/responses", headers=a,
                              json={"model": MODEL, "input": "a b", "max_output_tokens": 3}).json()
        kept = [d for d in s.decode if first["id"] in d.stored]
        assert len(kept) == 1 and first["id"].startswith("resp_") and len(first["id"]) == 69  # the router's id
        cfg = RouterConfig(policy="round_robin", prefill_timeout_s=5, decode_timeout_s=10, local_prefill_below_tokens=0,
                           api_keys=["key-b", "key-a"])
        with ThreadServer(s.router_for(cfg).app) as other, httpx.Client(base_url=other.url, timeout=20) as c:
            n_requests = sum(len(d.requests) for d in s.decode + s.prefill)
            assert c.get(f"/v1/responses/{first['id']}", headers=b).status_code == 404
            cont = c.post("/v1/responses", headers=b, json={"model": MODEL, "input": "more", "max_output_tokens": 3,
                                                            "previous_response_id": first["id"]})
            assert cont.status_code == 404 and cont.json()["error"]["param"] == "previous_response_id"
            assert sum(len(d.requests) for d in s.decode + s.prefill) == n_requests  # B reached no engine
            got = c.get(f"/v1/responses/{first['id']}", headers=a)
            assert got.status_code == 200 and got.json()["id"] == first["id"]
            for _ in range(2):  # on the engine that keeps it, whichever decode replica routing would pick
                more = {"model": MODEL, "input": "more", "max_output_tokens": 3, "previous_response_id": first["id"]}
                ok = c.post("/v1/responses", headers=a, json=more)
                assert ok.status_code == 200, ok.text
                assert kept[0].requests[-1]["previous_response_id"] == first["id"]
            # An id of the right shape made under other keys (another app) is not this key's either.
            from pdserve.router.stored import StoredResponses

            forged = StoredResponses(secret=b"x" * 32).new_id("")
            assert c.get(f"/v1/responses/{forged}", headers=a).status_code == 404


def test_a_continued_conversation_is_admitted_by_its_whole_length(pd):
    """The engine reads a stored conversation again for previous_response_id: admission counts its tokens
    (from the stored response's usage, whole or streamed), not only the new input's."""
    from pdserve.router.stored import StoredResponses

    first = pd.client.post("/v1/responses", json={"model": MODEL, "input": "a b c d", "max_output_tokens": 3}).json()
    with pd.client.stream("POST", "/v1/responses", json={"model": MODEL, "input": "e f", "max_output_tokens": 4,
                                                         "stream": True}) as st:
        streamed = _events(st)
    stored: StoredResponses = pd.orch.stored
    whole = first["usage"]["input_tokens"] + first["usage"]["output_tokens"]
    assert stored.context_tokens(first["id"]) == whole > 3
    sid = streamed[0][1]["response"]["id"]
    usage = streamed[-1][1]["response"]["usage"]
    assert stored.context_tokens(sid) == usage["input_tokens"] + usage["output_tokens"] > 4
    assert stored.context_tokens(first["id"], owner="someone-else") == 0
    seen: list[int] = []
    admit = pd.orch.gate._admit_count
    pd.orch.gate._admit_count = lambda n_prompt, *rest: (seen.append(n_prompt), admit(n_prompt, *rest))[1]
    try:
        r = pd.client.post("/v1/responses", json={"model": MODEL, "input": "more", "max_output_tokens": 3,
                                                  "previous_response_id": first["id"]})
    finally:
        pd.orch.gate._admit_count = admit
    assert r.status_code == 200 and seen and seen[0] >= whole


def test_anthropic_messages_run_both_legs(pd):
    body = {"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": "x y z"}]}
    r = pd.client.post("/v1/messages", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["content"][0]["text"] == " ".join(expected_words("x y z", 5))
    p = pd.prefill[0].requests[0]
    assert (p["max_tokens"], p["stream"]) == (1, False) and p["kv_transfer_params"]["do_remote_decode"] is True
    assert pd.decode[0].requests[0]["max_tokens"] == 5
    with pd.client.stream("POST", "/v1/messages", json={**body, "stream": True}) as st:
        events = _events(st)
    assert events[0][0] == "message_start" and events[-1][0] == "message_stop"
    assert "".join(e["delta"]["text"] for k, e in events if k == "content_block_delta") == \
        " ".join(expected_words("x y z", 5))


def test_bad_bodies_are_refused_before_any_engine(pd):
    for path, body, param in (
        ("/v1/messages", {"model": MODEL, "messages": [{"role": "user", "content": "a"}]}, "max_tokens"),
        ("/v1/messages", {"model": MODEL, "max_tokens": 4, "messages": []}, "messages"),
        ("/v1/responses", {"model": MODEL, "input": ""}, "input"),
        ("/v1/responses", {"model": MODEL, "input": "a", "max_output_tokens": 0}, "max_output_tokens"),
        ("/v1/responses", {"model": MODEL, "input": "a", "kv_transfer_params": {"do_remote_prefill": True}},
         "kv_transfer_params"),
    ):
        r = pd.client.post(path, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (path, body, r.text)
    assert pd.prefill[0].requests == [] and pd.decode[0].requests == []


def test_a_responses_request_id_the_client_chooses_is_bounded(pd):
    """Without keys a client may name its Responses answer (vLLM stores it under the id); the router keeps
    50,000 such ids, so a megabyte each would be gigabytes of its memory: ids are request-id sized."""
    body = {"model": MODEL, "input": "a b", "max_output_tokens": 3}
    for bad in ("x" * 129, "a b", "é", 7):
        r = pd.client.post("/v1/responses", json={**body, "request_id": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "request_id", (bad, r.text)
    ok = pd.client.post("/v1/responses", json={**body, "request_id": "my-answer_1"})
    assert ok.status_code == 200 and ok.json()["id"] == "my-answer_1", ok.text


def test_a_full_router_refuses_before_it_reads_a_body(pd):
    """A full router answers 429 without reading or parsing the body it would refuse (up to max_body_bytes
    each): here a body that is not even JSON gets the 429, not the 400 a parse would give."""
    gate = pd.orch.gate
    cap = pd.orch.cfg.max_inflight
    gate.admitted["decode"] += cap  # (as if the router held its whole cap)
    try:
        r = pd.client.post("/v1/completions", content=b'{"model": ', headers={"Content-Type": "application/json"})
        assert r.status_code == 429, r.text
        r = pd.client.post("/tokenize", content=b'{"model": ', headers={"Content-Type": "application/json"})
        assert r.status_code == 429, r.text
    finally:
        gate.admitted["decode"] -= cap
    r = pd.client.post("/v1/completions", content=b'{"model": ', headers={"Content-Type": "application/json"})
    assert r.status_code == 400
