"""The ``tracing`` section: OpenTelemetry traces of each request, off unless an OTLP endpoint is given."""

from __future__ import annotations

from pydantic import Field, field_validator

from pdserve.config.base import _Strict


class TracingConfig(_Strict):
    """One trace per request: admission, the prefill leg, the KV handoff, the decode leg, a moved stream,
    with vLLM's own spans of each leg in the same trace (the router passes W3C ``traceparent`` on)."""

    otlp_endpoint: str | None = Field(
        None,
        description=(
            "OTLP/HTTP traces endpoint, e.g. `http://127.0.0.1:4318/v1/traces` (Jaeger, an OpenTelemetry "
            "Collector). Unset: no tracing, and nothing of OpenTelemetry is loaded."
        ),
    )
    engines: bool = Field(
        True, description="The engines export their own spans there too (vLLM's `--otlp-traces-endpoint`)."
    )
    service_name: str = Field("pdserve", min_length=1, max_length=64,
                              description="The router's `service.name`; the engines add `-prefill` / `-decode`.")
    sample_ratio: float = Field(1.0, ge=0.0, le=1.0,
                                description="Share of requests traced (a client's sampled `traceparent` is always).")

    @field_validator("otlp_endpoint")
    @classmethod
    def _url(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("http://", "https://")):
            raise ValueError("tracing.otlp_endpoint must be an http:// or https:// URL (OTLP over HTTP)")
        return v
