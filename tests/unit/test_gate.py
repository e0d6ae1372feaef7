"""Stage 1's order: a refusal the router can decide alone comes before anything that costs an engine."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.config.schema import RouterConfig
from pdserve.errors import Overloaded
from pdserve.router.endpoint import Endpoint
from pdserve.router.gate import Gate
from pdserve.router.metrics import RouterMetrics
from pdserve.router.pool import EnginePool
from pdserve.router.prompt_length import PromptLength
from pdserve.router.stored import StoredResponses


class CountingChecks:
    """An engine client whose body check passes and counts how often it was asked."""

    def __init__(self) -> None:
        self.checks = 0

    async def check_body(self, ep, route, body, path, timeout_s):
        self.checks += 1
        return {}


def gate(**router) -> tuple[Gate, CountingChecks]:
    pool = EnginePool([Endpoint(role="prefill", url="http://p:1"), Endpoint(role="decode", url="http://d:1")])
    client = CountingChecks()
    g = Gate(pool, RouterConfig(**router), RouterMetrics(), PromptLength(), None, StoredResponses(), None,
             client)  # type: ignore[arg-type]
    return g, client


BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.mark.parametrize("full", ["router", "decode", "prefill"])
def test_a_full_router_refuses_before_the_engines_check(full):
    """At an in-flight cap a request is refused (429) without an engine's check: a client flooding a full
    router costs the engines nothing. Below it, the same request is checked and admitted."""
    g, client = gate(max_inflight=4 if full == "router" else 100, max_inflight_per_decode_engine=4,
                     max_inflight_per_prefill_engine=4)
    asyncio.run(g.admit("chat", dict(BODY), None, "", "default"))[2].release()
    assert client.checks == 1
    g.admitted["prefill" if full == "prefill" else "decode"] = 4
    with pytest.raises(Overloaded):
        asyncio.run(g.admit("chat", dict(BODY), None, "", "default"))
    assert client.checks == 1
    refused = g.metrics.refused.labels("router_full" if full == "router" else f"{full}_full")._value.get()
    assert refused == 1
