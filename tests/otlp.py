"""An OTLP/HTTP trace receiver for tests: every span it is sent, decoded, in the test's own process."""

from __future__ import annotations

import threading
import time
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route


class Collector:
    """Serve :meth:`app` (e.g. with ``ThreadServer``) and point an OTLP/HTTP exporter at ``<url>/v1/traces``."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    def app(self) -> Starlette:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        async def traces(request: Request) -> Response:
            req = ExportTraceServiceRequest()
            req.ParseFromString(await request.body())
            got = []
            for rs in req.resource_spans:
                service = next((a.value.string_value for a in rs.resource.attributes if a.key == "service.name"), "")
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        got.append({
                            "name": s.name, "trace": s.trace_id.hex(), "id": s.span_id.hex(),
                            "parent": s.parent_span_id.hex(), "start": s.start_time_unix_nano,
                            "end": s.end_time_unix_nano, "service": service, "status": s.status.code,
                            "events": [e.name for e in s.events],
                            "attrs": {a.key: a.value.string_value or a.value.int_value or a.value.double_value
                                      for a in s.attributes}})
            with self._lock:
                self.spans.extend(got)
            return Response(b"", media_type="application/x-protobuf")

        return Starlette(routes=[Route("/v1/traces", traces, methods=["POST"])])

    def of_trace(self, trace_id: str) -> list[dict[str, Any]]:
        with self._lock:
            return [s for s in self.spans if s["trace"] == trace_id]

    def wait_for(self, trace_id: str, want: int, timeout_s: float) -> list[dict[str, Any]]:
        """The spans of ``trace_id`` once at least ``want`` have arrived (or all that came within the time)."""
        deadline = time.monotonic() + timeout_s
        while len(got := self.of_trace(trace_id)) < want and time.monotonic() < deadline:
            time.sleep(0.1)
        return got
