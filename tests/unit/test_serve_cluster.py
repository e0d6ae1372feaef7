"""`pdserve serve` on a cluster: a cluster that cannot be joined gives an error that says what to check
(serve itself, and "ready" polling a router: tests/component/test_serve_cluster.py)."""

from __future__ import annotations

from pdserve.cli.serve import join_error


def test_join_error_names_the_address_and_the_token_settings(monkeypatch):
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    msg = str(join_error("10.0.0.1:6379", ConnectionError("Failed to connect to Ray cluster")))
    assert "10.0.0.1:6379" in msg and "Failed to connect" in msg
    assert "RAY_AUTH_MODE=token" in msg and "RAY_AUTH_TOKEN_PATH" in msg


def test_join_error_leaves_out_the_token_hint_when_token_mode_is_set(monkeypatch):
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    msg = str(join_error("head:6379", ConnectionError("x")))
    assert "head:6379" in msg and "RAY_AUTH_MODE" not in msg
