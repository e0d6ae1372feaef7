"""Tenants through a router over fake engines on loopback (the limits, shares and priorities themselves:
tests/unit/test_tenants.py)."""

from __future__ import annotations

import contextlib

import httpx


@contextlib.contextmanager
def httpx_client(url: str):
    with httpx.Client(base_url=url, timeout=20) as c:
        yield c


def test_tenants_through_the_router(monkeypatch):
    """With fake engines: a tenant over its limit gets 429 naming it, the engines see each tenant's salt,
    and a tenant's status shows its own figures only."""
    from tests.component.test_router import MODEL, System

    monkeypatch.setenv("KEYS_ACME", "ka")
    monkeypatch.setenv("KEYS_BETA", "kb")
    with System(tenants={"acme": {"keys_env": "KEYS_ACME", "requests_per_s": 1},
                         "beta": {"keys_env": "KEYS_BETA", "priority": 1}}, api_keys=["kop"]) as s:
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
        # Not where the engines run, nor anything that counts every tenant's work (their load, decisions).
        assert status["engines"] and all(set(e) <= {"role", "replica_id", "healthy"}
                                         for e in status["engines"])
        assert not {"decisions", "router", "kv_cache_routing", "pd_in_effect"} & set(status), status
        full = s.client.get("/pdserve/status", headers={"Authorization": "Bearer kop"}).json()
        assert "decisions" in full and "queued_prompt_tokens" in full["engines"][0]
        # /metrics counts every tenant by name: the operator's (a key of router.api_keys), not a tenant's.
        for path in ("/metrics", "/metrics?engines=0"):
            r = s.client.get(path, headers=b)
            assert r.status_code == 403 and "acme" not in r.text, r.text
        text = s.client.get("/metrics?engines=0", headers={"Authorization": "Bearer kop"}).text
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


def test_embeddings_and_score_carry_the_tenants_salt_as_generation_does(monkeypatch):
    """vLLM's pooling requests run the model over the prompt with the prefix cache: each tenant's carries its
    own salt (with the client's inside); tokenize, which computes nothing, goes as it came."""
    from tests.component.test_router import MODEL, System

    monkeypatch.setenv("KEYS_TRIAL", "kt")
    with System(tenants={"trial": {"keys_env": "KEYS_TRIAL"}}) as s:
        sent: list[tuple[str, dict]] = []

        async def forward(path, body, rid):
            sent.append((path, dict(body)))
            return 200, b"{}", "application/json"

        monkeypatch.setattr(s.orch, "forward", forward)
        h = {"Authorization": "Bearer kt"}
        for path, body in (("/v1/embeddings", {"input": "a b"}), ("/v1/score", {"text_1": "a", "text_2": "b",
                                                                                "cache_salt": "mine"}),
                           ("/tokenize", {"prompt": "a b"})):
            assert s.client.post(path, json={"model": MODEL, **body}, headers=h).status_code == 200
        tenants = s.orch.gate.tenants
        assert sent[0][1]["cache_salt"] == tenants.salt("trial", None)
        assert sent[1][1]["cache_salt"] == tenants.salt("trial", "mine") != "mine"
        assert "cache_salt" not in sent[2][1]


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


def test_a_tenants_output_limit_counts_every_sequence_and_the_context_a_request_may_fill(monkeypatch):
    """``output_tokens_per_min`` is charged what the engine may generate: the context left after the prompt
    when ``max_tokens`` is not given (it was charged 0), and each sequence of ``n`` and of a batch's prompts
    (it was charged once)."""
    from pdserve.router.build import build_router
    from pdserve.router.validate import EngineLimits
    from pdserve.testing.thread_server import ThreadServer
    from tests.component.test_router import MODEL, System

    monkeypatch.setenv("KEYS_TRIAL", "kt")
    cfg = {"trial": {"keys_env": "KEYS_TRIAL", "output_tokens_per_min": 1_000_000}}
    with System(tenants=cfg) as s:
        router = build_router(s.orch.cfg, MODEL, endpoints=s.pool.endpoints(), limits=EngineLimits(max_model_len=512))
        tenants = router.orchestrator.gate.tenants
        charged = lambda: tenants.summary()["trial"]["output_tokens"]  # noqa: E731
        with ThreadServer(router.app) as srv, httpx_client(srv.url) as c:
            h = {"Authorization": "Bearer kt"}
            r = c.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
                       headers=h)
            assert r.status_code == 200, r.text
            first = charged()
            assert 400 < first < 512  # the context less the prompt
            r = c.post("/v1/completions", json={"model": MODEL, "prompt": ["a b"] * 20, "n": 5, "max_tokens": 9},
                       headers=h)
            assert r.status_code == 200, r.text
            assert charged() - first == 20 * 5 * 9


def test_a_chunked_body_on_a_one_engine_route_is_charged_as_read(monkeypatch):
    """/tokenize charges a tenant's prompt tokens by the body's bytes as read, not by its Content-Length: a
    chunked body has none (it was charged nothing)."""
    from tests.component.test_router import MODEL, System

    monkeypatch.setenv("KEYS_TRIAL", "kt")
    with System(tenants={"trial": {"keys_env": "KEYS_TRIAL", "prompt_tokens_per_min": 1_000_000}}) as s:
        body = ('{"model": "%s", "prompt": "%s"}' % (MODEL, "word " * 2000)).encode()

        def chunks():
            for i in range(0, len(body), 1000):
                yield body[i:i + 1000]

        r = s.client.post("/tokenize", content=chunks(), headers={"Authorization": "Bearer kt",
                                                                  "Content-Type": "application/json"})
        assert r.status_code == 200, r.text
        assert s.orch.gate.tenants.summary()["trial"]["prompt_tokens"] == len(body) // 4


def test_a_tenant_over_its_limit_is_refused_before_its_body_is_parsed(monkeypatch):
    """On the generation routes too the tenant's limits come first: a body the router would refuse as bad
    JSON is a 429 for a tenant with no request left, never parsed; and a higher-priority tenant whose
    requests are all refused holds no lower priority back."""
    from pdserve.router import body
    from tests.component.test_router import MODEL, System

    monkeypatch.setenv("KEYS_GOLD", "kg")
    monkeypatch.setenv("KEYS_BULK", "kb")
    with System(tenants={"gold": {"keys_env": "KEYS_GOLD", "priority": 1, "requests_per_s": 1},
                         "bulk": {"keys_env": "KEYS_BULK", "priority": 0}}) as s:
        gold = {"Authorization": "Bearer kg", "Content-Type": "application/json"}
        assert s.client.post("/v1/completions", content=b"not json", headers=gold).status_code == 400
        long = {"model": MODEL, "prompt": "word " * 3000, "max_tokens": 2}
        r = s.client.post("/v1/completions", json=long, headers={"Authorization": "Bearer kb"})
        assert r.status_code == 200, r.text  # gold's refused request made it no active tenant
        ok = {"model": MODEL, "prompt": "one two", "max_tokens": 2}
        assert s.client.post("/v1/completions", json=ok, headers=gold).status_code == 200  # its one a second
        parsed: list[int] = []
        real = body.parse_body
        monkeypatch.setattr(body, "parse_body", lambda raw: parsed.append(len(raw)) or real(raw))
        r = s.client.post("/v1/completions", content=b"not json", headers=gold)
        assert r.status_code == 429 and parsed == [], r.text


def test_a_tenant_without_limits_leaves_the_last_slots_of_a_cap_to_others(monkeypatch):
    """With tenants, a tenant with no limit of its own fills a hard in-flight cap only up to its last eighth
    (one slot here); a tenant under its share still gets in. Before, the first took every slot with long
    streams and every other tenant's first request was refused at once."""
    import threading
    import time

    from pdserve.config.schema import RouterConfig
    from pdserve.router.build import build_router
    from pdserve.testing.thread_server import ThreadServer
    from tests.component.test_router import MODEL, System

    monkeypatch.setenv("KEYS_BIG", "kbig")
    monkeypatch.setenv("KEYS_SMALL", "ksmall")
    with System() as s:
        s.decode[0].faults.delay_s = 3.0  # long answers hold their slots
        cfg = RouterConfig(prefill_timeout_s=5, decode_timeout_s=10, local_prefill_below_tokens=0,
                           max_inflight_per_decode_engine=4,
                           tenants={"big": {"keys_env": "KEYS_BIG"}, "small": {"keys_env": "KEYS_SMALL"}})
        built = build_router(cfg, MODEL, endpoints=s.pool.endpoints())
        body = {"model": MODEL, "prompt": "one two three", "max_tokens": 4}
        with ThreadServer(built.app) as srv:
            codes: list[int] = []

            def big() -> None:
                with httpx.Client(base_url=srv.url, timeout=20) as c:
                    r = c.post("/v1/completions", json=body, headers={"Authorization": "Bearer kbig"})
                    codes.append(r.status_code)

            threads = [threading.Thread(target=big) for _ in range(3)]
            for t in threads:
                t.start()
            deadline = time.monotonic() + 10
            while built.orchestrator.gate.admitted["decode"] < 3 and time.monotonic() < deadline:
                time.sleep(0.02)
            with httpx.Client(base_url=srv.url, timeout=20) as c:
                fourth = c.post("/v1/completions", json=body, headers={"Authorization": "Bearer kbig"})
                assert fourth.status_code == 429 and "share" in fourth.json()["error"]["message"], fourth.text
                small = c.post("/v1/completions", json=body, headers={"Authorization": "Bearer ksmall"})
                assert small.status_code == 200, small.text
            for t in threads:
                t.join()
            assert codes == [200, 200, 200]


def test_asking_for_a_stored_response_is_a_request_of_its_tenant(monkeypatch):
    """Locating a response id asks every engine: a tenant's GETs and cancels are charged like any request, so
    one at its rate is refused before it asks them."""
    from tests.component.test_router import System

    monkeypatch.setenv("KEYS_ACME", "ka")
    with System(tenants={"acme": {"keys_env": "KEYS_ACME", "requests_per_s": 1}}) as s:
        a = {"Authorization": "Bearer ka"}
        first = s.client.get("/v1/responses/resp_unknown", headers=a)
        assert first.status_code == 404, first.text
        again = s.client.post("/v1/responses/resp_unknown/cancel", headers=a)
        assert again.status_code == 429 and "requests_per_s" in again.json()["error"]["message"], again.text
        assert s.orch.gate.tenants.summary("acme")["acme"]["inflight"] == 0
