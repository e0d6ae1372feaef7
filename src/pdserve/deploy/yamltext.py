"""YAML text for people: block style, indented lists, multi-line strings as ``|`` blocks, and comments.

PyYAML cannot emit comments, so :func:`dump_all` inserts them into the text afterwards: each comment goes
above every line that matches its pattern, at that line's indentation.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any

import yaml


class _Dumper(yaml.SafeDumper):
    def increase_indent(self, flow: bool = False, indentless: bool = False) -> None:
        # Indent list items under their key (the style of Kubernetes' and Helm's own examples).
        return super().increase_indent(flow, False)

    def ignore_aliases(self, data: Any) -> bool:
        return True  # a repeated object is written out again, never as &anchor / *alias


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)

#: (regex matched against a whole line, comment text); the comment may have several lines.
Comment = tuple[str, str]


def dump(data: Any) -> str:
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False, width=1_000_000, allow_unicode=True)


def add_comments(text: str, comments: Sequence[Comment]) -> str:
    compiled = [(re.compile(p), c) for p, c in comments]
    out: list[str] = []
    for line in text.splitlines():
        for pattern, comment in compiled:
            if pattern.fullmatch(line):
                indent = " " * (len(line) - len(line.lstrip(" ")))
                out += [f"{indent}# {c}".rstrip() for c in comment.splitlines()]
        out.append(line)
    return "\n".join(out) + "\n"


def dump_all(docs: Iterable[Any], *, header: str = "", comments: Sequence[Comment] = ()) -> str:
    """Documents separated by ``---``, with ``header`` (``#`` lines) on top and ``comments`` inserted."""
    body = "---\n".join(dump(d) for d in docs)
    top = "".join(f"# {h}".rstrip() + "\n" for h in header.splitlines()) if header else ""
    return top + add_comments(body, comments)
