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
