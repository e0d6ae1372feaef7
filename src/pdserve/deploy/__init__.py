"""``pdserve render``: a config file in, deployment manifests out (KubeRay on EKS).

    placement.py     engine replicas -> Ray worker pods -> GPU nodes; the custom Ray resource per role
    serve_config.py  the ``serveConfigV2`` of the RayService (the app and its args)
    kuberay.py       Namespace, PVC, RayService (with its endpoint Service), NetworkPolicy
    eksctl.py        the eksctl ClusterConfig (CPU system nodes, one EFA GPU node group in one AZ)
    helm.py          values for the KubeRay operator Helm chart
    yamltext.py      YAML text with the comments that say why
    render.py        ``render(loaded_config, target) -> str``: the one entry point
    cli.py           the ``render`` subcommand

The ``kubernetes:`` section of the YAML (cluster-specific values, with defaults) is part of the config:
:mod:`pdserve.config.kubernetes`. What one engine replica reserves (GPUs, placement bundles) is shared with
the app builder: :mod:`pdserve.config.resources`. Kept free of heavy imports (ray, vllm, torch).
"""
