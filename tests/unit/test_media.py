"""Media URLs a client sends: which an engine may fetch (router/media.py; the engines' side:
engine/launcher.py)."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.config.schema import PDServeArgs
from pdserve.engine.launcher import engine_kwargs_for
from pdserve.errors import BadRequest
from pdserve.router import handoff, media
from pdserve.router.request import Request
from pdserve.router.validate import EngineLimits, RequestValidator
from pdserve.settings import NO_MEDIA_HOST

METADATA = "http://169.254.169.254/latest/meta-data/iam/security-credentials/"


def chat(*parts: dict) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, *parts]}]}


#: Every place vLLM reads a media URL from, as a client would send it.
SHAPES = {
    "chat image_url": chat({"type": "image_url", "image_url": {"url": METADATA}}),
    "chat image_url without a type": chat({"image_url": METADATA}),
    "chat audio_url": chat({"type": "audio_url", "audio_url": {"url": METADATA}}),
    "chat video_url": chat({"type": "video_url", "video_url": {"url": METADATA}}),
    "responses input_image": {"model": "m", "input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": METADATA}]}]},
    "messages image by url": {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": METADATA}}]}]},
    "messages tool result with an image": {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": [
            {"type": "image", "source": {"type": "url", "url": METADATA}}]}]}]},
    "score documents": {"model": "m", "queries": "q", "documents": {"content": [
        {"type": "image_url", "image_url": {"url": METADATA}}]}},
}


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_every_media_url_shape_is_found_and_refused_unless_its_host_is_allowed(name):
    body = SHAPES[name]
    assert [url for _, url in media.media_urls(body)] == [METADATA]
    with pytest.raises(BadRequest) as e:
        media.check(body, [])
    assert e.value.code == "media_url_not_allowed" and "169.254.169.254" in e.value.message
    assert e.value.param and e.value.param.endswith(("image_url", "audio_url", "video_url", "source"))
    assert media.check(body, ["169.254.169.254."]) is True  # (allowed, as named with a last dot: fetched)


@pytest.mark.parametrize("url", [
    "file:///etc/passwd", "ftp://images.example.com/a.png", "//images.example.com/a.png", "images.example.com/a.png",
    "http://images.example.com@169.254.169.254/", "http://169.254.169.254\\@images.example.com/",
    "http://images.example.com /x", "http://images.example.com:99999/", "https://images.example.com.evil.net/a",
    "http://IMAGES.example.com.:80/a.png\n", f"http://{NO_MEDIA_HOST}/a.png",
    "http://images.example.com./a.png",  # (vLLM compares the host as written: it would refuse it)
])
def test_only_http_urls_on_an_allowed_host_pass_and_urls_parsers_read_differently_never(url):
    with pytest.raises(BadRequest) as e:
        media.check(chat({"type": "image_url", "image_url": {"url": url}}), ["images.example.com", NO_MEDIA_HOST])
    assert e.value.code == "media_url_not_allowed"


def test_data_urls_and_text_need_no_host_and_hosts_compare_without_case():
    assert media.check(chat({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}), []) is False
    assert media.check(chat(), []) is False
    # A schema or a tool that merely names such a field holds no URL.
    assert media.check({"model": "m", "messages": [], "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"image_url": {"type": "string"}}}}}]}, []) is False
    url = "HTTPS://Images.Example.COM:8443/a.png"
    assert media.check(chat({"type": "image_url", "image_url": {"url": url}}), ["Images.example.com."]) is True


def test_a_request_an_engine_fetches_media_for_runs_on_one_engine():
    body = chat({"type": "image_url", "image_url": {"url": "https://images.example.com/a.png"}})
    req = Request.parse("chat", body, 10, media_fetched=True)
    assert handoff.plan(req) == handoff.Plan(False, "media_url")
    assert req.with_body(dict(body)).media_fetched
    assert handoff.plan(Request.parse("chat", chat(), 10)).disaggregate


def test_the_router_refuses_before_any_engine_checks_the_body():
    seen: list[dict] = []

    async def engine_check(route, body):
        seen.append(body)
        return {}

    v = RequestValidator(limits=EngineLimits(media_domains=("images.example.com",)), engine_check=engine_check)
    with pytest.raises(BadRequest):
        asyncio.run(v.check("chat", SHAPES["chat image_url"]))
    assert seen == []
    ok = chat({"type": "image_url", "image_url": {"url": "https://images.example.com/a.png"}})
    assert asyncio.run(v.check("chat", ok)).media_fetched and len(seen) == 1


def test_engines_fetch_from_no_host_unless_named_and_follow_no_redirect():
    from pdserve.engine.launcher import EnginePlacement, engine_env

    args = PDServeArgs()
    pl = EnginePlacement(http_port=1, side_channel_port=2, side_channel_host="127.0.0.1", engine_id="e", cores=[0],
                         on_cpu=True)
    assert engine_env(args, pl)["VLLM_MEDIA_URL_ALLOW_REDIRECTS"] == "0"
    kws = [engine_kwargs_for(role, args, on_cpu=True) for role in ("prefill", "decode")]
    assert all(kw["allowed_media_domains"] == [NO_MEDIA_HOST] for kw in kws)
    assert EngineLimits.from_engine_kwargs(*kws).media_domains == ()
    named = PDServeArgs.model_validate({
        "prefill_config": {"engine_kwargs": {"allowed_media_domains": ["a.example", "B.example."]}},
        "decode_config": {"engine_kwargs": {"allowed_media_domains": "b.example"}}})  # (one name, as a string)
    kws = [engine_kwargs_for(role, named, on_cpu=True) for role in ("prefill", "decode")]
    assert kws[0]["allowed_media_domains"] == ["a.example", "b.example"]  # as vLLM compares: lower-case
    assert kws[1]["allowed_media_domains"] == ["b.example"]
    assert EngineLimits.from_engine_kwargs(*kws).media_domains == ("b.example",)  # what both roles allow
