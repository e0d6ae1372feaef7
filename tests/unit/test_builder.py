"""The Serve application graph, built without starting Ray."""

import pytest

from pdserve import build_pd_openai_app


def _deployments(app):
    out = {}

    def walk(node):
        d = node._bound_deployment
        out[d.name] = d
        for a in list(d.init_args) + list(d.init_kwargs.values()):
            if hasattr(a, "_bound_deployment"):
                walk(a)

    walk(app)
    return out


def test_builder_accepts_ray_serve_llm_args_dict():
    args = {
        "prefill_config": {"model_loading_config": {"model_id": "m", "model_source": "/models/m"},
                           "engine_kwargs": {"max_model_len": 1024},
                           "deployment_config": {"num_replicas": 2}},
        "decode_config": {"model_loading_config": {"model_id": "m", "model_source": "/models/m"},
                          "deployment_config": {"autoscaling_config": {"min_replicas": 1, "max_replicas": 3}}},
        "ingress_deployment_config": {"num_replicas": 2},
    }
    deps = _deployments(build_pd_openai_app(args))
    assert set(deps) == {"router", "prefill", "decode"}
    assert deps["prefill"].num_replicas == 2
    assert deps["decode"]._deployment_config.autoscaling_config.max_replicas == 3
    assert deps["router"].num_replicas == 2
    # On a host without GPUs the engine reservations are nominal: 1P + 1D + router fit on 2 cores.
    assert deps["prefill"].ray_actor_options["num_cpus"] < 0.1
    assert deps["router"].ray_actor_options["num_cpus"] < 0.1


def test_builder_default_is_the_embedded_model():
    deps = _deployments(build_pd_openai_app(None))
    assert deps["prefill"].num_replicas == 1 and deps["decode"].num_replicas == 1


def _pretend_host_has_nvidia_smi(monkeypatch):
    # The builder must not look at the host it runs on: that is not where the engines run.
    import shutil

    real = shutil.which
    monkeypatch.setattr(shutil, "which", lambda name, *a, **kw: "/usr/bin/nvidia-smi" if name == "nvidia-smi"
                        else real(name, *a, **kw))


def _pretend_ray(monkeypatch, resources):
    import ray

    monkeypatch.setattr(ray, "is_initialized", lambda: resources is not None)
    monkeypatch.setattr(ray, "cluster_resources", lambda: dict(resources or {}))


@pytest.mark.parametrize("host_has_nvidia_smi", [False, True])
def test_without_ray_a_config_that_asks_for_no_gpu_gets_cpu_reservations(monkeypatch, host_has_nvidia_smi):
    _pretend_ray(monkeypatch, None)
    if host_has_nvidia_smi:
        _pretend_host_has_nvidia_smi(monkeypatch)
    deps = _deployments(build_pd_openai_app({"decode_config": {"engine_kwargs": {"tensor_parallel_size": 2}},
                                             "prefill_config": {"engine_kwargs": {"tensor_parallel_size": 2}}}))
    for role in ("prefill", "decode"):
        assert deps[role].ray_actor_options["num_cpus"] < 0.1
        assert "num_gpus" not in deps[role].ray_actor_options
        assert deps[role]._replica_config.placement_group_bundles is None
    assert deps["router"].ray_actor_options["num_cpus"] < 0.1


def test_without_ray_a_config_that_asks_for_gpus_gets_gpu_reservations(monkeypatch):
    _pretend_ray(monkeypatch, None)
    args = {"prefill_config": {"accelerator_type": "L4", "engine_kwargs": {"tensor_parallel_size": 2}},
            "decode_config": {"accelerator_type": "L4", "engine_kwargs": {"tensor_parallel_size": 2}}}
    deps = _deployments(build_pd_openai_app(args))
    for role in ("prefill", "decode"):
        opts = deps[role].ray_actor_options
        assert opts["num_gpus"] == 0 and opts["num_cpus"] == 1 and opts["accelerator_type"] == "L4"
        assert deps[role]._replica_config.placement_group_bundles == [{"GPU": 1, "CPU": 1}] * 2
        assert deps[role]._replica_config.placement_group_strategy == "STRICT_PACK"
    assert deps["router"].ray_actor_options["num_cpus"] == 1


@pytest.mark.parametrize("host_has_nvidia_smi", [False, True])
def test_with_ray_the_cluster_decides(monkeypatch, host_has_nvidia_smi):
    if host_has_nvidia_smi:
        _pretend_host_has_nvidia_smi(monkeypatch)
    _pretend_ray(monkeypatch, {"CPU": 16.0, "GPU": 2.0})
    deps = _deployments(build_pd_openai_app(None))
    assert deps["prefill"].ray_actor_options["num_gpus"] == 1
    assert deps["decode"].ray_actor_options["num_gpus"] == 1

    _pretend_ray(monkeypatch, {"CPU": 2.0})
    deps = _deployments(build_pd_openai_app({"prefill_config": {"engine_kwargs": {"tensor_parallel_size": 2}},
                                             "decode_config": {"engine_kwargs": {"tensor_parallel_size": 2}}}))
    assert deps["prefill"].ray_actor_options["num_cpus"] < 0.1
    assert "num_gpus" not in deps["prefill"].ray_actor_options


def test_cpu_only_cluster_rule(monkeypatch):
    from pdserve.app.placement import cpu_only_cluster
    from pdserve.config.loader import parse_args

    gpu_cfg = parse_args({"decode_config": {"deployment_config": {"ray_actor_options": {"num_gpus": 1}}}},
                         source="test")
    _pretend_ray(monkeypatch, None)
    assert cpu_only_cluster() is True
    assert cpu_only_cluster(gpu_cfg) is False
    _pretend_ray(monkeypatch, {"GPU": 8.0})
    assert cpu_only_cluster() is False
    _pretend_ray(monkeypatch, {"CPU": 8.0})
    assert cpu_only_cluster(gpu_cfg) is True


def test_direct_ingress_pins_the_router_to_the_host_serving_the_port(monkeypatch):
    """Under ``pdserve serve`` the router replicas listen on the port themselves: they must run on the
    host the user reaches (the driver's), not wherever Ray places them in a cluster; `serve run` (Ray's
    proxy) leaves them free."""
    import ray

    class Ctx:
        def get_node_id(self):
            return "b" * 56

    monkeypatch.setattr(ray, "get_runtime_context", lambda: Ctx())
    monkeypatch.setattr(ray, "nodes", lambda: [{"NodeID": "a" * 56, "NodeManagerAddress": "10.0.0.2"},
                                               {"NodeID": "b" * 56, "NodeManagerAddress": "10.0.0.1"}])
    from pdserve.app.builder import build_pd_openai_app as build

    direct = {"host": "0.0.0.0", "port": 8000, "route_prefix": "/", "proxy_port": None}
    deps = _deployments(build(None, direct_ingress=direct))
    assert deps["router"].ray_actor_options["resources"] == {"node:10.0.0.1": 0.001}
    assert "resources" not in deps["prefill"].ray_actor_options
    assert "resources" not in _deployments(build_pd_openai_app(None))["router"].ray_actor_options
    # Serve sees none of their requests: its wait before looking for them is short (a stop is seconds sooner).
    assert deps["router"]._deployment_config.graceful_shutdown_wait_loop_s == 0.25
    assert deps["prefill"]._deployment_config.graceful_shutdown_wait_loop_s == 0.25


def test_serve_waits_its_own_time_where_it_sees_requests_or_the_config_says():
    """Through Serve's proxy the router's requests pass through Serve: Serve's own wait (2 s) stands there; a
    role's ``graceful_shutdown_wait_loop_s`` (Ray Serve LLM's field) is the engines' wait."""
    deps = _deployments(build_pd_openai_app(
        {"decode_config": {"deployment_config": {"graceful_shutdown_wait_loop_s": 1.5}}}))
    assert deps["router"]._deployment_config.graceful_shutdown_wait_loop_s == 2.0
    assert deps["decode"]._deployment_config.graceful_shutdown_wait_loop_s == 1.5
    assert deps["prefill"]._deployment_config.graceful_shutdown_wait_loop_s == 0.25
