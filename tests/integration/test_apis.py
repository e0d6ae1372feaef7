"""The Responses API and Anthropic Messages through P/D with real engines, through the official clients.

Exactness as for chat: the prefill engine alone, asked the same request first, is the reference.
"""

from __future__ import annotations

import re

import httpx
import pytest

from tests.integration.conftest import STORED_PER_OWNER, ServeProcess, engine_auth
from tests.integration.test_pd_real import MODEL

pytestmark = pytest.mark.integration

QUESTION = "Write one sentence about the sea."


def _direct(url: str, path: str, body: dict) -> dict:
    r = httpx.post(url + path, json=body, headers=engine_auth(url), timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def test_responses_through_pd_equal_one_engine_and_continue_where_stored(served: ServeProcess):
    import openai

    client = openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=5)
    ask = {"model": MODEL, "input": QUESTION, "max_output_tokens": 16, "temperature": 0}
    ref = _direct(served.engine_url("prefill"), "/v1/responses", {**ask, "store": False})
    ref_text = "".join(c["text"] for item in ref["output"] if item["type"] == "message" for c in item["content"])
    got = client.responses.create(**ask)
    assert got.output_text == ref_text and got.output_text
    streamed = "".join(e.delta for e in client.responses.create(**ask, stream=True)
                       if e.type == "response.output_text.delta")
    assert streamed == ref_text
    # Stored on the decode engine that answered, under the id the router made (router/stored.py): retrieved and
    # continued there.
    assert re.fullmatch(r"resp_[0-9a-f]{64}", got.id), got.id
    decode = served.engine_url("decode")
    assert httpx.get(f"{decode}/v1/responses/{got.id}", headers=engine_auth(decode), timeout=60).status_code == 200
    assert client.responses.retrieve(got.id).output_text == ref_text
    follow = client.responses.create(model=MODEL, input="And another.", max_output_tokens=8, temperature=0,
                                     previous_response_id=got.id)
    # (Only the decode engine that answered keeps the conversation: elsewhere this is a 404.)
    assert follow.status in ("completed", "incomplete") and follow.output_text
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_not_here")


def test_a_stored_response_cannot_be_replaced_under_its_id(served: ServeProcess):
    """vLLM makes a body's ``request_id`` the new response's id: naming a stored one would replace it on the
    engine (tried: another key holder read and replaced a response). The router refuses it."""
    ask = {"model": MODEL, "input": QUESTION, "max_output_tokens": 8, "temperature": 0}
    first = httpx.post(served.url + "/v1/responses", json=ask, timeout=300)
    assert first.status_code == 200, first.text
    rid = first.json()["id"]
    squat = httpx.post(served.url + "/v1/responses", timeout=300,
                       json={**ask, "input": "Say something else entirely.", "request_id": rid})
    assert squat.status_code == 400 and squat.json()["error"]["param"] == "request_id", squat.text
    again = httpx.get(served.url + f"/v1/responses/{rid}", timeout=60)
    assert again.status_code == 200 and again.json()["output"] == first.json()["output"]


def test_an_engine_keeps_a_bounded_number_of_answers_the_oldest_going_first(served: ServeProcess):
    """vLLM's store keeps every answer for good; pdserve's engines keep ``router.stored_responses_per_owner``
    of one owner's (conftest: STORED_PER_OWNER; no keys here, so every client is one owner), the oldest
    forgotten first with its conversation: a 404 when read or continued later, the newer ones intact."""
    ask = {"model": MODEL, "max_output_tokens": 1, "temperature": 0}
    ids = []
    for i in range(STORED_PER_OWNER + 2):
        r = httpx.post(served.url + "/v1/responses", json={**ask, "input": f"Count to {i}."}, timeout=300)
        assert r.status_code == 200, r.text
        ids.append(r.json()["id"])
    status = [httpx.get(served.url + f"/v1/responses/{rid}", timeout=60).status_code for rid in ids]
    assert status == [404, 404] + [200] * STORED_PER_OWNER
    gone = httpx.post(served.url + "/v1/responses", json={**ask, "input": "Go on.", "previous_response_id": ids[0]},
                      timeout=300)
    assert gone.status_code == 404, gone.text
    kept = httpx.post(served.url + "/v1/responses", json={**ask, "input": "Go on.", "previous_response_id": ids[-1]},
                      timeout=300)
    assert kept.status_code == 200, kept.text


def test_anthropic_messages_through_pd_equal_one_engine(served: ServeProcess):
    import anthropic

    client = anthropic.Anthropic(base_url=served.url, api_key="unused", max_retries=5)
    ask = {"model": MODEL, "max_tokens": 16, "messages": [{"role": "user", "content": QUESTION}]}
    greedy = {"temperature": 0}  # (the client's own signature has no temperature: sent as an extra field)
    ref = _direct(served.engine_url("prefill"), "/v1/messages", {**ask, **greedy})
    got = client.messages.create(**ask, extra_body=greedy)
    assert got.content[0].text == ref["content"][0]["text"] and got.content[0].text
    with client.messages.stream(**ask, extra_body=greedy) as stream:
        assert "".join(stream.text_stream) == got.content[0].text
    assert got.usage.output_tokens == 16 and got.stop_reason == "max_tokens"
