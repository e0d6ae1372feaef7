"""`pdserve serve` on a cluster: a cluster that cannot be joined gives an error that says what to check;
"ready" waits until the router lists an engine of each role (it learns them by polling)."""

from __future__ import annotations

import signal

import pytest

from pdserve.cli.progress import roles_missing
from pdserve.cli.serve import serve
from pdserve.errors import PDServeError
from pdserve.testing.thread_server import ThreadServer, free_port


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
        # A free port: serve holds its port before it joins, and 8000 may be another app's on this host.
        serve(None, host=None, port=free_port(), address="10.0.0.1:6379")


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


def test_serve_fails_on_a_port_in_use_before_it_prepares_the_model_or_starts_anything(monkeypatch,
                                                                                      keep_signal_handlers):
    """A public port already taken is the first error `pdserve serve` gives: before the model is prepared (a
    first run converts it for a minute) and before the engine forkserver or Ray start."""
    import socket

    from pdserve.cli import serve as serve_mod

    def not_yet(*a, **kw):
        raise AssertionError("the model was prepared before the port was checked")

    monkeypatch.setattr(serve_mod, "_prepare_model", not_yet)
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        with pytest.raises(PDServeError, match=f"cannot listen on 127.0.0.1:{port}.*choose --port"):
            serve(None, host=None, port=port, address=None)
    finally:
        taken.close()
