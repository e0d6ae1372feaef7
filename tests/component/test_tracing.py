"""Traces: one per request, received over OTLP/HTTP in this process, against fake engines."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import pytest

from pdserve.config.schema import RouterConfig
from pdserve.config.tracing import TracingConfig
from pdserve.router.build import build_router
from pdserve.router.endpoint import Endpoint
from pdserve.testing.fake_engine import FakeEngine, build_fake_engine
from pdserve.testing.thread_server import ThreadServer
from tests.otlp import Collector

MODEL = "fake-model"


@pytest.fixture
def traced():
    collector = Collector()
    engines = [FakeEngine("prefill", MODEL), FakeEngine("decode", MODEL)]
    servers = [ThreadServer(build_fake_engine(e)) for e in engines]
    with ThreadServer(collector.app()) as otlp:
        for s in servers:
            s.__enter__()
        eps = [Endpoint(role=e.role, url=s.url, engine_id=e.engine_id)  # type: ignore[arg-type]
               for e, s in zip(engines, servers)]
        for ep in eps:
            ep.load.calibrated(1e6)
        cfg = RouterConfig(local_prefill_below_tokens=0)
        router = build_router(cfg, MODEL, endpoints=eps,
                              tracing=TracingConfig(otlp_endpoint=otlp.url + "/v1/traces", service_name="pdserve-test"))
        with ThreadServer(router.app) as srv:
            yield srv, router, collector, engines
        for s in servers:
            s.__exit__()


def _tree(collector: Collector, router: Any) -> dict[str, dict[str, Any]]:
    assert router.orchestrator.tracing.flush()
    deadline = time.monotonic() + 5
    while not collector.spans and time.monotonic() < deadline:
        time.sleep(0.05)
    return {s["name"]: s for s in collector.spans}


def test_a_streamed_pd_request_is_one_trace_whose_spans_account_for_its_time(traced):
    import gc

    srv, router, collector, engines = traced
    t0 = time.time_ns()
    # The router, the fake engines and this client share one process (which imported vLLM's request models
    # for the fakes' checks): a collection of its heap between two spans would be time no span holds.
    gc.disable()
    try:
        with httpx.stream("POST", srv.url + "/v1/completions", timeout=20, json={
                "model": MODEL, "prompt": "one two three four five six", "max_tokens": 6, "stream": True}) as r:
            assert r.status_code == 200
            body = b"".join(r.iter_bytes())
    finally:
        gc.enable()
    t1 = time.time_ns()
    assert body.endswith(b"data: [DONE]\n\n")
    spans = _tree(collector, router)
    root = spans["pdserve.request"]
    assert set(spans) >= {"pdserve.request", "admission", "prefill", "kv_handoff", "decode"}
    assert len({s["trace"] for s in collector.spans}) == 1 and root["parent"] == ""
    for name in ("admission", "prefill", "kv_handoff", "decode"):
        s = spans[name]
        assert s["parent"] == root["id"], name
        assert root["start"] <= s["start"] <= s["end"] <= root["end"], name
    # the stages follow one another, and together they account for the request's time
    order = [spans[n] for n in ("admission", "prefill", "kv_handoff", "decode")]
    assert all(a["end"] <= b["start"] for a, b in zip(order, order[1:]))
    covered = sum(s["end"] - s["start"] for s in order)
    assert covered >= 0.8 * (root["end"] - root["start"]), [
        (n, s["start"] - root["start"], s["end"] - s["start"]) for n, s in spans.items()]
    assert t0 <= root["start"] and root["end"] <= t1
    assert root["attrs"]["pdserve.route"] == "completions" and root["service"] == "pdserve-test"
    # each engine request carried its leg's span as W3C traceparent: the engine's own spans join the trace
    (pre,), (dec,) = engines[0].traceparents, engines[1].traceparents
    assert pre.split("-")[1] == root["trace"] and pre.split("-")[2] == spans["prefill"]["id"]
    assert dec.split("-")[1] == root["trace"] and dec.split("-")[2] == spans["kv_handoff"]["id"]


def test_a_clients_traceparent_makes_the_request_its_child(traced):
    srv, router, collector, _ = traced
    trace_id, parent = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    r = httpx.post(srv.url + "/v1/completions", timeout=20, headers={"traceparent": f"00-{trace_id}-{parent}-01"},
                   json={"model": MODEL, "prompt": "a b c", "max_tokens": 3})
    assert r.status_code == 200
    root = _tree(collector, router)["pdserve.request"]
    assert root["trace"] == trace_id and root["parent"] == parent


def test_a_refused_request_ends_its_trace_with_the_error(traced):
    srv, router, collector, _ = traced
    r = httpx.post(srv.url + "/v1/completions", timeout=20, json={"model": MODEL, "prompt": "", "max_tokens": 3})
    assert r.status_code == 400
    spans = _tree(collector, router)
    assert spans["pdserve.request"]["status"] == 2 and spans["admission"]["status"] == 2  # STATUS_CODE_ERROR
    assert spans["pdserve.request"]["attrs"]["http.response.status_code"] == 400


def test_off_by_default_imports_nothing_of_opentelemetry():
    import subprocess
    import sys

    code = ("import sys; from pdserve.router.build import build_router; from pdserve.config.schema import "
            "RouterConfig; build_router(RouterConfig(), 'm'); "
            "print(json.dumps(sorted(m for m in sys.modules if m.startswith('opentelemetry.sdk'))))")
    out = subprocess.run([sys.executable, "-c", "import json; " + code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
