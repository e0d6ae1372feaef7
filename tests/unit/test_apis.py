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


def test_the_secret_of_response_ids_is_the_apps_keys_own():
    """Every router replica with the same keys seals response ids alike (any replica goes on with a
    conversation); other keys, a key more, or none added give another secret."""
    from pdserve.config.schema import RouterConfig
    from pdserve.router.auth import ApiKeys

    a = ApiKeys(RouterConfig(api_keys=["k1", "k2"])).id_secret()
    assert ApiKeys(RouterConfig(api_keys=["k2", "k1"])).id_secret() == a  # (order does not matter)
    assert ApiKeys(RouterConfig(api_keys=["k1"])).id_secret() != a
    assert ApiKeys(RouterConfig(api_keys=["k1", "k3"])).id_secret() != a
    assert len(a) == 32 and b"k1" not in a
