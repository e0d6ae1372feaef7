"""Request bodies the engines would refuse, sent through a router over fake engines on loopback: refused before
the prefill leg, naming the field; and what importing the router imports, in a process of its own (the checks
themselves: tests/unit/test_validate.py)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import httpx
import pytest

from pdserve.engine import request_check
from pdserve.router import validate
from pdserve.router.body import MAX_DEPTH
from tests.unit.test_validate import HOSTILE, LIMITS, VALID, VOCAB, comp


@pytest.fixture(scope="module")
def engine_models():
    # make setup installs vLLM: without its request models the router's main check is missing.
    models = request_check.engine_models()
    assert models is not None, "vLLM's request models are not importable"
    return models


def test_the_router_imports_neither_vllm_nor_torch():
    """The router's checks run on an engine, its KV-event structs and chat templates are its own: importing
    it, rendering the packaged model's chat template and reading a KV-event batch import no vLLM, torch or
    transformers (each would cost the router process hundreds of MB and seconds of start)."""
    code = """
import sys
import msgspec
import pdserve.router.api, pdserve.router.orchestrator, pdserve.router.validate, pdserve.router.build
from pdserve.model.resolve import resolve_model
from pdserve.router.kv_index import KvIndex, wire_decoder
from pdserve.router.prompt_length import PromptLength
pl = PromptLength(resolve_model(None))
pl.load_chat_template()
assert pl.token_ids("chat", {"messages": [{"role": "user", "content": "hi"}]})
KvIndex().apply("e", 1, wire_decoder().decode(msgspec.msgpack.encode([1.0, [{"type": "AllBlocksCleared"}]])))
heavy = sorted({m.split(".")[0] for m in sys.modules} & {"vllm", "torch", "transformers"})
sys.exit(f"imported {heavy}" if heavy else 0)
"""
    r = subprocess.run([sys.executable, "-c", code], timeout=120, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]


# -- through the router, against fake engines ---------------------------------------------------------------


@pytest.fixture(scope="module")
def system(engine_models):
    from tests.component.test_router import System

    with System() as s:
        s.orch.gate.lengths.vocab_size = VOCAB
        s.orch.gate.validator.limits = LIMITS
        yield s


def _engines_untouched(s) -> None:
    assert [e.counters["requests"] for e in s.prefill + s.decode] == [0] * (len(s.prefill) + len(s.decode))
    assert all(e.held == {} for e in s.prefill)


def test_refused_bodies_reach_neither_engine(system):
    """Every hostile body is a 400 OpenAI error naming its field, and no engine saw any of them."""
    for route, body, param in HOSTILE:
        path = {"chat": "/v1/chat/completions", "responses": "/v1/responses"}.get(route, "/v1/completions")
        r = system.client.post(path, content=json.dumps(body), headers={"Content-Type": "application/json"})
        assert r.status_code == 400, (body, r.text[:300])
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["param"] == param, (body, err)
    # Bodies json cannot parse, and odd request ids.
    deep = b'{"prompt": ' + b"[" * 20_000 + b"]" * 20_000 + b"}"
    r = system.client.post("/v1/completions", content=deep, headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "deeper" in r.json()["error"]["message"]
    for rid in (b"\xff\xfe", b"a b", b"x" * 200, b"../../admin"):
        r = system.client.post("/v1/completions", json=comp(), headers={"X-Request-Id": rid})
        assert r.status_code == 400 and r.json()["error"]["param"] == "X-Request-Id"
        assert r.headers["x-request-id"].encode() != rid
    _engines_untouched(system)
    status = system.client.get("/pdserve/status").json()["router"]["request_checks"]
    assert status == {"engine_checks": True, "max_model_len": 2048, "max_logprobs": 20,
                      "vocab_size": VOCAB, "max_depth": MAX_DEPTH}
    # The system is fine afterwards, and valid bodies are served.
    for route, body in VALID:
        path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
        r = system.client.post(path, json=body, headers={"X-Request-Id": "valid-1"})
        assert r.status_code == 200, (body, r.text[:300])
        assert r.headers["x-request-id"] == "valid-1"
        if body.get("stream"):
            assert r.text.rstrip().endswith("data: [DONE]")
    assert system.prefill[0].held == {}
    # Each check had the engine's verdict: the hostile bodies refused there or by the router's own rules
    # before, the valid ones passed; none fell back to the router's rules alone.
    text = system.client.get("/metrics?engines=0").text
    checks = {o: float(re.search(rf'^pdserve_engine_checks_total{{outcome="{o}"}} (\S+)$', text, re.M).group(1))
              for o in ("passed", "refused", "no_verdict")}
    assert checks["refused"] > 0 and checks["passed"] >= len(VALID) and checks["no_verdict"] == 0, checks


def test_kv_lease_url_escapes_the_request_id():
    """A request id is part of the lease URL: one with '?' must not ask about another request."""
    import asyncio

    from pdserve.router.lease import Lease
    from tests.component.test_router import System

    with System() as s:
        s.orch.lease_check_after_s = 0.0
        prefill_ep = s.pool.endpoints("prefill")[0]
        s.prefill[0].expired.add("cmpl-x?y#z")
        assert asyncio.run(s.orch.leases.lost(Lease(prefill_ep, "cmpl-x?y#z", 0.0), "x")) is True
        assert s.orch.metrics.kv_lease.labels("expired")._value.get() == 1
        assert httpx.get(s.router.url + "/health").status_code == 200


def test_the_router_trusts_only_the_checks_own_verdicts():
    """An engine's server also answers 400 for failures of its own (a broken route, a validator that raised):
    only an answer marked as the check's verdict refuses a client's request or sets its fields; any other
    answer, a busy or slow engine, is no verdict (the router's own rules decide)."""
    import asyncio

    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    from pdserve.config.schema import RouterConfig
    from pdserve.errors import BadRequest
    from pdserve.router.endpoint import Endpoint
    from pdserve.router.engine_client import CHECK_VERDICT, EngineClient
    from pdserve.testing.thread_server import ThreadServer

    verdict_400 = {"error": {"message": "'top_p' must be in (0, 1]", "param": "top_p"}, CHECK_VERDICT: True}
    answers = {
        "refused": (400, verdict_400),
        "passed": (200, {"decided": {"n": 2}, CHECK_VERDICT: True}),
        "vllm_400": (400, {"error": {"message": "1 validation error: query.request", "param": "query.request"}}),
        "no_mark": (200, {"decided": {"n": 3}}),
        "not_a_check": (422, {"error": {"message": "a check is ..."}, CHECK_VERDICT: False}),
        "busy": (503, {"error": {"message": "busy"}}),
        "text": (500, "Internal Server Error"),
        "slow": (200, {"decided": {}, CHECK_VERDICT: True}),
    }
    which = {"now": "passed"}

    async def check(request):
        status, body = answers[which["now"]]
        if which["now"] == "slow":
            await asyncio.sleep(3)
        if isinstance(body, str):
            return Response(body, status_code=status)
        return JSONResponse(body, status_code=status)

    app = Starlette(routes=[Route(validate.CHECK_PATH, check, methods=["POST"])])
    with ThreadServer(app) as srv:
        ep = Endpoint(role="prefill", url=srv.url)

        async def ask(kind: str, timeout_s: float = 2.0):
            which["now"] = kind
            client = EngineClient(RouterConfig())
            try:
                return await client.check_body(ep, "chat", {"messages": []}, validate.CHECK_PATH, timeout_s)
            finally:
                await client.close()

        assert asyncio.run(ask("passed")) == {"n": 2}
        with pytest.raises(BadRequest) as e:
            asyncio.run(ask("refused"))
        assert e.value.param == "top_p"
        for kind in ("vllm_400", "no_mark", "not_a_check", "busy", "text"):
            assert asyncio.run(ask(kind)) is None, kind
        assert asyncio.run(ask("slow", timeout_s=0.5)) is None


def test_media_urls_to_hosts_the_engines_may_not_fetch_never_reach_one():
    """A multimodal engine fetches image, audio and video URLs itself, from inside the cluster (169.254.169.254
    answers there with a node's credentials on EC2): the router refuses them, on generation and on the routes
    whose engine renders messages (/tokenize), and the engines see nothing (router/media.py)."""
    from tests.component.test_router import MODEL, System
    from tests.unit.test_media import METADATA

    part = {"type": "image_url", "image_url": {"url": METADATA}}
    messages = [{"role": "user", "content": [{"type": "text", "text": "hi"}, part]}]
    with System() as s:
        for path, body in (("/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 4}),
                           ("/tokenize", {"model": MODEL, "messages": messages}),
                           ("/v1/messages", {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [
                               {"type": "image", "source": {"type": "url", "url": METADATA}}]}]})):
            r = s.client.post(path, json=body)
            assert r.status_code == 400, (path, r.text)
            assert r.json()["error"]["code"] == "media_url_not_allowed", (path, r.text)
        assert all(not e.requests for e in s.prefill + s.decode)
        ok = s.client.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 4, "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]})
        assert ok.status_code == 200, ok.text
