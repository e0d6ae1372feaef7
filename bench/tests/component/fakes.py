"""Stand-ins for the benchmark's systems on loopback: a real router (pdserve.router.build) over fake engines
for ``pdserve serve``, two fake engines for the colocated pair."""

from __future__ import annotations

from typing import Any

from pdserve.config.schema import PDServeArgs
from pdserve.router.load import CALIBRATION_DERATE
from pdserve.testing.fake_engine import FakeEngine, build_fake_engine
from pdserve.testing.thread_server import ThreadServer

MODEL = "fake-model"


class FakeApp:
    """A router over one fake prefill and one fake decode engine, configured as the scenario asks."""

    def __init__(self, args: PDServeArgs) -> None:
        self.args = args
        self.engines = [FakeEngine("prefill", MODEL), FakeEngine("decode", MODEL)]
        self.servers = [ThreadServer(build_fake_engine(e)) for e in self.engines]
        self.url = ""

    def spec(self) -> dict[str, Any]:
        return {"kind": "router over fake engines"}

    def __enter__(self) -> FakeApp:
        from pdserve.router.build import build_router
        from pdserve.router.endpoint import Endpoint

        for s in self.servers:
            s.__enter__()
        eps = [Endpoint(role=e.role, url=s.url, engine_id=e.engine_id)  # type: ignore[arg-type]
               for e, s in zip(self.engines, self.servers)]
        for ep in eps:
            ep.load.calibrated(1e5 / CALIBRATION_DERATE)
        self.srv = ThreadServer(build_router(self.args.router, MODEL, endpoints=eps).app).__enter__()
        self.url = self.srv.url
        return self

    def __exit__(self, *exc: object) -> None:
        self.srv.__exit__()
        for s in self.servers:
            s.__exit__()


class FakePair:
    """Two fake engines answering whole requests: the colocated baseline."""

    def __init__(self) -> None:
        self.engines = [FakeEngine("decode", MODEL), FakeEngine("decode", MODEL)]
        self.servers = [ThreadServer(build_fake_engine(e)) for e in self.engines]
        self.urls: list[str] = []

    def spec(self) -> dict[str, Any]:
        return {"kind": "2 fake engines"}

    def __enter__(self) -> FakePair:
        self.urls = [s.__enter__().url for s in self.servers]
        return self

    def __exit__(self, *exc: object) -> None:
        for s in self.servers:
            s.__exit__()
