"""The Responses API and Anthropic Messages: how Anthropic clients authenticate (through P/D, against fake
engines: tests/component/test_apis.py)."""

from __future__ import annotations

import pytest


def test_anthropic_clients_authenticate_with_x_api_key(monkeypatch):
    from pdserve.config.schema import RouterConfig
    from pdserve.errors import Unauthorized
    from pdserve.router.auth import ApiKeys

    keys = ApiKeys(RouterConfig(api_keys=["k1"]))
    keys.check("/v1/messages", None, "k1")
    keys.check("/v1/messages", "Bearer k1", None)
    with pytest.raises(Unauthorized):
        keys.check("/v1/messages", None, "nope")
    with pytest.raises(Unauthorized):
        keys.check("/v1/messages", None, None)
