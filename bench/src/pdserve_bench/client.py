"""One streaming request, timed: TTFT, inter-token latencies, end-to-end."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp


@dataclass
class Result:
    ok: bool
    prompt_tokens: int
    output_tokens: int = 0
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    error: str = ""
    start_s: float = 0.0
    status: int = 0  # HTTP status of the (decode) answer; 0 when no answer came
    retry_after: str | None = None  # the Retry-After header of a refused request
    retry_after_ms: str | None = None  # its retry-after-ms header (what OpenAI's clients wait, when given)
    retries: int = 0  # 429s answered before this result, each retried after its wait
    target: str = ""  # the base URL it was sent to (the load spreads over several in turn)

    @property
    def retry_wait_s(self) -> float:
        """How long a client that honours the answer waits before it retries (as OpenAI's clients do)."""
        try:
            if self.retry_after_ms is not None:
                return float(self.retry_after_ms) / 1000
            return float(self.retry_after or 1)
        except ValueError:
            return 1.0

    @property
    def tpot_s(self) -> float:
        if self.output_tokens <= 1:
            return 0.0
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["tpot_s"] = self.tpot_s
        return d


async def stream_completion(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], prompt_tokens: int,
    *, prefill_url: str | None = None, auth: Callable[[str], dict[str, str]] | None = None,
) -> Result:
    """POST ``body`` to ``url`` and time the stream.

    With ``prefill_url`` this is the bare two-call P/D handoff (the floor any P/D router is measured
    against): the prefill leg first, then the decode leg with its ``kv_transfer_params``. ``auth``: the
    headers each engine URL needs (an app's engines answer only with their keys).
    """
    t0 = time.perf_counter()
    res = Result(ok=False, prompt_tokens=prompt_tokens, start_s=t0)
    last = t0
    try:
        if prefill_url is not None:
            from pdserve.router.handoff import decode_body, prefill_body, usable_kv_params

            async with session.post(prefill_url, json=prefill_body("completions", body),
                                    headers=auth(prefill_url) if auth else None) as pr:
                if pr.status != 200:
                    res.error = f"prefill HTTP {pr.status}: {(await pr.text())[:200]}"
                    return res
                kv = usable_kv_params((await pr.json()).get("kv_transfer_params"))
            if kv is not None:
                body = decode_body(body, kv)
        async with session.post(url, json=body, headers=auth(url) if auth else None) as r:
            res.status = r.status
            res.retry_after = r.headers.get("Retry-After")
            res.retry_after_ms = r.headers.get("retry-after-ms")
            if r.status != 200:
                res.error = f"HTTP {r.status}: {(await r.text())[:200]}"
                res.e2e_s = time.perf_counter() - t0  # how long the refusal or error took
                return res
            buf = b""
            async for chunk in r.content.iter_any():
                buf += chunk
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    if not event.startswith(b"data: "):
                        continue
                    data = event[6:]
                    if data == b"[DONE]":
                        continue
                    msg = json.loads(data)
                    if "error" in msg:
                        res.error = str(msg["error"])[:200]
                        return res
                    if msg.get("usage"):
                        res.output_tokens = int(msg["usage"].get("completion_tokens", res.output_tokens))
                    for c in msg.get("choices", []):
                        piece = c.get("text") if "text" in c else (c.get("delta") or {}).get("content")
                        if piece is None:
                            continue
                        now = time.perf_counter()
                        if res.ttft_s == 0.0:
                            res.ttft_s = now - t0
                        else:
                            res.itl_s.append(now - last)
                        last = now
    except (aiohttp.ClientError, OSError, ValueError) as e:
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.e2e_s = time.perf_counter() - t0
    if res.output_tokens == 0:
        res.output_tokens = len(res.itl_s) + (1 if res.ttft_s else 0)
    res.ok = res.ttft_s > 0
    return res
