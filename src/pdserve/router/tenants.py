"""Tenants at admission: each one's limits, and who gives way under overload (config: pdserve/config/tenants.py).

A request is charged to its caller's tenant before admission by work sees it:

1. **Limits**, each a bucket refilled continuously: requests per second (a second's worth), prompt tokens
   and output tokens per minute (a minute's worth; the output budget is charged when admitted), and
   requests in flight. A request beyond one is refused with 429, the limit named and ``Retry-After`` the
   time until the bucket holds it. A request larger than a whole bucket passes when the bucket is full
   (and empties it), so it is slow to come, never impossible.
2. **Priority hold.** An engine cannot interrupt a prompt once its step has started: a lower priority's
   1,000-token prompt admitted a moment before a higher priority's request delays it by seconds. While a
   tenant of higher priority is active (a request in flight, or one in the last :data:`HOLD_S` seconds), a
   lower-priority request is admitted only if it would hold the prefill engine at most
   :data:`PRIORITY_SLICE_S` (its queue's wait plus its prompt, at the measured speed); else 429
   ``priority``. Short requests of lower priority go on; long ones wait for a quiet moment.
3. **Fair share and priority under overload.** Admission by work refuses a request whose expected wait
   exceeds ``router.max_queue_wait_s``. With several tenants in flight that budget is scaled per tenant
   (:meth:`Tenants.wait_scale`): a tenant holding at least its fair share of what is in flight (an equal
   split between the tenants in flight of its priority and above) gets :data:`OVER_SHARE_SCALE` of it, and each priority level
   below the highest in flight multiplies it by :data:`LOWER_PRIORITY_SCALE`. As queues grow, the over-share
   and lower-priority tenants reach their budget first and are refused, leaving the wait below the others'
   budget. With one tenant in flight nothing changes. The hard in-flight caps keep their last eighth for
   tenants under their share of the cap (:meth:`Tenants.under_share`, router/gate.py).

A tenant's prefix cache is its own: the router adds a per-tenant ``cache_salt`` (vLLM hashes it into every
prompt's first block), so no tenant's prompt is found in another's cache, nor shows in the router's cache
counters. Stored responses belong to the tenant (pdserve/router/stored.py).
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pdserve.config.schema import RouterConfig
from pdserve.config.tenants import DEFAULT_TENANT, TenantConfig
from pdserve.errors import Overloaded
from pdserve.owned import fair_share

#: Share of the wait budget a tenant at or over its fair share of the requests in flight may use.
OVER_SHARE_SCALE = 0.5
#: Factor on the wait budget for each priority level below the highest among the tenants in flight.
LOWER_PRIORITY_SCALE = 0.6
#: Longest Retry-After a tenant limit gives, seconds.
MAX_RETRY_S = 60.0
#: A tenant counts as active this long after its last request (for the priority hold).
HOLD_S = 5.0
#: While a higher-priority tenant is active, a lower-priority request may hold an engine this long at most.
PRIORITY_SLICE_S = 0.5


class TenantLimited(Overloaded):
    """429: the tenant is over one of its limits (``limit`` names it)."""

    def __init__(self, tenant: str, limit: str, value: float, wait_s: float, why: str = "") -> None:
        said = why or f"over its {limit} limit ({value:g})"
        super().__init__(f"tenant '{tenant}': {said}; retry in {wait_s:.1f} s",
                         retry_after_ms=int(math.ceil(min(MAX_RETRY_S, max(wait_s, 0.1)) * 1000)))
        self.limit = limit


@dataclass
class Bucket:
    """``capacity`` units refilled at ``rate`` per second."""

    rate: float
    capacity: float
    level: float
    at: float

    def _refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + max(0.0, now - self.at) * self.rate)
        self.at = now

    def wait_for(self, n: float, now: float) -> float:
        """Seconds until ``n`` units can be taken (0: now). More than the whole bucket needs a full one."""
        self._refill(now)
        need = min(n, self.capacity)
        return 0.0 if self.level >= need else (need - self.level) / self.rate

    def take(self, n: float) -> None:
        self.level -= n  # may go below 0 for a request bigger than the bucket: the debt refills first

    def give_back(self, n: float) -> None:
        self.level = min(self.capacity, self.level + n)


@dataclass
class TenantState:
    name: str
    cfg: TenantConfig
    buckets: dict[str, Bucket] = field(default_factory=dict)
    inflight: int = 0
    last_seen: float = -1e9
    admitted: int = 0
    refused: dict[str, int] = field(default_factory=dict)
    prompt_tokens: int = 0
    output_tokens: int = 0


@dataclass
class Ticket:
    """A request's hold on its tenant (released once, when the request ends)."""

    tenant: TenantState | None
    released: bool = False


class Tenants:
    def __init__(self, cfg: RouterConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        configured = dict(cfg.tenants)
        configured.setdefault(DEFAULT_TENANT, TenantConfig(keys_env=cfg.api_keys_env))
        now = clock()
        self._by_name: dict[str, TenantState] = {}
        for name, tc in configured.items():
            st = TenantState(name, tc)
            for limit, per_s, size in (("requests_per_s", tc.requests_per_s, tc.requests_per_s),
                                       ("prompt_tokens_per_min", _per_s(tc.prompt_tokens_per_min),
                                        tc.prompt_tokens_per_min),
                                       ("output_tokens_per_min", _per_s(tc.output_tokens_per_min),
                                        tc.output_tokens_per_min)):
                if per_s and size:
                    cap = max(1.0, float(size))
                    st.buckets[limit] = Bucket(rate=float(per_s), capacity=cap, level=cap, at=now)
            self._by_name[name] = st
        #: Whether the app has tenants of its own (else everything is the default tenant, as before).
        self.enabled = bool(cfg.tenants)
        self.on_refused: Callable[[str, str], None] | None = None
        self.on_admitted: Callable[[str, int, int], None] | None = None

    def names(self) -> list[str]:
        return list(self._by_name)

    def precheck(self, tenant: str) -> None:
        """Before a request is parsed and checked (the costly part of a refusal): :class:`TenantLimited`
        when the tenant is at its concurrency limit, has no request left this second, or has spent a token
        bucket to nothing. A flooding tenant's refusals then cost the router almost nothing."""
        st = self._by_name.get(tenant)
        if st is None:
            return
        now = self.clock()
        if st.cfg.max_concurrent is not None and st.inflight >= st.cfg.max_concurrent:
            self._refuse(st, "max_concurrent")
            raise TenantLimited(st.name, "max_concurrent", st.cfg.max_concurrent, 1.0)
        for limit, bucket in st.buckets.items():
            wait = bucket.wait_for(1.0, now)
            if wait > 0:
                self._refuse(st, limit)
                raise TenantLimited(st.name, limit, getattr(st.cfg, limit), wait)

    def outranked(self, tenant: str) -> bool:
        """Whether a tenant of higher priority than ``tenant`` is active (see the priority hold)."""
        st = self._by_name.get(tenant)
        if st is None:
            return False
        now = self.clock()
        return any(t.cfg.priority > st.cfg.priority and (t.inflight > 0 or now - t.last_seen < HOLD_S)
                   for t in self._by_name.values())

    def hold(self, tenant: str, engine_s: float) -> None:
        """The priority hold: :class:`TenantLimited` (``priority``) when ``tenant`` is outranked and its request
        would hold an engine longer than :data:`PRIORITY_SLICE_S`."""
        if engine_s > PRIORITY_SLICE_S and self.outranked(tenant):
            st = self._by_name[tenant]
            self._refuse(st, "priority")
            raise TenantLimited(st.name, "priority", PRIORITY_SLICE_S, HOLD_S,
                                why=f"a higher-priority tenant is active and this request would hold an "
                                    f"engine {engine_s:.1f} s (at most {PRIORITY_SLICE_S:g} s meanwhile)")

    def admit(self, tenant: str, prompt_tokens: int, output_tokens: int) -> Ticket:
        """Charge a request to ``tenant``; :class:`TenantLimited` when it is over a limit (nothing charged)."""
        st = self._by_name.get(tenant)
        if st is None:
            return Ticket(None)
        now = self.clock()
        if st.cfg.max_concurrent is not None and st.inflight >= st.cfg.max_concurrent:
            self._refuse(st, "max_concurrent")
            raise TenantLimited(st.name, "max_concurrent", st.cfg.max_concurrent, 1.0)
        asks = {"requests_per_s": 1.0, "prompt_tokens_per_min": float(prompt_tokens),
                "output_tokens_per_min": float(output_tokens)}
        for limit, bucket in st.buckets.items():
            wait = bucket.wait_for(asks[limit], now)
            if wait > 0:
                self._refuse(st, limit)
                raise TenantLimited(st.name, limit, getattr(st.cfg, limit), wait)
        for limit, bucket in st.buckets.items():
            bucket.take(asks[limit])
        # Active, for the priority hold, from admitted work only: a tenant whose requests are all refused
        # (bad bodies, its own limits) holds back no one.
        st.last_seen = now
        st.inflight += 1
        st.admitted += 1
        st.prompt_tokens += prompt_tokens
        st.output_tokens += output_tokens
        if self.on_admitted is not None:
            self.on_admitted(st.name, prompt_tokens, output_tokens)
        return Ticket(st)

    def refund(self, ticket: Ticket, prompt_tokens: int, output_tokens: int) -> None:
        """Give back what a request was charged when it was refused after all (admission by work)."""
        st = ticket.tenant
        if st is None:
            return
        for limit, n in (("requests_per_s", 1.0), ("prompt_tokens_per_min", float(prompt_tokens)),
                         ("output_tokens_per_min", float(output_tokens))):
            if limit in st.buckets:
                st.buckets[limit].give_back(n)
        st.admitted -= 1
        st.prompt_tokens -= prompt_tokens
        st.output_tokens -= output_tokens

    def release(self, ticket: Ticket) -> None:
        if ticket.released or ticket.tenant is None:
            return
        ticket.released = True
        ticket.tenant.inflight = max(0, ticket.tenant.inflight - 1)

    def refused(self, tenant: str, cause: str) -> None:
        """Count a refusal by admission by work against ``tenant``."""
        st = self._by_name.get(tenant)
        if st is not None:
            self._refuse(st, cause)

    def _refuse(self, st: TenantState, cause: str) -> None:
        st.refused[cause] = st.refused.get(cause, 0) + 1
        if self.on_refused is not None:
            self.on_refused(st.name, cause)

    def priority(self, tenant: str) -> int:
        """The tenant's configured priority (0 for a tenant not configured)."""
        st = self._by_name.get(tenant)
        return st.cfg.priority if st is not None else 0

    def under_share(self, tenant: str, cap: int, counted: bool = False) -> bool:
        """Whether ``tenant`` holds less than its share of a cap of ``cap`` requests in flight: the cap over the
        tenants in flight (itself included), two at least. ``counted``: its count includes the request
        asking."""
        st = self._by_name.get(tenant)
        if st is None:
            return True
        active = sum(1 for t in self._by_name.values() if t.inflight > 0 or t is st)
        return st.inflight - (1 if counted else 0) < fair_share(cap, active)

    def wait_scale(self, tenant: str) -> float:
        """The share of ``max_queue_wait_s`` this tenant's next request may fill (see the module's text)."""
        st = self._by_name.get(tenant)
        active = [t for t in self._by_name.values() if t.inflight > 0 or t is st]
        if st is None or len(active) < 2:
            return 1.0
        scale = 1.0
        # The fair share among the tenants of this one's priority and above: a lower priority's request in
        # flight (a trickle of one) does not halve a higher priority's budget.
        peers = [t for t in active if t.cfg.priority >= st.cfg.priority]
        fair = sum(t.inflight for t in peers) / len(peers)
        if len(peers) > 1 and st.inflight >= fair and st.inflight > 0:
            scale *= OVER_SHARE_SCALE
        top = max(t.cfg.priority for t in active)
        below = len({t.cfg.priority for t in active if st.cfg.priority < t.cfg.priority <= top})
        return scale * (LOWER_PRIORITY_SCALE ** below)

    def salt(self, tenant: str, given: Any) -> str | None:
        """The ``cache_salt`` a request of ``tenant`` goes to the engines with: the tenant's own, with the
        client's inside it (so a tenant can still separate its own requests); None without tenants."""
        if not self.enabled:
            return None
        base = hashlib.sha256(f"pdserve tenant\0{tenant}".encode()).hexdigest()[:24]
        if not (isinstance(given, str) and given):
            return base
        # The client's salt hashed: a salt vLLM accepts (at most 128 characters) stays one it accepts with the
        # tenant's in front of it (57 characters in all).
        return f"{base}:{hashlib.sha256(given.encode()).hexdigest()[:32]}"

    def summary(self, tenant: str | None = None) -> dict[str, Any]:
        """Per tenant: priority, limits, in flight, admitted, refused by cause, tokens (``tenant``: only it)."""
        out = {}
        for name, st in self._by_name.items():
            if tenant is not None and name != tenant:
                continue
            limits = {k: v for k, v in st.cfg.model_dump().items() if k not in ("keys_env", "priority") and v}
            out[name] = {"priority": st.cfg.priority, "limits": limits, "inflight": st.inflight,
                         "admitted": st.admitted, "refused": dict(st.refused),
                         "prompt_tokens": st.prompt_tokens, "output_tokens": st.output_tokens}
        return out


def _per_s(per_min: int | None) -> float | None:
    return per_min / 60.0 if per_min else None
