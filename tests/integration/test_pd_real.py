"""Real vLLM + NIXL + Ray Serve on CPU, with the packaged SmolLM2-135M-Instruct.

The reference for exactness is one engine with the same engine arguments computing the whole request:
the prefill engine, asked directly with no ``kv_transfer_params``, before the P/D request is sent (so
the decode engine never computed that prompt itself and has to pull it).
"""

from __future__ import annotations

import os
import random
import signal

import httpx
import pytest

from tests import sse
from tests.integration.conftest import (
    ServeProcess,
    cmdline,
    descendants,
    engine_auth,
    engine_server_pid,
    stop_mid_request,
)

pytestmark = pytest.mark.integration

MODEL = "smollm2-135m-instruct"
# Prompts shorter than a block (128 tokens on CPU: nothing to pull), a block exactly, blocks and a part, up to
# 1,000 tokens.
LENGTHS = [1, 17, 89, 128, 144, 256, 512, 1000]
NEW_TOKENS = 16


def _samples(text: str):
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        yield from family.samples


def metric(text: str, name: str) -> float:
    """Sum of the samples of ``name`` in a Prometheus exposition: any labels, or those given as in a query,
    ``name{label="value",...}``. A series that is not there is an error, not a zero: a misspelt name must
    not make an assertion pass."""
    import re

    base, _, selector = name.partition("{")
    wanted = dict(re.findall(r'(\w+)="([^"]*)"', selector))
    found = [s.value for s in _samples(text)
             if s.name == base and all(s.labels.get(k) == v for k, v in wanted.items())]
    assert found, f"no series {name} in the exposition"
    return float(sum(found))


def by_source(text: str, source: str) -> float:
    """vLLM's prompt tokens by where their KV came from (local_compute, local_cache_hit, external_kv_transfer)."""
    return float(sum(s.value for s in _samples(text)
                     if s.name == "vllm:prompt_tokens_by_source_total" and s.labels.get("source") == source))


def engine_metrics(url: str) -> str:
    return httpx.get(url + "/metrics", timeout=10).text


def prompts() -> list[list[int]]:
    rng = random.Random(1234)
    # Token ids from the middle of the vocabulary: plain word pieces, no special tokens.
    return [[rng.randrange(200, 40000) for _ in range(n)] for n in LENGTHS]


def complete(url: str, prompt: list[int], **kw) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, **kw}
    return post_ok(url + "/v1/completions", body)


def post_ok(url: str, body: dict, timeout_s: float = 300) -> dict:
    """POST like a well-behaved client: a 429 (admission by work) is retried after its Retry-After."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        r = httpx.post(url, json=body, timeout=timeout_s, headers=engine_auth(url))
        if r.status_code != 429 or time.monotonic() > deadline:
            break
        time.sleep(float(r.headers["retry-after"]))
    assert r.status_code == 200, r.text
    return r.json()


def test_pd_equals_single_engine_token_for_token(served: ServeProcess):
    prefill_url, decode_url = served.engine_url("prefill"), served.engine_url("decode")
    before_d = engine_metrics(decode_url)
    ext_before = by_source(before_d, "external_kv_transfer")
    xfers_before = metric(before_d, "vllm:nixl_xfer_time_seconds_count")
    bytes_before = metric(before_d, "vllm:nixl_bytes_transferred_sum")
    mismatches = []
    for p in prompts():
        ref = complete(prefill_url, p)["choices"][0]
        got = complete(served.url, p)["choices"][0]
        assert len(got["token_ids"]) >= NEW_TOKENS
        if got["token_ids"] != ref["token_ids"]:
            mismatches.append((len(p), ref["text"], got["text"]))
    assert not mismatches, f"P/D answers differ from the single engine: {mismatches}"

    after_d = engine_metrics(decode_url)
    after_p = engine_metrics(prefill_url)
    # The KV was pulled over NIXL, not recomputed: one transfer per prompt that fills at least one block.
    xfers = metric(after_d, "vllm:nixl_xfer_time_seconds_count") - xfers_before
    moved = metric(after_d, "vllm:nixl_bytes_transferred_sum") - bytes_before
    assert xfers >= sum(1 for n in LENGTHS if n >= 128), (xfers, after_d[-2000:])
    # SmolLM2 keeps 23,040 bytes of KV per token; at least the long prompts' KV crossed.
    assert moved >= 23040 * 1000
    assert metric(after_d, "vllm:nixl_num_failed_transfers_total") == 0
    # Decode took most prompt tokens over NIXL (it computes at most the last partial block itself).
    assert by_source(after_d, "external_kv_transfer") - ext_before >= 0.8 * sum(LENGTHS), after_d[-3000:]
    # No block was freed on prefill before decode had it (the lease-expiry failure mode).
    assert metric(after_p, "vllm:nixl_num_kv_expired_reqs_total") == 0
    assert served.status()["decisions"]["pd"] >= len(LENGTHS)


def _stream(url: str, body: dict) -> tuple[str, list[dict]]:
    """A streamed completion's text and the usage objects its events carried."""
    text, usage = "", []
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=300) as r:
        assert r.status_code == 200, r.read()
        for ev in sse.events(r.iter_lines()):
            assert "error" not in ev, ev
            text += sse.text(ev)
            usage += [ev["usage"]] if ev.get("usage") else []
    return text, usage


def _stream_text(url: str, body: dict) -> str:
    return _stream(url, body)[0]


def test_streams_start_with_the_prefill_token_and_read_every_token_once(served: ServeProcess):
    """The first token comes from the prefill leg at once; decode's copy is removed: greedy and seeded
    streams equal the single engine's answer, and no stream saw decode compute another first token."""
    prefill_url = served.engine_url("prefill")
    before = httpx.get(served.url + "/metrics?engines=0", timeout=10).text
    sent0 = metric(before, 'pdserve_early_first_token_total{outcome="sent"}')
    cases = [({"temperature": 0}, p) for p in prompts()[::3]]
    cases += [({"temperature": 0.9, "top_p": 0.95, "seed": 1234 + i}, p) for i, p in enumerate(prompts()[1::6])]
    wrong = []
    for sampling, p in cases:
        body = {"model": MODEL, "prompt": p, "max_tokens": NEW_TOKENS, "ignore_eos": True, **sampling}
        ref = httpx.post(prefill_url + "/v1/completions", json=body, headers=engine_auth(prefill_url),
                         timeout=300).json()["choices"][0]["text"]
        got = _stream_text(served.url, body)
        if got != ref:
            wrong.append((len(p), sampling, ref, got))
    # Sampling without a seed: the router seeds both legs alike, so the stream stays one answer.
    for p in prompts()[2::8]:
        assert _stream_text(served.url, {"model": MODEL, "prompt": p, "max_tokens": 8, "temperature": 1.0})
    after = httpx.get(served.url + "/metrics?engines=0", timeout=10).text
    assert not wrong, f"streams differ from the single engine: {wrong}"
    # every stream whose prompt fills a KV block ran P/D (shorter ones may run on decode alone)
    assert metric(after, 'pdserve_early_first_token_total{outcome="sent"}') - sent0 >= sum(
        1 for _, p in cases if len(p) >= 128)
    assert metric(after, 'pdserve_early_first_token_total{outcome="mismatch_passed"}') == 0


def _prefill_claiming(prefill_url: str, token: int, text: str):
    """An app in front of the real prefill engine whose prefill legs answer with ``token`` as the first token:
    the two engines breaking a near-tie differently (measured: 2 in 100 bfloat16 streams), made certain."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route

    auth = engine_auth(prefill_url)

    async def forward(request: Request) -> Response:
        body = await request.body()
        async with httpx.AsyncClient(timeout=300) as c:
            r = await c.request(request.method, prefill_url + request.url.path, content=body,
                                params=request.query_params, headers={"Content-Type": "application/json", **auth})
        out = r.content
        if request.method == "POST" and r.status_code == 200 and b'"do_remote_decode"' in body:
            import json

            answer = json.loads(out)
            answer["choices"][0].update(text=text, token_ids=[token])
            out = json.dumps(answer).encode()
        return Response(out, status_code=r.status_code, media_type=r.headers.get("content-type"))

    return Starlette(routes=[Route("/{path:path}", forward, methods=["GET", "POST"])])


def test_decode_computing_another_first_token_goes_on_from_the_prefills(served: ServeProcess):
    """The client is sent the prefill leg's first token; when decode computes another, its stream is dropped
    and the real decode engine goes on from the client's token: the answer is the prompt + that token's
    greedy continuation, usage counts every token once, and the prompt's blocks come from decode's prefix
    cache (pulled over NIXL for the first leg), not computed again. The router runs in this process on the
    served app's real engines, its prefill engine behind a proxy that claims the other token."""
    from pdserve.config.schema import RouterConfig
    from pdserve.router.build import build_router
    from pdserve.router.endpoint import Endpoint
    from pdserve.testing.thread_server import ThreadServer

    prefill_url, decode_url = served.engine_url("prefill"), served.engine_url("decode")
    prompt = [random.Random(31).randrange(200, 40000) for _ in range(300)]
    computed = complete(prefill_url, prompt, max_tokens=1)["choices"][0]["token_ids"][0]
    claimed = 1000 if computed != 1000 else 1001
    text = httpx.post(prefill_url + "/detokenize", json={"model": MODEL, "tokens": [claimed]},
                      headers=engine_auth(prefill_url), timeout=30).json()["prompt"]
    ref = complete(prefill_url, prompt + [claimed], max_tokens=NEW_TOKENS - 1)["choices"][0]
    decode_key = engine_auth(decode_url).get("Authorization", "").removeprefix("Bearer ")
    with ThreadServer(_prefill_claiming(prefill_url, claimed, text)) as proxy:
        eps = [Endpoint(role="prefill", url=proxy.url), Endpoint(role="decode", url=decode_url, api_key=decode_key)]
        for ep in eps:
            ep.load.calibrated_rate = 1e6  # admission by work is not what this tests
        cfg = RouterConfig(local_prefill_below_tokens=0)
        with ThreadServer(build_router(cfg, MODEL, endpoints=eps).app) as router:
            before = engine_metrics(decode_url)
            got, usage = _stream(router.url, {"model": MODEL, "prompt": prompt, "max_tokens": NEW_TOKENS,
                                              "temperature": 0, "ignore_eos": True,
                                              "stream_options": {"include_usage": True}})
            after = engine_metrics(decode_url)
            outcomes = httpx.get(router.url + "/metrics?engines=0", timeout=10).text
    assert got == text + ref["text"]
    assert usage == [{"prompt_tokens": 300, "completion_tokens": NEW_TOKENS, "total_tokens": 300 + NEW_TOKENS}]
    assert metric(outcomes, 'pdserve_early_first_token_total{outcome="mismatch"}') == 1
    assert metric(outcomes, 'pdserve_early_first_token_total{outcome="mismatch_passed"}') == 0
    # The first decode leg pulled the prompt; the way on found its full blocks in decode's prefix cache (the
    # CPU engines' blocks are 128 tokens: 256 of the 301, the rest computed).
    pulled = by_source(after, "external_kv_transfer") - by_source(before, "external_kv_transfer")
    hit = by_source(after, "local_cache_hit") - by_source(before, "local_cache_hit")
    assert pulled >= 0.8 * 300 and hit >= 0.8 * 300, (pulled, hit)


def test_paris(served: ServeProcess):
    import openai  # the dev extra (make setup) installs it
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="unused")
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=24, temperature=0)
    assert "Paris" in r.choices[0].message.content
    assert r.usage.completion_tokens > 0 and r.usage.prompt_tokens > 0


def test_streaming_equals_non_streaming_chat_and_completions(served: ServeProcess):
    import openai  # the dev extra (make setup) installs it
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="unused")
    msgs = [{"role": "user", "content": "Name three colours of the rainbow."}]
    full = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=20, temperature=0)
    stream = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=20, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    pieces, usage = [], None
    for ev in stream:
        if ev.usage:
            usage = ev.usage
        for c in ev.choices:
            pieces.append(c.delta.content or "")
    assert "".join(pieces) == full.choices[0].message.content
    assert usage is not None and usage.completion_tokens == full.usage.completion_tokens

    prompt = "Once upon a time, in a small village by the sea,"
    c_full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0)
    c_stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0, stream=True)
    assert "".join(ev.choices[0].text for ev in c_stream if ev.choices) == c_full.choices[0].text


def test_raw_sse_ends_with_done_and_request_id_is_echoed(served: ServeProcess):
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, "stream": True}
    with httpx.stream("POST", served.url + "/v1/completions", json=body, timeout=60,
                      headers={"X-Request-Id": "it-req-42"}) as r:
        assert r.status_code == 200
        assert r.headers["x-request-id"] == "it-req-42"
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    assert all(ln.startswith("data: ") for ln in lines)


def test_n_stop_seed_logprobs_pass_through(served: ServeProcess):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Count: one, two, three,"}],
            "max_tokens": 12, "n": 2, "seed": 7, "temperature": 0.8, "logprobs": True, "top_logprobs": 2,
            "stop": ["\n\n"]}
    r = httpx.post(served.url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    data = r.json()
    assert len(data["choices"]) == 2
    assert data["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
    # Same seed, same answer.
    again = httpx.post(served.url + "/v1/chat/completions", json=body, timeout=120).json()
    assert [c["message"]["content"] for c in again["choices"]] == [c["message"]["content"] for c in data["choices"]]
    body2 = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 8,
             "logprobs": True, "top_logprobs": 1, "temperature": 0}
    r2 = httpx.post(served.url + "/v1/chat/completions", json=body2, timeout=120)
    assert r2.status_code == 200 and r2.json()["choices"][0]["logprobs"]["content"]


def test_errors_are_openai_json(served: ServeProcess):
    u = served.url
    r = httpx.post(u + "/v1/chat/completions", json={"model": "nope", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 404 and r.json()["error"]["message"]
    r = httpx.post(u + "/v1/completions", content=b"{", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    long_prompt = [300] * 3000  # beyond max_model_len 2048 of the test config
    r = httpx.post(u + "/v1/completions", json={"model": MODEL, "prompt": long_prompt, "max_tokens": 4}, timeout=60)
    assert r.status_code == 400, r.text
    assert "error" in r.json()
    assert httpx.get(u + "/v1/models").json()["data"][0]["id"] == MODEL
    assert httpx.get(u + "/health").status_code == 200


def test_model_by_id_tokenize_detokenize_and_unsupported_tasks(served: ServeProcess):
    u = served.url
    assert httpx.get(f"{u}/v1/models/{MODEL}", timeout=10).json()["id"] == MODEL
    assert httpx.get(f"{u}/v1/models/nope", timeout=10).status_code == 404
    r = httpx.post(u + "/tokenize", json={"model": MODEL, "prompt": "The capital of France is"}, timeout=60)
    assert r.status_code == 200, r.text
    tokens = r.json()["tokens"]
    assert r.json()["count"] == len(tokens) > 0
    r = httpx.post(u + "/detokenize", json={"model": MODEL, "tokens": tokens}, timeout=60)
    assert r.status_code == 200 and r.json()["prompt"].strip() == "The capital of France is", r.text
    # SmolLM2 generates text only: a clear OpenAI 400, not a bare 404 from the engine.
    r = httpx.post(u + "/v1/embeddings", json={"model": MODEL, "input": "hello"}, timeout=60)
    assert r.status_code == 400 and "does not support" in r.json()["error"]["message"], r.text


def test_engines_answer_only_the_router(served: ServeProcess):
    """Each engine holds a key of its own: without it an engine port refuses generation, its other control
    paths and the KV-lease endpoint; health and metrics stay open. The router's answers show it has the keys."""
    for role in ("prefill", "decode"):
        url = served.engine_url(role)
        body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
        for method, path in (("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
                             ("GET", "/pdserve/kv-lease/some-request"), ("POST", "/tokenize"),
                             ("POST", "/scale_elastic_ep")):
            r = httpx.request(method, url + path, json=body if method == "POST" else None, timeout=30)
            assert r.status_code == 401, (role, path, r.status_code, r.text[:200])
        r = httpx.post(url + "/v1/completions", json=body, headers={"Authorization": "Bearer guessed"}, timeout=30)
        assert r.status_code == 401
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        assert "vllm:" in engine_metrics(url)
        assert httpx.post(url + "/v1/completions", json=body, headers=engine_auth(url), timeout=60).status_code == 200
    # The router's status never carries a key.
    assert "api_key" not in httpx.get(served.url + "/pdserve/status", timeout=10).text


def test_direct_ingress_router_owns_the_port_and_no_proxy_runs(served: ServeProcess):
    """``pdserve serve`` default: the router replica listens on the public port itself and echoes request
    ids as Ray Serve's proxy would; with no ``http.proxy_port`` Ray Serve's proxy does not run at all."""
    import psutil

    st = served.status()
    assert st["ingress"]["mode"] == "direct" and st["ingress"]["port"] == served.port
    assert st["ingress"]["proxy_port"] is None
    owners = {c.pid for c in psutil.net_connections(kind="inet")
              if c.status == psutil.CONN_LISTEN and c.laddr.port == served.port}
    assert owners == {st["router"]["pid"]}, owners  # the router replica's process, nothing else
    names = [cmdline(p) for p in descendants(served.proc.pid)]
    assert any("ServeController" in n for n in names), names  # (the process list is Serve's)
    assert not any("ProxyActor" in n for n in names), names
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
    echoed = httpx.post(served.url + "/v1/completions", json=body, timeout=120, headers={"X-Request-Id": "id-1"})
    assert echoed.status_code == 200 and echoed.headers["x-request-id"] == "id-1"
    made = httpx.post(served.url + "/v1/completions", json=body, timeout=120)
    assert len(made.headers["x-request-id"]) == 32  # made by the router when the client sent none


def test_laptop_mode_listens_only_on_loopback(served: ServeProcess):
    """With a loopback http.host and no cluster address, every socket the app listens on (Ray's own
    processes, Serve's proxy and replicas, the engines' HTTP servers and NIXL side channels) is on loopback."""
    import ipaddress

    import psutil

    pids = {served.proc.pid} | {p.pid for p in descendants(served.proc.pid)}
    listening = [c for c in psutil.net_connections(kind="inet")
                 if c.status == psutil.CONN_LISTEN and c.pid in pids]
    assert len(listening) >= 5, listening  # the router, two engines, two side channels at least
    def loopback(ip: str) -> bool:
        addr = ipaddress.ip_address(ip)
        return (getattr(addr, "ipv4_mapped", None) or addr).is_loopback

    exposed = [(c.pid, _name(c.pid), c.laddr) for c in listening if not loopback(c.laddr.ip)]
    assert not exposed, f"listening beyond loopback: {exposed}"


def _name(pid: int) -> str:
    import psutil

    try:
        return " ".join(psutil.Process(pid).cmdline())[:100]
    except psutil.Error:
        return "?"


def test_fields_that_steer_the_kv_connector_are_refused_before_any_engine(served: ServeProcess):
    """`vllm_xargs.kv_transfer_params: 0` once reached decode and killed its EngineCore."""
    before = served.status()["engines"]
    prefill_url = served.engine_url("prefill")
    tokens_before = metric(engine_metrics(prefill_url), "vllm:prompt_tokens_total")
    for body in ({"model": MODEL, "prompt": "x", "n": 2, "max_tokens": 2, "vllm_xargs": {"kv_transfer_params": 0}},
                 {"model": MODEL, "prompt": "x", "max_tokens": 2, "vllm_xargs": {"ec_transfer_params": "x"}},
                 {"model": MODEL, "prompt": "x", "max_tokens": 2, "kv_transfer_params": {"do_remote_prefill": 1}}):
        r = httpx.post(served.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["type"] == "invalid_request_error"
    assert metric(engine_metrics(prefill_url), "vllm:prompt_tokens_total") == tokens_before
    after = served.status()["engines"]
    assert {e["engine_id"] for e in after} == {e["engine_id"] for e in before}
    assert all(e["healthy"] for e in after)
    assert complete(served.url, [1000, 2000, 3000])["choices"][0]["text"]


def test_tool_and_response_format_fields_reach_the_engine(served: ServeProcess):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Give me a JSON object with key a."}],
            "max_tokens": 20, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "o", "schema": {
                "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}}
    r = httpx.post(served.url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["message"]["content"]
    assert content.lstrip().startswith("{")


def test_metrics_router_and_engines(served: ServeProcess):
    from tests.promtool import check_metrics

    httpx.post(served.url + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 4}, timeout=60)
    text = httpx.get(served.url + "/metrics", timeout=30).text
    assert "pdserve_requests_total" in text
    assert 'pdserve_phase_duration_seconds_count{phase="kv_handoff"}' in text
    # The engines' own metrics, NIXL ones included, with role and replica labels.
    assert 'vllm:nixl_xfer_time_seconds_count{' in text
    assert 'pdserve_role="prefill"' in text and 'pdserve_role="decode"' in text
    check_metrics(text)


def test_status_command(served: ServeProcess):
    import json
    import subprocess
    import sys
    from pathlib import Path

    exe = str(Path(sys.executable).parent / "pdserve")
    out = subprocess.run([exe, "status", "--url", served.url, "--json"], capture_output=True, text=True, check=True)
    data = json.loads(out.stdout)
    assert {e["role"] for e in data["engines"]} == {"prefill", "decode"}
    assert all(e["healthy"] for e in data["engines"])
    table = subprocess.run([exe, "status", "--url", served.url], capture_output=True, text=True, check=True).stdout
    assert "prefill" in table and "decode" in table
    # The memory of pdserve's processes on the router's host, by part (the engines' among them).
    assert data["host_footprint"]["pss_bytes"].get("engine core", 0) > 0
    assert "memory (PSS, GiB) of pdserve's processes on the router's host:" in table
    # P/D in effect: the earlier tests' requests went P/D, and the decode engine's own counters agree that
    # their KV came over NIXL rather than being recomputed.
    eff = data["pd_in_effect"]
    assert eff["pd_share"] > 0.5 and eff["decode_prompt_tokens_pulled_share"] > 0.5, eff
    assert "P/D in effect:" in table


def test_answers_under_concurrent_load_equal_single_engine(served: ServeProcess):
    """Expired leases or bad blocks under load must never show up as wrong tokens."""
    import concurrent.futures

    prefill_url = served.engine_url("prefill")
    rng = random.Random(99)
    batch = [[rng.randrange(200, 40000) for _ in range(rng.randrange(100, 700))] for _ in range(6)]
    refs = [complete(prefill_url, p)["choices"][0]["token_ids"] for p in batch]
    with concurrent.futures.ThreadPoolExecutor(6) as ex:
        got = list(ex.map(lambda p: complete(served.url, p)["choices"][0]["token_ids"], batch))
    wrong = [i for i, (a, b) in enumerate(zip(refs, got)) if a != b]
    assert not wrong, f"answers under load differ from the single engine for prompts {wrong}"
    assert metric(engine_metrics(prefill_url), "vllm:nixl_num_kv_expired_reqs_total") == 0


def test_cancelled_streams_release_kv_blocks(served: ServeProcess):
    import time

    urls = [served.engine_url("prefill"), served.engine_url("decode")]
    idle = [metric(engine_metrics(u), "vllm:kv_cache_usage_perc") for u in urls]
    rng = random.Random(5)
    for _ in range(6):
        body = {"model": MODEL, "prompt": [rng.randrange(200, 40000) for _ in range(600)], "max_tokens": 300,
                "stream": True, "ignore_eos": True}
        with httpx.stream("POST", served.url + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    break  # the client goes away after the first token
    deadline = time.monotonic() + 90  # at most one KV lease (30 s) plus margin
    while True:
        now = [metric(engine_metrics(u), "vllm:kv_cache_usage_perc") for u in urls]
        if all(n <= i + 1e-9 for n, i in zip(now, idle)):
            break
        assert time.monotonic() < deadline, f"KV cache use stayed at {now} (idle {idle})"
        time.sleep(2)
    assert httpx.get(served.url + "/health").status_code == 200


def test_failed_kv_pull_is_recomputed_correctly(served: ServeProcess):
    """Decode given params whose blocks cannot be pulled (their prefill engine is gone) recomputes the
    prompt (pdserve's default kv_load_failure_policy) and still answers correctly."""
    from pdserve.testing.thread_server import free_port

    prefill_url, decode_url = served.engine_url("prefill"), served.engine_url("decode")
    prompt = [random.Random(11).randrange(200, 40000) for _ in range(300)]
    ref = complete(prefill_url, prompt)["choices"][0]["token_ids"]
    ghost = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "gone-engine",
             "remote_block_ids": [[1, 2, 3, 4]], "remote_request_id": "gone-request", "remote_host": "127.0.0.1",
             "remote_port": free_port(), "tp_size": 1}
    before = engine_metrics(decode_url)
    got = complete(decode_url, prompt, kv_transfer_params=ghost)["choices"][0]["token_ids"]
    assert got == ref
    after = engine_metrics(decode_url)
    # Counted: the decode engine computed the whole prompt itself instead of taking it over NIXL.
    recomputed = by_source(after, "local_compute") - by_source(before, "local_compute")
    pulled = by_source(after, "external_kv_transfer") - by_source(before, "external_kv_transfer")
    assert recomputed >= 290 and pulled == 0, (recomputed, pulled)


def _engine_workers(url: str) -> list:
    """The processes doing an engine's work (EngineCore, workers): descendants of its API server."""
    import psutil

    pid = engine_server_pid(url)
    assert pid is not None, f"no vLLM API server process for {url}"
    return psutil.Process(pid).children(recursive=True)


def test_cpu_engines_are_forked_from_one_pre_imported_process(served: ServeProcess):
    """``pdserve serve`` on a host with no GPU (cpu.fork_engines): both engines' servers are children of one
    engine forkserver, each leading its own process group with its engine core in it. (A GPU app's servers
    are their guards' children.)"""
    import psutil

    on_cpu = any("CPU engines compute in" in ln for ln in served.lines)
    mark = "pdserve.engine.forkserver" if on_cpu else "pdserve.engine.guard"
    parents = set()
    for role in ("prefill", "decode"):
        pid = engine_server_pid(served.engine_url(role))
        assert pid is not None
        server = psutil.Process(pid)
        parent = server.parent()
        assert parent is not None and mark in " ".join(parent.cmdline()), (role, parent)
        parents.add(parent.pid)
        if on_cpu:
            assert os.getpgid(pid) == pid
            cores = [c for c in server.children() if "EngineCore" in " ".join(c.cmdline())]
            assert cores and all(os.getpgid(c.pid) == pid for c in cores), role
    assert len(parents) == (1 if on_cpu else 2)


def test_expired_kv_lease_is_recomputed_not_wrong(served: ServeProcess):
    """The hazard vLLM only logs: prefill frees a request's blocks when its lease runs out before
    decode pulled them, and a busy prefill engine reuses them. Decode is frozen past the lease while
    prefill keeps generating; the router must notice and answer from a recompute, token for token."""
    import os
    import signal
    import threading
    import time

    prefill_url, decode_url = served.engine_url("prefill"), served.engine_url("decode")
    prompt = [random.Random(21).randrange(200, 40000) for _ in range(300)]
    ref = complete(prefill_url, prompt)["choices"][0]["token_ids"]
    expired_before = metric(engine_metrics(prefill_url), "vllm:nixl_num_kv_expired_reqs_total")
    router_before = metric(httpx.get(served.url + "/metrics").text, 'pdserve_kv_lease_checks_total{outcome="expired"}')

    stop_busy = threading.Event()

    def keep_prefill_busy() -> None:
        # Prefill engines step (and reap expired leases) only while they have work; this also reuses blocks.
        while not stop_busy.is_set():
            body = {"model": MODEL, "prompt": [random.randrange(200, 40000) for _ in range(400)],
                    "max_tokens": 1200, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", prefill_url + "/v1/completions", json=body, timeout=300,
                              headers=engine_auth(prefill_url)) as r:
                for _ in r.iter_lines():
                    if stop_busy.is_set():
                        break

    busy = threading.Thread(target=keep_prefill_busy, daemon=True)
    busy.start()
    frozen = _engine_workers(decode_url)
    result: dict = {}

    def signal_all(sig: int) -> None:
        for p in frozen:
            try:
                os.kill(p.pid, sig)
            except ProcessLookupError:
                pass

    signal_all(signal.SIGSTOP)
    try:
        t = threading.Thread(target=lambda: result.update(complete(served.url, prompt)), daemon=True)
        t.start()
        # The lease is 10 s in pd-test.yaml: short enough that a frozen decode engine is not yet replaced
        # for failing health checks (Ray Serve: 3 failures, 10 s apart).
        deadline = time.monotonic() + 25
        while metric(engine_metrics(prefill_url), "vllm:nixl_num_kv_expired_reqs_total") <= expired_before:
            assert time.monotonic() < deadline, "the prefill engine never released the request's lease"
            time.sleep(0.5)
    finally:
        signal_all(signal.SIGCONT)
    t.join(timeout=180)
    stop_busy.set()
    busy.join(timeout=60)
    assert result, "the request did not finish"
    assert result["choices"][0]["token_ids"] == ref
    router_after = metric(httpx.get(served.url + "/metrics").text, 'pdserve_kv_lease_checks_total{outcome="expired"}')
    assert router_after == router_before + 1


def test_router_knows_what_the_prefill_engine_cached_from_its_kv_events(served: ServeProcess):
    """The prefill engine publishes its KV cache events, the router follows them, and the blocks it expects a
    repeated prompt to hit are the blocks the engine then reports as prefix-cache hits. (The prompt fills the
    prefill engine's cache directly: through the router, decode would hold it too, and the repeat would run
    there alone, router.cache_aware_steps.)"""
    import time

    def prefill_events() -> tuple[dict, int]:
        kv = served.status().get("kv_cache_routing") or {}
        return kv, sum(e["events"] for k, e in (kv.get("engines") or {}).items() if k.startswith("prefill|"))

    # A seed of its own: test_cancelled_streams_release_kv_blocks draws from Random(5) too, and its first prompt
    # began with this one's 400 tokens, so both engines held its blocks already (no event came, and the repeat
    # ran on decode alone).
    rng = random.Random(612)
    prompt = [rng.randrange(200, 40000) for _ in range(400)]
    _, start = prefill_events()
    complete(served.engine_url("prefill"), prompt)  # fills the prefill engine's cache with the prompt's blocks
    deadline = time.monotonic() + 30
    while True:
        # Until the prefill engine's events of this prompt have reached the router (nothing else runs on that
        # engine meanwhile). Not its block count: with its cache full, stored blocks evict as many others.
        # Not any engine's blocks: decode's, from earlier tests, say nothing of this prompt.
        kv, now = prefill_events()
        if kv.get("block_size") and now > start:
            break
        assert time.monotonic() < deadline, f"the router heard no KV event of the prompt from prefill: {kv}"
        time.sleep(0.5)
    time.sleep(1.0)  # (a step's events may come in more than one batch)
    size = kv["block_size"]
    prefill_url = served.engine_url("prefill")
    hits_before = metric(engine_metrics(prefill_url), "vllm:prefix_cache_hits_total")
    before = served.status()["kv_cache_routing"]
    complete(served.url, prompt + [rng.randrange(200, 40000) for _ in range(40)])
    after = served.status()["kv_cache_routing"]
    expected = after["routed_hit_blocks"] - before["routed_hit_blocks"]
    hit_tokens = metric(engine_metrics(prefill_url), "vllm:prefix_cache_hits_total") - hits_before
    assert expected == 400 // size, (after, size)
    assert hit_tokens == expected * size, (hit_tokens, expected, size)
    assert after["gaps"] == 0


def test_a_follow_up_the_decode_engine_holds_runs_there_alone(served: ServeProcess):
    """Cache-aware disaggregation with real engines: after a P/D request, the decode engine holds the prompt's
    blocks it pulled over NIXL (its own KV events say so); a follow-up of a few more tokens then runs on that
    decode engine alone, no prefill leg, and its greedy answer is the one engine's."""
    import time

    def decode_events() -> tuple[dict, dict, int]:
        kv = served.status().get("kv_cache_routing") or {}
        engines = {k: e for k, e in (kv.get("engines") or {}).items() if k.startswith("decode|")}
        return kv, {k: e["blocks"] for k, e in engines.items()}, sum(e["events"] for e in engines.values())

    rng = random.Random(17)
    prompt = [rng.randrange(200, 40000) for _ in range(400)]
    _, _, start = decode_events()
    complete(served.url, prompt)  # P/D: decode pulls the prompt's blocks
    deadline = time.monotonic() + 30
    while True:
        # Until the decode engine's events of this request have reached the router (not any blocks it holds:
        # earlier tests left some, which say nothing of this prompt).
        kv, held, now = decode_events()
        if now > start and any(held.values()):
            break
        assert time.monotonic() < deadline, f"the router learnt nothing of the decode engine's cache: {kv}"
        time.sleep(0.5)
    time.sleep(1.0)  # (a step's events may come in more than one batch)
    label = 'pdserve_pd_decisions_total{decision="local",reason="cached_on_decode"}'
    text = httpx.get(served.url + "/metrics").text
    before = metric(text, label) if 'reason="cached_on_decode"' in text else 0.0  # (none yet: no series)
    follow = prompt + [rng.randrange(200, 40000) for _ in range(8)]
    got = complete(served.url, follow)
    assert metric(httpx.get(served.url + "/metrics").text, label) == before + 1, (held, served.status()["decisions"])
    ref = complete(served.engine_url("prefill"), follow)
    dtype = next((ln for ln in served.lines if "CPU engines compute in" in ln), "")
    if "float32" in dtype or not dtype:
        assert got["choices"][0]["token_ids"] == ref["choices"][0]["token_ids"]


def _engine(served: ServeProcess, role: str) -> dict:
    return next(e for e in served.status()["engines"] if e["role"] == role)


def _killed_mid_stream_goes_on(served: ServeProcess, pid: int) -> None:
    """SIGKILL the decode engine while it streams a greedy answer: the client's stream goes on on the other
    engine (router/migrate.py) with no error event and every token once. What docs/failure-semantics.md
    promises beyond that: the single engine's answer where the numerics allow, i.e. in float32; in bfloat16
    the continuation's one prefill of the context may break a near-tie the other way, so there the answer
    is checked to be whole (as many token ids as asked for, none lost or repeated at the move)."""
    import os
    import time

    rng = random.Random(91)
    prompt = [rng.randrange(200, 40000) for _ in range(120)]
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 160, "temperature": 0, "ignore_eos": True}
    prefill_url = served.engine_url("prefill")
    ref = post_ok(prefill_url + "/v1/completions", body)["choices"][0]["text"]
    moved_before = metric(httpx.get(served.url + "/metrics").text, 'pdserve_stream_migrations_total{outcome="migrated"}')
    text, events, killed_at, ids = "", 0, None, []
    stream_body = {**body, "stream": True, "return_token_ids": True}
    with httpx.stream("POST", served.url + "/v1/completions", json=stream_body, timeout=300) as r:
        assert r.status_code == 200, r.read()
        for ev in sse.events(r.iter_lines()):
            assert "error" not in ev, ev
            text += sse.text(ev)
            ids += [t for c in ev["choices"] for t in c.get("token_ids") or []]
            events += 1
            if events == 12:
                os.kill(pid, signal.SIGKILL)
                killed_at = time.monotonic()
    assert killed_at is not None, "the answer ended before the decode engine was killed"
    assert len(ids) == body["max_tokens"], (len(ids), ids)
    dtype = next((ln for ln in served.lines if "CPU engines compute in" in ln), "")
    if "float32" in dtype or not dtype:  # float32 on CPU, or a GPU app: the one engine's very answer
        assert text == ref, (text, ref)
    moved = metric(httpx.get(served.url + "/metrics").text, 'pdserve_stream_migrations_total{outcome="migrated"}')
    assert moved == moved_before + 1


def test_restarted_engines_are_used_for_pd_again(served: ServeProcess):
    """SIGKILL the decode engine mid-stream (the stream goes on), then the prefill engine: Serve replaces
    both replicas at once (new engines, new engine ids and NIXL agents) and P/D resumes with them: decode
    pulls the KV over NIXL again, nothing silently runs local."""
    import os
    import time

    old = {role: _engine(served, role) for role in ("decode", "prefill")}
    pids = {role: engine_server_pid(e["url"]) for role, e in old.items()}
    assert None not in pids.values(), pids
    _killed_mid_stream_goes_on(served, pids["decode"])  # (its continuation ran on the prefill engine)
    os.kill(pids["prefill"], signal.SIGKILL)
    deadline = time.monotonic() + 400  # health check period + two replicas' engine start on two cores
    while True:
        engines = served.status()["engines"]
        ids = {e["engine_id"] for e in engines}
        fresh = {e["role"] for e in engines if e["healthy"] and e["engine_id"] != old[e["role"]]["engine_id"]}
        if fresh == {"prefill", "decode"} and not ids & {e["engine_id"] for e in old.values()}:
            break
        assert time.monotonic() < deadline, f"no new engines took over: {engines}"
        time.sleep(2)
    decode_url = served.engine_url("decode")
    before = engine_metrics(decode_url)
    pd_before = served.status()["decisions"]["pd"]
    rng = random.Random(77)
    for n in (300, 600):
        complete(served.url, [rng.randrange(200, 40000) for _ in range(n)])
    after = engine_metrics(decode_url)
    moved = metric(after, "vllm:nixl_bytes_transferred_sum") - metric(before, "vllm:nixl_bytes_transferred_sum")
    pulled = by_source(after, "external_kv_transfer") - by_source(before, "external_kv_transfer")
    assert served.status()["decisions"]["pd"] - pd_before >= 2
    assert pulled >= 800 and moved >= 23040 * 800, (pulled, moved)
    assert metric(after, "vllm:nixl_num_failed_transfers_total") == metric(before, "vllm:nixl_num_failed_transfers_total")


def test_zz_sigterm_mid_request_stops_everything(served: ServeProcess):
    """Last in this module: stop the shared system with SIGTERM, as Kubernetes does and as ``timeout`` or
    ``kill -- -PGID`` do to its whole process group, while an engine is busy: "stopped", exit status 0,
    nothing it started left running."""
    stop_mid_request(served, signal.SIGTERM, MODEL)
