"""A fake engine that speaks the vLLM OpenAI server's P/D protocol, for fast router tests.

It tokenises by whitespace and "generates" a deterministic word sequence from the prompt, so answers can
be compared exactly. A prefill-role fake keeps "blocks" for each ``do_remote_decode`` request; a
decode-role fake given ``kv_transfer_params`` pulls them from the named prefill fake (through an
in-process directory) or, when the params are unusable, recomputes and counts it. Faults can be injected.

Not for production: real serving always runs real vLLM engines.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from pdserve.engine.vllm_plugin import add_check_route

#: engine_id -> FakeEngine, so decode fakes can "pull" from prefill fakes in the same process.
DIRECTORY: dict[str, FakeEngine] = {}


#: The fakes' vocabulary: word <-> token id, shared by every fake in the process (ids from 100000, so small
#: integer prompts stay what they are).
_VOCAB: dict[str, int] = {}
_WORDS: dict[int, str] = {}
_FIRST_ID = 100_000


def token_ids(words: list[str]) -> list[int]:
    for w in words:
        if w not in _VOCAB:
            _VOCAB[w] = _FIRST_ID + len(_VOCAB)
            _WORDS[_VOCAB[w]] = w
    return [_VOCAB[w] for w in words]


def _mix(state: int, word: str) -> int:
    for c in word:
        state = (state * 131 + ord(c)) % 1_000_003
    return (state * 31 + 7) % 1_000_003


def expected_words(prompt: str, n: int) -> list[str]:
    """What a fake engine generates for ``prompt``: the same on any fake, P/D or not. Autoregressive over
    words, like a model: the prompt's words and the words generated so far decide the next, so a stream
    continued from prompt + generated words goes on with the same words."""
    state = 0
    for w in prompt.split():
        state = _mix(state, w)
    out = []
    for _ in range(n):
        w = f"w{state % 1000}"
        out.append(w)
        state = _mix(state, w)
    return out


@dataclass
class Faults:
    fail_status: int | None = None  # answer every generation request with this status
    delay_s: float = 0.0  # before answering
    first_token_delay_s: float = 0.0  # streams: after the headers, before the first token (a real engine's pull)
    die_mid_stream_after: int | None = None  # close the stream after this many chunks
    drop_kv_params: bool = False  # prefill answers without kv_transfer_params
    expire_leases: bool = False  # prefill frees blocks at once and reports the lease as expired
    first_word: str | None = None  # prefill legs' answers start with this word (a near-tie broken otherwise)


@dataclass
class FakeEngine:
    role: str
    model_id: str = "fake-model"
    engine_id: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    max_model_len: int = 4096
    faults: Faults = field(default_factory=Faults)
    held: dict[str, int] = field(default_factory=dict)  # prefill: request id -> prompt tokens held
    counters: dict[str, int] = field(default_factory=lambda: {
        "requests": 0, "pulled": 0, "pulled_expired": 0, "recomputed": 0, "held_all": 0, "aborted_streams": 0})
    requests: list[dict[str, Any]] = field(default_factory=list)
    traceparents: list[str | None] = field(default_factory=list)  # each request's W3C traceparent header
    request_ids: list[str | None] = field(default_factory=list)  # each POST's X-Request-Id header
    expired: set[str] = field(default_factory=set)  # prefill: request ids whose lease ran out
    stored: dict[str, dict[str, Any]] = field(default_factory=dict)  # Responses kept (store), by id
    adapters: set[str] = field(default_factory=set)  # LoRA adapters it serves as "<model_id>:<name>"
    held_adapter: dict[str, str] = field(default_factory=dict)  # prefill: request id -> adapter of its KV
    api_key: str = ""  # when set, the same key guard as a real engine (pdserve.engine.vllm_plugin)

    def __post_init__(self) -> None:
        DIRECTORY[self.engine_id] = self


def _prompt_text(body: dict[str, Any]) -> str:
    if "messages" in body:
        msgs = body["messages"] if isinstance(body["messages"], list) else []
        return "\n".join(str(m.get("content", "")) for m in msgs if isinstance(m, dict))
    if "input" in body:  # the Responses API
        given = body["input"]
        return given if isinstance(given, str) else "\n".join(
            str(m.get("content", "")) for m in given if isinstance(m, dict))
    p = body.get("prompt", "")
    if isinstance(p, list):
        return " ".join(_WORDS.get(x, str(x)) if isinstance(x, int) else str(x) for x in p)
    return str(p)


def _error(status: int, msg: str) -> JSONResponse:
    return JSONResponse({"error": {"message": msg, "type": "BadRequestError", "param": None, "code": status}},
                        status_code=status)


class _NoteRequestIds:
    """Each POST's ``X-Request-Id`` into ``engine.request_ids`` (plain ASGI: a response streams through as is,
    a stream's injected death included)."""

    def __init__(self, app: Any, engine: FakeEngine) -> None:
        self.app, self.engine = app, engine

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            headers = dict(scope.get("headers") or [])
            rid = headers.get(b"x-request-id")
            self.engine.request_ids.append(rid.decode("latin-1") if rid is not None else None)
        await self.app(scope, receive, send)


def build_fake_engine(engine: FakeEngine) -> FastAPI:
    app = FastAPI()
    if engine.api_key:
        from pdserve.engine.vllm_plugin import EngineKeyGuard

        app.add_middleware(EngineKeyGuard, key=engine.api_key)

    app.add_middleware(_NoteRequestIds, engine=engine)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/pdserve/kv-lease/{request_id}")
    async def kv_lease(request_id: str) -> Response:
        return JSONResponse({"request_id": request_id, "expired": request_id in engine.expired,
                             "read_after_expiry": False})

    # vLLM's own request models, by the very route a real engine's API server gets from pdserve's plugin.
    add_check_route(app)

    @app.get("/metrics")
    async def metrics() -> Response:
        values = {**engine.counters, "held": len(engine.held)}
        lines = []
        for k, v in values.items():
            lines += [f"# HELP fake_{k} Fake engine {k}.", f"# TYPE fake_{k} gauge", f"fake_{k} {v}"]
        return Response("\n".join(lines) + "\n", media_type="text/plain")

    async def generate(route: str, request: Request) -> Response:
        body = await request.json()
        engine.requests.append(body)
        engine.traceparents.append(request.headers.get("traceparent"))
        engine.counters["requests"] += 1
        if engine.faults.delay_s:
            await asyncio.sleep(engine.faults.delay_s)
        if engine.faults.fail_status:
            return _error(engine.faults.fail_status, "injected failure")
        model = str(body.get("model"))
        adapter = model[len(engine.model_id) + 1:] if model.startswith(engine.model_id + ":") else ""
        if model != engine.model_id and adapter not in engine.adapters:
            return _error(404, f"The model `{body.get('model')}` does not exist.")
        prompt = _prompt_text(body)
        n_prompt = len(prompt.split())
        if n_prompt > engine.max_model_len:
            return _error(400, f"prompt has {n_prompt} tokens, more than max_model_len {engine.max_model_len}")
        max_tokens = (body.get("max_completion_tokens") or body.get("max_tokens") or body.get("max_output_tokens")
                      or 16)
        if route == "responses" and body.get("previous_response_id"):
            earlier = engine.stored.get(str(body["previous_response_id"]))
            if earlier is None:
                return _error(404, f"Response with id '{body['previous_response_id']}' not found.")
            body = {**body, "input": _prompt_text(body) + " " + earlier["text"]}
            prompt = _prompt_text(body)
        rid = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        kv = body.get("kv_transfer_params")
        try:
            out_kv, prompt = _kv_leg(engine, kv, rid, n_prompt, adapter, prompt)
        except ValueError as e:
            return _error(400, str(e))
        n = int(body.get("n") or 1)
        words = expected_words(f"[{adapter}] {prompt}" if adapter else prompt, int(max_tokens))
        if engine.faults.first_word and words and isinstance(kv, dict) and kv.get("do_remote_decode"):
            words[0] = engine.faults.first_word
        created = int(time.time())
        cid = ("chatcmpl-" if route == "chat" else "cmpl-") + rid
        usage = {"prompt_tokens": n_prompt, "completion_tokens": len(words), "total_tokens": n_prompt + len(words)}
        if route in ("responses", "messages"):
            return _api_answer(engine, route, body, rid, words, usage, out_kv)
        with_ids = bool(body.get("return_token_ids"))
        if not body.get("stream"):
            return _whole(engine, route, cid, created, words, prompt, usage, out_kv, n, with_ids)

        return StreamingResponse(_events(engine, route, body, cid, created, words, prompt, usage, with_ids),
                                 media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate("completions", request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await generate("chat", request)

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        return await generate("responses", request)

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        return await generate("messages", request)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> Response:
        got = engine.stored.get(response_id)
        return JSONResponse(got["answer"]) if got else _error(404, f"Response with id '{response_id}' not found.")

    # Like vLLM's: one token id per word (its position in a fixed word list, else a hash), and back.
    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        body = await request.json()
        engine.counters["requests"] += 1
        tokens = [_word_id(w) for w in _prompt_text(body).split()]
        return JSONResponse({"count": len(tokens), "max_model_len": engine.max_model_len, "tokens": tokens})

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        body = await request.json()
        engine.counters["requests"] += 1
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            return _error(400, "'tokens' must be a list of integers")  # as vLLM's request model says
        return JSONResponse({"prompt": " ".join(f"w{t}" for t in tokens)})

    return app


def _api_answer(engine: FakeEngine, route: str, body: dict[str, Any], rid: str, words: list[str],
                usage: dict[str, int], out_kv: dict[str, Any] | None) -> Response:
    """A Responses or Anthropic Messages answer (whole, or streamed as those APIs stream)."""
    text = " ".join(words)
    use = {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"]}
    if route == "responses":
        answer: dict[str, Any] = {
            "id": str(body.get("request_id") or "resp_" + rid), "object": "response", "status": "completed",
            "model": body.get("model"),
            "output": [{"type": "message", "role": "assistant", "id": "msg_" + rid,
                        "content": [{"type": "output_text", "text": text, "annotations": []}]}],
            "usage": use, "kv_transfer_params": out_kv}
        if body.get("store", True):
            engine.stored[answer["id"]] = {"answer": answer, "text": text}
    else:
        answer = {"id": "msg_" + rid, "type": "message", "role": "assistant", "model": body.get("model"),
                  "content": [{"type": "text", "text": text}], "stop_reason": "max_tokens", "usage": use,
                  "kv_transfer_params": out_kv}
    if not body.get("stream"):
        return JSONResponse(answer)

    def event(kind: str, data: dict[str, Any]) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"

    async def events() -> Any:
        head = {k: v for k, v in answer.items() if k != "kv_transfer_params"}
        if route == "responses":
            yield event("response.created", {"response": {**head, "status": "in_progress", "output": []}})
            for j, w in enumerate(words):
                yield event("response.output_text.delta", {"delta": w if j == 0 else " " + w})
                await asyncio.sleep(0)
            yield event("response.completed", {"response": head})
        else:
            yield event("message_start", {"message": {**head, "content": []}})
            for j, w in enumerate(words):
                yield event("content_block_delta", {"index": 0, "delta": {"type": "text_delta",
                                                                          "text": w if j == 0 else " " + w}})
                await asyncio.sleep(0)
            yield event("message_stop", {})

    return StreamingResponse(events(), media_type="text/event-stream")


def _word_id(word: str) -> int:
    import zlib

    return zlib.crc32(word.encode()) % 50000


def _kv_leg(engine: FakeEngine, kv: Any, rid: str, n_prompt: int, adapter: str, prompt: str
            ) -> tuple[dict[str, Any] | None, str]:
    """The P/D part of a request: a prefill leg holds its "blocks" and answers KV params; a decode leg pulls
    them from the prefill engine (or recomputes). Returns the KV params to answer and the prompt the answer is
    made of (another request's, when stale blocks were read)."""
    out_kv: dict[str, Any] | None = None
    if isinstance(kv, dict) and kv.get("do_remote_decode"):
        if engine.role != "prefill":
            raise ValueError("do_remote_decode sent to a decode engine")
        engine.held[rid] = n_prompt
        engine.held_adapter[rid] = adapter
        engine.counters["held_all"] += 1
        if engine.faults.expire_leases:
            # The blocks are "reused" at once: a decode pulling them gets the wrong words.
            engine.held[rid] = -1
            engine.expired.add(rid)
        if not engine.faults.drop_kv_params:
            out_kv = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": engine.engine_id,
                      "remote_block_ids": [[1, 2, 3]], "remote_request_id": rid, "remote_host": "127.0.0.1",
                      "remote_port": 1, "tp_size": 1}
    elif isinstance(kv, dict) and kv.get("do_remote_prefill"):
        src = DIRECTORY.get(str(kv.get("remote_engine_id")))
        held = src.held.pop(str(kv.get("remote_request_id")), None) if src is not None else None
        held_adapter = src.held_adapter.pop(str(kv.get("remote_request_id")), "") if src is not None else ""
        if held is not None and held_adapter != adapter:
            engine.counters["pulled"] += 1
            prompt = f"KV of adapter {held_adapter!r} read with {adapter!r}"
        elif held == -1:
            engine.counters["pulled_expired"] += 1
            prompt = "stale blocks of another request"
        elif held is not None:
            engine.counters["pulled"] += 1
        else:
            engine.counters["recomputed"] += 1
    else:
        engine.counters["recomputed"] += 1
    return out_kv, prompt


def _whole(engine: FakeEngine, route: str, cid: str, created: int, words: list[str], prompt: str,
           usage: dict[str, int], out_kv: dict[str, Any] | None, n: int, with_ids: bool) -> JSONResponse:
    """A whole (non-streamed) chat or completions answer."""
    choices = []
    ids: dict[str, Any] = {"token_ids": token_ids(words)} if with_ids else {}
    for i in range(n):
        text = " ".join(words)
        if route == "chat":
            choices.append({"index": i, "message": {"role": "assistant", "content": text},
                            "finish_reason": "length", **ids})
        else:
            choices.append({"index": i, "text": text, "finish_reason": "length", **ids,
                            **({"prompt_token_ids": token_ids(prompt.split())} if with_ids else {})})
    top = {"prompt_token_ids": token_ids(prompt.split())} if with_ids and route == "chat" else {}
    return JSONResponse({"id": cid, "object": "chat.completion" if route == "chat" else "text_completion",
                         "created": created, "model": engine.model_id, "choices": choices,
                         "usage": usage, "kv_transfer_params": out_kv, **top})


async def _events(engine: FakeEngine, route: str, body: dict[str, Any], cid: str, created: int, words: list[str],
                  prompt: str, usage: dict[str, int], with_ids: bool) -> Any:
    """A streamed chat or completions answer, event by event as vLLM streams it (faults injected)."""
    include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
    # A prompt given as ids continues a text: its next piece starts with a space.
    continues = isinstance(body.get("prompt"), list) and bool(body["prompt"]) and isinstance(body["prompt"][0], int)
    obj = "chat.completion.chunk" if route == "chat" else "text_completion"
    head = {"id": cid, "object": obj, "created": created, "model": engine.model_id}
    prompt_ids = token_ids(prompt.split())
    if route == "chat" and with_ids:
        # vLLM's first chat event: the role, and the prompt's ids when asked
        role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
        yield f"data: {json.dumps({**head, 'choices': [role], 'prompt_token_ids': prompt_ids})}\n\n"
    for j, w in enumerate(words):
        if engine.faults.die_mid_stream_after is not None and j >= engine.faults.die_mid_stream_after:
            raise ConnectionResetError("injected mid-stream death")
        if j == 0 and engine.faults.first_token_delay_s:
            await asyncio.sleep(engine.faults.first_token_delay_s)
        piece = w if j == 0 and not continues else " " + w
        last = j == len(words) - 1
        if route == "chat":
            choice: dict[str, Any] = {"index": 0, "delta": {"content": piece},
                                      "finish_reason": "length" if last else None}
        else:
            choice = {"index": 0, "text": piece, "finish_reason": "length" if last else None}
        if with_ids:
            choice["token_ids"] = token_ids([w])
            if j == 0 and route != "chat":
                choice["prompt_token_ids"] = prompt_ids
        chunk = {**head, "choices": [choice]}
        yield f"data: {json.dumps(chunk)}\n\n"
        await asyncio.sleep(0)
    if include_usage:
        yield f"data: {json.dumps({'id': cid, 'choices': [], 'usage': usage})}\n\n"
    yield "data: [DONE]\n\n"
