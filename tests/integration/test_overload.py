"""Overload with real engines: closed-loop clients sending long prompts for twenty seconds (the first round
of prompts already passes the queue bound).

Admission by work must keep every admitted request inside its timeout and refuse the rest at once with
429 + Retry-After, counted in /metrics; no 5xx, no prompt dumped on a busy decode engine. The load is
sized from the engines' measured prompt speed (``/pdserve/status``), so that it exceeds what the engines
finish within ``router.max_queue_wait_s`` on a fast host and a slow one alike. No wall-clock assertion:
the client timeout is a bound on hanging, derived from the same measured speed.
"""

from __future__ import annotations

import random
import threading
import time

import httpx
import pytest

from tests.integration.conftest import ServeProcess
from tests.integration.test_pd_real import MODEL, metric

pytestmark = pytest.mark.integration

CLIENTS = 8
SECONDS = 20
#: Seconds of one prefill (at the measured speed) each prompt is sized to.
PROMPT_SECONDS = 1.5


def test_long_prompt_overload_refuses_fast_and_admitted_requests_finish(served: ServeProcess):
    status = served.status()
    prefill = [e for e in status["engines"] if e["role"] == "prefill" and e.get("prompt_tokens_per_s")]
    assert prefill, f"the router has not measured a prefill engine: {status['engines']}"
    rate = prefill[0]["prompt_tokens_per_s"]
    n_tokens = int(min(1800, max(128, rate * PROMPT_SECONDS)))
    # CLIENTS prompts of PROMPT_SECONDS each are 12 s of queue: more than max_queue_wait_s (8 s) holds.
    # An admitted request waits at most ~8 s, then runs: far inside this bound unless something hangs.
    timeout_s = 8 + 20 * PROMPT_SECONDS + 60
    metrics_url = served.url + "/metrics?engines=0"
    refused_before = metric(httpx.get(metrics_url).text, "pdserve_admission_refused_total")
    results: list[tuple[int, str | None, str]] = []  # status, Retry-After, error
    lock = threading.Lock()
    deadline = time.monotonic() + SECONDS

    def client(seed: int) -> None:
        rng = random.Random(seed)
        with httpx.Client(timeout=timeout_s) as c:
            while time.monotonic() < deadline:
                body = {"model": MODEL, "prompt": [rng.randrange(200, 40000) for _ in range(n_tokens)],
                        "max_tokens": rng.choice([2, 32]), "ignore_eos": True, "stream": rng.random() < 0.5}
                try:
                    r = c.post(served.url + "/v1/completions", json=body)
                    got = (r.status_code, r.headers.get("retry-after"), "" if r.status_code < 500 else r.text[:200])
                except httpx.TimeoutException as e:
                    got = (0, None, f"client timeout after {timeout_s:.0f}s: {e!r}")
                with lock:
                    results.append(got)
                if got[0] == 429:
                    time.sleep(float(got[1] or 1))

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=SECONDS + timeout_s + 30)
    assert not any(t.is_alive() for t in threads), "a client never returned"

    codes = [s for s, _, _ in results]
    failures = [(s, e) for s, _, e in results if s not in (200, 429)]
    assert not failures, f"requests failed or hung (status 0 = client timeout): {failures[:5]}"
    assert codes.count(200) >= CLIENTS, codes
    assert codes.count(429) > 0, f"{CLIENTS} clients of {n_tokens}-token prompts never exceeded the queue bound"
    assert all(ra is not None and int(ra) >= 1 for s, ra, _ in results if s == 429)
    # /metrics counted every refusal, by cause.
    refused = metric(httpx.get(metrics_url).text, "pdserve_admission_refused_total") - refused_before
    assert refused == codes.count(429), (refused, codes.count(429))
    # Afterwards nothing is held: every admitted request gave its claims back, and the engines answer.
    settle = time.monotonic() + 30
    while True:
        engines = served.status()["engines"]
        if all(e["queued_prompt_tokens"] == 0 and e["streams"] == 0 and e["pending_pd"] == 0 for e in engines):
            break
        assert time.monotonic() < settle, engines
        time.sleep(0.5)
    assert served.status()["router"]["inflight"] == 0
    assert httpx.get(served.url + "/health").status_code == 200


def test_calibrated_prompt_speed_is_within_2x_of_the_speed_of_the_next_prompts(served: ServeProcess):
    """The router calibrates each engine's prompt speed after a warm-up prompt: the figure admission starts
    from is within 2x of what the engine then computes (prompts of 1,000 tokens, timed one at a time, side
    by side in this run)."""
    from tests.integration.conftest import engine_auth

    deadline = time.monotonic() + 120
    while True:
        pre = next(e for e in served.status()["engines"] if e["role"] == "prefill")
        if pre.get("calibrated_prompt_tokens_per_s") or time.monotonic() > deadline:
            break
        time.sleep(2)
    calibrated = pre["calibrated_prompt_tokens_per_s"]
    assert calibrated, pre
    rng = random.Random(77)
    speeds = []
    for _ in range(3):
        prompt = [rng.randrange(200, 40000) for _ in range(1000)]
        t0 = time.perf_counter()
        r = httpx.post(pre["url"] + "/v1/completions", headers=engine_auth(pre["url"]), timeout=300,
                       json={"model": MODEL, "prompt": prompt, "max_tokens": 1})
        took = time.perf_counter() - t0
        assert r.status_code == 200, r.text
        speeds.append(r.json()["usage"]["prompt_tokens"] / took)
    measured = sorted(speeds)[1]
    assert 0.5 <= calibrated / measured <= 2.0, (calibrated, speeds)
