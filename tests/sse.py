"""One way for tests to read an OpenAI-style server-sent event stream (completions and chat completions)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

DONE = "data: [DONE]"


def events(lines: Iterable[str | bytes]) -> Iterator[dict[str, Any]]:
    """Each data event's JSON as its line arrives (lazily: a test may act mid-stream); ``[DONE]``, comments
    and ``event:`` lines are skipped."""
    for line in lines:
        line = (line.decode() if isinstance(line, bytes) else line).strip()
        if line.startswith("data: ") and line != DONE:
            yield json.loads(line[6:])


def text(ev: dict[str, Any]) -> str:
    """The text one event carries: completions' ``text`` or chat's ``delta.content``, over its choices."""
    return "".join(c.get("text") or (c.get("delta") or {}).get("content") or "" for c in ev.get("choices") or [])


@dataclass
class Stream:
    """A whole stream, read to its end."""

    events: list[dict[str, Any]] = field(default_factory=list)
    done: bool = False  # it ended with [DONE]

    @property
    def text(self) -> str:
        return "".join(text(ev) for ev in self.events)

    @property
    def usage(self) -> dict[str, Any] | None:
        """The last usage object an event carried."""
        return next((ev["usage"] for ev in reversed(self.events) if ev.get("usage")), None)

    @property
    def error(self) -> Any:
        """The first in-band error event's error, if any."""
        return next((ev["error"] for ev in self.events if ev.get("error")), None)


def read(lines: Iterable[str | bytes]) -> Stream:
    lines = [ln.decode() if isinstance(ln, bytes) else ln for ln in lines]
    return Stream(list(events(lines)), any(ln.strip() == DONE for ln in lines))
