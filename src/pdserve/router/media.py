"""Media URLs in a request: which ones an engine may fetch.

A multimodal vLLM engine fetches every http(s) URL of an image, audio or video part itself, from inside the
cluster, where a node's metadata service (169.254.169.254 on EC2) and every internal service answer it.
vLLM allows every host unless ``allowed_media_domains`` names some (an empty list allows every host too),
follows redirects off an allowed host by default, and echoes a fetched page's 4xx status to the client. A
text-only engine refuses such a request before fetching anything (vLLM's online renderer asks for the
model's multimodal processor first).

pdserve's rules:

* The engines' ``allowed_media_domains`` (none by default) lists the hosts whose media URLs a client may
  send; the router refuses (400) any other http(s) media URL before any engine sees it, and every scheme
  but http(s) and ``data:`` (``file:`` included). Hosts compare exactly, lower-case (the configured names
  without a trailing dot; any port of an allowed host passes, as in vLLM). A URL with
  user info (``user@host``), a backslash, whitespace or a control character is refused: parsers disagree on
  where such a URL's host is.
* The list is vLLM's own engine argument, ``allowed_media_domains`` in both roles' ``engine_kwargs`` (the
  router takes the hosts both roles allow). Without it an engine gets an unresolvable name
  (:data:`~pdserve.settings.NO_MEDIA_HOST`: vLLM reads an empty list as every host), and every engine runs
  with ``VLLM_MEDIA_URL_ALLOW_REDIRECTS=0`` (engine/launcher.py).
* A request with an http(s) media URL runs on one engine (router/handoff.py): the two legs of P/D would each
  fetch it and could get different bytes.

``data:`` URLs are the request's own bytes, bounded by ``router.max_body_bytes``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any
from urllib.parse import urlsplit

from pdserve.errors import BadRequest
from pdserve.settings import NO_MEDIA_HOST, media_hosts

#: The fields of a content part that hold a media URL, as vLLM reads them: a string, or an object's ``url``
#: (chat ``image_url``/``audio_url``/``video_url``, Responses ``input_image``'s ``image_url``); and an
#: Anthropic image's ``source`` (``{"type": "url", "url": ...}``).
URL_FIELDS = ("image_url", "audio_url", "video_url", "file_url", "source")
_BAD_CHARS = frozenset("\\ \t\r\n\x0b\x0c")


def media_urls(body: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """``(field path, url)`` for every media URL in ``body``, at any depth: wherever a route's engine renders
    content parts (messages, Responses input, a tool result's content, ``/tokenize``, embeddings and score
    bodies), a field of :data:`URL_FIELDS` anywhere counts."""
    # (Containers only, their paths written out only for a URL found: a prompt of token ids is a list of
    # 100,000 numbers, and writing each one's path took 73 ms of the event loop.)
    containers = (dict, list)
    stack: list[tuple[Any, tuple[Any, ...]]] = [(v, (k,)) for k, v in body.items() if type(v) in containers]
    while stack:
        node, at = stack.pop()
        if type(node) is list:
            if not set(map(type, node)).isdisjoint(containers):
                stack.extend((v, (*at, i)) for i, v in enumerate(node) if type(v) in containers)
            continue
        for key in URL_FIELDS:
            value = node.get(key)
            if isinstance(value, dict):
                value = value.get("url")
            if isinstance(value, str):
                yield _path((*at, key)), value
        stack.extend((v, (*at, k)) for k, v in node.items() if type(v) in containers and k not in URL_FIELDS)


def _path(at: tuple[Any, ...]) -> str:
    """``("messages", 0, "content")`` as ``messages[0].content``."""
    return "".join(f"[{p}]" if isinstance(p, int) else (f".{p}" if i else str(p)) for i, p in enumerate(at))


def fetched(url: str) -> bool:
    """Whether an engine would fetch ``url`` over the network (not a ``data:`` URL)."""
    return not url.lstrip().lower().startswith("data:")


def check(body: dict[str, Any], allowed: Sequence[str]) -> bool:
    """Refuse (400) a media URL an engine must not fetch; whether ``body`` has any it may (http(s) on an
    allowed host)."""
    hosts = set(media_hosts(list(allowed))) - {NO_MEDIA_HOST}
    remote = False
    for param, url in media_urls(body):
        if not fetched(url):
            continue
        if any(c in _BAD_CHARS or ord(c) < 0x20 or c == "\x7f" for c in url):
            raise BadRequest("a media URL may not hold a backslash, whitespace or a control character",
                             param=param, code="media_url_not_allowed")
        try:
            parts = urlsplit(url)
            host = parts.hostname or ""  # (lower-case; compared exactly, as vLLM does)
            _ = parts.port
        except ValueError:
            raise BadRequest("the media URL is not a valid URL", param=param, code="media_url_not_allowed") from None
        if parts.scheme.lower() not in ("http", "https"):
            raise BadRequest(f"media URLs may be http(s) or data: URLs, not {parts.scheme or 'no scheme'}:",
                             param=param, code="media_url_not_allowed")
        if "@" in parts.netloc:
            raise BadRequest("a media URL may not carry user info (user@host)", param=param,
                             code="media_url_not_allowed")
        if host not in hosts:
            allowed_text = ", ".join(sorted(hosts)) if hosts else "none (engine_kwargs.allowed_media_domains)"
            raise BadRequest(f"media from host '{host[:100]}' is not allowed; allowed hosts: {allowed_text}",
                             param=param, code="media_url_not_allowed")
        remote = True
    return remote
