from types import SimpleNamespace

from pdserve import build_pd_openai_app
from pdserve.app.autoscaling import decode_policy, parse_engine_stats, prefill_policy
from tests.unit.test_builder import _deployments


def ctx(current, metrics, target=2.0):
    return SimpleNamespace(current_num_replicas=current, target_num_replicas=current, aggregated_metrics=metrics,
                           config=SimpleNamespace(get_target_ongoing_requests=lambda: target))


def test_prefill_scales_with_waiting_prompts():
    up, _ = prefill_policy(ctx(1, {"running": {"r1": 1}, "waiting": {"r1": 5}}))
    assert up == 3.0
    down, _ = prefill_policy(ctx(3, {"running": {"a": 0, "b": 1, "c": 0}, "waiting": {}}))
    assert down == 0.5


def test_decode_scales_on_sequences_or_kv_pressure():
    assert decode_policy(ctx(2, {"running": {"a": 4, "b": 4}, "kv_usage": {"a": 0.1, "b": 0.2}}))[0] == 4.0
    n, state = decode_policy(ctx(2, {"running": {"a": 1, "b": 1}, "kv_usage": {"a": 0.95, "b": 0.9}}))
    assert n == 3 and state["decode_kv_usage"] > 0.85
    assert decode_policy(ctx(0, {}))[0] == 0


def test_parse_engine_stats():
    text = ('vllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
            'vllm:num_requests_waiting{engine="0",model_name="m"} 2.0\n'
            'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\n')
    assert parse_engine_stats(text) == {"running": 3.0, "waiting": 2.0, "kv_usage": 0.25}


def test_builder_wires_per_phase_policies():
    args = {"prefill_config": {"deployment_config": {"autoscaling_config": {"min_replicas": 1, "max_replicas": 3}}},
            "decode_config": {"deployment_config": {"autoscaling_config": {"min_replicas": 1, "max_replicas": 2}}}}
    deps = _deployments(build_pd_openai_app(args))
    for role, fn in (("prefill", "prefill_policy"), ("decode", "decode_policy")):
        pol = deps[role]._deployment_config.autoscaling_config.policy
        assert str(pol.policy_function).endswith(fn) or getattr(pol.policy_function, "__name__", "") == fn
