"""The ``serveConfigV2`` of the RayService: pdserve's builder with the config file's own args.

The args are what the file set (defaults are left to the builder), less the ``kubernetes`` section and
``cache_dir`` (the pods' cache is the volume ``kubernetes.cache`` mounts), plus two things the cluster needs:

* ``nixl.backend: LIBFABRIC`` unless the file chose a backend: NIXL reaches EFA through libfabric.
* each role's replicas ask for one unit of their worker group's custom resource (see
  :mod:`pdserve.deploy.placement`), unless the file already set ``ray_actor_options``. When a replica is a
  placement group (tensor or pipeline parallel, or ``placement_group_config``), the unit goes into the
  first bundle, where Ray Serve puts the replica actor.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pdserve.config.resources import multi_gpu_placement
from pdserve.deploy.placement import ROLES, role_resource

if TYPE_CHECKING:
    from pdserve.config.loader import LoadedConfig
    from pdserve.config.schema import PDServeArgs

IMPORT_PATH = "pdserve:build_pd_openai_app"


def embedded_args(args: PDServeArgs) -> dict[str, Any]:
    """The ``args:`` of the Serve application (JSON-able; validates as :class:`PDServeArgs`)."""
    # cache_dir names a directory on the host that wrote the file; pods use the cache volume
    # (PDSERVE_CACHE_DIR, HF_HOME and VLLM_CACHE_ROOT under kubernetes.cache.mount_path).
    data: dict[str, Any] = args.model_dump(mode="json", exclude_unset=True, exclude={"kubernetes", "cache_dir"})
    data.setdefault("nixl", {}).setdefault("backend", "LIBFABRIC")
    for role in ROLES:
        key = f"{role}_config"
        llm = getattr(args, key)
        if llm.deployment_config.ray_actor_options is not None:
            continue  # the file places its replicas itself
        resource = role_resource(role)
        cfg = data.setdefault(key, {})
        cfg.setdefault("deployment_config", {})["ray_actor_options"] = {"resources": {resource: 1}}
        pg = cfg.get("placement_group_config")
        if pg is None:
            # What the builder reserves for a multi-GPU engine, made explicit to carry the resource.
            pg = multi_gpu_placement(llm)
            if pg is not None:
                cfg["placement_group_config"] = pg
        if pg is not None:
            pg["bundles"][0][resource] = 1
    return data


def serve_config(loaded: LoadedConfig) -> dict[str, Any]:
    """The Serve config (``serve deploy`` shape) that the RayService embeds as text."""
    k = loaded.args.kubernetes
    return {
        "proxy_location": "EveryNode",
        "http_options": {"host": "0.0.0.0", "port": k.serve_port},
        "applications": [
            {
                "name": loaded.app_name,
                "route_prefix": loaded.route_prefix,
                "import_path": IMPORT_PATH,
                "args": embedded_args(loaded.args),
            }
        ],
    }
