"""A stopping engine replica waits for its requests (engine/drain.py), on a clock of the test's own."""

from __future__ import annotations

from pdserve.engine.drain import POLL_S, wait_until_idle


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s


def test_it_waits_out_the_routers_refresh_then_until_the_engine_is_idle():
    clock = Clock()
    looks: list[float] = []

    def busy() -> float:
        looks.append(clock.t)
        return 2.0 if clock.t < 5.0 else 0.0  # two streams finish at 5 s

    drained, waited = wait_until_idle(busy, min_s=2.0, max_s=17.0, clock=clock, sleep=clock.sleep)
    assert drained and 5.0 <= waited < 5.0 + 2 * POLL_S
    assert looks[0] >= 2.0  # nothing read before the router has seen the replica go


def test_an_idle_engine_stops_after_the_refresh_and_a_busy_one_at_the_bound():
    clock = Clock()
    assert wait_until_idle(lambda: 0.0, min_s=2.0, max_s=17.0, clock=clock, sleep=clock.sleep) == (True, 2.0)
    clock = Clock()
    drained, waited = wait_until_idle(lambda: 1.0, min_s=2.0, max_s=17.0, clock=clock, sleep=clock.sleep)
    assert not drained and 17.0 <= waited < 17.0 + POLL_S


def test_an_engine_that_cannot_be_read_has_nothing_left_to_finish():
    clock = Clock()
    assert wait_until_idle(lambda: None, min_s=1.0, max_s=17.0, clock=clock, sleep=clock.sleep)[0]


class FakeKv:
    """Ray's key-value store as the app's registry uses it."""

    def __init__(self) -> None:
        self.kv: dict[bytes, bytes] = {}

    def internal_kv_put(self, key: bytes, value: bytes, overwrite: bool, ns: bytes, timeout: float) -> None:
        self.kv[key] = value

    def internal_kv_get(self, key: bytes, ns: bytes, timeout: float) -> bytes | None:
        return self.kv.get(key)

    def internal_kv_del(self, key: bytes, by_prefix: bool, ns: bytes, timeout: float) -> None:
        for k in [k for k in self.kv if (k.startswith(key) if by_prefix else k == key)]:
            del self.kv[k]


def test_engines_of_a_stopping_app_do_not_wait_for_routers_that_are_gone(monkeypatch):
    """A scale-down or redeploy waits out the routers' refresh before the engine stops; when ``pdserve serve``
    stops the whole app (its routers stopped first), the engines stop as soon as they are idle. A mark left by
    a stop that never finished is gone at the next deploy."""
    from pdserve.app import deployments, registry
    from pdserve.config.schema import PDServeArgs
    from pdserve.engine import drain

    kv = FakeKv()
    monkeypatch.setattr(registry, "_store", lambda: kv)
    floors: list[float] = []
    monkeypatch.setattr(drain, "wait_until_idle", lambda busy, *, min_s, max_s: (floors.append(min_s), (True, 0.0))[1])
    server = object.__new__(deployments.EngineServer)
    server.args, server.role, server.app_name, server.replica_id = PDServeArgs(), "decode", "app", "r1"
    server._drain()
    registry.mark_stopping("app")
    assert registry.stopping("app") and not registry.stopping("other")
    server._drain()
    registry.unmark_stopping("app")
    server._drain()
    registry.mark_stopping("app")
    registry.clear("app")
    server._drain()
    refresh = 2 * PDServeArgs().router.engine_refresh_s
    assert floors == [refresh, 0.0, refresh, refresh]
