"""OpenTelemetry traces of the P/D flow: one trace per request.

The request's span (``pdserve.request``) holds one span per stage: ``admission``, ``prefill`` (the prefill
leg), ``kv_handoff`` (from the decode leg's start to its first byte: the KV pull and decode's first step),
``decode`` (from there to the stream's end), and an event per moved stream (``migration``). Each engine
request carries the W3C ``traceparent`` of its leg's span, so the engines' own spans (vLLM's
``--otlp-traces-endpoint``) join the same trace; a client's ``traceparent`` makes the request's span its
child.

Off unless ``tracing.otlp_endpoint`` is set: then every call here is a no-op on :data:`OFF`, and nothing of
OpenTelemetry is imported.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from pdserve.config.tracing import TracingConfig

log = logging.getLogger(__name__)


class Trace:
    """One request's spans; this base class records nothing (tracing off)."""

    def span(self, name: str, **attrs: Any) -> Any:
        return _nothing()

    def begin(self, name: str, **attrs: Any) -> None:
        """Start a span that ends in another frame (:meth:`end`), e.g. across a stream's chunks."""

    def end(self, name: str, error: str | None = None) -> None:
        """End the span :meth:`begin` started (nothing when it is not open)."""

    def event(self, name: str, **attrs: Any) -> None:
        """A point in time on the request's span."""

    def headers(self, leg: str | None = None) -> dict[str, str]:
        """The W3C trace headers of an engine request, under leg ``leg``'s span (else the request's)."""
        return {}

    def finish(self, status: int | None = None, error: str | None = None) -> None:
        """End the request's span (and any stage still open); once."""


@contextmanager
def _nothing() -> Iterator[None]:
    yield


OFF = Trace()


class _Live(Trace):
    def __init__(self, tracer: Any, propagator: Any, root: Any) -> None:
        self._tracer, self._prop, self._root = tracer, propagator, root
        self._open: dict[str, Any] = {}
        self._done = False

    def _ctx(self, span: Any) -> Any:
        from opentelemetry import trace

        return trace.set_span_in_context(span)

    @contextmanager
    def span(self, name: str, **attrs: Any) -> Iterator[None]:
        s = self._tracer.start_span(name, context=self._ctx(self._root), attributes=attrs or None)
        try:
            yield
        except BaseException as e:
            _failed(s, f"{type(e).__name__}: {e}")
            raise
        finally:
            s.end()

    def begin(self, name: str, **attrs: Any) -> None:
        self.end(name)
        self._open[name] = self._tracer.start_span(name, context=self._ctx(self._root), attributes=attrs or None)

    def end(self, name: str, error: str | None = None) -> None:
        s = self._open.pop(name, None)
        if s is not None:
            if error:
                _failed(s, error)
            s.end()

    def event(self, name: str, **attrs: Any) -> None:
        self._root.add_event(name, attributes=attrs or None)

    def headers(self, leg: str | None = None) -> dict[str, str]:
        carrier: dict[str, str] = {}
        self._prop.inject(carrier, context=self._ctx(self._open.get(leg or "", self._root)))
        return carrier

    def finish(self, status: int | None = None, error: str | None = None) -> None:
        if self._done:
            return
        self._done = True
        for name in list(self._open):
            self.end(name, error)
        if status is not None:
            self._root.set_attribute("http.response.status_code", status)
        if error or (status is not None and status >= 500):
            _failed(self._root, error or f"HTTP {status}")
        self._root.end()


def _failed(span: Any, message: str) -> None:
    from opentelemetry.trace import Status, StatusCode

    span.set_status(Status(StatusCode.ERROR, message[:200]))


class Tracing:
    """The router's tracer: :meth:`request` gives each request its :class:`Trace` (:data:`OFF` when off)."""

    def __init__(self, cfg: TracingConfig | None = None) -> None:
        self.cfg = cfg or TracingConfig()
        self.enabled = self.cfg.otlp_endpoint is not None
        self._provider: Any = None
        if self.enabled:
            self._start()

    def _start(self) -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        # The router's own provider, not the process-wide one: nothing else in the replica is traced by it.
        self._provider = TracerProvider(resource=Resource.create({"service.name": self.cfg.service_name}),
                                        sampler=ParentBased(TraceIdRatioBased(self.cfg.sample_ratio)))
        self._provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=self.cfg.otlp_endpoint)))
        self._tracer = self._provider.get_tracer("pdserve.router")
        self._prop = TraceContextTextMapPropagator()
        log.info("tracing requests to %s", self.cfg.otlp_endpoint)

    def request(self, route: str, request_id: str, client_headers: Mapping[str, str] | None = None) -> Trace:
        if not self.enabled:
            return OFF
        parent = self._prop.extract(dict(client_headers or {}))
        root = self._tracer.start_span("pdserve.request", context=parent, attributes={
            "pdserve.route": route, "pdserve.request_id": request_id})
        if not root.is_recording():
            root.end()
            return OFF
        return _Live(self._tracer, self._prop, root)

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Export every ended span now (at shutdown, and in tests)."""
        return bool(self._provider.force_flush(int(timeout_s * 1000))) if self._provider is not None else True

    def close(self) -> None:
        if self._provider is not None:
            self._provider.shutdown()
            self._provider = None


#: The client headers a trace may continue from.
TRACE_HEADERS = ("traceparent", "tracestate")
