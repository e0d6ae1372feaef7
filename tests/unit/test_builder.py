"""The Serve application graph, built without starting Ray."""

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
