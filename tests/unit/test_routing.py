"""Routing plugins one by one (key, filter, score, pick), their registry, and their config blocks."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.config.loader import parse_args
from pdserve.config.routing import (
    PLUGIN_NAMES,
    LeastLoadedSettings,
    PluginSettings,
    PrefixAffinitySettings,
    RoundRobinSettings,
    SessionAffinitySettings,
)
from pdserve.config.schema import RouterConfig
from pdserve.errors import ConfigError
from pdserve.router.endpoint import Endpoint
from pdserve.router.pool import EnginePool
from pdserve.router.routing import PLUGINS, RoutingRequest, make_policy
from pdserve.router.routing.affinity import rendezvous_weight
from pdserve.router.routing.least_loaded import LeastLoaded
from pdserve.router.routing.prefix_affinity import PrefixAffinity
from pdserve.router.routing.round_robin import RoundRobin
from pdserve.router.routing.session_affinity import SessionAffinity

VALID = "valid: kv_cache, least_loaded, prefix_affinity, round_robin, session_affinity"


def eps(*inflight: int, role: str = "prefill") -> list[Endpoint]:
    return [Endpoint(role=role, url=f"http://h:{i}", inflight=n) for i, n in enumerate(inflight)]  # type: ignore[arg-type]


def completions(prompt) -> RoutingRequest:
    return RoutingRequest("completions", {"prompt": prompt})


# -- round_robin ---------------------------------------------------------------------------------------


def test_round_robin_keeps_all_scores_alike_and_takes_turns():
    rr = RoundRobin(RoundRobinSettings())
    e = eps(5, 0, 9)
    assert rr.key(completions("x")) is None
    assert rr.filter(e, None) == e
    assert {rr.score(ep, None) for ep in e} == {0.0}
    assert [rr.choose(e, None) for _ in range(6)] == e + e


# -- least_loaded --------------------------------------------------------------------------------------


def test_least_loaded_scores_by_inflight_and_picks_the_best_drawn():
    ll = LeastLoaded(LeastLoadedSettings())
    e = eps(3, 1)
    assert ll.key(completions("x")) is None
    assert ll.filter(e, None) == e
    assert [ll.score(ep, None) for ep in e] == [-3, -1]
    assert all(ll.pick([(e[0], -3), (e[1], -1)], None) is e[1] for _ in range(20))  # two of two drawn
    assert ll.choose(e[:1], None) is e[0]


def test_least_loaded_choices_bounds_the_draw():
    e = eps(4, 0, 4, 4, 4, 4)
    strict = LeastLoaded(LeastLoadedSettings(choices=len(e)))  # draws every replica: the strict minimum
    assert all(strict.choose(e, None) is e[1] for _ in range(20))
    two = LeastLoaded(LeastLoadedSettings())  # two of six: the idle one is often not drawn
    assert {id(two.choose(e, None)) for _ in range(200)} != {id(e[1])}


# -- prefix_affinity -----------------------------------------------------------------------------------


def test_prefix_affinity_key_is_the_prompt_prefix():
    pa = PrefixAffinity(PrefixAffinitySettings(tokens=3))
    assert pa.key(completions([5, 6, 7, 8])) == "5,6,7"
    assert pa.key(completions([5, 6, 7, 9])) == pa.key(completions([5, 6, 7]))
    assert pa.key(completions("abcdefghijklmnop")) == '"abcdefghijk'  # 4 x 3 characters of its JSON
    chat = RoutingRequest("chat", {"messages": [{"role": "user", "content": "hi"}]}, session="s")
    assert pa.key(chat) == '[{"content":'
    assert PrefixAffinity(PrefixAffinitySettings()).key(completions(list(range(300)))).count(",") == 255


def test_prefix_affinity_writes_only_the_head_of_a_long_conversation(monkeypatch):
    """The whole of a 16-MiB conversation written as JSON took a third of a second of the event loop for every
    request: only its head is, and the key is what the whole's JSON starts with."""
    import json

    from pdserve.router.routing import prefix_affinity

    pa = PrefixAffinity(PrefixAffinitySettings(tokens=16))
    messages = [{"role": "system", "content": "You are a careful agent. " * 20},
                *({"role": "user", "content": "tool output " * 50_000} for _ in range(20))]
    whole = json.dumps(messages, sort_keys=True)
    written: list[int] = []
    real = json.dumps
    monkeypatch.setattr(prefix_affinity.json, "dumps", lambda v, **kw: written.append(len(real(v, **kw))) or real(v, **kw))
    key = pa.key(RoutingRequest("chat", {"messages": messages}, session=None))
    assert key == whole[:64] and written and max(written) < 200
    other = [{**messages[0], "content": "You are a careless agent."}, *messages[1:]]
    assert pa.key(RoutingRequest("chat", {"messages": other}, session=None)) != key


def test_prefix_affinity_filters_overloaded_scores_by_hash_and_picks_the_highest():
    pa = PrefixAffinity(PrefixAffinitySettings(slack=2))
    e = eps(0, 2, 3, 1)
    assert pa.filter(e, "k") == [e[0], e[1], e[3]]  # e[2] holds 3 above the least loaded
    assert [pa.score(ep, "k") for ep in e] == [rendezvous_weight("k", ep) for ep in e]
    best = max((e[0], e[1], e[3]), key=lambda ep: rendezvous_weight("k", ep))
    assert pa.choose(e, "k") is best
    assert pa.pick([(e[0], 1.0), (e[1], 5.0), (e[3], 5.0)], "k") is e[1]  # highest, first on a tie


def test_prefix_affinity_is_sticky_and_its_slack_is_configurable():
    e = eps(0, 0, 0, 0)
    tight = PrefixAffinity(PrefixAffinitySettings(slack=0))
    chosen = tight.choose(e, "k")
    assert all(tight.choose(e, "k") is chosen for _ in range(10))
    chosen.inflight = 1
    assert tight.choose(e, "k") is not chosen  # one request above the others is already too many
    assert PrefixAffinity(PrefixAffinitySettings(slack=1)).choose(e, "k") is chosen


def test_affinity_without_a_key_is_least_loaded():
    sa = SessionAffinity(SessionAffinitySettings())
    e = eps(7, 0)
    assert all(sa.choose(e, None) is e[1] and sa(e, None) is e[1] for _ in range(20))


# -- session_affinity ----------------------------------------------------------------------------------


def test_session_affinity_key_is_the_session_header():
    sa = SessionAffinity(SessionAffinitySettings())
    assert sa.key(RoutingRequest("completions", {"prompt": "x"}, session="conv-7")) == "conv-7"
    assert sa.key(completions("x")) is None
    e = eps(0, 0, 0)
    assert len({id(sa.choose(e, f"s{i}")) for i in range(30)}) == 3  # sessions spread
    assert sa.choose(e, "conv-7") is sa.choose(e, "conv-7")


# -- registry and config -------------------------------------------------------------------------------


def test_registry_has_one_plugin_per_config_name():
    assert tuple(sorted(PLUGINS)) == PLUGIN_NAMES == ("kv_cache", "least_loaded", "prefix_affinity",
                                                      "round_robin", "session_affinity")
    for name, cls in PLUGINS.items():
        assert cls.name == name
        assert isinstance(make_policy(name), cls)
        assert cls.settings_model is PluginSettings.model_fields[name].annotation


def test_make_policy_builds_from_the_plugins_block():
    pa = make_policy("prefix_affinity", PluginSettings(prefix_affinity=PrefixAffinitySettings(tokens=2)))
    assert pa.key(completions([1, 2, 3])) == "1,2"
    with pytest.raises(ValueError, match=VALID):
        make_policy("fastest")


@pytest.mark.parametrize("field", ["policy", "prefill_policy", "decode_policy"])
def test_unknown_policy_is_a_config_error_listing_valid_names(field):
    with pytest.raises(ConfigError) as e:
        parse_args({"router": {field: "fastest"}}, source="x.yaml")
    assert f"x.yaml: router.{field}:" in str(e.value)
    assert "unknown routing policy 'fastest'" in str(e.value) and VALID in str(e.value)


def test_plugin_blocks_are_optional_checked_and_keep_the_old_spelling():
    r = parse_args({}).router
    assert r.plugins == PluginSettings() and r.plugins.prefix_affinity.tokens == 256
    r = parse_args({"router": {"policy": "prefix_affinity", "plugins": {"prefix_affinity": {"tokens": 64}},
                               "prefill_policy": "round_robin"}}).router
    assert r.plugins.prefix_affinity.tokens == 64 and r.plugins.prefix_affinity.slack == 8
    assert RouterConfig(prefix_affinity_tokens=8).plugins.prefix_affinity.tokens == 8
    assert RouterConfig(prefix_affinity_tokens=8, plugins={"prefix_affinity": {"tokens": 8}}).prefix_affinity_tokens == 8
    with pytest.raises(ConfigError, match="disagree"):
        parse_args({"router": {"prefix_affinity_tokens": 8, "plugins": {"prefix_affinity": {"tokens": 9}}}})
    with pytest.raises(ConfigError, match=r"router.plugins.prefix_affinity.tokns: unknown field"):
        parse_args({"router": {"plugins": {"prefix_affinity": {"tokns": 8}}}}, source="x.yaml")
    with pytest.raises(ConfigError, match=r"router.plugins.fastest: unknown field"):
        parse_args({"router": {"plugins": {"fastest": {}}}}, source="x.yaml")
    with pytest.raises(ConfigError, match=r"router.plugins.least_loaded.choices"):
        parse_args({"router": {"plugins": {"least_loaded": {"choices": 1}}}}, source="x.yaml")


# -- the pool and the orchestrator ---------------------------------------------------------------------


def test_pool_reads_the_key_with_each_roles_plugin():
    pool = EnginePool(eps(0, 0) + eps(0, 0, role="decode"), policy="session_affinity",
                      prefill_policy="prefix_affinity",
                      plugins=PluginSettings(prefix_affinity=PrefixAffinitySettings(tokens=2)))
    req = RoutingRequest("completions", {"prompt": [1, 2, 3]}, session="s")
    assert pool.routing_key("prefill", req) == "1,2"
    assert pool.routing_key("decode", req) == "s"
    assert EnginePool(policy="round_robin").routing_key("decode", req) is None


def test_orchestrator_applies_the_routers_plugin_settings():
    from pdserve.router.orchestrator import Orchestrator

    pool = EnginePool(eps(0, 0), policy="round_robin", prefill_policy="prefix_affinity")
    assert pool.routing_key("prefill", completions(list(range(10)))) == ",".join(map(str, range(10)))
    orch = Orchestrator(pool, RouterConfig(plugins={"prefix_affinity": {"tokens": 4}}))
    assert orch.gate.routing_key("prefill", "completions", {"prompt": list(range(10))}, None, None) == "0,1,2,3"
    assert orch.gate.routing_key("decode", "completions", {"prompt": list(range(10))}, "s", None) is None
    assert pool.policy_names == {"prefill": "prefix_affinity", "decode": "round_robin"}  # names stay the pool's


def test_orchestrator_and_admission_name_no_policy():
    src = Path(__file__).resolve().parents[2] / "src" / "pdserve" / "router"
    for f in ("orchestrator.py", "gate.py", "admission.py"):
        text = (src / f).read_text()
        assert not [n for n in PLUGIN_NAMES if n in text], f
