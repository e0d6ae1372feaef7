from types import SimpleNamespace

import pytest

from pdserve import build_pd_openai_app
from pdserve.app.autoscaling import TtftWindow, decode_policy, parse_engine_stats, prefill_policy
from pdserve.config.schema import PDServeArgs
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
            'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\n'
            'vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} 12.5\n'
            'vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 10.0\n')
    assert parse_engine_stats(text) == {"running": 3.0, "waiting": 2.0, "kv_usage": 0.25, "ttft_sum": 12.5,
                                        "ttft_count": 10.0}


def test_parse_engine_stats_reads_a_full_exposition():
    # As vLLM writes it: HELP/TYPE lines, a histogram, one label set per engine core (summed), a timestamp.
    text = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0 1700000000000
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="1.0",model_name="m"} 7.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="m"} 10.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 10.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} 12.5
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="m"} 99.0
"""
    assert parse_engine_stats(text) == {"running": 4.0, "waiting": 2.0, "kv_usage": 0.25, "ttft_sum": 12.5,
                                        "ttft_count": 10.0}
    assert parse_engine_stats("") == {"running": 0.0, "waiting": 0.0, "kv_usage": 0.0, "ttft_sum": 0.0,
                                      "ttft_count": 0.0}


def test_prefill_scales_on_recent_ttft_against_its_target():
    w = TtftWindow(target_s=0.5)
    assert w.pressure(10.0, 20) is None  # first report: no window yet
    assert w.pressure(10.0, 20) is None  # nothing finished since: no evidence either way
    assert w.pressure(14.0, 24) == pytest.approx(2.0)  # 4 prompts at 1 s mean TTFT = 2x the target
    # Queue says 1 replica is enough, TTFT says twice the current 2: TTFT wins.
    n, state = prefill_policy(ctx(2, {"running": {"a": 1, "b": 0}, "waiting": {}, "ttft_pressure": {"a": 2.0, "b": 2.0}},
                                  target=1.0))
    assert n == 4.0 and state["prefill_ttft_pressure"] == 2.0
    # TTFT well under target does not scale down below what the queue wants.
    n, _ = prefill_policy(ctx(2, {"running": {"a": 3, "b": 3}, "waiting": {}, "ttft_pressure": {"a": 0.1}}, target=1.0))
    assert n == 6.0


def test_target_ttft_is_prefill_only_and_stays_out_of_ray_config():
    auto = {"min_replicas": 1, "max_replicas": 2, "target_ttft_s": 0.8}
    with pytest.raises(ValueError, match="TTFT is a prefill signal"):
        PDServeArgs.model_validate({"decode_config": {"deployment_config": {"autoscaling_config": auto}}})
    deps = _deployments(build_pd_openai_app({"prefill_config": {"deployment_config": {"autoscaling_config": auto}}}))
    cfg = deps["prefill"]._deployment_config.autoscaling_config
    assert cfg.max_replicas == 2 and not hasattr(cfg, "target_ttft_s")


def test_the_signals_periods_reach_ray_and_a_window_no_longer_than_a_report_is_refused():
    auto = {"min_replicas": 1, "max_replicas": 2, "metrics_interval_s": 2, "look_back_period_s": 10}
    deps = _deployments(build_pd_openai_app({"decode_config": {"deployment_config": {"autoscaling_config": auto}}}))
    cfg = deps["decode"]._deployment_config.autoscaling_config
    assert (cfg.metrics_interval_s, cfg.look_back_period_s) == (2, 10)
    for bad, named in (({"look_back_period_s": 10}, "10"), ({"metrics_interval_s": 30}, "30"),
                       ({"metrics_interval_s": 5, "look_back_period_s": 5}, "5")):
        with pytest.raises(ValueError, match=rf"look_back_period_s \({named}\)|metrics_interval_s \({named}\)"):
            PDServeArgs.model_validate({"decode_config": {"deployment_config": {"autoscaling_config": bad}}})


def test_builder_wires_per_phase_policies():
    args = {"prefill_config": {"deployment_config": {"autoscaling_config": {"min_replicas": 1, "max_replicas": 3}}},
            "decode_config": {"deployment_config": {"autoscaling_config": {"min_replicas": 1, "max_replicas": 2}}}}
    deps = _deployments(build_pd_openai_app(args))
    for role, fn in (("prefill", "prefill_policy"), ("decode", "decode_policy")):
        pol = deps[role]._deployment_config.autoscaling_config.policy
        assert str(pol.policy_function).endswith(fn) or getattr(pol.policy_function, "__name__", "") == fn


def test_num_replicas_auto_autoscales_on_the_roles_own_signals():
    """``num_replicas: auto`` (Ray Serve's shorthand for autoscaling with its defaults): left to Ray it would
    scale on requests through Serve handles, which engine replicas never get, and sit at one replica."""
    args = {"prefill_config": {"deployment_config": {"num_replicas": "auto"}},
            "decode_config": {"deployment_config": {"num_replicas": "auto",
                                                    "autoscaling_config": {"min_replicas": 2}}}}
    parsed = PDServeArgs.model_validate(args)
    assert parsed.prefill_config.replicas_text() == "1-100 replicas (autoscaling)"
    assert parsed.decode_config.replicas_text() == "2-100 replicas (autoscaling)"
    bounded = PDServeArgs.model_validate({"decode_config": {"deployment_config": {
        "num_replicas": "auto", "autoscaling_config": {"max_replicas": 3}}}})
    assert bounded.decode_config.replicas_text() == "1-3 replicas (autoscaling)"
    deps = _deployments(build_pd_openai_app(args))
    for role, fn in (("prefill", "prefill_policy"), ("decode", "decode_policy")):
        cfg = deps[role]._deployment_config.autoscaling_config
        assert cfg.max_replicas == 100
        assert str(cfg.policy.policy_function).endswith(fn) or getattr(cfg.policy.policy_function, "__name__", "") == fn
