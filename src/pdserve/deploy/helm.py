"""Values for the KubeRay operator Helm chart: a pinned operator image, on the CPU system nodes."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pdserve.deploy import yamltext

if TYPE_CHECKING:
    from pdserve.config.loader import LoadedConfig

CHART_REPO = "https://ray-project.github.io/kuberay-helm/"


def operator_values(loaded: LoadedConfig) -> dict[str, Any]:
    k = loaded.args.kubernetes
    values: dict[str, Any] = {
        "image": {"repository": "quay.io/kuberay/operator", "tag": f"v{k.kuberay_version}"},
        # Same nodes as the Ray head: the GPU nodes are for engines.
        "nodeSelector": k.head.selector(),
    }
    if k.head.tolerations:
        values["tolerations"] = [t.model_dump(exclude_none=True) for t in k.head.tolerations]
    values["resources"] = {"requests": {"cpu": "100m", "memory": "512Mi"}, "limits": {"cpu": "1", "memory": "512Mi"}}
    return values


def render_helm_values(loaded: LoadedConfig, header: str) -> str:
    k = loaded.args.kubernetes
    header += (
        f"\n3. helm repo add kuberay {CHART_REPO} && helm repo update"
        f"\n   helm install kuberay-operator kuberay/kuberay-operator --version {k.kuberay_version} "
        f"--namespace {k.operator_namespace} --create-namespace -f <this file>"
    )
    return yamltext.dump_all([operator_values(loaded)], header=header)
