"""The engines the router can send to, by role, with health and in-flight counts."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable

from pdserve.config.routing import PluginSettings
from pdserve.errors import NoEngineAvailable
from pdserve.router.endpoint import Endpoint, Role
from pdserve.router.kv_index import KvIndex, follow
from pdserve.router.routing import RoutingKey, RoutingPlugin, RoutingRequest, make_policy

log = logging.getLogger(__name__)

Discover = Callable[[], Awaitable[list[Endpoint]]]

#: With no request started on any engine for this long, every engine healthy and probed, health probes and
#: reads of the engine list back off to one every :data:`IDLE_PROBE_S` (a request reads a list older than
#: twice the refresh interval before it is placed: :meth:`EnginePool.current`).
IDLE_AFTER_S = 30.0
IDLE_PROBE_S = 10.0
#: Longest a request waits for that read before it is placed with the list the router has.
READ_TIMEOUT_S = 1.0

#: Consecutive failed health probes before an engine leaves rotation.
PROBE_STRIKES = 3


class EnginePool:
    """Holds the endpoints of both roles and picks one per request.

    ``discover`` (optional) returns the current endpoint list; the pool merges it, keeping in-flight
    counts and health of known endpoints.
    """

    def __init__(self, endpoints: list[Endpoint] | None = None, *, policy: str = "least_loaded",
                 prefill_policy: str | None = None, decode_policy: str | None = None,
                 plugins: PluginSettings | None = None, follow_all: bool = False) -> None:
        self._eps: dict[str, Endpoint] = {}
        #: Follow every engine's KV events whatever its role's policy (``router.cache_aware_steps``: where a
        #: request runs alone, and how much of a prompt its engine computes; router/cache_aware.py).
        self.follow_all = follow_all
        self.policy_names = {"prefill": prefill_policy or policy, "decode": decode_policy or policy}
        self._settings: PluginSettings | None = None
        self._plugins: dict[str, RoutingPlugin] = {}
        #: Every followed engine's cached blocks (one index; its engines are keyed by role and URL).
        self.kv_index = KvIndex()
        self._followers: dict[str, tuple[asyncio.Task[None], asyncio.Event]] = {}
        #: How the engine list is read (the app's registry; set by :func:`probe_forever`), and when it last was.
        self._discover: Discover | None = None
        self.read_at = -math.inf
        self._reading: asyncio.Task[None] | None = None
        self.configure(plugins or PluginSettings())
        for ep in endpoints or []:
            self._eps[ep.key] = ep

    def configure(self, settings: PluginSettings) -> None:
        """Build each role's routing plugin from its block of ``settings`` (``router.plugins``); the policy
        names stay those the pool was made with. The same settings again change nothing."""
        if settings == self._settings:
            return
        self._settings = settings
        self._plugins = {role: make_policy(name, settings) for role, name in self.policy_names.items()}
        for plugin in self._plugins.values():
            if hasattr(plugin, "index"):
                plugin.index = self.kv_index

    def wants_prompt_ids(self, role: Role) -> bool:
        """Whether the role's routing plugin reads the prompt's token ids."""
        return self._plugins[role].wants_prompt_ids

    def follows(self, role: Role) -> bool:
        """Whether the router keeps an index of what ``role``'s engines hold (routed by it, or under
        cache-aware disaggregation)."""
        return self.follow_all or self.wants_prompt_ids(role)

    def follow_kv_events(self) -> None:
        """Follow the KV cache events of every engine whose role is routed by them, or of every engine under
        cache-aware disaggregation (and stop following the engines that left); call from the event loop after
        the endpoint list changed. One index for all: a role routed by ``kv_cache`` shares it."""
        want = {ep.key: ep for ep in self._eps.values() if ep.kv_events and self.follows(ep.role)}
        for key in list(self._followers):
            task, stop = self._followers[key]
            if key not in want or task.done():
                stop.set()
                del self._followers[key]
        loop = asyncio.get_running_loop()
        for key, ep in want.items():
            if key not in self._followers:
                stop = asyncio.Event()
                self._followers[key] = (loop.create_task(follow(self.kv_index, key, ep.kv_events, stop, ep.api_key)), stop)
        for ep in self._eps.values():
            ep.kv_blocks = self.kv_index.blocks(ep.key) if ep.key in want else None

    def stop_following(self) -> None:
        for _task, stop in self._followers.values():
            stop.set()
        self._followers.clear()

    def reads_from(self, discover: Discover | None) -> None:
        self._discover = discover

    async def read(self) -> None:
        """Read the engine list now and follow the new engines' KV events; callers at the same moment share
        one read."""
        if self._discover is None:
            return
        if self._reading is None or self._reading.done():
            self._reading = asyncio.get_running_loop().create_task(self._read(self._discover))
        await asyncio.shield(self._reading)

    async def _read(self, discover: Discover) -> None:
        self.replace(await discover())
        self.read_at = time.monotonic()
        self.follow_kv_events()

    async def current(self, max_age_s: float, timeout_s: float = READ_TIMEOUT_S) -> None:
        """Before a request is placed: read the engine list first when the last read is older than
        ``max_age_s`` (an idle router reads it seldom: :class:`ProbeSchedule`), so that no request goes to
        a replica that left meanwhile. A read that fails or takes longer than ``timeout_s`` leaves the list
        as it was (a request that finds an engine gone goes to another)."""
        if self._discover is None or time.monotonic() - self.read_at <= max_age_s:
            return
        try:
            await asyncio.wait_for(self.read(), timeout_s)
        except Exception as e:  # noqa: BLE001 - the request goes on with the list the router has
            log.warning("reading the engine list before a request failed (%s: %s)", type(e).__name__, e)

    def routing_key(self, role: Role, request: RoutingRequest) -> RoutingKey:
        """What the role's routing plugin reads from ``request`` (pass it to :meth:`pick` as ``key``)."""
        return self._plugins[role].key(request)

    def endpoints(self, role: Role | None = None) -> list[Endpoint]:
        return [e for e in self._eps.values() if role is None or e.role == role]

    def healthy(self, role: Role) -> list[Endpoint]:
        return [e for e in self._eps.values() if e.role == role and e.healthy]

    def has(self, role: Role) -> bool:
        return any(e.role == role and e.healthy for e in self._eps.values())

    def pick(self, role: Role, exclude: set[str] | None = None, key: RoutingKey = None,
             prefer: Callable[[Endpoint], bool] | None = None) -> Endpoint:
        """A healthy engine of ``role`` not in ``exclude``, chosen by the role's routing; among those
        ``prefer`` takes, where it takes any."""
        cands = [e for e in self.healthy(role) if not exclude or e.url not in exclude]
        if not cands:
            raise NoEngineAvailable(f"no healthy {role} engine is available")
        if prefer is not None:
            cands = [e for e in cands if prefer(e)] or cands
        return self._plugins[role].choose(cands, key)

    def replace(self, fresh: list[Endpoint]) -> None:
        new: dict[str, Endpoint] = {}
        for ep in fresh:
            old = self._eps.get(ep.key)
            if old is not None and old.engine_id == ep.engine_id:
                new[ep.key] = old
            else:
                new[ep.key] = ep
        self._eps = new

    def mark_failed(self, ep: Endpoint) -> None:
        ep.failures += 1
        ep.healthy = False

    def missed_probe(self, ep: Endpoint) -> None:
        """A health probe went unanswered: a busy engine on one core can miss one; :data:`PROBE_STRIKES` in a
        row take it out of rotation (a failed request marks it at once: :meth:`mark_failed`)."""
        ep.failures += 1
        if ep.failures >= PROBE_STRIKES:
            ep.healthy = False

    def mark_ok(self, ep: Endpoint) -> None:
        if ep.refused_key:
            return  # its /health answers, but from a server that is not this engine (router/engine_client.py)
        ep.failures = 0
        ep.healthy = True
        ep.last_ok = time.monotonic()




class ProbeSchedule:
    """When the next round of health probes, and of reading the engine list, is due. While requests come, or
    while an engine is new, unwell or missed its last probe, every round; an app left idle probes and reads
    every :data:`IDLE_PROBE_S` instead: each probe wakes the router and every engine's API server, each read
    the router and Ray's GCS, the app's largest idle costs of its own (measured by ``pdserve bench
    --scenario footprint``). Nothing is lost: the first request after a while reads the list before it is
    placed (:meth:`EnginePool.current`), and a request that finds an engine gone marks it at once and goes
    to another (router/orchestrator.py)."""

    def __init__(self, interval_s: float, idle_after_s: float = IDLE_AFTER_S, idle_probe_s: float = IDLE_PROBE_S,
                 roles: tuple[Role, ...] = ()):
        self.interval_s = interval_s
        #: The app's engine roles: while one has no healthy engine (the app starting, a replica replaced),
        #: every round.
        self.roles = roles
        self.idle_after_s = idle_after_s
        self.idle_probe_s = max(idle_probe_s, interval_s)
        self._probed: set[str] = set()
        self._last = -1e18

    def due(self, eps: list[Endpoint], now: float) -> bool:
        if now - self._last >= self.idle_probe_s:
            return True
        if any(not any(ep.role == role and ep.healthy for ep in eps) for role in self.roles):
            return True
        return any(ep.key not in self._probed or not ep.healthy or ep.failures or ep.inflight
                   or now - ep.used < self.idle_after_s for ep in eps)

    def probed(self, eps: list[Endpoint], now: float) -> None:
        self._probed = {ep.key for ep in eps}
        self._last = now


async def probe_forever(
    pool: EnginePool,
    check: Callable[[Endpoint], Awaitable[bool]],
    *,
    discover: Discover | None,
    interval_s: float,
    forget: Callable[[Endpoint], Awaitable[None]] | None = None,
    forget_after_s: float = 60.0,
    schedule: ProbeSchedule | None = None,
) -> None:
    """Read the endpoint list and probe the engines' health every ``interval_s`` when ``schedule`` says
    (every round without one) until cancelled."""
    pool.reads_from(discover)
    while True:
        try:
            now = time.monotonic()
            if schedule is not None and not schedule.due(pool.endpoints(), now):
                pool.follow_kv_events()
                await asyncio.sleep(interval_s)
                continue
            await pool.read()
            pool.follow_kv_events()
            eps = pool.endpoints()
            results = await asyncio.gather(*(check(ep) for ep in eps), return_exceptions=True)
            if schedule is not None:
                schedule.probed(eps, now)
            for ep, ok in zip(eps, results):
                if ok is True:
                    pool.mark_ok(ep)
                else:
                    # A busy engine on one core can miss a probe; three in a row take it out of rotation.
                    # (A failed request marks it at once.)
                    pool.missed_probe(ep)
                    if forget is not None and ep.failures * interval_s >= forget_after_s:
                        # A dead replica is replaced by a new one at a new address; the old entry goes.
                        await forget(ep)
        except asyncio.CancelledError:
            pool.stop_following()
            raise
        except Exception:  # noqa: BLE001 - the prober must outlive any one bad round
            log.exception("engine refresh failed")
        await asyncio.sleep(interval_s)
