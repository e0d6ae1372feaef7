"""Per-phase autoscaling for Ray Serve: signals that fit each phase.

The router sends requests straight to the engines' HTTP servers, so Ray Serve's default signal
(requests passing through Serve handles) would read zero. Instead each engine replica reports its own
vLLM gauges (``EngineServer.record_autoscaling_stats``) and these policies turn them into a replica
count; Ray Serve then applies min/max, the up/down delays and the scaling factors of the role's
``autoscaling_config``.

- prefill: requests running + waiting on the engine (waiting prompts are what drive TTFT up), against
  ``target_ongoing_requests`` per replica; with ``target_ttft_s``, also the mean TTFT of the prompts
  finished since the last report, against that target (whichever wants more replicas);
- decode: running sequences against ``target_ongoing_requests`` per replica, and KV cache use: above
  ``KV_HIGH`` on average, one more replica even if the sequence count looks fine.
"""

from __future__ import annotations

from typing import Any

#: Average decode KV cache use above which decode scales up regardless of the sequence count.
KV_HIGH = 0.85

#: Names of the stats engine replicas report (``EngineServer.record_autoscaling_stats``).
RUNNING, WAITING, KV_USAGE, TTFT_PRESSURE = "running", "waiting", "kv_usage", "ttft_pressure"


def _per_replica(ctx: Any, name: str) -> list[float]:
    metrics = ctx.aggregated_metrics or {}
    return [float(v) for v in (metrics.get(name) or {}).values()]


def _target(ctx: Any) -> float:
    try:
        return float(ctx.config.get_target_ongoing_requests())
    except AttributeError:
        return float(ctx.config.target_ongoing_requests)


def prefill_policy(ctx: Any) -> tuple[float, dict[str, Any]]:
    if ctx.current_num_replicas == 0:
        return ctx.target_num_replicas, {}
    load = sum(_per_replica(ctx, RUNNING)) + sum(_per_replica(ctx, WAITING))
    desired = load / _target(ctx)
    state: dict[str, Any] = {"prefill_load": load}
    pressure = _per_replica(ctx, TTFT_PRESSURE)
    if pressure:
        mean = sum(pressure) / len(pressure)
        desired = max(desired, ctx.current_num_replicas * mean)
        state["prefill_ttft_pressure"] = mean
    return desired, state


def decode_policy(ctx: Any) -> tuple[float, dict[str, Any]]:
    n = ctx.current_num_replicas
    if n == 0:
        return ctx.target_num_replicas, {}
    running = sum(_per_replica(ctx, RUNNING)) + sum(_per_replica(ctx, WAITING))
    desired = running / _target(ctx)
    kv = _per_replica(ctx, KV_USAGE)
    kv_avg = sum(kv) / len(kv) if kv else 0.0
    if kv_avg > KV_HIGH:
        desired = max(desired, n + 1)
    return desired, {"decode_running": running, "decode_kv_usage": kv_avg}


POLICY_PATHS = {"prefill": "pdserve.app.autoscaling:prefill_policy",
                "decode": "pdserve.app.autoscaling:decode_policy"}


class TtftWindow:
    """Mean TTFT of the requests an engine finished between two reports, from vLLM's cumulative
    ``vllm:time_to_first_token_seconds`` histogram sum and count."""

    def __init__(self, target_s: float) -> None:
        self.target_s = target_s
        self._last: tuple[float, float] | None = None

    def pressure(self, total_s: float, count: float) -> float | None:
        """Mean recent TTFT / target; None when nothing finished since the last report (no evidence)."""
        last, self._last = self._last, (total_s, count)
        if last is None or count <= last[1]:
            return None
        return (total_s - last[0]) / (count - last[1]) / self.target_s


def parse_engine_stats(text: str) -> dict[str, float]:
    """The three gauges (and the TTFT histogram's sum and count) from a vLLM ``/metrics`` exposition."""
    want = {"vllm:num_requests_running": RUNNING, "vllm:num_requests_waiting": WAITING,
            "vllm:kv_cache_usage_perc": KV_USAGE, "vllm:time_to_first_token_seconds_sum": "ttft_sum",
            "vllm:time_to_first_token_seconds_count": "ttft_count"}
    from prometheus_client.parser import text_string_to_metric_families

    out = {v: 0.0 for v in want.values()}
    for fam in text_string_to_metric_families(text):
        for sample in fam.samples:
            if sample.name in want:  # summed over label sets (one per engine core of a data-parallel engine)
                out[want[sample.name]] += sample.value
    return out
