"""``--scenario router``: the fake engines' answers, wrk's report, the dry run (run for real, in its smallest
form: bench/tests/component/test_router_bench.py)."""

from __future__ import annotations

import json

from pdserve_bench import router_bench as rb


def _head(method: str, **headers: str) -> bytes:
    lines = [f"{method} /v1/completions HTTP/1.1"] + [f"{k}: {v}" for k, v in headers.items()]
    return "\r\n".join(lines).lower().encode()


def test_fake_engines_answer_each_leg_and_ask_for_the_key():
    from pdserve.router.handoff import decode_body, prefill_body, usable_kv_params

    canned = rb._canned()
    auth = b"authorization: bearer " + rb.ENGINE_KEY.encode()
    keyed = _head("POST", Authorization=f"Bearer {rb.ENGINE_KEY}")
    body = rb.client_body(False)
    prefill = json.dumps(prefill_body("completions", body)).encode()
    assert rb._answer(keyed, prefill, canned, auth) == canned["prefill"]
    assert rb._answer(keyed, json.dumps(prefill_body("completions", body), separators=(",", ":")).encode(),
                      canned, auth) == canned["prefill"]
    # What the prefill answer names is what decode can pull with.
    kv = json.loads(canned["prefill"].split(b"\r\n\r\n", 1)[1])["kv_transfer_params"]
    assert usable_kv_params(kv) is not None
    assert rb._answer(keyed, json.dumps(decode_body(body, kv)).encode(), canned, auth) == canned["decode"]
    streamed = json.dumps(decode_body(rb.client_body(True), kv)).encode()
    assert rb._answer(keyed, streamed, canned, auth) == canned["stream"]
    assert canned["stream"].count(b"data: ") == rb.STREAM_CHUNKS + 1
    assert rb._answer(_head("POST"), prefill, canned, auth) == canned["refused"]
    assert rb._answer(_head("GET"), b"", canned, auth) == canned["health"]


def test_wrk_report_is_read():
    report = """Running 10s test @ http://127.0.0.1:8000/v1/completions
  1 threads and 32 connections
  23012 requests in 10.00s, 9.51MB read
  Socket errors: connect 0, read 2, write 0, timeout 1
  Non-2xx or 3xx responses: 12
Requests/sec:   2301.20
"""
    d = rb.parse_wrk(report)
    assert d is not None and d.client == "wrk"
    assert d.done == 23000 and d.wall_s == 10.0 and d.failed == {"non-2xx": 12, "socket": 3} and d.errors == 15
    clean = rb.parse_wrk("  812 requests in 1.00s, 300KB read\n")
    assert clean is not None and clean.done == 812 and clean.errors == 0
    assert rb.parse_wrk("unable to connect to 127.0.0.1:1 Connection refused") is None


def test_dry_run_names_both_processes_and_their_cores(nothing_starts):
    from pdserve_bench.plan import Plan

    plan = Plan("router", dry_run=True)
    got = rb.measure_router(seconds=2, concurrency=8, latency_requests=5, plan=plan)
    assert got["dry_run"] is True
    procs = {s["name"]: s for s in got["systems"]}
    assert set(procs) == {"fake engines", "router"}
    fakes = f"http://127.0.0.1:{procs['fake engines']['argv'][-1]}"
    assert procs["router"]["argv"].count(fakes) == 2  # one fake process serves both roles
    assert procs["router"]["core"] != procs["fake engines"]["core"] or got["settings"]["shared_core"]
    assert [p["name"] for p in got["phases"]] == ["added latency", "non_streaming", "streaming"]
    assert got["phases"][1]["load"] == "concurrency:8" and got["phases"][0]["pairs"] == 5
