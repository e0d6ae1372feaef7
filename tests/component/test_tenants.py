"""Tenants through a router over fake engines on loopback (the limits, shares and priorities themselves:
tests/unit/test_tenants.py)."""

from __future__ import annotations


def test_tenants_through_the_router(monkeypatch):
    """With fake engines: a tenant over its limit gets 429 naming it, the engines see each tenant's salt,
    and a tenant's status shows its own figures only."""
    from tests.component.test_router import MODEL, System

    monkeypatch.setenv("KEYS_ACME", "ka")
    monkeypatch.setenv("KEYS_BETA", "kb")
    with System(tenants={"acme": {"keys_env": "KEYS_ACME", "requests_per_s": 1},
                         "beta": {"keys_env": "KEYS_BETA", "priority": 1}}) as s:
        a, b = {"Authorization": "Bearer ka"}, {"Authorization": "Bearer kb"}
        body = {"model": MODEL, "prompt": "one two three", "max_tokens": 2}
        assert s.client.post("/v1/completions", json=body, headers=a).status_code == 200
        r = s.client.post("/v1/completions", json=body, headers=a)
        assert r.status_code == 429 and "requests_per_s" in r.json()["error"]["message"]
        assert int(r.headers["retry-after"]) >= 1
        assert s.client.post("/v1/completions", json={**body, "cache_salt": "x"}, headers=b).status_code == 200
        salts = [req.get("cache_salt") for req in s.decode[0].requests]
        assert len(set(salts)) == 2 and all(salts)
        status = s.client.get("/pdserve/status", headers=b).json()
        assert list(status["tenants"]) == ["beta"] and status["tenants"]["beta"]["admitted"] == 1
        text = s.client.get("/metrics?engines=0", headers=b).text
        assert 'pdserve_tenant_refused_total{cause="requests_per_s",tenant="acme"} 1.0' in text


def test_under_load_the_tenant_over_its_share_is_refused_first(monkeypatch):
    """With prefill's queue at a few seconds, a request of the tenant holding more than its share is refused
    while the other tenant's (same priority) is admitted: the same wait, different budgets."""
    from tests.component.test_router import MODEL, System

    monkeypatch.setenv("KEYS_GOLD", "kg")
    monkeypatch.setenv("KEYS_FLOOD", "kf")
    with System(tenants={"gold": {"keys_env": "KEYS_GOLD", "priority": 0},
                         "flood": {"keys_env": "KEYS_FLOOD", "priority": 0}}) as s:
        held = [s.orch.gate.tenants.admit("flood", 10, 10) for _ in range(3)]  # the flooder's requests in flight
        held.append(s.orch.gate.tenants.admit("gold", 10, 10))
        pre = next(ep for ep in s.pool.endpoints() if ep.role == "prefill")
        pre.load.calibrated_rate = 2000.0  # admission's rate: 1,000 tokens/s (derated)
        pre.load.add_prompt(3000)  # 3 s of prompts queued: over the flooder's budget, within gold's
        dec = next(ep for ep in s.pool.endpoints() if ep.role == "decode")
        dec.load.add_stream()  # decode busy streaming: the prompt cannot be computed there instead
        body = {"model": MODEL, "prompt": "one two three", "max_tokens": 2}
        flood = s.client.post("/v1/completions", json=body, headers={"Authorization": "Bearer kf"})
        gold = s.client.post("/v1/completions", json=body, headers={"Authorization": "Bearer kg"})
        assert flood.status_code == 429, flood.text
        assert gold.status_code == 200, gold.text
        refused = s.orch.gate.tenants.summary()["flood"]["refused"]
        assert sum(refused.values()) == 1 and "gold" not in str(refused)
        for t in held:
            s.orch.gate.tenants.release(t)


def test_one_engine_routes_count_against_the_tenants_limits(monkeypatch):
    """/tokenize, /detokenize, /v1/embeddings, /v1/score reach an engine too: a tenant at its limits is refused
    there as on generation, and nothing reaches the engine."""
    from tests.component.test_router import MODEL, System

    monkeypatch.setenv("KEYS_TRIAL", "kt")
    with System(tenants={"trial": {"keys_env": "KEYS_TRIAL", "requests_per_s": 1, "max_concurrent": 1}}) as s:
        h = {"Authorization": "Bearer kt"}
        gen = {"model": MODEL, "prompt": "one two three", "max_tokens": 2}
        assert s.client.post("/v1/completions", json=gen, headers=h).status_code == 200
        before = s.prefill[0].counters["requests"]
        r = s.client.post("/tokenize", json={"model": MODEL, "prompt": "a b c " * 5000}, headers=h)
        assert r.status_code == 429 and "requests_per_s" in r.json()["error"]["message"]
        assert s.prefill[0].counters["requests"] == before
        assert s.orch.gate.tenants.summary()["trial"]["inflight"] == 0


def test_engines_that_schedule_by_priority_get_each_tenants(monkeypatch):
    """Engines run with ``scheduling_policy: priority`` (every role): both legs of a request carry its
    tenant's priority as vLLM reads it (lower first); engines that do not get none (they would refuse it)."""
    from pdserve.router.validate import EngineLimits
    from tests.component.test_router import MODEL, System

    monkeypatch.setenv("KEYS_GOLD", "kg")
    monkeypatch.setenv("KEYS_BULK", "kb")
    with System(tenants={"gold": {"keys_env": "KEYS_GOLD", "priority": 5},
                         "bulk": {"keys_env": "KEYS_BULK", "priority": -2}}) as s:
        body = {"model": MODEL, "prompt": "one two three", "max_tokens": 2}
        assert s.client.post("/v1/completions", json=body, headers={"Authorization": "Bearer kg"}).status_code == 200
        assert "priority" not in s.prefill[0].requests[-1] and "priority" not in s.decode[0].requests[-1]
        s.orch.gate.validator.limits = EngineLimits.from_engine_kwargs({"scheduling_policy": "priority"},
                                                                       {"scheduling_policy": "priority"})
        for key, want in (("kg", -5), ("kb", 2)):
            r = s.client.post("/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                              json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
            assert r.status_code == 200, r.text
            assert s.prefill[0].requests[-1]["priority"] == want and s.decode[0].requests[-1]["priority"] == want
        mine = s.client.post("/v1/completions", json={**body, "priority": -100}, headers={"Authorization": "Bearer kb"})
        assert mine.status_code == 400 and mine.json()["error"]["param"] == "priority"  # never the client's own
