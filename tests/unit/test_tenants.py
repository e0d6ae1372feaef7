"""Tenants: keys to tenants, each tenant's limits, fair share and priority under overload, per-tenant
prefix cache and stored responses (router/tenants.py, router/auth.py)."""

from __future__ import annotations

import pytest

from pdserve.config.schema import RouterConfig
from pdserve.errors import ConfigError, Unauthorized
from pdserve.router.auth import ApiKeys
from pdserve.router.tenants import LOWER_PRIORITY_SCALE, OVER_SHARE_SCALE, TenantLimited, Tenants


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _cfg(**tenants) -> RouterConfig:
    return RouterConfig(tenants={name: {"keys_env": f"KEYS_{name.upper()}", **t} for name, t in tenants.items()})


def test_keys_map_to_tenants_from_the_environment(monkeypatch):
    monkeypatch.setenv("KEYS_ACME", "a1, a2")
    monkeypatch.setenv("KEYS_BETA", "b1")
    monkeypatch.setenv("PDSERVE_API_KEYS", "plain")
    keys = ApiKeys(_cfg(acme={}, beta={}))
    assert keys.check("/v1/completions", "Bearer a2").tenant == "acme"
    assert keys.check("/v1/completions", None, "b1").tenant == "beta"
    plain = keys.check("/v1/completions", "Bearer plain")
    assert plain.tenant == "default" and plain.owner and "plain" not in plain.owner
    assert keys.check("/v1/completions", "Bearer a1").owner == keys.check("/v1/completions", "Bearer a2").owner
    with pytest.raises(Unauthorized):
        keys.check("/v1/completions", "Bearer nope")
    monkeypatch.setenv("KEYS_BETA", "a1")
    with pytest.raises(ConfigError, match="two tenants"):
        ApiKeys(_cfg(acme={}, beta={}))


def test_a_tenant_no_key_reaches_is_refused_at_start(monkeypatch):
    """A tenant's variable not exported where the router starts: refused, saying which, rather than an
    endpoint that (with no other key) takes requests from anyone."""
    monkeypatch.delenv("PDSERVE_API_KEYS", raising=False)
    monkeypatch.setenv("KEYS_ACME", "a1")
    monkeypatch.setenv("KEYS_BETA", " , ")
    with pytest.raises(ConfigError, match=r"router.tenants.beta: no API keys in \$KEYS_BETA"):
        ApiKeys(_cfg(acme={}, beta={}))
    monkeypatch.delenv("KEYS_BETA")
    with pytest.raises(ConfigError, match="beta"):
        ApiKeys(_cfg(acme={}, beta={}))
    assert ApiKeys(_cfg(acme={})).enabled


def test_each_limit_refuses_with_its_name_and_when_to_come_back():
    clock = Clock()
    t = Tenants(_cfg(acme={"requests_per_s": 2, "prompt_tokens_per_min": 600, "output_tokens_per_min": 120,
                           "max_concurrent": 3}), clock=clock)
    tickets = [t.admit("acme", 10, 10), t.admit("acme", 10, 10)]
    with pytest.raises(TenantLimited) as e:
        t.admit("acme", 10, 10)
    assert e.value.limit == "requests_per_s" and "requests_per_s limit (2)" in str(e.value)
    assert 400 <= e.value.retry_after_ms <= 600  # one request refills in 0.5 s
    clock.t += 1
    tickets.append(t.admit("acme", 10, 10))
    clock.t += 1
    with pytest.raises(TenantLimited) as e:
        t.admit("acme", 10, 10)
    assert e.value.limit == "max_concurrent"
    t.release(tickets.pop())
    with pytest.raises(TenantLimited) as e:
        t.admit("acme", 10, 200)  # the output budget: 120 a minute, 30 spent
    assert e.value.limit == "output_tokens_per_min"
    with pytest.raises(TenantLimited) as e:
        t.admit("acme", 595, 1)
    assert e.value.limit == "prompt_tokens_per_min" and e.value.retry_after_ms >= 500  # 5 tokens at 10/s
    refused = t.summary()["acme"]["refused"]
    assert refused == {"requests_per_s": 1, "max_concurrent": 1, "output_tokens_per_min": 1,
                       "prompt_tokens_per_min": 1}
    # a request bigger than a whole bucket passes once the bucket is full
    clock.t += 120
    t.admit("acme", 5000, 1)
    with pytest.raises(TenantLimited):
        t.admit("acme", 1, 1)


def test_a_tenant_out_of_requests_or_tokens_is_refused_before_its_body_is_checked():
    clock = Clock()
    t = Tenants(_cfg(acme={"prompt_tokens_per_min": 60, "max_concurrent": 1}), clock=clock)
    t.precheck("acme")
    ticket = t.admit("acme", 60, 1)  # the minute's prompt tokens, all of them
    with pytest.raises(TenantLimited) as e:
        t.precheck("acme")
    assert e.value.limit == "max_concurrent"
    t.release(ticket)
    with pytest.raises(TenantLimited) as e:
        t.precheck("acme")
    assert e.value.limit == "prompt_tokens_per_min"
    clock.t += 2
    t.precheck("acme")  # a token's worth is back
    t.precheck("unknown")  # not a tenant: nothing to check


def test_a_refund_gives_back_what_admission_by_work_refused():
    clock = Clock()
    t = Tenants(_cfg(acme={"requests_per_s": 1}), clock=clock)
    ticket = t.admit("acme", 10, 10)
    t.refund(ticket, 10, 10)
    t.release(ticket)
    t.admit("acme", 10, 10)  # the refused request did not use up the second's request


def test_over_its_share_and_lower_priority_a_tenant_gets_less_of_the_wait_budget():
    t = Tenants(_cfg(gold={"priority": 2}, bronze={"priority": 0}, flood={"priority": 0}))
    assert t.wait_scale("flood") == 1.0  # alone: unchanged
    for _ in range(6):
        t.admit("flood", 10, 10)
    assert t.wait_scale("flood") == 1.0  # still alone in flight
    t.admit("gold", 10, 10)
    assert t.wait_scale("gold") == 1.0  # under its share, the highest priority
    assert t.wait_scale("flood") == pytest.approx(OVER_SHARE_SCALE * LOWER_PRIORITY_SCALE)
    assert t.wait_scale("bronze") == pytest.approx(LOWER_PRIORITY_SCALE)  # under its share, lower priority
    # A lower priority's one request in flight does not halve a higher priority's budget: the share is
    # counted among the tenants of its own priority and above.
    t = Tenants(_cfg(gold={"priority": 1}, cheap={"priority": 0}))
    for _ in range(10):
        t.admit("gold", 10, 10)
    assert t.wait_scale("gold") == 1.0
    t.admit("cheap", 10, 10)
    assert t.wait_scale("gold") == 1.0 and t.wait_scale("cheap") == pytest.approx(LOWER_PRIORITY_SCALE)


def test_each_tenant_has_its_own_prefix_cache_salt():
    t = Tenants(_cfg(acme={}, beta={}))
    a, b = t.salt("acme", None), t.salt("beta", None)
    assert a and b and a != b and "acme" not in a
    assert t.salt("acme", "mine").startswith(a + ":") and t.salt("acme", "mine") != a
    assert t.salt("acme", "mine") != t.salt("acme", "yours") != t.salt("beta", "yours")
    # A salt vLLM takes (at most 128 characters) is still one it takes with the tenant's in front of it.
    assert len(t.salt("acme", "s" * 128)) <= 128
    assert Tenants(RouterConfig()).salt("default", "x") is None  # no tenants: the client's salt as it is


def test_while_a_higher_priority_tenant_is_active_long_lower_priority_requests_wait():
    """The priority hold: a lower priority's request that would hold an engine past the slice is refused
    while a higher-priority tenant is active; a short one goes; once that tenant is quiet, all go."""
    from pdserve.router.tenants import HOLD_S, PRIORITY_SLICE_S

    clock = Clock()
    t = Tenants(_cfg(gold={"priority": 1}, flood={"priority": 0}), clock=clock)
    t.hold("flood", 10.0)  # nobody of higher priority active: anything goes
    t.precheck("gold")  # gold sends a request that is refused after all (a bad body): gold is not active
    t.hold("flood", 10.0)
    t.release(t.admit("gold", 10, 10))  # gold's request admitted (and done)
    t.hold("gold", 10.0)  # never held back by lower priorities
    with pytest.raises(TenantLimited) as e:
        t.hold("flood", PRIORITY_SLICE_S * 4)
    assert e.value.limit == "priority" and "higher-priority tenant is active" in str(e.value)
    t.hold("flood", PRIORITY_SLICE_S / 2)  # a short one goes
    clock.t += HOLD_S + 0.1
    t.hold("flood", 10.0)  # gold quiet: the flood's long prompt goes
    assert t.summary()["flood"]["refused"] == {"priority": 1}
