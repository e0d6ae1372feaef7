"""Optional API-key authentication: ``Authorization: Bearer KEY`` (or ``x-api-key: KEY``, as Anthropic's
clients send it), keys compared in constant time.

Keys come from ``router.api_keys`` and the environment variable named by ``router.api_keys_env``
(``PDSERVE_API_KEYS`` unless set; keys separated by commas or newlines), read when the router's app is
built; they are never logged. On Kubernetes the variable is the only way in: ``pdserve render`` refuses
``router.api_keys`` and fills the variable from a Secret (``kubernetes.api_keys_secret``).

The engines' own ports carry no authentication: keep them cluster-internal (the rendered Kubernetes
NetworkPolicy does).
"""

from __future__ import annotations

import hashlib
import hmac
import re

from pdserve.config.schema import RouterConfig
from pdserve.errors import Unauthorized
from pdserve.settings import settings

OPEN_PATHS = frozenset({"/health"})


def env_keys(value: str) -> list[str]:
    """The keys in the environment variable's ``value``: separated by commas or newlines, blanks ignored."""
    return [k.strip() for k in re.split(r"[,\n]", value) if k.strip()]


class ApiKeys:
    def __init__(self, cfg: RouterConfig) -> None:
        keys = list(cfg.api_keys)
        keys += env_keys(settings().named(cfg.api_keys_env))
        # Digests of equal length make the comparison time independent of the key's length and content.
        self._digests = [hashlib.sha256(k.encode()).digest() for k in keys]

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def check(self, path: str, authorization: str | None, x_api_key: str | None = None) -> str:
        """Raise :class:`Unauthorized` unless the request carries a valid key; the caller's identity (a
        digest of its key, never the key; ``""`` without keys or on an open path): what it owns, such as
        stored responses, belongs to that identity."""
        if not self._digests or path in OPEN_PATHS:
            return ""
        if authorization and authorization.startswith("Bearer "):
            key = authorization[7:].strip()
        elif x_api_key:
            key = x_api_key.strip()
        else:
            raise Unauthorized("missing API key: send 'Authorization: Bearer YOUR_KEY'", code="invalid_api_key")
        given = hashlib.sha256(key.encode()).digest()
        ok = False
        for d in self._digests:
            ok |= hmac.compare_digest(given, d)
        if not ok:
            raise Unauthorized("invalid API key", code="invalid_api_key")
        return hashlib.sha256(b"pdserve owner\0" + key.encode()).hexdigest()[:24]
