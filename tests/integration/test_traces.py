"""Traces with real engines: vLLM's own spans of each leg join the router's trace of the request.

The shared system exports to an OTLP/HTTP receiver in this process (conftest ``otlp_collector``): the router
as ``pdserve-it``, the engines (vLLM's ``--otlp-traces-endpoint``) as ``pdserve-it-prefill`` / ``-decode``.
"""

from __future__ import annotations

import secrets

import httpx
import pytest

from tests.integration.conftest import TRACED_SERVICE, ServeProcess
from tests.integration.test_pd_real import MODEL
from tests.otlp import Collector

pytestmark = pytest.mark.integration

#: The router's spans of a disaggregated request (a stream's decode leg is two: the KV handoff until its first
#: byte, then decode) and vLLM's one span per engine request.
ROUTER_SPANS = {"pdserve.request", "admission", "prefill", "decode"}
ENGINE_SPAN = "llm_request"
#: vLLM's exporter sends in batches, every 5 s by default.
ARRIVAL_S = 60


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_the_engines_spans_nest_under_the_routers_legs_in_the_clients_trace(
        served: ServeProcess, otlp_collector: tuple[Collector, str], stream: bool):
    collector, _ = otlp_collector
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Name three colours."}],
            "max_tokens": 8, "temperature": 0, "stream": stream}
    r = httpx.post(served.url + "/v1/chat/completions", json=body, timeout=300,
                   headers={"traceparent": f"00-{trace_id}-{client_span}-01"})
    assert r.status_code == 200, r.text

    want = ROUTER_SPANS | ({"kv_handoff"} if stream else set())
    spans = collector.wait_for(trace_id, len(want) + 2, ARRIVAL_S)
    by_name: dict[str, list[dict]] = {}
    for s in spans:
        by_name.setdefault(s["name"], []).append(s)
    assert set(by_name) == want | {ENGINE_SPAN}, sorted((s["service"], s["name"]) for s in spans)
    assert all(len(by_name[n]) == 1 for n in want), sorted((s["service"], s["name"]) for s in spans)
    router = {n: by_name[n][0] for n in want}
    root = router["pdserve.request"]
    assert root["parent"] == client_span and root["service"] == TRACED_SERVICE
    assert all(router[n]["parent"] == root["id"] for n in want - {"pdserve.request"})

    engines = {s["service"]: s for s in by_name[ENGINE_SPAN]}
    assert set(engines) == {f"{TRACED_SERVICE}-prefill", f"{TRACED_SERVICE}-decode"}, by_name[ENGINE_SPAN]
    pre, dec = engines[f"{TRACED_SERVICE}-prefill"], engines[f"{TRACED_SERVICE}-decode"]
    # Each engine's span is a child of the router's span that sent its request: the prefill leg, and the
    # decode leg's first span (a stream's KV handoff: its request goes out as the KV cache moves).
    assert pre["parent"] == router["prefill"]["id"]
    assert dec["parent"] == router["kv_handoff" if stream else "decode"]["id"]
    # vLLM's figures of each leg: the prefill leg makes one token, the decode leg the rest of the answer.
    assert pre["attrs"]["gen_ai.usage.completion_tokens"] == 1
    assert dec["attrs"]["gen_ai.usage.completion_tokens"] >= 1
    assert pre["attrs"]["gen_ai.usage.prompt_tokens"] == dec["attrs"]["gen_ai.usage.prompt_tokens"] > 0
    # Each lies inside the router's span that sent it (one host, one clock: vLLM stamps a request's arrival
    # with time.time, its span ends when the answer's last token is out, before the router has it).
    slack = 50_000_000  # ns
    for s, leg in ((pre, router["prefill"]), (dec, router["kv_handoff" if stream else "decode"])):
        assert leg["start"] - slack <= s["start"] <= s["end"] <= max(leg["end"], root["end"]) + slack, (s, leg)
