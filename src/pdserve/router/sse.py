"""Server-sent events as the engines stream them and the router passes them on.

An OpenAI-style stream is ``data: <json>`` events separated by a blank line and closed by ``data: [DONE]``.
The router mostly passes bytes through unparsed; where it must look inside (the early first token, a moved
stream, a stored response's id) it splits whole events here, so every module reads the same framing.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from pdserve.router.http_errors import error_body

log = logging.getLogger(__name__)

SEP = b"\n\n"
DATA = b"data: "
DONE = b"data: [DONE]\n\n"


class StreamBroke(Exception):
    """An engine's stream ended early: its connection broke, or it sent an engine failure as an event."""


class Splitter:
    """Whole events out of a byte stream's chunks; an event cut between chunks waits for its end."""

    def __init__(self) -> None:
        self.rest = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        """The events completed by ``chunk``, each without its closing blank line."""
        self.rest += chunk
        if SEP not in self.rest:
            return []
        *events, self.rest = self.rest.split(SEP)
        return events


def data_of(event: bytes) -> bytes | None:
    """The payload of an event's ``data:`` line (``b"[DONE]"`` for the end); None when it has none."""
    for line in event.split(b"\n"):
        line = line.strip()
        if line.startswith(DATA):
            return line[len(DATA):]
    return None


def json_of(event: bytes) -> Any:
    """An event's JSON payload; None for ``[DONE]``, an event without data, or data that is not JSON."""
    data = data_of(event)
    if data is None or data == b"[DONE]":
        return None
    try:
        return json.loads(data)
    except ValueError:
        return None


def is_done(event: bytes) -> bool:
    return data_of(event) == b"[DONE]"


def encode(obj: Any) -> bytes:
    """One event carrying ``obj`` as compact JSON."""
    return DATA + json.dumps(obj, separators=(",", ":")).encode() + SEP


def error_event(message: str, code: int, err_type: str = "upstream_error") -> bytes:
    """An OpenAI error as a stream's last event, then ``[DONE]``: the headers are out, the failure goes in-band."""
    return encode(error_body(message, err_type, code)) + DONE


async def in_band(stream: AsyncIterator[bytes], request_id: str) -> AsyncIterator[bytes]:
    """``stream``, with a failure that was not moved elsewhere told to the client as the last event."""
    try:
        async for chunk in stream:
            yield chunk
    except StreamBroke as e:
        log.warning("request %s: stream ended with an error: %s", request_id, e)
        yield error_event(str(e), 502)


async def once(data: bytes) -> AsyncIterator[bytes]:
    """A stream of one chunk."""
    yield data


async def first_byte_at(stream: AsyncIterator[bytes], at: list[float],
                        then: Callable[[], None] | None = None) -> AsyncIterator[bytes]:
    """``stream`` unchanged; the time (``time.perf_counter``) its first chunk arrived is appended to ``at``,
    and ``then()`` is called at that moment."""
    import time

    async for chunk in stream:
        if not at:
            at.append(time.perf_counter())
            if then is not None:
                then()
        yield chunk
