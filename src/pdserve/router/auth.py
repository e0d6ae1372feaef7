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
from dataclasses import dataclass

from pdserve.config.schema import RouterConfig
from pdserve.config.tenants import DEFAULT_TENANT
from pdserve.errors import ConfigError, Unauthorized
from pdserve.settings import settings

OPEN_PATHS = frozenset({"/health"})


def env_keys(value: str) -> list[str]:
    """The keys in the environment variable's ``value``: separated by commas or newlines, blanks ignored."""
    return [k.strip() for k in re.split(r"[,\n]", value) if k.strip()]


@dataclass(frozen=True)
class Caller:
    """Who sent a request: its tenant, and the identity that owns what it stores (a stored response): the
    tenant for a named tenant's keys, else a digest of the key (never the key); ``""`` without keys."""

    tenant: str = DEFAULT_TENANT
    owner: str = ""


ANONYMOUS = Caller()


class ApiKeys:
    def __init__(self, cfg: RouterConfig) -> None:
        # Digests of equal length make the comparison time independent of the key's length and content.
        self._keys: list[tuple[bytes, str]] = []
        env = settings()
        keys = list(cfg.api_keys) + env_keys(env.named(cfg.api_keys_env))
        self._keys += [(hashlib.sha256(k.encode()).digest(), DEFAULT_TENANT) for k in keys]
        for name, tenant in cfg.tenants.items():
            mine = env_keys(env.named(tenant.keys_env))
            if not mine:
                # A tenant no key reaches is a variable not exported: with no other key, the whole endpoint
                # would take requests from anyone.
                raise ConfigError(f"router.tenants.{name}: no API keys in ${tenant.keys_env} (unset or empty "
                                  "where the router starts); export its keys there, or remove the tenant")
            self._keys += [(hashlib.sha256(k.encode()).digest(), name) for k in mine]
        seen: dict[bytes, str] = {}
        for digest, name in self._keys:
            if seen.setdefault(digest, name) != name:
                raise ConfigError(f"one API key belongs to two tenants ({seen[digest]!r} and {name!r})")

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def id_secret(self) -> bytes:
        """The key of stored responses' id seals (router/stored.py), the same in every router replica of the
        app: derived from all its API keys (whoever knows them all could act as any key anyway)."""
        return hashlib.sha256(b"pdserve response ids\0" + b"".join(sorted(d for d, _ in self._keys))).digest()

    def check(self, path: str, authorization: str | None, x_api_key: str | None = None) -> Caller:
        """Raise :class:`Unauthorized` unless the request carries a valid key; who sent it (:class:`Caller`,
        :data:`ANONYMOUS` without keys or on an open path)."""
        if not self._keys or path in OPEN_PATHS:
            return ANONYMOUS
        if authorization and authorization[:7].lower() == "bearer ":  # (a scheme's case does not matter)
            key = authorization[7:].strip()
        elif x_api_key:
            key = x_api_key.strip()
        else:
            raise Unauthorized("missing API key: send 'Authorization: Bearer YOUR_KEY'", code="invalid_api_key")
        given = hashlib.sha256(key.encode()).digest()
        tenant = None
        for digest, name in self._keys:  # every key compared, in constant time each
            if hmac.compare_digest(given, digest):
                tenant = name
        if tenant is None:
            raise Unauthorized("invalid API key", code="invalid_api_key")
        if tenant != DEFAULT_TENANT:
            return Caller(tenant, "tenant:" + tenant)
        return Caller(tenant, hashlib.sha256(b"pdserve owner\0" + key.encode()).hexdigest()[:24])
