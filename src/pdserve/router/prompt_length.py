"""How long a request's prompt is, in tokens, cheaply enough to decide per request.

Token-id prompts are counted exactly. Text is counted with the model's ``tokenizer.json`` (Rust
``tokenizers``, tens of microseconds) when the router can find it, else estimated at 4 characters per
token. Chat adds a few tokens per message for the template.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

_TEMPLATE_TOKENS_PER_MESSAGE = 5


class PromptLength:
    def __init__(self, tokenizer_dir: str | None = None) -> None:
        self._tok: Any = None
        if tokenizer_dir:
            path = Path(tokenizer_dir) / "tokenizer.json"
            if path.exists():
                try:
                    from tokenizers import Tokenizer

                    self._tok = Tokenizer.from_file(str(path))
                except Exception as e:  # noqa: BLE001 - an estimate is still useful
                    log.warning("cannot load %s (%s); estimating prompt lengths", path, e)

    def _text(self, text: str) -> int:
        if self._tok is not None:
            return len(self._tok.encode(text, add_special_tokens=False).ids)
        return max(1, len(text) // 4)

    def count(self, route: str, body: dict[str, Any]) -> int:
        if route == "chat":
            total = 0
            for m in body.get("messages") or []:
                content = m.get("content") if isinstance(m, dict) else None
                if isinstance(content, list):  # content parts
                    content = " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
                total += self._text(str(content or "")) + _TEMPLATE_TOKENS_PER_MESSAGE
            return total
        prompt = body.get("prompt")
        if isinstance(prompt, list):
            if prompt and isinstance(prompt[0], int):
                return len(prompt)
            return sum(self._text(str(p)) for p in prompt)
        return self._text(str(prompt or ""))
