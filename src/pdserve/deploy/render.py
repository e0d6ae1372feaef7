"""``render(loaded_config, target) -> str``: the manifests of one target, as YAML text.

Targets, in the order the deployment uses them (docs/deploy-eks.md):

    eksctl        the EKS cluster: CPU system nodes, one EFA GPU node group in one zone
    helm-values   values for the KubeRay operator Helm chart
    kuberay       Namespace, weight-cache PVC, RayService (with its Service), NetworkPolicy
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from pdserve.deploy.eksctl import render_eksctl
from pdserve.deploy.helm import render_helm_values
from pdserve.deploy.kuberay import render_kuberay
from pdserve.errors import ConfigError

if TYPE_CHECKING:
    from pdserve.config.loader import LoadedConfig

TARGETS: dict[str, Callable[[LoadedConfig, str], str]] = {
    "kuberay": render_kuberay,
    "eksctl": render_eksctl,
    "helm-values": render_helm_values,
}


def render(loaded: LoadedConfig, target: str) -> str:
    """YAML text of ``target`` for ``loaded`` (raises :class:`ConfigError` for an unknown target)."""
    try:
        fn = TARGETS[target]
    except KeyError:
        raise ConfigError(f"unknown render target {target!r}; valid: {', '.join(TARGETS)}") from None
    source = Path(loaded.source).name if not loaded.source.startswith("<") else loaded.source
    header = f"Rendered by `pdserve render {source} --target {target}`: edit the config and render again."
    return fn(loaded, header)
