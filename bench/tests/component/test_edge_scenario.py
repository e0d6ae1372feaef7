"""The edge scenario's hostile clients (pdserve_bench/edge.py) against the public port's limits
(pdserve/router/edge.py) on a real socket."""

from __future__ import annotations

from pdserve.router.edge import EdgeLimits
from pdserve.router.ingress import DirectIngress
from pdserve.testing.edge import serve_edge


def test_the_edge_scenarios_attack_is_refused_and_every_probe_answered():
    """The edge scenario's hostile clients (small: 20 for 2 s) against the limits: slow heads and stalled bodies
    get 408, oversized heads 431, and no /health probe fails meanwhile."""
    from pdserve_bench.edge import _attack

    async def scenario(port: int, ingress: DirectIngress) -> None:
        out = await _attack("127.0.0.1", port, clients=20, seconds=2.5)
        assert out["failed"] == 0 and out["times_ms"]
        assert ingress.counters.refused.get(431, 0) >= 5 and ingress.counters.refused.get(408, 0) >= 5
        assert set(out["hostile_connections"]) >= {"slow-head", "stalled-body", "oversized-head", "silent"}

    serve_edge(EdgeLimits(header_timeout_s=0.5, body_timeout_s=0.5), scenario)
