"""`pdserve serve` on a cluster: a cluster that cannot be joined gives an error that says what to check;
"ready" waits until the router lists an engine of each role (it learns them by polling)."""

from __future__ import annotations

import signal

import pytest

from pdserve.cli.serve import join_error, roles_missing, serve
from pdserve.errors import PDServeError
from pdserve.testing.thread_server import ThreadServer, free_port


def test_join_error_names_the_address_and_the_token_settings(monkeypatch):
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    msg = str(join_error("10.0.0.1:6379", ConnectionError("Failed to connect to Ray cluster")))
    assert "10.0.0.1:6379" in msg and "Failed to connect" in msg
    assert "RAY_AUTH_MODE=token" in msg and "RAY_AUTH_TOKEN_PATH" in msg


def test_join_error_leaves_out_the_token_hint_when_token_mode_is_set(monkeypatch):
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    msg = str(join_error("head:6379", ConnectionError("x")))
    assert "head:6379" in msg and "RAY_AUTH_MODE" not in msg


@pytest.fixture
def keep_signal_handlers():
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    yield
    for s, h in saved.items():
        signal.signal(s, h)


def test_serve_turns_a_failed_join_into_a_pdserve_error(monkeypatch, keep_signal_handlers):
    import ray

    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)

    def refuse(**kw):
        assert kw["address"] == "10.0.0.1:6379"
        raise ConnectionError("Failed to connect to Ray cluster at 10.0.0.1:6379")

    monkeypatch.setattr(ray, "init", refuse)
    with pytest.raises(PDServeError, match="RAY_AUTH_MODE=token"):
        serve(None, host=None, port=None, address="10.0.0.1:6379")


def _status_app(engines: list[dict] | None, code: int = 200):
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    app = FastAPI()

    @app.get("/pdserve/status")
    async def status() -> JSONResponse:
        return JSONResponse({"engines": engines or []}, status_code=code)

    return app


@pytest.mark.parametrize(("engines", "missing"), [
    ([], ["prefill", "decode"]),
    ([{"role": "decode", "healthy": True}], ["prefill"]),
    ([{"role": "decode", "healthy": True}, {"role": "prefill", "healthy": False}], ["prefill"]),
    ([{"role": "decode", "healthy": True}, {"role": "prefill", "healthy": True}], []),
])
def test_roles_missing_reads_the_router_status(engines, missing):
    with ThreadServer(_status_app(engines)) as srv:
        assert roles_missing(srv.url) == missing


def test_roles_missing_cannot_tell_behind_an_api_key():
    with ThreadServer(_status_app(None, code=401)) as srv:
        assert roles_missing(srv.url) == []


def test_roles_missing_when_nothing_answers():
    assert roles_missing(f"http://127.0.0.1:{free_port()}") == ["prefill", "decode"]
