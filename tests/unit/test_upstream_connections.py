"""The router's pooled connections to engines: an engine closing a kept-alive connection as the router reuses
it costs the request nothing (the race that failed requests under load when vLLM's 5 s keep-alive ran out): the keep-alive times here,
the race on real connections in tests/component/test_upstream_connections.py."""

from __future__ import annotations

from pdserve.config.schema import PDServeArgs
from pdserve.engine.launcher import ENGINE_KEEP_ALIVE_S, EnginePlacement, engine_env
from pdserve.router.engine_client import ROUTER_KEEP_ALIVE_S


def test_engines_keep_connections_longer_than_the_router():
    env = engine_env(PDServeArgs(), EnginePlacement(http_port=1, side_channel_port=2, side_channel_host="127.0.0.1",
                                                    engine_id="e", cores=[], on_cpu=True))
    assert int(env["VLLM_HTTP_TIMEOUT_KEEP_ALIVE"]) == ENGINE_KEEP_ALIVE_S > ROUTER_KEEP_ALIVE_S
