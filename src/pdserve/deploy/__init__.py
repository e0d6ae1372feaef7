"""``pdserve render``: a config file in, deployment manifests out (KubeRay on EKS).

    kubernetes.py    the ``kubernetes:`` section of the YAML (cluster-specific values, with defaults)
    placement.py     engine replicas -> Ray worker pods -> GPU nodes; the custom Ray resource per role
    serve_config.py  the ``serveConfigV2`` of the RayService (the app and its args)
    kuberay.py       Namespace, PVC, RayService (with its endpoint Service), NetworkPolicy
    eksctl.py        the eksctl ClusterConfig (CPU system nodes, one EFA GPU node group in one AZ)
    helm.py          values for the KubeRay operator Helm chart
    yamltext.py      YAML text with the comments that say why
    render.py        ``render(loaded_config, target) -> str``: the one entry point
    cli.py           the ``render`` subcommand

Kept free of heavy imports (ray, vllm, torch), and of imports of :mod:`pdserve.config.schema` at module
level in ``kubernetes.py``, which the schema imports.
"""
