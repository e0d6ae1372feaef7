"""The fake engines of ``--scenario router``, and the one request the scenario sends: a bare asyncio HTTP/1.1
keep-alive responder with canned answers (aiohttp's or FastAPI's server costs more per call than the router
does and would be the limit instead), both roles on one port, asking for the engine key as a real engine
does."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

MODEL = "bench"
PROMPT = "hello world"
MAX_TOKENS = 8
STREAM_CHUNKS = 8
#: The key the fakes ask for, as every real engine asks for its own (the router sends it on both legs).
ENGINE_KEY = "bench-engine-key"


def client_body(stream: bool) -> dict[str, Any]:
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "stream": stream}


def _http(body: bytes, ctype: bytes, status: bytes = b"200 OK") -> bytes:
    head = b"HTTP/1.1 %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n" % (status, ctype, len(body))
    return head + body


def canned() -> dict[str, bytes]:
    """Whole HTTP responses: the prefill leg's answer (KV params decode can pull with), decode's answer,
    decode's stream, health, and the refusal of a request without the engine key."""
    prefill = {"id": "cmpl-bench", "object": "text_completion", "created": 0, "model": MODEL,
               "choices": [{"index": 0, "text": "a", "finish_reason": "length"}],
               "usage": {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3},
               "kv_transfer_params": {"do_remote_prefill": True, "do_remote_decode": False,
                                      "remote_engine_id": "bench-prefill", "remote_block_ids": [[1]],
                                      "remote_request_id": "bench", "remote_host": "127.0.0.1",
                                      "remote_port": 1}}
    decode = {"id": "cmpl-bench", "object": "text_completion", "created": 0, "model": MODEL,
              "choices": [{"index": 0, "text": " a" * MAX_TOKENS, "finish_reason": "length"}],
              "usage": {"prompt_tokens": 2, "completion_tokens": MAX_TOKENS, "total_tokens": 2 + MAX_TOKENS}}
    chunk = b"data: %s\n\n" % json.dumps({"id": "cmpl-bench", "object": "text_completion", "model": MODEL,
                                           "choices": [{"index": 0, "text": " a"}]}).encode()
    stream = chunk * STREAM_CHUNKS + b"data: [DONE]\n\n"
    refused = {"error": {"message": "missing or wrong engine key", "type": "Unauthorized", "code": 401}}
    return {"prefill": _http(json.dumps(prefill).encode(), b"application/json"),
            "decode": _http(json.dumps(decode).encode(), b"application/json"),
            "stream": _http(stream, b"text/event-stream"),
            "health": _http(b"ok", b"text/plain"),
            "refused": _http(json.dumps(refused).encode(), b"application/json", b"401 Unauthorized")}


def answer(head: bytes, body: bytes, responses: dict[str, bytes], auth: bytes) -> bytes:
    """The canned response for one request (``head`` lowercased): GETs are health checks; a POST must carry
    the key, and is a prefill leg when it asks the engine to keep its blocks for a remote decode."""
    if head.startswith(b"get"):
        return responses["health"]
    if auth not in head:
        return responses["refused"]
    compact = body.replace(b" ", b"")
    if b'"do_remote_decode":true' in compact:
        return responses["prefill"]
    return responses["stream"] if b'"stream":true' in compact else responses["decode"]


def serve_fakes(port: int, key: str = ENGINE_KEY) -> None:
    """Both fake engines on one port (the router's pool holds it once per role), until killed."""
    responses = canned()
    auth = b"authorization: bearer " + key.lower().encode()

    class Conn(asyncio.Protocol):
        def connection_made(self, transport: Any) -> None:
            self.transport = transport
            self.pending = b""

        def data_received(self, data: bytes) -> None:
            self.pending += data
            while (end := self.pending.find(b"\r\n\r\n")) >= 0:
                head = self.pending[:end].lower()
                m = re.search(rb"\r\ncontent-length:\s*(\d+)", head)
                size = int(m.group(1)) if m else 0
                if len(self.pending) < end + 4 + size:
                    return  # the body is still on its way
                body = self.pending[end + 4:end + 4 + size]
                self.pending = self.pending[end + 4 + size:]
                self.transport.write(answer(head, body, responses, auth))

    loop = asyncio.new_event_loop()
    loop.run_until_complete(loop.create_server(Conn, "127.0.0.1", port))
    loop.run_forever()
