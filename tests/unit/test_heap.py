"""The router's heap settling: objects alive at start leave the collector's scans; pauses are measured."""

from __future__ import annotations

import gc

from prometheus_client import CollectorRegistry, Histogram

from pdserve.router import heap
from pdserve.router.metrics import RouterMetrics


def test_settle_freezes_what_is_alive_at_start() -> None:
    kept = [{"i": i, "self": None} for i in range(50_000)]
    for d in kept:
        d["self"] = d  # cycles: what the collector must scan
    try:
        before = gc.get_freeze_count()
        frozen = heap.settle()
        assert frozen >= before + len(kept)
        # Still frozen (the count may drop a little: objects another thread held at the freeze, e.g. the
        # suite's memory sampler, leave the permanent generation when they are freed).
        assert gc.get_freeze_count() >= before + len(kept)
    finally:
        gc.unfreeze()


def test_every_collection_is_timed_by_generation() -> None:
    registry = CollectorRegistry()
    hist = Histogram("pauses", "test", ["generation"], registry=registry)
    heap.watch_pauses(hist)
    gc.collect(0)
    gc.collect(2)
    assert registry.get_sample_value("pauses_count", {"generation": "0"}) >= 1
    assert registry.get_sample_value("pauses_count", {"generation": "2"}) >= 1
    # a second watcher replaces the first: one callback per process
    callbacks = len(gc.callbacks)
    metrics = RouterMetrics()
    heap.watch_pauses(metrics.gc_pause)
    assert len(gc.callbacks) == callbacks
    gc.collect(1)
    assert metrics.registry.get_sample_value("pdserve_router_gc_pause_seconds_count", {"generation": "1"}) >= 1


def test_only_the_named_families_are_kept_for_parsing() -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from pdserve.router.metrics import only_families

    text = (
        "# HELP vllm:prompt_tokens_by_source_total Prompt tokens by source.\n"
        "# TYPE vllm:prompt_tokens_by_source_total counter\n"
        'vllm:prompt_tokens_by_source_total{source="local_compute"} 5.0\n'
        'vllm:prompt_tokens_by_source_total{source="external_kv_transfer"} 7.0\n'
        "# HELP vllm:e2e_request_latency_seconds Latency.\n"
        "# TYPE vllm:e2e_request_latency_seconds histogram\n"
        'vllm:e2e_request_latency_seconds_bucket{le="1.0"} 3.0\n'
        "vllm:e2e_request_latency_seconds_count 3.0\n"
        "vllm:e2e_request_latency_seconds_sum 1.5\n"
    )
    kept = only_families(text, ("vllm:prompt_tokens_by_source",))
    fams = list(text_string_to_metric_families(kept))
    assert [f.name for f in fams] == ["vllm:prompt_tokens_by_source"]
    assert sorted(s.value for s in fams[0].samples) == [5.0, 7.0]
    assert "e2e_request_latency" not in kept
