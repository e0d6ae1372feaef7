"""The Grafana dashboard for the P/D view, generated from the metric names the router exposes.

    python -m pdserve.router.dashboard > deploy/grafana/pdserve-dashboard.json
"""

from __future__ import annotations

import json
import sys
from typing import Any

_Q = "histogram_quantile({q}, sum by (le{by}) (rate({m}_bucket[$__rate_interval])))"


def _panel(pid: int, title: str, targets: list[tuple[str, str]], unit: str, x: int, y: int) -> dict[str, Any]:
    return {
        "id": pid, "type": "timeseries", "title": title, "datasource": {"type": "prometheus", "uid": "${ds}"},
        "gridPos": {"x": x, "y": y, "w": 12, "h": 8},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "targets": [{"expr": e, "legendFormat": leg, "refId": chr(65 + i)} for i, (e, leg) in enumerate(targets)],
    }


def build_dashboard() -> dict[str, Any]:
    panels_spec: list[tuple[str, list[tuple[str, str]], str]] = [
        ("Requests by route and status", [
            ("sum by (route, status) (rate(pdserve_requests_total[$__rate_interval]))", "{{route}} {{status}}")],
         "reqps"),
        ("Time to first token", [
            (_Q.format(q=0.5, by="", m="pdserve_time_to_first_token_seconds"), "p50"),
            (_Q.format(q=0.99, by="", m="pdserve_time_to_first_token_seconds"), "p99")], "s"),
        ("Time per output token", [
            (_Q.format(q=0.5, by="", m="pdserve_time_per_output_token_seconds"), "p50"),
            (_Q.format(q=0.99, by="", m="pdserve_time_per_output_token_seconds"), "p99")], "s"),
        ("P/D phases (p90)", [
            (_Q.format(q=0.9, by=", phase", m="pdserve_phase_duration_seconds"), "{{phase}}")], "s"),
        ("In flight at the router", [
            ("sum by (role) (pdserve_inflight_requests)", "{{role}}")], "short"),
        ("P/D decisions", [
            ("sum by (decision, reason) (rate(pdserve_pd_decisions_total[$__rate_interval]))",
             "{{decision}} ({{reason}})")], "reqps"),
        ("Errors by cause", [
            ("sum by (cause) (rate(pdserve_errors_total[$__rate_interval]))", "{{cause}}")], "reqps"),
        ("NIXL transfer time (p90) and failures", [
            (_Q.format(q=0.9, by=", pdserve_replica", m="vllm:nixl_xfer_time_seconds"), "xfer {{pdserve_replica}}"),
            ("sum(rate(vllm:nixl_num_failed_transfers_total[$__rate_interval]))", "failed transfers"),
            ("sum(rate(vllm:nixl_num_kv_expired_reqs_total[$__rate_interval]))", "expired KV leases")], "s"),
        ("KV bytes moved per second", [
            ("sum by (pdserve_replica) (rate(vllm:nixl_bytes_transferred_sum[$__rate_interval]))",
             "{{pdserve_replica}}")], "Bps"),
        ("KV cache use by role", [
            ("avg by (pdserve_role) (vllm:kv_cache_usage_perc)", "{{pdserve_role}}")], "percentunit"),
        ("Running and waiting sequences by role", [
            ("sum by (pdserve_role) (vllm:num_requests_running)", "running {{pdserve_role}}"),
            ("sum by (pdserve_role) (vllm:num_requests_waiting)", "waiting {{pdserve_role}}")], "short"),
        ("Engine prompt and generation tokens/s", [
            ("sum by (pdserve_role) (rate(vllm:prompt_tokens_total[$__rate_interval]))", "prompt {{pdserve_role}}"),
            ("sum by (pdserve_role) (rate(vllm:generation_tokens_total[$__rate_interval]))",
             "generation {{pdserve_role}}")], "short"),
    ]
    panels = [_panel(i + 1, t, tg, u, 12 * (i % 2), 8 * (i // 2)) for i, (t, tg, u) in enumerate(panels_spec)]
    return {
        "title": "pdserve: prefill/decode", "uid": "pdserve-pd", "schemaVersion": 39, "version": 1,
        "time": {"from": "now-1h", "to": "now"}, "refresh": "10s", "tags": ["pdserve", "vllm", "nixl"],
        "templating": {"list": [{"name": "ds", "type": "datasource", "query": "prometheus", "label": "Prometheus"}]},
        "panels": panels,
    }


if __name__ == "__main__":
    sys.stdout.write(json.dumps(build_dashboard(), indent=2) + "\n")
