"""The KV lease check end to end (fake engines): a prefill engine that is gone by the time decode answers
cannot confirm its lease, so the router answers from a recompute on decode."""

from __future__ import annotations

import threading
import time

import pytest

from pdserve.testing.fake_engine import expected_words
from tests.component.test_router import System, completion


def _wait(cond, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.mark.parametrize("stream", [False, True])
def test_prefill_gone_before_the_lease_check_recomputes_on_decode(stream):
    with System() as s:
        s.orch.lease_check_after_s = 0.0  # check every handoff
        decode = s.decode[0]
        decode.faults.delay_s = 1.0  # decode answers late enough for the prefill engine to be stopped first
        result: dict[str, object] = {}

        def send() -> None:
            if stream:
                with s.client.stream("POST", "/v1/completions", json=completion(stream=True)) as r:
                    result["status"] = r.status_code
                    result["body"] = "\n".join(r.iter_lines())
            else:
                r = s.client.post("/v1/completions", json=completion())
                result["status"], result["body"] = r.status_code, r.text

        t = threading.Thread(target=send)
        t.start()
        _wait(lambda: decode.counters["requests"] >= 1)  # the prefill leg is over: decode has the request
        s.servers[0].__exit__()  # the prefill engine goes away
        t.join(timeout=30)
        assert not t.is_alive()

        assert result["status"] == 200, result
        want = expected_words("one two three", 8)
        assert all(w in str(result["body"]) for w in want), result
        assert decode.counters["pulled"] == 1  # the first answer used the pulled blocks ...
        assert decode.counters["recomputed"] == 1  # ... and was replaced by a local prefill on decode
        assert decode.requests[-1].get("kv_transfer_params") is None
        # The recompute's stream reaches the client as the one it replaced would have: without the ids its
        # engine was asked for (a movable stream's), and movable itself.
        assert "token_ids" not in str(result["body"]), result
        if stream:
            assert decode.requests[-1].get("return_token_ids") is True
        assert s.orch.metrics.kv_lease.labels("unknown")._value.get() == 1
        assert s.orch.metrics.decisions.labels("local", "kv_lease_lost")._value.get() == 1
