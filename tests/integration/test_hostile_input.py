"""Hostile requests against the real system (Ray Serve + vLLM CPU engines + NIXL): every one is answered
with a 4xx, none crashes or changes an engine, and none costs the prefill engine a prompt token.

The corpus is written from vLLM 0.32's request handling: fields the router passes through, fields only it
may set (KV transfer parameters), wrong types, extreme values, odd request ids, and the errors only a decode
engine raises because the prefill leg carries ``max_tokens=1``, no streaming, and no ``min_tokens`` /
``logit_bias`` / ``stream_options`` / ``n``. A body of that last kind that got past the router would cost a
full prefill (and hold its KV blocks until their lease ran out) before decode refused it: the prefill
engine's ``vllm:prompt_tokens_total`` must not move while the corpus runs.

This module must run before test_pd_real.py, whose last test stops the shared system.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx
import pytest

from tests.integration.conftest import ServeProcess
from tests.integration.test_pd_real import engine_metrics, metric

pytestmark = pytest.mark.integration

MODEL = "smollm2-135m-instruct"
MAX_MODEL_LEN = 2048  # tests/integration/pd-test.yaml
VOCAB = 49152  # SmolLM2's config.json
TIMEOUT_S = 60

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": {"type": "object", "required": ["city"],
                                                          "properties": {"city": {"type": "string"}}}}}]
FORGED_KV = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "forged-engine",
             "remote_block_ids": [[0, 1, 2, 3]], "remote_request_id": "someone-elses-request",
             "remote_host": "127.0.0.1", "remote_port": 5600, "tp_size": 1}


@dataclass
class Case:
    name: str
    body: dict | None = None
    route: str = "completions"
    raw: bytes | None = None  # sent as is instead of ``body``
    headers: dict = field(default_factory=dict)


def comp(name: str, **kw) -> Case:
    return Case(name, {"model": MODEL, "prompt": "Hello, my name is", "max_tokens": 8, **kw})


def chat(name: str, **kw) -> Case:
    return Case(name, {"model": MODEL, "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
                       "max_tokens": 8, **kw}, route="chat")


def with_id(name: str, rid: str | bytes) -> Case:
    return Case(name, comp(name).body, headers={"X-Request-Id": rid})


def nested(depth: int) -> list:
    v: list = []
    for _ in range(depth - 1):
        v = [v]
    return v


CORPUS = [
    # Forged KV transfer parameters: only the router may set them, at any level vLLM reads them from.
    comp("kv params: decode params naming another request's blocks", kv_transfer_params=FORGED_KV),
    comp("kv params: prefill params", kv_transfer_params={"do_remote_decode": True}),
    comp("kv params: a string", kv_transfer_params="x"),
    comp("kv params: null", kv_transfer_params=None),
    chat("kv params: prompt_token_ids to skip rendering", kv_transfer_params={"prompt_token_ids": [1, 2, 3]}),
    comp("kv params inside vllm_xargs", vllm_xargs={"kv_transfer_params": json.dumps(FORGED_KV)}),
    comp("kv params inside vllm_xargs, a number, on a decode-only request", n=2, temperature=0.5,
         vllm_xargs={"kv_transfer_params": 0}),
    comp("ec params inside vllm_xargs", vllm_xargs={"ec_transfer_params": "x"}),
    comp("kv cache report mode inside vllm_xargs", vllm_xargs={"kv_cache_report_mode": "all"}),
    comp("ec params", ec_transfer_params={"do_remote_decode": True}),
    # Wrong types on fields the router forwards or rewrites.
    comp("max_tokens a string", max_tokens="8"),
    comp("max_tokens a float", max_tokens=8.5),
    comp("max_tokens a boolean", max_tokens=True),
    comp("n a string", n="2"),
    comp("stream a string", stream="yes"),
    comp("stream_options a string", stream=True, stream_options="x"),
    comp("stream_options.include_usage not a boolean", stream=True, stream_options={"include_usage": "maybe"}),
    comp("min_tokens a string", min_tokens="3"),
    comp("logit_bias a string", logit_bias="x"),
    comp("logit_bias with a word for a key", logit_bias={"hello": 5}),
    comp("temperature a word", temperature="hot"),
    comp("prompt an object", prompt={"text": "hi"}),
    chat("message content a number", messages=[{"role": "user", "content": 5}]),
    chat("messages a string", messages="hello"),
    chat("tools not objects", tools=[1]),
    comp("vllm_xargs value an object", vllm_xargs={"a": {"b": 1}}),
    comp("best_of a string", best_of="2"),
    # A client's chat template is a program the router would run to route by cached prefix (pd-test.yaml
    # routes prefill by kv_cache): refused before anything renders it.
    chat("a chat template of two nested loops",
         chat_template="{% for i in range(20000) %}{% for j in range(20000) %}{% endfor %}{% endfor %}"),
    chat("a chat template of a 12 MB string", chat_template="{{'ab '*4000000}}"),
    chat("a chat template inside chat_template_kwargs",
         chat_template_kwargs={"chat_template": "{% for i in range(20000) %}{% for j in range(20000) %}"
                                                "{% endfor %}{% endfor %}"}),
    chat("chat_template_kwargs a string", chat_template_kwargs="x"),
    # Bodies whose parsing and walking would hold the router's event loop for seconds: refused by their
    # bytes before they are parsed.
    Case("a 16 MiB body of empty arrays",
         raw=b'{"model":"' + MODEL.encode() + b'","max_tokens":2,"prompt":[' + b"[]," * 5_500_000 + b"[]]}"),
    Case("a 16 MiB token-id prompt", raw=b'{"model":"' + MODEL.encode() + b'","max_tokens":2,"prompt":['
         + b"1," * 8_000_000 + b"1]}"),
    # Extreme values.
    comp("max_tokens 2**63", max_tokens=2**63),
    comp("max_tokens past the context", max_tokens=100_000),
    chat("max_completion_tokens past the context", max_completion_tokens=MAX_MODEL_LEN + 1),
    comp("max_tokens 0", max_tokens=0),
    comp("max_tokens negative", max_tokens=-1),
    comp("temperature -1", temperature=-1),
    comp("temperature 3", temperature=3),
    comp("top_p 2", top_p=2),
    comp("top_p 0", top_p=0),
    comp("top_k -2", top_k=-2),
    comp("presence_penalty 9", presence_penalty=9),
    comp("repetition_penalty 0", repetition_penalty=0),
    comp("n 0", n=0),
    comp("n 100000", n=100_000),
    comp("seed 2**64", seed=2**64),
    comp("priority 2**70", priority=2**70),
    comp("logprobs 1000", logprobs=1000),
    comp("logprobs -5", logprobs=-5),
    chat("top_logprobs 1000", logprobs=True, top_logprobs=1000),
    comp("prompt_logprobs 1000", prompt_logprobs=1000),
    comp("1000 stop strings", stop=[f"stop{i}" for i in range(1000)]),
    comp("an empty stop string", stop=[""]),
    comp("an empty bad word", bad_words=[""]),
    comp("truncate_prompt_tokens -5", truncate_prompt_tokens=-5),
    comp("an empty cache_salt", cache_salt=""),
    comp("no allowed token", allowed_token_ids=[]),
    comp("a stop token id outside the vocabulary", stop_token_ids=[VOCAB]),
    comp("a prompt token id outside the vocabulary", prompt=[VOCAB + 1000]),
    comp("an empty token prompt", prompt=[[]]),
    # Errors only a decode engine raises: the prefill leg does not carry the client's values.
    comp("min_tokens above max_tokens", min_tokens=20),
    comp("min_tokens above what the context leaves after the prompt", prompt=[300] * 1500, max_tokens=700,
         min_tokens=600),
    comp("logit_bias for a token id past the vocabulary", logit_bias={str(VOCAB): 5}),
    comp("logit_bias for a negative token id", logit_bias={"-1": 5}),
    chat("logit_bias for a huge token id", logit_bias={str(2**40): 5}),
    comp("stream_options without stream", stream_options={"include_usage": True}),
    chat("stream_options with stream false", stream=False, stream_options={"include_usage": True}),
    comp("beam search streamed", stream=True, use_beam_search=True),
    comp("prompt logprobs streamed", stream=True, prompt_logprobs=1),
    comp("n 2 with greedy sampling", n=2, temperature=0),
    # Prompts the context cannot hold.
    comp("a prompt past the context", prompt=[300] * 3000, max_tokens=4),
    comp("a prompt as long as the context", prompt=[300] * MAX_MODEL_LEN, max_tokens=4),
    chat("a message past the context", messages=[{"role": "user", "content": "hello " * 3000}]),
    # Text the router would spend seconds of its event loop tokenizing: refused by its length alone.
    comp("a 4 MiB text prompt", prompt="lorem ipsum dolor " * 233_017),
    chat("a 4 MiB message", messages=[{"role": "user", "content": "lorem ipsum dolor " * 233_017}]),
    # Fields that would steer engines past the router's own order and claims.
    comp("a priority ahead of everyone", priority=-(2**63)),
    Case("a Responses request in the background", {"model": MODEL, "input": "Hello", "background": True,
                                                   "max_output_tokens": 8}, route="responses"),
    # Structured output and tools.
    chat("an unknown response_format type", response_format={"type": "xml"}),
    chat("json_schema without a schema", response_format={"type": "json_schema"}),
    comp("two structured-output constraints", structured_outputs={"json": {"type": "object"}, "regex": "a+"}),
    chat("an unknown tool_choice", tools=TOOLS, tool_choice="sometimes"),
    chat("tool_choice without tools", tool_choice="auto"),
    chat("tool_choice naming a tool that is not there", tools=TOOLS,
         tool_choice={"type": "function", "function": {"name": "launch_rockets"}}),
    chat("an empty tools list", tools=[]),
    # Compile work a schema would cost each engine before its first token (distinct length bounds: ~2 s each).
    chat("a schema of many distinct length bounds", response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {
            f"p{i}": {"type": "string", "maxLength": 1000 + i} for i in range(150)}}}}),
    chat("a forced tool with many distinct length bounds", tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {
            f"p{i}": {"type": "string", "minLength": 100 + i} for i in range(20)}}}}], tool_choice="required"),
    comp("logit_bias past the GPU runner's 1,024 entries", logit_bias={str(i): 1 for i in range(1025)}),
    comp("2,000 stop token ids with min_tokens", stop_token_ids=list(range(2000)), min_tokens=1),
    comp("a regex of many distinct repetition bounds",
         structured_outputs={"regex": "".join(f"{chr(97 + i)}.{{0,{200 + i}}}" for i in range(20))}),
    chat("a grammar of many distinct repetition bounds", structured_outputs={
        "grammar": "root ::= " + " ".join(f"[a-z]{{0,{100 + i}}}" for i in range(20))}),
    # Template parameters that make a short message a long prompt (padded on the engine, counted short here).
    chat("chat_template_kwargs padding to 6,000 tokens",
         chat_template_kwargs={"padding": "max_length", "max_length": 6000}),
    chat("chat_template_kwargs truncation", chat_template_kwargs={"truncation": True, "max_length": 2}),
    # Media an engine would fetch from inside the cluster (router/media.py): no host is allowed here.
    chat("an image from the node's metadata service", messages=[{"role": "user", "content": [
        {"type": "text", "text": "Describe it."},
        {"type": "image_url", "image_url": {"url": "http://169.254.169.254/latest/meta-data/"}}]}]),
    chat("audio from a file on the engine's host", messages=[{"role": "user", "content": [
        {"type": "audio_url", "audio_url": {"url": "file:///etc/passwd"}}]}]),
    Case("a Responses image from an internal service", {"model": MODEL, "max_output_tokens": 8, "input": [
        {"role": "user", "content": [{"type": "input_image", "image_url": "http://kubernetes.default.svc/"}]}]},
        route="responses"),
    # Shape and encoding.
    chat("a tool schema nested 100 deep", tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"x": nested(100)}}}}]),
    comp("a prompt nested 100 deep", prompt=nested(100)),
    Case("JSON nested 10000 deep", raw=b'{"model": "%s", "prompt": ' % MODEL.encode() + b"[" * 10_000
         + b"]" * 10_000 + b"}"),
    comp("a lone surrogate in the prompt", prompt="Hello \ud800 there"),
    Case("a body that is not UTF-8", raw=b'{"model": "' + MODEL.encode() + b'", "prompt": "\xff\xfe"}'),
    Case("a body that is not JSON", raw=b'{"model": '),
    Case("a body that is an array", raw=b"[]"),
    Case("an empty body", raw=b""),
    comp("an unknown model", model="gpt-9"),
    # Odd request ids. (Not raw non-UTF-8 bytes: Ray Serve's proxy decodes the header before the router.)
    with_id("a request id of 200 characters", "r" * 200),
    with_id("a request id with a space", "a b"),
    with_id("a request id that walks up a path", "../../pdserve/kv-lease/x"),
    with_id("a request id with ? and #", "x?y#z"),
    with_id("a request id with percent escapes", "a%2Fb%0Ac"),
    with_id("a request id outside ASCII", "é-id".encode()),
]

PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions", "responses": "/v1/responses"}


def _send(url: str, case: Case) -> httpx.Response:
    content = case.raw if case.raw is not None else json.dumps(case.body).encode()
    return httpx.post(url + PATHS[case.route], content=content, timeout=TIMEOUT_S,
                      headers={"Content-Type": "application/json", **case.headers})


def _engines(served: ServeProcess) -> dict[str, tuple[str, bool]]:
    return {e["url"]: (e["engine_id"], e["healthy"]) for e in served.status()["engines"]}


def _prefill_prompt_tokens(served: ServeProcess) -> float:
    return sum(metric(engine_metrics(e["url"]), "vllm:prompt_tokens_total")
               for e in served.status()["engines"] if e["role"] == "prefill")


def _settled_prefill_prompt_tokens(served: ServeProcess, quiet_s: float = 5, limit_s: float = 180) -> float:
    """The prefill engines' prompt-token count once nothing moves it (a new engine's calibration
    requests, an earlier test's stragglers)."""
    deadline = time.monotonic() + limit_s
    last = _prefill_prompt_tokens(served)
    while True:
        time.sleep(quiet_s)
        now = _prefill_prompt_tokens(served)
        if now == last:
            return now
        assert time.monotonic() < deadline, "the prefill engine's prompt-token count never settled"
        last = now


def test_router_checks_with_vllms_models_and_the_engine_limits(served: ServeProcess):
    checks = served.status()["router"]["request_checks"]
    assert checks["engine_checks"] is True, checks
    assert checks["vocab_size"] == VOCAB, checks
    # Without it, the decode-only "max_tokens past the context" errors cost a full prefill each.
    assert checks["max_model_len"] == MAX_MODEL_LEN, (
        "the router was not given the engines' limits (Orchestrator(limits=EngineLimits.from_engine_kwargs(...)))",
        checks)


def test_hostile_requests_are_4xx_and_cost_the_engines_nothing(served: ServeProcess):
    assert len(CORPUS) >= 40
    before = _engines(served)
    assert before and all(healthy for _, healthy in before.values()), before
    tokens_before = _settled_prefill_prompt_tokens(served)

    wrong = []
    for case in CORPUS:
        try:
            r = _send(served.url, case)
        except httpx.TimeoutException:
            wrong.append((case.name, "no answer within 60 s"))
            continue
        if not 400 <= r.status_code < 500:
            wrong.append((case.name, r.status_code, r.text[:200]))
            continue
        try:
            err = r.json()["error"]
            assert isinstance(err["message"], str) and err["message"]
        except (ValueError, KeyError, TypeError, AssertionError):
            wrong.append((case.name, r.status_code, "not an OpenAI error body", r.text[:200]))
    assert not wrong, "\n".join(map(str, wrong))

    # No engine died or was replaced, and no prefill ran for any of them (no valid request was sent).
    after = _engines(served)
    assert after == before, (before, after)
    grown = _prefill_prompt_tokens(served) - tokens_before
    assert grown == 0, f"the prefill engine computed {grown} prompt tokens for refused requests"
    # The system still serves.
    r = httpx.post(served.url + "/v1/completions", json={"model": MODEL, "prompt": "The capital of France is",
                                                         "max_tokens": 4, "temperature": 0}, timeout=TIMEOUT_S)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"]
    assert httpx.get(served.url + "/health", timeout=10).status_code == 200
    # vLLM's models judged the bodies on an engine, each time with a verdict (none fell back to the router's
    # rules alone): some refused, the last one passed.
    text = httpx.get(served.url + "/metrics?engines=0", timeout=10).text
    checks = {o: metric(text, f'pdserve_engine_checks_total{{outcome="{o}"}}') for o in ("passed", "refused",
                                                                                        "no_verdict")}
    assert checks["refused"] > 0 and checks["passed"] > 0 and checks["no_verdict"] == 0, checks


def test_seeded_prompts_computed_in_several_steps_neither_kill_an_engine_nor_change_their_answer(
        served: ServeProcess):
    """A request with a ``seed`` whose prompt does not fit one engine step (the step's 2,048-token budget is
    shared with other prompts) killed vLLM's CPU engine: it rewinds that request's generator with
    ``set_offset``, which torch's CPU generator lacks. The router seeds every sampled request itself, so this
    was ordinary traffic under load. Here: an engine busy with one prompt, two seeded ones queued behind it
    (the second is split across two steps), then the second again alone: same answer, engine alive."""
    import concurrent.futures
    import random

    from tests.integration.conftest import engine_auth

    url = served.engine_url("prefill")
    before = _engines(served)
    rng = random.Random(time.time_ns())  # fresh prompts: a cached prefix would not be recomputed in steps

    def ask(prompt: list[int], seed: int | None) -> tuple[int, str]:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 1.0, "ignore_eos": True,
                **({"seed": seed} if seed is not None else {})}
        r = httpx.post(url + "/v1/completions", json=body, headers=engine_auth(url), timeout=120)
        return r.status_code, (r.json()["choices"][0]["text"] if r.status_code == 200 else r.text[:300])

    busy, first, second = ([rng.randrange(200, 40000) for _ in range(n)] for n in (1900, 1200, 1200))
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        running = pool.submit(ask, busy, None)
        time.sleep(0.3)  # the busy prompt's step is under way: the next two wait and share the next step
        got = [pool.submit(ask, p, 11) for p in (first, second)]
        answers = [running.result()] + [g.result() for g in got]
    assert [s for s, _ in answers] == [200, 200, 200], answers
    assert ask(second, 11) == answers[2], "a seeded answer changed with the steps its prompt was computed in"
    # Through the router too: sampled requests without a seed get one from the router.
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        codes = list(pool.map(lambda _: httpx.post(served.url + "/v1/completions", json={
            "model": MODEL, "prompt": [rng.randrange(200, 40000) for _ in range(900)], "max_tokens": 4},
            timeout=120).status_code, range(3)))
    assert set(codes) <= {200, 429} and 200 in codes, codes
    assert _engines(served) == before, "an engine died or was replaced"


def test_a_salted_prompt_tells_another_tenant_nothing_through_the_routers_cache_counters(served: ServeProcess):
    """Prefill is routed by the engine's KV events (pd-test.yaml). Tenant A's prompt cached under its
    ``cache_salt``: the same prompt from tenant B, unsalted or with another salt, shows no cached block in
    ``/pdserve/status``; A asking again does (the control). A's prompt is cached on the prefill engine
    directly: through the router, decode would hold it too and A's repeat would run there alone
    (router.cache_aware_steps), never routed to prefill."""
    import random

    rng = random.Random(2024)
    prompt = [rng.randrange(200, 40000) for _ in range(700)]

    def routed() -> tuple[int, int]:
        r = served.status()["kv_cache_routing"]
        return r["routed_blocks"], r["routed_hit_blocks"]

    def send(**kw) -> tuple[int, int]:
        before = routed()
        r = httpx.post(served.url + "/v1/completions", timeout=TIMEOUT_S,
                       json={"model": MODEL, "prompt": prompt, "max_tokens": 2, **kw})
        assert r.status_code == 200, r.text
        after = routed()
        return after[0] - before[0], after[1] - before[1]

    from tests.integration.conftest import engine_auth

    prefill = served.engine_url("prefill")

    def prefill_events() -> int:
        engines = served.status()["kv_cache_routing"]["engines"]
        return sum(e["events"] for k, e in engines.items() if k.startswith("prefill|"))

    # (Events, not blocks held: with its cache full, the engine evicts as many blocks as it stores.)
    seen = prefill_events()
    r = httpx.post(prefill + "/v1/completions", headers=engine_auth(prefill), timeout=TIMEOUT_S,
                   json={"model": MODEL, "prompt": prompt, "max_tokens": 2, "cache_salt": "tenant-a-secret"})
    assert r.status_code == 200, r.text
    deadline = time.monotonic() + 20
    while prefill_events() <= seen:  # the engine's events reach the router after the step
        assert time.monotonic() < deadline, "the router never learnt of the prefill engine's new blocks"
        time.sleep(0.5)
    time.sleep(1.0)  # (the request's later step, if its events came in a batch of their own)
    blocks, hits = send(cache_salt="tenant-a-secret")
    assert blocks and hits, "the control: tenant A's own repeat never showed its cached blocks"
    assert send()[1] == 0, "tenant B (no salt) saw tenant A's cached blocks"
    assert send(cache_salt="tenant-b")[1] == 0, "tenant B (its own salt) saw tenant A's cached blocks"


#: The field that bounds a route's output, set when a generated body has none.
OUTPUT_BUDGET = {"/v1/completions": "max_tokens", "/v1/chat/completions": "max_tokens",
                 "/v1/responses": "max_output_tokens", "/v1/messages": "max_tokens"}


def test_bodies_from_vllms_request_schemas_never_5xx_on_the_real_system(served: ServeProcess):
    """The unit suite's schema-driven bodies (tests/schema_bodies.py), fewer of them, against the real
    engines: no 5xx on any route, and the same engines, alive, afterwards."""
    from hypothesis import HealthCheck, given, settings

    from tests.schema_bodies import ROUTES, bodies

    before = _engines(served)
    bad: list[tuple[str, dict, int, str]] = []
    def checker(path: str, model_path: str):
        @settings(max_examples=15, deadline=None, database=None,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
        @given(body=bodies(model_path, MODEL))
        def check(body):
            if isinstance(body, dict):
                # Keep each request cheap for one-core engines: a few output tokens at most, also where the
                # body names no budget (a Responses request without one generates to the end of the context).
                budgets = ("max_tokens", "max_completion_tokens", "max_output_tokens")
                for key in budgets:
                    if isinstance(body.get(key), int) and body[key] > 8:
                        body[key] = 8
                if path in OUTPUT_BUDGET and not any(k in body for k in budgets):
                    body[OUTPUT_BUDGET[path]] = 8
                body.pop("stream", None)
            r = httpx.post(served.url + path, json=body, timeout=TIMEOUT_S)
            if r.status_code >= 500:
                bad.append((path, body, r.status_code, r.text[:200]))

        return check

    for path, model_path in ROUTES:
        checker(path, model_path)()
    assert not bad, bad[:5]
    assert _engines(served) == before, "an engine died or was replaced"


BASE_PROMPT = {"model": MODEL, "prompt": "Once upon a time, in a land far away,", "ignore_eos": True}


def decode_streams(served: ServeProcess) -> int:
    return sum(e["streams"] for e in served.status()["engines"] if e["role"] == "decode")


class StreamBeside:
    """Another client's greedy 200-token stream, running on the decode engine once this returns."""

    def __init__(self, served: ServeProcess) -> None:
        import threading

        self.served, self.events = served, []
        self.thread = threading.Thread(target=self._read)
        self.thread.start()
        deadline = time.monotonic() + 120
        while decode_streams(served) < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert decode_streams(served) == 1, "the stream never started"

    def _read(self) -> None:
        with httpx.stream("POST", self.served.url + "/v1/completions", timeout=300,
                          json={**BASE_PROMPT, "max_tokens": 200, "temperature": 0, "stream": True}) as r:
            self.events.append(str(r.status_code))
            self.events.extend(line for line in r.iter_lines() if line.startswith("data: "))

    def ended(self, what: str) -> None:
        """It was still running when ``what`` (else the check proved nothing), and then ended whole."""
        running = decode_streams(self.served)
        self.thread.join(timeout=300)
        assert running == 1, f"the stream ended before {what}: the check proved nothing"
        assert self.events[0] == "200" and self.events[-1] == "data: [DONE]" and len(self.events) == 1 + 200 + 1


def test_a_request_of_many_sequences_is_not_let_onto_an_engine_beside_a_stream(served: ServeProcess):
    """One ``n: 64`` request runs 64 sequences at once. Counted as one stream, it was let onto the decode
    engine beside another client's stream and took that stream from 53 to 246 ms per token; now admission
    counts its sequences (router/admission.py) and answers 429 while the stream runs, which ends whole; then,
    alone, it is served."""
    base, beside = BASE_PROMPT, StreamBeside(served)
    r = httpx.post(served.url + "/v1/completions", timeout=TIMEOUT_S,
                   json={**base, "max_tokens": 48, "temperature": 0.8, "n": 64})
    beside.ended("the big request was asked")
    assert r.status_code == 429, r.text[:300]
    # Alone on an idle engine it is served, whatever router.max_tpot_s says of its sequences at once (there a
    # 429 would never end). 128, the most a request may ask, is estimated at 33 one-stream steps a token:
    # past max_tpot_s's 1 s wherever a step takes over 31 ms (52 ms here, float32 on AVX-512).
    deadline = time.monotonic() + 60
    while decode_streams(served) and time.monotonic() < deadline:
        time.sleep(0.1)
    alone = httpx.post(served.url + "/v1/completions", timeout=TIMEOUT_S,
                       json={**base, "max_tokens": 8, "temperature": 0.8, "n": 128})
    assert alone.status_code == 200, alone.text[:300]
    assert len(alone.json()["choices"]) == 128 and alone.json()["usage"]["completion_tokens"] == 128 * 8


def test_a_long_prompt_that_cannot_be_split_is_not_computed_beside_a_stream(served: ServeProcess):
    """``max_tokens: 1`` cannot be split (its prefill leg would be the whole answer). A client's long prompt so
    was computed on the decode engine beside another client's stream, stalling it for the prompt's whole
    time; now a prefill engine answers it whole (router/admission.py ``_prompt_bound``), and the stream ends
    whole."""
    import random

    from tests.integration.test_pd_real import complete

    label = 'pdserve_pd_decisions_total{decision="local",reason="max_tokens=1_on_prefill"}'
    text = httpx.get(served.url + "/metrics").text
    before = metric(text, label) if "max_tokens=1_on_prefill" in text else 0.0  # (no series before the first)
    prompt = [random.Random(77).randrange(200, 40000) for _ in range(1900)]  # (seconds, on any host)
    beside = StreamBeside(served)
    got = complete(served.url, prompt, max_tokens=1)
    beside.ended("the long prompt was answered")
    assert metric(httpx.get(served.url + "/metrics").text, label) == before + 1
    assert got["choices"][0]["token_ids"] == complete(served.engine_url("prefill"), prompt, max_tokens=1)[
        "choices"][0]["token_ids"]
