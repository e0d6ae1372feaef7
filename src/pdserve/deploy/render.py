"""``render(loaded_config, target) -> str``: the manifests of one target, as YAML text.

Targets, in the order the deployment uses them (docs/deploy-eks.md):

    eksctl        the EKS cluster: CPU system nodes, one EFA GPU node group in one zone
    helm-values   values for the KubeRay operator Helm chart
    kuberay       Namespace, weight-cache PVC, RayService (with its Service), NetworkPolicy

No target writes a secret. A manifest is read by whoever can read the object, and the RayService's Serve
config also by whoever reaches the Ray dashboard, so API keys come from a Secret (``kubernetes.api_keys_secret``)
and every target refuses a config that names them in clear.
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


def _refuse_keys_in_clear(loaded: LoadedConfig, source: str) -> None:
    args = loaded.args
    k = args.kubernetes
    env = args.router.api_keys_env
    if args.router.api_keys:
        where = "router.api_keys"
    elif env in k.extra_env:
        where = f"kubernetes.extra_env.{env}"
    else:
        return
    secret = k.api_keys_secret.name if k.api_keys_secret else f"{k.name}-api-keys"
    raise ConfigError(
        f"{source}: {where}: API keys would be written in clear into the rendered manifests (the RayService "
        "and its Serve config, which anyone who can read the object or reach the Ray dashboard can read). "
        f"Remove {where} and keep the keys in a Secret instead:\n"
        f"  kubectl -n {k.namespace} create secret generic {secret} --from-literal={env}=KEY1,KEY2\n"
        f"then name it in the config:\n"
        f"  kubernetes:\n"
        f"    api_keys_secret: {{name: {secret}, key: {env}}}\n"
        f"The Ray pods get {env} from the Secret (secretKeyRef) and the router reads the keys from it."
    )


def render(loaded: LoadedConfig, target: str) -> str:
    """YAML text of ``target`` for ``loaded``.

    Raises :class:`ConfigError` for an unknown target, or when the config holds API keys in clear.
    """
    try:
        fn = TARGETS[target]
    except KeyError:
        raise ConfigError(f"unknown render target {target!r}; valid: {', '.join(TARGETS)}") from None
    source = Path(loaded.source).name if not loaded.source.startswith("<") else loaded.source
    _refuse_keys_in_clear(loaded, source)
    header = f"Rendered by `pdserve render {source} --target {target}`: edit the config and render again."
    return fn(loaded, header)
