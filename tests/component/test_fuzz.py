"""Generated requests against the router (fake engines): never a 5xx, always an OpenAI-shaped answer."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.component.test_router import MODEL, System

scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**12, 10**12), st.floats(allow_nan=False),
                    st.text(max_size=40))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                        st.dictionaries(st.text(max_size=10), inner, max_size=4)),
                      max_leaves=12)
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "bogus"]),
                                           "content": st.one_of(st.text(max_size=60), values)}), max_size=3)
FIELDS = {
    "model": st.one_of(st.just(MODEL), st.text(max_size=12), values),
    "prompt": st.one_of(st.text(max_size=80), st.lists(st.integers(0, 50000), max_size=30), values),
    "messages": st.one_of(messages, values),
    "max_tokens": st.one_of(st.integers(-5, 5000), values),
    "max_completion_tokens": st.one_of(st.integers(-5, 50), values),
    "n": st.one_of(st.integers(-2, 300), values),
    "stream": st.one_of(st.booleans(), values),
    "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": st.booleans()}), values),
    "temperature": values, "stop": values, "seed": values, "logprobs": values, "echo": values,
    "min_tokens": st.one_of(st.integers(-3, 10), values), "tools": values, "response_format": values,
    "kv_transfer_params": values, "unknown_field": values,
}
bodies = st.fixed_dictionaries({}, optional=FIELDS)


@pytest.fixture(scope="module")
def system():
    with System() as s:
        yield s


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(route=st.sampled_from(["/v1/completions", "/v1/chat/completions"]), body=bodies)
def test_generated_requests_never_5xx(system, route, body):
    r = system.client.post(route, content=json.dumps(body), headers={"Content-Type": "application/json"})
    assert r.status_code < 500, (body, r.status_code, r.text[:300])
    if r.status_code >= 400:
        err = r.json()["error"]
        assert isinstance(err["message"], str) and err["message"]


def _is_json_object(raw: bytes) -> bool:
    try:
        return isinstance(json.loads(raw), dict)
    except ValueError:  # not JSON, or not text at all (UnicodeDecodeError is a ValueError)
        return False


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.binary(max_size=300).filter(lambda b: not _is_json_object(b)))
@example(raw=b"")
@example(raw=b"\xff\xfe\x00")
@example(raw=b'{"model": ')
@example(raw=b"[1, 2]")
@example(raw=b"null")
def test_arbitrary_bytes_are_a_4xx(system, raw):
    """Bytes that are not a JSON object are never served: a 4xx with an OpenAI-shaped error."""
    r = system.client.post("/v1/completions", content=raw, headers={"Content-Type": "application/json"})
    assert 400 <= r.status_code < 500, (raw, r.status_code, r.text[:300])
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"]


def test_no_blocks_stranded_after_the_fuzz(system):
    """Every prefill leg the fuzz caused was followed by its decode leg: nothing held on prefill. (Alone,
    this module's system has seen only the requests below; they are enough to make the check non-vacuous.)"""
    for body in ({"model": MODEL, "prompt": "a b c", "max_tokens": 3},
                 {"model": MODEL, "prompt": "a b c", "max_tokens": 3, "min_tokens": 9},  # refused: no leg
                 {"model": MODEL, "messages": [{"role": "user", "content": "x y"}], "max_tokens": 2, "stream": True}):
        system.client.post("/v1/completions" if "prompt" in body else "/v1/chat/completions", json=body)
    assert system.prefill[0].requests, "no prefill leg ran: the check below would be vacuous"
    assert system.prefill[0].held == {}
    assert httpx.get(system.router.url + "/health").status_code == 200


# --- bodies generated from vLLM's own request models (tests/schema_bodies.py) -------------------------

from tests.schema_bodies import ROUTES, bodies  # noqa: E402


@pytest.mark.parametrize("path,model_path", ROUTES, ids=[m.rsplit(":", 1)[1] for _, m in ROUTES])
def test_bodies_from_vllms_request_schemas_never_5xx(system, path, model_path):
    """Every route the router serves from a body, with bodies drawn from the request model vLLM's server
    validates that route with: never a 5xx, every 4xx an OpenAI-shaped error."""
    seen: list[int] = []

    @settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                      HealthCheck.too_slow,
                                                                      HealthCheck.data_too_large])
    @given(body=bodies(model_path, MODEL))
    def check(body):
        r = system.client.post(path, content=json.dumps(body), headers={"Content-Type": "application/json"})
        seen.append(r.status_code)
        assert r.status_code < 500, (body, r.status_code, r.text[:300])
        if r.status_code >= 400 and r.headers.get("content-type", "").startswith("application/json"):
            err = r.json().get("error") or r.json()
            assert err, r.text[:300]

    check()
    assert len(seen) >= 50  # the property ran on many bodies, not vacuously
