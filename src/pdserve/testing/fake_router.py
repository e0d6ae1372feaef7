"""A router in front of one fake prefill and one fake decode engine, each on loopback in a thread: admission,
refusals and the client side of overload, tested without vLLM."""

from __future__ import annotations

from typing import Any

from pdserve.config.schema import RouterConfig
from pdserve.router.admission import HEADROOM
from pdserve.router.build import build_router
from pdserve.router.endpoint import Endpoint
from pdserve.router.load import CALIBRATION_DERATE
from pdserve.testing.fake_engine import FakeEngine, build_fake_engine
from pdserve.testing.thread_server import ThreadServer

#: The model the fakes serve.
MODEL = "fake-model"


class SlowRouter:
    """A router over one fake prefill and one fake decode engine, with a slow prefill of known speed.

    ``rate``: the prompt tokens per second admission counts on for each engine; ``delay_s``: how long each
    fake takes per request; ``router``: more :class:`RouterConfig` fields (``max_queue_wait_s`` is one
    second of headroom). ``srv.url`` is the router's address while in the ``with`` block."""

    def __init__(self, rate: float, delay_s: float, **router: Any) -> None:
        self.prefill, self.decode = FakeEngine("prefill", MODEL), FakeEngine("decode", MODEL)
        self.prefill.faults.delay_s = self.decode.faults.delay_s = delay_s
        self.servers = [ThreadServer(build_fake_engine(e)) for e in (self.prefill, self.decode)]
        self.router_cfg = RouterConfig(max_queue_wait_s=1.0 / HEADROOM, **router)
        self.rate = rate

    def __enter__(self) -> SlowRouter:
        for s in self.servers:
            s.__enter__()
        eps = [Endpoint(role=e.role, url=s.url, engine_id=e.engine_id)  # type: ignore[arg-type]
               for e, s in zip((self.prefill, self.decode), self.servers)]
        for ep in eps:
            ep.load.calibrated(self.rate / CALIBRATION_DERATE)
        router = build_router(self.router_cfg, MODEL, endpoints=eps)
        self.pool, self.orch = router.pool, router.orchestrator
        self.srv = ThreadServer(router.app).__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.srv.__exit__()
        for s in self.servers:
            s.__exit__()
