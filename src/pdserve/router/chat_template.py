"""The model's chat template, rendered the way Hugging Face tokenizers render it, without transformers.

The router renders a conversation only to route it by cached prefix (router/prompt_length.py): the token ids
a chat prompt will have on the engine. transformers' ``apply_chat_template`` would do it, but importing
transformers imports torch: half a GiB and seconds of start in a process that computes no tensor. This module
renders the same template with the same Jinja environment: a sandbox (a template never reaches Python
objects' internals), ``trim_blocks`` and ``lstrip_blocks``, loop controls, ``tojson`` as transformers defines
it, ``raise_exception`` and ``strftime_now``, the tokenizer's special tokens as variables, and
``{% generation %}`` blocks rendered as their content. A unit test holds its output to transformers' for the
packaged model. A template it cannot render gives no ids: the request is routed by load.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

#: The tokenizer's special tokens a template may name (transformers passes its special tokens map).
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class TemplateError(Exception):
    """The template raised (``raise_exception``) or does not fit the conversation."""


def _raise(message: str) -> None:
    raise TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> Any:
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """``{% generation %}...{% endgeneration %}`` (marks the assistant's tokens for training masks):
        rendered as its content."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_content"), [], [], body).set_lineno(lineno)

        @staticmethod
        def _content(caller: Any) -> str:
            return caller()

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, loopcontrols], undefined=jinja2.Undefined)
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = _strftime_now
    return env


def _token_text(v: Any) -> str | None:
    if isinstance(v, dict):  # {"content": "<s>", "lstrip": false, ...}
        v = v.get("content")
    return v if isinstance(v, str) else None


#: Put after the text of a message to be continued (``continue_final_message``).
_MARK = "\x00pdserve-continue\x00 "


def _marked(messages: list[Any]) -> list[Any]:
    """A copy of ``messages`` with :data:`_MARK` after the final message's last text."""
    if not messages or not isinstance(messages[-1], dict):
        raise TemplateError("there is no final message to continue")
    last = dict(messages[-1])
    content = last.get("content")
    if isinstance(content, str):
        last["content"] = content + _MARK
    elif isinstance(content, list):
        parts = list(content)
        i = next((i for i in range(len(parts) - 1, -1, -1)
                  if isinstance(parts[i], dict) and isinstance(parts[i].get("text"), str)), None)
        if i is None:
            raise TemplateError("the final message has no text to continue")
        parts[i] = {**parts[i], "text": parts[i]["text"] + _MARK}
        last["content"] = parts
    else:
        raise TemplateError("the final message has no text to continue")
    return [*messages[:-1], last]


class ChatTemplate:
    """One model's chat template (``chat_template.jinja``, else ``tokenizer_config.json``'s ``chat_template``)
    and its special tokens."""

    def __init__(self, source: str | dict[str, str], special: dict[str, str]) -> None:
        env = _environment()
        named = source if isinstance(source, dict) else {"default": source}
        self._templates = {name: env.from_string(text) for name, text in named.items()}
        self._special = special

    @classmethod
    def load(cls, model_dir: str) -> ChatTemplate:
        """Raises ``OSError`` / ``ValueError`` when the directory holds no chat template."""
        d = Path(model_dir)
        cfg: dict[str, Any] = {}
        if (d / "tokenizer_config.json").exists():
            loaded = json.loads((d / "tokenizer_config.json").read_text(encoding="utf-8"))
            cfg = loaded if isinstance(loaded, dict) else {}
        special = {k: t for k in SPECIAL_TOKENS if (t := _token_text(cfg.get(k))) is not None}
        source: Any = None
        if (d / "chat_template.jinja").exists():
            source = (d / "chat_template.jinja").read_text(encoding="utf-8")
        elif isinstance(cfg.get("chat_template"), str):
            source = cfg["chat_template"]
        elif isinstance(cfg.get("chat_template"), list):  # named templates: [{"name": ..., "template": ...}]
            source = {t["name"]: t["template"] for t in cfg["chat_template"]
                      if isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)}
        if not source:
            raise ValueError(f"{model_dir} has no chat template (chat_template.jinja or tokenizer_config.json)")
        return cls(source, special)

    def render(self, messages: list[Any], tools: list[Any] | None = None, add_generation_prompt: bool = True,
               continue_final_message: bool = False, **kwargs: Any) -> str:
        """The conversation as the prompt text (before tokenization), as transformers renders it."""
        if tools and "tool_use" in self._templates:
            template = self._templates["tool_use"]
        elif "default" in self._templates:
            template = self._templates["default"]
        elif len(self._templates) == 1:
            template = next(iter(self._templates.values()))
        else:
            raise TemplateError("the model has several named chat templates and none is 'default'")
        variables = {**self._special, **kwargs}
        if continue_final_message:
            # A marker after the final message's (last) text: the prompt ends where the marker is, before
            # whatever the template closes the message with.
            messages = _marked(messages)
        text = template.render(messages=messages, tools=tools, documents=None,
                               add_generation_prompt=add_generation_prompt, **variables)
        if continue_final_message:
            at = text.rfind(_MARK.strip())
            if at < 0:
                raise TemplateError("the template drops the final message that is to be continued")
            text = text[:at] if text[at:at + len(_MARK)] == _MARK else text[:at].rstrip()
        return text
