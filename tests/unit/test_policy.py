import json

import pytest

from pdserve.router.endpoint import Endpoint
from pdserve.router.pool import EnginePool
from pdserve.router.routing import AFFINITY_SLACK, make_policy


def eps(n, role="prefill"):
    return [Endpoint(role=role, url=f"http://h:{i}") for i in range(n)]


def test_unknown_policy_lists_valid_ones():
    with pytest.raises(ValueError, match="valid: kv_cache, least_loaded, prefix_affinity, round_robin, session_affinity"):
        make_policy("fastest")


def test_least_loaded_prefers_idle():
    e = eps(2)
    e[0].inflight = 10
    pick = make_policy("least_loaded")
    assert all(pick(e, None) is e[1] for _ in range(20))


def test_affinity_is_sticky_and_spreads_keys():
    e = eps(4)
    pick = make_policy("prefix_affinity")
    first = {k: pick(e, k) for k in (f"prefix-{i}" for i in range(40))}
    assert all(pick(e, k) is v for k, v in first.items())  # same key, same replica
    assert len({id(v) for v in first.values()}) >= 3  # keys spread over replicas


def test_affinity_survives_a_replica_leaving_for_other_keys():
    e = eps(4)
    pick = make_policy("session_affinity")
    before = {k: pick(e, k).url for k in (f"s{i}" for i in range(40))}
    gone = e[0].url
    after = {k: pick(e[1:], k).url for k in before}
    moved = [k for k in before if before[k] != gone and before[k] != after[k]]
    assert not moved  # rendezvous hashing: only the departed replica's keys move


def test_affinity_yields_to_overload():
    e = eps(2)
    pick = make_policy("prefix_affinity")
    chosen = pick(e, "k")
    chosen.inflight = AFFINITY_SLACK + 5
    assert pick(e, "k") is not chosen


def test_pool_uses_per_role_policies():
    pool = EnginePool(eps(2) + eps(2, "decode"), policy="round_robin", prefill_policy="prefix_affinity")
    assert pool.policy_names == {"prefill": "prefix_affinity", "decode": "round_robin"}
    assert pool.pick("prefill", key="x") is pool.pick("prefill", key="x")


def test_probe_needs_three_strikes_and_one_success_restores():
    import asyncio

    from pdserve.router.pool import probe_forever

    pool = EnginePool(eps(1))
    ep = pool.endpoints()[0]
    answers = [False, False, False, True]
    seen = []

    async def check(_):
        seen.append(ep.healthy)
        return answers[len(seen) - 1] if len(seen) <= len(answers) else True

    async def run():
        task = asyncio.create_task(probe_forever(pool, check, discover=None, interval_s=0.001))
        while len(seen) < 5:
            await asyncio.sleep(0.001)
        task.cancel()

    asyncio.run(run())
    # healthy while probes 1-2 failed, out after the 3rd, back after a success
    assert seen[:5] == [True, True, True, False, True]


def test_probes_back_off_only_while_the_app_is_idle_and_every_engine_is_well():
    from pdserve.router.pool import ProbeSchedule

    a, b = eps(1) + eps(1, "decode")
    sched = ProbeSchedule(1.0, idle_after_s=30, idle_probe_s=10)
    assert sched.due([a, b], 100.0)  # never probed
    sched.probed([a, b], 100.0)
    assert not sched.due([a, b], 101.0)  # idle, all well: next at 110
    assert sched.due([a, b], 110.0)
    c = eps(2)[1]
    assert sched.due([a, b, c], 101.0)  # a new engine is probed (and calibrated) at once
    a.used = 95.0
    assert sched.due([a, b], 101.0)  # a request started within the last 30 s
    a.used = 0.0
    b.inflight = 1
    assert sched.due([a, b], 101.0)  # one in flight now
    b.inflight = 0
    b.failures = 1
    assert sched.due([a, b], 101.0)  # it missed a probe: every round until it answers
    b.failures, b.healthy = 0, False
    assert sched.due([a, b], 101.0)
    # Never slower than the refresh interval itself.
    assert ProbeSchedule(20.0, idle_probe_s=10).idle_probe_s == 20.0


def test_probes_and_reads_run_every_round_while_a_role_has_no_healthy_engine():
    from pdserve.router.pool import ProbeSchedule

    a, b = eps(1) + eps(1, "decode")
    sched = ProbeSchedule(1.0, idle_after_s=30, idle_probe_s=10, roles=("prefill", "decode"))
    sched.probed([a], 100.0)
    assert sched.due([a], 101.0)  # the app is starting: no decode engine yet, so the list is read again
    sched.probed([a, b], 102.0)
    assert not sched.due([a, b], 103.0)
    b.healthy = False
    assert sched.due([a, b], 103.0)


def test_an_idle_router_reads_the_engine_list_seldom_and_a_request_reads_a_stale_one_first():
    """Idle rounds neither probe nor read the registry; the first request after them reads it before it is
    placed (one read for requests arriving together), and a read that fails leaves the list as it was."""
    import asyncio

    from pdserve.router.pool import ProbeSchedule, probe_forever

    a, b, c = eps(1) + eps(2, "decode")
    listed = [[a, b, c]]
    reads = []

    async def discover():
        reads.append(1)
        await asyncio.sleep(0.01)
        if isinstance(listed[0], Exception):
            raise listed[0]
        return list(listed[0])

    async def check(_):
        return True

    async def run():
        pool = EnginePool()
        sched = ProbeSchedule(0.001, idle_after_s=30, idle_probe_s=3600, roles=("prefill", "decode"))
        task = asyncio.create_task(probe_forever(pool, check, discover=discover, interval_s=0.001, schedule=sched))
        while len(pool.endpoints()) < 3:
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.05)  # many idle rounds
        idle_reads = len(reads)
        await pool.current(max_age_s=3600)  # fresh enough: no read
        assert len(reads) == idle_reads
        listed[0] = [a, b]  # a decode replica left while the router was idle
        await asyncio.gather(*(pool.current(max_age_s=0.0) for _ in range(3)))
        shared = len(reads) - idle_reads
        after = [ep.url for ep in pool.endpoints()]
        listed[0] = RuntimeError("GCS unreachable")
        await pool.current(max_age_s=0.0)
        kept = [ep.url for ep in pool.endpoints()]
        task.cancel()
        return idle_reads, shared, after, kept

    idle_reads, shared, after, kept = asyncio.run(run())
    assert idle_reads <= 2  # the start's read (and the round that probed the second engine), none while idle
    assert shared == 1
    assert after == kept == [a.url, b.url]


def test_registry_reads_only_whole_entries():
    from pdserve.app.registry import decode, key, prefix

    good = {"role": "decode", "url": "http://h:1", "replica_id": "r1", "engine_id": "e1", "api_key": "k"}
    values = {key("app", "r1"): json.dumps(good).encode(), key("app", "r0"): b"not json", key("app", "r2"): b"[1]",
              key("app", "r3"): json.dumps({"role": "decode"}).encode(), key("app", "r4"): None}
    assert decode(values) == [good]
    assert key("app", "r1").startswith(prefix("app")) and not key("app2", "r1").startswith(prefix("app"))
