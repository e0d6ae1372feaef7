"""The router against fake engines on loopback: the P/D protocol, streaming, errors, fallbacks (what needs
no engine: tests/unit/test_router.py)."""

from __future__ import annotations

import json

import httpx
import pytest

from pdserve.config.schema import RouterConfig
from pdserve.router.build import Router, build_router
from pdserve.router.endpoint import Endpoint
from pdserve.router.orchestrator import Orchestrator
from pdserve.router.pool import EnginePool
from pdserve.testing.fake_engine import FakeEngine, build_fake_engine, expected_words
from pdserve.testing.thread_server import ThreadServer
from tests import sse

MODEL = "fake-model"


class System:
    def __init__(self, n_prefill: int = 1, n_decode: int = 1, policy: str = "round_robin",
                 engine_keys: bool = False, adapters: set[str] | None = None, lora_root: str | None = None,
                 api_keys: list[str] | None = None, tenants: dict | None = None) -> None:
        self.api_keys = list(api_keys or [])
        self.tenants = dict(tenants or {})
        self.prefill = [FakeEngine("prefill", MODEL) for _ in range(n_prefill)]
        self.decode = [FakeEngine("decode", MODEL) for _ in range(n_decode)]
        for e in self.prefill + self.decode:
            e.adapters = set(adapters or ())
        self.lora_root = lora_root
        if engine_keys:
            for i, e in enumerate(self.prefill + self.decode):
                e.api_key = f"key-{e.role}-{i}"
        self.servers = [ThreadServer(build_fake_engine(e)) for e in self.prefill + self.decode]
        self.policy = policy

    def __enter__(self) -> System:
        for s in self.servers:
            s.__enter__()
        eps = [Endpoint(role=e.role, url=s.url, engine_id=e.engine_id, api_key=e.api_key)  # type: ignore[arg-type]
               for e, s in zip(self.prefill + self.decode, self.servers)]
        for ep in eps:
            ep.load.calibrated_rate = 1e6  # fakes answer at once; admission by work is tested on its own
        # Every prompt disaggregated: the fakes' measured speeds are not an engine's (see the test of ``auto``).
        cfg = RouterConfig(policy=self.policy, prefill_timeout_s=5, decode_timeout_s=10, max_body_bytes=64 * 1024,
                           local_prefill_below_tokens=0, api_keys=self.api_keys, tenants=self.tenants)
        built = build_router(cfg, MODEL, endpoints=eps, lora_root=self.lora_root)
        self.pool, self.orch = built.pool, built.orchestrator
        self.router = ThreadServer(built.app).__enter__()
        self.client = httpx.Client(base_url=self.router.url, timeout=20)
        return self

    def router_for(self, cfg: RouterConfig) -> Router:
        """Another router, by ``cfg``, over these engines."""
        return build_router(cfg, MODEL, endpoints=self.pool.endpoints())

    def __exit__(self, *exc: object) -> None:
        self.client.close()
        self.router.__exit__()
        for s in self.servers:
            s.__exit__()


@pytest.fixture
def pd():
    with System() as s:
        yield s


def completion(prompt: str = "one two three", **kw):
    return {"model": MODEL, "prompt": prompt, "max_tokens": 8, **kw}


def test_completion_goes_through_both_legs(pd):
    r = pd.client.post("/v1/completions", json=completion(), headers={"X-Request-Id": "rid-1"})
    assert r.status_code == 200, r.text
    assert r.headers["x-request-id"] == "rid-1"
    assert r.json()["choices"][0]["text"] == " ".join(expected_words("one two three", 8))
    p, d = pd.prefill[0], pd.decode[0]
    assert p.requests[0]["max_tokens"] == 1 and p.requests[0]["stream"] is False
    assert p.requests[0]["kv_transfer_params"]["do_remote_decode"] is True
    assert d.requests[0]["max_tokens"] == 8
    assert d.requests[0]["kv_transfer_params"]["remote_engine_id"] == p.engine_id
    assert d.counters["pulled"] == 1 and d.counters["recomputed"] == 0
    assert p.held == {}  # decode pulled the blocks


def test_chat_streaming_equals_non_streaming(pd):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 6}
    full = pd.client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
    with pd.client.stream("POST", "/v1/chat/completions",
                          json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        got = sse.read(r.iter_lines())
    assert got.done and got.usage["completion_tokens"] == 6
    assert got.text == full
    assert pd.orch.gate.admitted == {"prefill": 0, "decode": 0}  # the ended stream gave its slots back
    # The prefill leg never streams, whatever the client asked.
    assert all(req["stream"] is False and "stream_options" not in req for req in pd.prefill[0].requests)


def test_openai_client_chat_and_completions(pd):
    import openai  # a dev dependency (make setup): never skipped
    client = openai.OpenAI(base_url=pd.router.url + "/v1", api_key="x")
    c = client.completions.create(model=MODEL, prompt="a b c", max_tokens=4)
    assert c.choices[0].text == " ".join(expected_words("a b c", 4))
    ch = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a b c"}], max_tokens=4)
    assert ch.choices[0].message.content == " ".join(expected_words("a b c", 4))
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_missing_model_field_defaults_and_unknown_model_is_404(pd):
    body = completion()
    body.pop("model")
    assert pd.client.post("/v1/completions", json=body).status_code == 200
    r = pd.client.post("/v1/completions", json=completion(model="gpt-9"))
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "model_not_found"
    assert pd.prefill[0].counters["requests"] == 1  # the 404 never reached an engine


@pytest.mark.parametrize("raw, status, needle", [
    (b"{not json", 400, "not valid JSON"),
    (b"[1, 2]", 400, "JSON object"),
    (b"", 400, "empty"),
    (b'{"prompt": "\xff\xfe"}', 400, "UTF-8"),
    (json.dumps(completion(max_tokens=0)).encode(), 400, "max_tokens"),
    (json.dumps(completion(n=10_000)).encode(), 400, "'n'"),
    (b"x" * (70 * 1024), 413, "limit"),
])
def test_bad_input_is_a_4xx_openai_error(pd, raw, status, needle):
    r = pd.client.post("/v1/completions", content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code == status
    err = r.json()["error"]
    assert needle in err["message"] and err["type"]
    assert pd.prefill[0].held == {}


def test_engine_4xx_is_passed_through(pd):
    r = pd.client.post("/v1/completions", json=completion(prompt="w " * 5000))
    assert r.status_code == 400
    assert "max_model_len" in r.json()["error"]["message"]
    assert pd.decode[0].counters["requests"] == 0


def test_missing_kv_params_means_local_prefill(pd):
    pd.prefill[0].faults.drop_kv_params = True
    r = pd.client.post("/v1/completions", json=completion())
    assert r.status_code == 200
    assert pd.decode[0].counters["recomputed"] == 1
    assert "kv_transfer_params" not in pd.decode[0].requests[0]
    assert pd.orch.stats["no_kv_params"] == 1


def test_requests_that_cannot_split_run_on_decode(pd):
    for body in (completion(n=2), completion(max_tokens=1), completion(echo=True)):
        assert pd.client.post("/v1/completions", json=body).status_code == 200
    assert pd.prefill[0].counters["requests"] == 0
    assert pd.orch.stats["local"] == 3


def test_prefill_failure_falls_back_to_decode(pd):
    pd.prefill[0].faults.fail_status = 500
    r = pd.client.post("/v1/completions", json=completion())
    assert r.status_code == 200
    assert r.json()["choices"][0]["text"] == " ".join(expected_words("one two three", 8))
    assert pd.orch.stats["prefill_fallback"] == 1


def test_second_prefill_replica_takes_over():
    with System(n_prefill=2) as s:
        s.prefill[0].faults.fail_status = 503
        s.prefill[1].faults.fail_status = None
        for _ in range(4):
            assert s.client.post("/v1/completions", json=completion()).status_code == 200
        assert s.decode[0].counters["pulled"] == 4
        assert s.orch.stats["prefill_fallback"] == 0


def test_no_engine_is_503(pd):
    for ep in pd.pool.endpoints():
        pd.pool.mark_failed(ep)
    r = pd.client.post("/v1/completions", json=completion())
    assert r.status_code == 503
    assert r.json()["error"]["type"] == "service_unavailable"
    assert pd.client.get("/health").status_code == 503


def test_mid_stream_death_of_a_stream_that_cannot_move_ends_with_error_event(pd):
    pd.decode[0].faults.die_mid_stream_after = 2
    # stop strings keep a stream on its engine (router/migrate.py); test_migrate.py has the streams that move
    with pd.client.stream("POST", "/v1/completions", json=completion(stream=True, stop=["zz"])) as r:
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    assert '"error"' in lines[-2]


def test_round_robin_spreads_over_replicas():
    with System(n_prefill=2, n_decode=2) as s:
        for i in range(8):
            assert s.client.post("/v1/completions", json=completion(prompt=f"p {i}")).status_code == 200
        assert [e.counters["requests"] for e in s.prefill] == [4, 4]
        assert [e.counters["pulled"] for e in s.decode] == [4, 4]


def test_health_models_status(pd):
    assert pd.client.get("/health").status_code == 200
    models = pd.client.get("/v1/models").json()
    assert models["object"] == "list" and [(m["id"], m["object"]) for m in models["data"]] == [(MODEL, "model")]
    st = pd.client.get("/pdserve/status").json()
    assert {e["role"] for e in st["engines"]} == {"prefill", "decode"}


def test_metrics_exposition(pd):
    pd.client.post("/v1/completions", json=completion())
    with pd.client.stream("POST", "/v1/completions", json=completion(stream=True)) as r:
        list(r.iter_lines())
    pd.client.post("/v1/completions", json=completion(model="nope"))
    text = pd.client.get("/metrics").text
    assert 'pdserve_requests_total{route="completions",status="200"} 2.0' in text
    assert 'pdserve_requests_total{route="completions",status="404"} 1.0' in text
    assert 'pdserve_pd_decisions_total{decision="pd",reason="pd"} 2.0' in text
    for phase in ("prefill", "kv_handoff", "decode"):
        assert f'pdserve_phase_duration_seconds_count{{phase="{phase}"}}' in text
    assert "pdserve_time_to_first_token_seconds_bucket" in text
    assert 'pdserve_errors_total{cause="ModelNotFound"} 1.0' in text
    # Engine metrics come through with role labels, one family each.
    assert 'fake_requests{pdserve_replica=' in text and 'pdserve_role="decode"' in text
    assert text.count("# TYPE fake_requests ") == 1


def test_metrics_pass_promtool(pd):
    from tests.promtool import check_metrics

    pd.client.post("/v1/completions", json=completion())
    check_metrics(pd.client.get("/metrics").text)


def test_api_keys(monkeypatch):
    monkeypatch.setenv("PDSERVE_TEST_KEYS", "env-key-1, env-key-2")
    with System() as s:
        cfg = RouterConfig(api_keys=["cfg-key"], api_keys_env="PDSERVE_TEST_KEYS")
        app = s.router_for(cfg).app
        with ThreadServer(app) as srv, httpx.Client(base_url=srv.url, timeout=20) as c:
            assert c.get("/health").status_code == 200  # open for probes
            r = c.post("/v1/completions", json=completion())
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
            assert c.post("/v1/completions", json=completion(),
                          headers={"Authorization": "Bearer wrong"}).status_code == 401
            assert c.get("/v1/models").status_code == 401
            for key in ("cfg-key", "env-key-1", "env-key-2"):
                r = c.post("/v1/completions", json=completion(), headers={"Authorization": f"Bearer {key}"})
                assert r.status_code == 200, key


def test_a_client_request_id_is_never_an_engine_request_id_on_any_route():
    """Engines keep things under a request's id: two clients sending the same ``X-Request-Id`` get engine ids
    of their own on generation and on the one-engine routes alike (the client reads its own back: the
    ingress's echo, tests/component/test_ingress.py). And the scheme of ``Authorization`` is read in any case (RFC 9110)."""
    with System() as s:
        cfg = RouterConfig(api_keys=["k1"], local_prefill_below_tokens=0)
        with ThreadServer(s.router_for(cfg).app) as srv, httpx.Client(base_url=srv.url, timeout=20) as c:
            for path, body in (("/v1/completions", completion()), ("/tokenize", {"prompt": "one two"}),
                               ("/v1/embeddings", {"input": "one two"})):
                for scheme in ("Bearer", "bearer"):
                    r = c.post(path, json={"model": MODEL, **body},
                               headers={"X-Request-Id": "victim-1", "Authorization": f"{scheme} k1"})
                    assert r.status_code in (200, 400), (path, r.text)  # (the fake engine embeds nothing)
            ids = [i for e in s.prefill + s.decode for i in e.request_ids if i and i.startswith("victim-1")]
            assert ids and all(i != "victim-1" for i in ids), ids
            assert len(set(ids)) >= 5  # a fresh suffix each request


def test_api_keys_from_the_environment_alone(monkeypatch):
    """How a rendered cluster passes keys: PDSERVE_API_KEYS from a Secret, none in the config."""
    monkeypatch.setenv("PDSERVE_API_KEYS", "secret-key-1\nsecret-key-2,\n")  # a key file: one per line
    with System() as s:
        cfg = RouterConfig()
        assert cfg.api_keys == [] and cfg.api_keys_env == "PDSERVE_API_KEYS"
        app = s.router_for(cfg).app
        with ThreadServer(app) as srv, httpx.Client(base_url=srv.url, timeout=20) as c:
            assert c.get("/health").status_code == 200
            assert c.post("/v1/completions", json=completion()).status_code == 401
            assert c.post("/v1/completions", json=completion(),
                          headers={"Authorization": "Bearer secret-key-1,secret-key-2"}).status_code == 401
            for key in ("secret-key-1", "secret-key-2"):
                r = c.post("/v1/completions", json=completion(), headers={"Authorization": f"Bearer {key}"})
                assert r.status_code == 200, key


def test_overload_is_429_with_retry_after():
    import concurrent.futures

    with System() as s:
        cfg = RouterConfig(max_inflight=2, decode_timeout_s=10)
        s.decode[0].faults.delay_s = 1.0
        app = s.router_for(cfg).app
        with ThreadServer(app) as srv:
            def call(_: int) -> httpx.Response:
                return httpx.post(srv.url + "/v1/completions", json=completion(), timeout=20)

            with concurrent.futures.ThreadPoolExecutor(6) as ex:
                rs = list(ex.map(call, range(6)))
            codes = sorted(r.status_code for r in rs)
            assert codes.count(200) >= 2 and 429 in codes
            r429 = next(r for r in rs if r.status_code == 429)
            assert r429.headers["retry-after"] == "1"
            assert r429.json()["error"]["type"] == "rate_limit_error"
            # Slots are given back: afterwards requests are admitted again.
            s.decode[0].faults.delay_s = 0
            assert call(0).status_code == 200


def test_dashboard_is_current_and_uses_exposed_metrics(pd):
    import re
    from pathlib import Path

    from pdserve.router.dashboard import build_dashboard

    path = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "pdserve-dashboard.json"
    assert json.loads(path.read_text()) == build_dashboard(), \
        "run: python -m pdserve.router.dashboard > deploy/grafana/pdserve-dashboard.json"
    pd.client.post("/v1/completions", json=completion(stream=True))
    exposed = pd.client.get("/metrics").text
    for panel in build_dashboard()["panels"]:
        for t in panel["targets"]:
            for name in re.findall(r"(pdserve_[a-z_]+)", t["expr"]):
                base = re.sub(r"_(bucket|total)$", "", name)
                assert base in exposed, f"dashboard uses {name}, the router does not expose it"


def test_conditional_disaggregation_keeps_short_prompts_local():
    from pathlib import Path

    from pdserve.model.embedded import embedded_model_dir
    from pdserve.router.prompt_length import PromptLength

    with System() as s:
        cfg = RouterConfig(local_prefill_below_tokens=20)
        built = s.router_for(cfg)
        orch, app = built.orchestrator, built.app
        with ThreadServer(app) as srv:
            short = httpx.post(srv.url + "/v1/completions", json=completion(prompt="a b c"), timeout=20)
            long = httpx.post(srv.url + "/v1/completions", json=completion(prompt=list(range(1, 40))), timeout=20)
        assert short.status_code == long.status_code == 200
        assert s.prefill[0].counters["requests"] == 1  # only the long prompt was prefilled remotely
        assert orch.stats == {**orch.stats, "pd": 1, "local": 1}
    tok = PromptLength(str(embedded_model_dir()) if Path(embedded_model_dir()).exists() else None)
    assert tok.count("completions", {"prompt": [1, 2, 3]}) == 3
    assert 5 <= tok.count("completions", {"prompt": "The capital of France is Paris."}) <= 12
    assert tok.count("chat", {"messages": [{"role": "user", "content": "hi"}]}) >= 6


def test_prefix_affinity_routes_shared_prefixes_together():
    with System(n_prefill=3, policy="round_robin") as s:
        cfg = RouterConfig(prefill_policy="prefix_affinity", prefix_affinity_tokens=8, local_prefill_below_tokens=0)
        app = s.router_for(cfg.model_copy(update={"policy": "round_robin"})).app
        with ThreadServer(app) as srv:
            for i in range(12):
                prompt = list(range(100, 108)) + [i, i + 1]  # one shared 8-token prefix
                assert httpx.post(srv.url + "/v1/completions", json=completion(prompt=prompt)).status_code == 200
        counts = sorted(e.counters["requests"] for e in s.prefill)
        assert counts == [0, 0, 12]


def test_session_header_pins_decode_replica():
    with System(n_decode=3) as s:
        cfg = RouterConfig(decode_policy="session_affinity")
        app = s.router_for(cfg.model_copy(update={"policy": "round_robin"})).app
        with ThreadServer(app) as srv:
            for i in range(9):
                r = httpx.post(srv.url + "/v1/completions", json=completion(prompt=f"turn {i}"),
                               headers={"X-Session-Id": "conversation-7"})
                assert r.status_code == 200
        assert sorted(e.counters["requests"] for e in s.decode) == [0, 0, 9]


def test_prefill_fallback_error_mode_is_503():
    with System() as s:
        s.prefill[0].faults.fail_status = 500
        cfg = RouterConfig(prefill_fallback="error")
        app = s.router_for(cfg).app
        with ThreadServer(app) as srv:
            r = httpx.post(srv.url + "/v1/completions", json=completion(), timeout=20)
        assert r.status_code == 503 and s.decode[0].counters["requests"] == 0


def test_per_role_inflight_bound_is_429_before_any_leg():
    import concurrent.futures

    with System() as s:
        cfg = RouterConfig(max_inflight_per_decode_engine=2)
        s.decode[0].faults.delay_s = 3.0  # holds its two slots while the other four arrive, also on a loaded host
        app = s.router_for(cfg).app
        with ThreadServer(app) as srv:
            with concurrent.futures.ThreadPoolExecutor(6) as ex:
                rs = list(ex.map(lambda _: httpx.post(srv.url + "/v1/completions", json=completion(), timeout=20),
                                 range(6)))
        codes = [r.status_code for r in rs]
        assert codes.count(200) >= 2 and codes.count(429) >= 1
        assert all(r.headers.get("retry-after") == "1" for r in rs if r.status_code == 429)
        # Refused requests never reached prefill: every prefill leg was followed by its decode leg.
        assert s.prefill[0].counters["requests"] == codes.count(200)
        assert s.prefill[0].held == {}


def _sse_text(r) -> tuple[str, list[dict]]:
    text, errors = [], []
    for line in r.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            ev = json.loads(line[6:])
            if "error" in ev:
                errors.append(ev)
            for c in ev.get("choices", []):
                text.append(c.get("text", ""))
    return "".join(text), errors


@pytest.mark.parametrize("stream", [False, True])
def test_expired_kv_lease_is_detected_and_recomputed(pd, stream):
    """Prefill frees the blocks before decode pulls them (the fake hands decode stale words): the router
    asks the prefill engine about the lease and answers from a recompute instead."""
    pd.orch.lease_check_after_s = 0.0  # check every handoff
    pd.prefill[0].faults.expire_leases = True
    want = " ".join(expected_words("one two three", 8))
    if stream:
        with pd.client.stream("POST", "/v1/completions", json=completion(stream=True)) as r:
            assert r.status_code == 200
            text, errors = _sse_text(r)
    else:
        r = pd.client.post("/v1/completions", json=completion())
        assert r.status_code == 200, r.text
        text, errors = r.json()["choices"][0]["text"], []
    assert errors == [] and text == want
    d = pd.decode[0]
    assert d.counters["pulled_expired"] == 1  # the stale pull happened ...
    assert d.requests[-1].get("kv_transfer_params") is None  # ... and was replaced by a local prefill
    assert pd.orch.metrics.kv_lease.labels("expired")._value.get() == 1


def test_held_lease_is_not_recomputed_and_fast_handoffs_are_not_checked(pd):
    pd.orch.lease_check_after_s = 0.0
    assert pd.client.post("/v1/completions", json=completion()).status_code == 200
    assert pd.orch.metrics.kv_lease.labels("held")._value.get() == 1
    assert len(pd.decode[0].requests) == 1
    pd.orch.lease_check_after_s = 60.0  # no lease can run out within a fast handoff: no check at all
    pd.prefill[0].faults.expire_leases = True
    r = pd.client.post("/v1/completions", json=completion("four five"))
    assert r.status_code == 200
    assert pd.orch.metrics.kv_lease.labels("expired")._value.get() == 0


def test_lease_check_of_an_unreachable_prefill_counts_as_lost(pd):
    """No answer about the lease counts as lost (the recompute itself: tests/component/test_lease_recompute.py)."""
    from pdserve.router.endpoint import Endpoint
    from pdserve.router.lease import Lease

    pd.orch.lease_check_after_s = 0.0
    gone = Endpoint(role="prefill", url="http://127.0.0.1:9", engine_id="x")
    import asyncio

    lost = asyncio.run(pd.orch.leases.lost(Lease(gone, "rid", 0.0), "rid"))
    assert lost is True
    assert pd.orch.metrics.kv_lease.labels("unknown")._value.get() == 1


def test_status_says_how_much_runs_pd_and_why_not():
    from pdserve.router.effect import WARN_MIN_REQUESTS

    with System() as s:
        for _ in range(5):
            assert s.client.post("/v1/completions", json=completion()).status_code == 200
        eff = s.client.get("/pdserve/status").json()["pd_in_effect"]
        assert eff["pd_share"] == 1.0 and eff["local_reasons"] == {} and "warning" not in eff
        s.prefill[0].faults.drop_kv_params = True  # prefill answers, but decode gets nothing to pull
        for _ in range(WARN_MIN_REQUESTS):
            assert s.client.post("/v1/completions", json=completion()).status_code == 200
        eff = s.client.get("/pdserve/status").json()["pd_in_effect"]
        assert eff["pd_share"] == pytest.approx(5 / (5 + WARN_MIN_REQUESTS))
        assert eff["local_reasons"] == {"prefill_fallback_or_no_kv": WARN_MIN_REQUESTS}
        assert "prefill_fallback_or_no_kv" in eff["warning"]
        text = s.client.get("/metrics?engines=0").text
        assert f"pdserve_pd_share_recent {5 / (5 + WARN_MIN_REQUESTS)}" in text


def test_engines_with_keys_answer_the_router_and_refuse_others():
    with System(engine_keys=True) as s:
        for stream in (False, True):
            r = s.client.post("/v1/completions", json=completion(stream=stream))
            assert r.status_code == 200, r.text
        assert s.decode[0].counters["pulled"] == 2
        eng = s.servers[0].url
        for path in ("/v1/completions", "/pdserve/kv-lease/x", "/tokenize"):
            r = httpx.post(eng + path, json=completion()) if path != "/pdserve/kv-lease/x" else httpx.get(eng + path)
            assert r.status_code == 401, (path, r.text)
            assert r.json()["error"]["type"] == "unauthorized"
        r = httpx.post(eng + "/v1/completions", json=completion(), headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401
        assert httpx.get(eng + "/health").status_code == 200
        assert httpx.get(eng + "/metrics").status_code == 200
        # The key never shows in the router's status.
        assert "key-" not in s.client.get("/pdserve/status").text


def test_one_engine_routes_models_by_id_tokenize_and_unsupported_tasks():
    with System() as s:
        r = s.client.get(f"/v1/models/{MODEL}")
        assert r.status_code == 200 and r.json()["id"] == MODEL
        r = s.client.get("/v1/models/other-model")
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        r = s.client.post("/tokenize", json={"model": MODEL, "prompt": "one two three"})
        assert r.status_code == 200 and r.json()["count"] == 3
        assert s.prefill[0].counters["requests"] == 1 and s.decode[0].counters["requests"] == 0
        toks = r.json()["tokens"]
        r = s.client.post("/detokenize", json={"tokens": toks})  # model defaults to the served one
        assert r.status_code == 200 and r.json()["prompt"].count("w") == 3
        r = s.client.post("/tokenize", json={"model": "nope", "prompt": "x"})
        assert r.status_code == 404
        # The fake serves generation only, as the packaged model: a clear 400, not the engine's bare 404.
        for path in ("/v1/embeddings", "/v1/score"):
            r = s.client.post(path, json={"model": MODEL, "input": "x"})
            assert r.status_code == 400, r.text
            assert "does not support" in r.json()["error"]["message"]
        # With the prefill role down, decode answers.
        for ep in s.pool.endpoints("prefill"):
            s.pool.mark_failed(ep)
        assert s.client.post("/tokenize", json={"prompt": "a b"}).status_code == 200
        assert s.decode[0].counters["requests"] == 1


def test_early_first_token_times_the_handoff_on_decodes_first_byte(pd):
    """The client's first token is the prefill leg's, sent at once; the handoff phase and the stream's time
    per token (what admission learns decode's pace from) still start at decode's own first byte."""
    pd.decode[0].faults.first_token_delay_s = 0.4  # headers at once, the first token after the KV pull
    with pd.client.stream("POST", "/v1/completions", json=completion(stream=True, temperature=0)) as r:
        text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in r.iter_lines()
                       if line.startswith("data: {"))
    assert text == " ".join(expected_words("one two three", 8))
    reg = pd.orch.metrics.registry
    assert reg.get_sample_value("pdserve_early_first_token_total", {"outcome": "sent"}) == 1
    handoff = reg.get_sample_value("pdserve_phase_duration_seconds_sum", {"phase": "kv_handoff"})
    # The client's first token came before decode's first byte; the handoff phase runs to the latter.
    assert reg.get_sample_value("pdserve_time_to_first_token_seconds_sum", {"route": "completions"}) < handoff
    # Decode's pace is learned from its own tokens, not from the handoff.
    tpot = reg.get_sample_value("pdserve_time_per_output_token_seconds_sum", {"route": "completions"})
    assert tpot is not None and tpot * 7 < handoff


def test_auto_local_prefill_threshold_follows_the_decode_engines_measured_speed():
    """``local_prefill_below_tokens: auto`` (the default): prompts a decode engine computes within two of its
    decode steps stay there while it is idle; until its speeds are measured, and while it is busy, every
    prompt is disaggregated."""
    assert RouterConfig().local_prefill_below_tokens == "auto"
    with System() as s:
        s.orch.cfg = s.orch.cfg.model_copy(update={"local_prefill_below_tokens": "auto"})
        assert s.orch.gate.local_below() == 0  # the fakes' decode step is not measured
        dec = s.pool.endpoints("decode")[0]
        dec.load.calibrated_rate, dec.load.tpot_single = 1000.0, 0.05
        assert s.orch.gate.local_below() == 100
        assert s.client.get("/pdserve/status").json()["local_prefill_below_tokens"] == 100
        r = s.client.post("/v1/completions", json=completion(prompt="a b c"))
        assert r.status_code == 200 and s.prefill[0].counters["requests"] == 0
        r = s.client.post("/v1/completions", json=completion(prompt=list(range(1, 150))))
        assert r.status_code == 200 and s.prefill[0].counters["requests"] == 1
        # Busy decode (a stream running): the short prompt is disaggregated, it does not queue on decode.
        dec.load.streams = 1
        r = s.client.post("/v1/completions", json=completion(prompt="a b c"))
        assert r.status_code == 200 and s.prefill[0].counters["requests"] == 2
        assert s.client.get("/pdserve/status").json()["decisions"]["pd"] >= 2
        # A fixed threshold keeps short prompts on decode however busy it is.
        s.orch.cfg = s.orch.cfg.model_copy(update={"local_prefill_below_tokens": 100})
        r = s.client.post("/v1/completions", json=completion(prompt="a b c"))
        assert r.status_code == 200 and s.prefill[0].counters["requests"] == 2
    assert Orchestrator(EnginePool([]), RouterConfig(local_prefill_below_tokens=7)).gate.local_below() == 7


def test_with_every_decode_engine_down_a_prefill_engine_answers_whole_requests(pd):
    """While the only decode replica is replaced, the prefill engine (the same model) answers requests whole
    instead of 503; with ``prefill_fallback: error`` the roles stay apart."""
    pd.pool.mark_failed(pd.pool.endpoints("decode")[0])
    r = pd.client.post("/v1/completions", json=completion())
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == " ".join(expected_words("one two three", 8))
    assert "kv_transfer_params" not in pd.prefill[0].requests[-1] and pd.decode[0].counters["requests"] == 0
    assert pd.client.get("/pdserve/status").json()["decisions"]["local"] >= 1
    assert pd.client.get("/health").status_code == 200
    pd.orch.cfg = pd.orch.cfg.model_copy(update={"prefill_fallback": "error"})
    assert pd.client.post("/v1/completions", json=completion()).status_code == 503
    assert pd.client.get("/health").status_code == 503


def test_non_streamed_local_answers_do_not_teach_decode_a_prompt_speed():
    """A non-streamed request whose prompt decode computes ends with its whole answer: timing the prompt by it
    gave decode a prompt speed of tokens per *answer* (a few tokens/s), and admission then refused every short
    prompt for decode's "queue" (a decode-heavy load never built up to scale decode)."""
    with System() as s:
        s.orch.cfg = s.orch.cfg.model_copy(update={"local_prefill_below_tokens": 1000})
        s.decode[0].faults.delay_s = 0.3
        dec = s.pool.endpoints("decode")[0]
        for i in range(3):
            assert s.client.post("/v1/completions", json=completion(prompt=f"a b c {i}")).status_code == 200
        assert s.prefill[0].counters["requests"] == 0  # all local
        assert dec.load.measured_rate() is None and dec.load.rate() == dec.load.calibrated_rate * 0.5
        assert dec.load.queued_tokens == 0 and dec.load.prompts == 0


def test_requests_during_shutdown_are_503_not_plain_500(pd):
    # Once closing, a request gets a 503 instead of a new connection pool...
    pd.orch.closing = True
    r = pd.client.post("/v1/completions", json=completion())
    assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
    assert "shutting down" in r.json()["error"]["message"]
    assert pd.orch.client._session is None or pd.orch.client._session.closed
    # ... and a request whose pool closed under it (aiohttp's RuntimeError "Session is closed") too.
    real = pd.orch.handle

    async def pool_closed(*a, **kw):
        raise RuntimeError("Session is closed")

    pd.orch.handle = pool_closed
    r = pd.client.post("/v1/chat/completions",
                       json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
    # Not closing: the same error is a bug, and stays a 500, as an OpenAI error.
    pd.orch.closing = False
    r = pd.client.post("/v1/completions", json=completion())
    assert r.status_code == 500 and r.json()["error"]["type"] == "internal_error"
    pd.orch.handle = real
    assert pd.client.post("/v1/completions", json=completion()).status_code == 200


def test_an_engine_that_refuses_the_routers_key_is_taken_out_not_passed_on():
    """The registry names an address another engine answers (two replicas that got one port): that server
    refuses the router's key for the engine it expected. The client never sees that 401: its request goes to
    another replica, or is a 502 when there is none (then a prefill engine answers whole requests); the address stays out of rotation though its /health
    answers, and the status says why."""
    with System(n_decode=2, engine_keys=True) as s:
        wrong = next(e for e in s.pool.endpoints() if e.url == s.servers[1].url)  # decode[0]'s address
        wrong.api_key = "the-key-of-an-engine-that-is-not-there"
        for stream in (False, True, False, True):
            r = s.client.post("/v1/completions", json=completion(stream=stream))
            assert r.status_code == 200, r.text
        assert wrong.refused_key and not wrong.healthy
        assert s.decode[0].counters["pulled"] == 0 and s.decode[1].counters["pulled"] == 4
        s.pool.mark_ok(wrong)  # a health probe: /health answers, from the wrong server
        assert not wrong.healthy
        status = {e["url"]: e for e in s.client.get("/pdserve/status").json()["engines"]}
        assert status[wrong.url].get("refused_key") is True and status[wrong.url]["healthy"] is False
    with System(engine_keys=True) as s:
        for ep in s.pool.endpoints():
            if ep.role == "decode":
                ep.api_key = "wrong"
        r = s.client.post("/v1/completions", json=completion())
        assert r.status_code == 502 and "refused the router's key" in r.json()["error"]["message"], r.text
        # No decode engine left: the prefill engine answers whole requests meanwhile.
        for stream in (False, True):
            r = s.client.post("/v1/completions", json=completion(stream=stream))
            assert r.status_code == 200, r.text


def test_kept_blocks_are_read_only_by_a_request_with_the_same_cache_salt(monkeypatch):
    """``nixl.bidirectional``: decode's kept blocks of a request salted ``alice`` are never offered to a
    prompt salted ``bob`` that starts with the same tokens (vLLM hashes the salt into its blocks; a NIXL read
    does not check it), but are to the next ``alice`` turn, and to unsalted turns among themselves."""
    from pdserve.router import handback

    asked: list[str] = []
    first = list(range(1000, 1130))

    async def kept(client, noted, request_id, timeout_s):
        asked.append(noted.request_id)
        return {"kv_transfer_params": {"remote_engine_id": "d", "remote_host": "h", "remote_port": 1,
                                       "remote_block_ids": [list(range(noted.tokens // 16 + 1))]},
                "token_ids": first[:noted.tokens], "block_size": 16, "lora": None}

    monkeypatch.setattr(handback, "kept_params", kept)
    with System() as s:
        router = build_router(RouterConfig(prefill_timeout_s=5, decode_timeout_s=10, local_prefill_below_tokens=0),
                              MODEL, endpoints=s.pool.endpoints(), handback_ttl_s=60)
        with ThreadServer(router.app) as srv, httpx.Client(base_url=srv.url, timeout=20) as c:
            def turn(rid: str, extra: int, salt: str | None) -> dict | None:
                body = {"model": MODEL, "prompt": first + list(range(5000, 5000 + extra)), "max_tokens": 4,
                        **({"cache_salt": salt} if salt else {})}
                r = c.post("/v1/completions", json=body, headers={"X-Request-Id": rid})
                assert r.status_code == 200, r.text
                return s.prefill[0].requests[-1].get("kv_transfer_params")

            turn("alice-1", 0, "alice")
            assert turn("bob-1", 10, "bob")["do_remote_decode"] and asked == []  # not offered alice's blocks
            assert turn("alice-2", 20, "alice")["remote_num_tokens"] >= 128
            assert [a.split("-")[0] for a in asked] == ["alice"]
            turn("plain-1", 0, None)
            assert turn("plain-2", 10, None)["remote_num_tokens"] >= 128
            assert [a.split("-")[0] for a in asked] == ["alice", "plain"]
            # A turn the engine cuts to its last 40 tokens computes other tokens than the kept blocks hold:
            # never offered them (vLLM's pull would load them over its 40 positions without comparing).
            turn("cut-1", 0, "cut")
            body = {"model": MODEL, "prompt": first + list(range(5000, 5020)), "max_tokens": 4,
                    "cache_salt": "cut", "truncate_prompt_tokens": 40, "truncation_side": "left"}
            assert c.post("/v1/completions", json=body, headers={"X-Request-Id": "cut-2"}).status_code == 200
            sent = s.prefill[0].requests[-1]
            assert sent["truncate_prompt_tokens"] == 40 and not sent["kv_transfer_params"].get("remote_num_tokens")
            assert [a.split("-")[0] for a in asked] == ["alice", "plain"]


def test_a_whole_answer_past_the_decode_timeout_is_a_504_not_a_run_on_every_replica():
    """A long answer past ``decode_timeout_s`` is the request's time running out, not its engine failing: a
    504 after one try; no other replica runs it again, none is taken out of rotation."""
    with System(n_decode=2) as s:
        s.orch.cfg = s.orch.cfg.model_copy(update={"decode_timeout_s": 1.0})
        for d in s.decode:
            d.faults.delay_s = 1.5  # (a long generation)
        r = s.client.post("/v1/completions", json=completion(max_tokens=4000))
        assert r.status_code == 504 and r.json()["error"]["type"] == "timeout", r.text
        assert sorted(d.counters["requests"] for d in s.decode) == [0, 1]
        assert all(ep.healthy for ep in s.pool.endpoints("decode"))


def test_an_unreachable_engine_is_a_502_that_names_no_address_inside_the_app():
    """The client's error says which role failed and how, never the engine's address (the router's log has
    it)."""
    with System() as s:
        decode_url = s.servers[1].url
        s.servers[1].__exit__()  # the decode engine goes away
        r = s.client.post("/v1/completions", json=completion())
        assert r.status_code in (502, 503), r.text
        s.servers[0].__exit__()  # and the prefill engine
        for ep in s.pool.endpoints():
            ep.healthy = True  # (as between two probes)
        t = s.client.post("/tokenize", json={"model": MODEL, "prompt": "a b"})
        assert t.status_code == 502 and "engine failed (" in t.json()["error"]["message"], t.text
        for text in (r.text, t.text):
            assert "127.0.0.1" not in text and decode_url.rsplit(":", 1)[1] not in text, text
        s.servers = []


def test_a_query_parameter_that_is_not_valid_is_an_openai_400(pd):
    for q, name in (("/metrics?engines=x", "engines"), ("/pdserve/status?footprint=x", "footprint")):
        r = pd.client.get(q)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["param"] == name and name in err["message"]
