"""The eksctl ClusterConfig: a CPU system node group and one EFA GPU node group in a single zone.

Prefill and decode nodes share the one GPU node group on purpose: EFA traffic cannot leave an availability
zone, and eksctl sets EFA up (its security group) per node group, so one group keeps all GPU nodes together. The node groups carry the
non-well-known labels of the pods' node selectors, so the rendered RayService can land on them.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from pdserve.deploy import yamltext
from pdserve.deploy.placement import ROLES, group_size
from pdserve.errors import ConfigError

if TYPE_CHECKING:
    from pdserve.config.loader import LoadedConfig

NODE_GROUP_LABEL = "pdserve.io/node-group"
SYSTEM_GROUP = "system"
GPU_GROUP = "gpu"

COMMENTS: list[yamltext.Comment] = [
    (r"\s+availabilityZones:",
     "EFA traffic cannot cross availability zones: every GPU node (prefill and decode) in this one."),
    (r"\s+efaEnabled: true",
     "EFA interfaces, their security group and the EFA device plugin (vpc.amazonaws.com/efa)."),
    (r"\s+configurationValues: .*enableNetworkPolicy.*",
     "Enforce NetworkPolicies (the rendered RayService comes with one)."),
]


def _own_labels(selector: dict[str, str]) -> dict[str, str]:
    """Selector labels a node group may set (kubelet owns the kubernetes.io / k8s.io ones)."""
    return {k: v for k, v in selector.items() if "kubernetes.io/" not in k and "k8s.io/" not in k}


def _merge_labels(group: str, *selectors: tuple[str, dict[str, str]]) -> dict[str, str]:
    labels = {NODE_GROUP_LABEL: group}
    for where, sel in selectors:
        for key, value in _own_labels(sel).items():
            if labels.get(key, value) != value:
                raise ConfigError(
                    f"{where}: node label {key}={value} conflicts with {key}={labels[key]} on the same "
                    f"node group {group!r}"
                )
            labels[key] = value
    return labels


def cluster_config(loaded: LoadedConfig) -> dict[str, Any]:
    k = loaded.args.kubernetes
    if k.prefill.instance_type != k.decode.instance_type:
        raise ConfigError(
            f"kubernetes.prefill.instance_type ({k.prefill.instance_type}) and kubernetes.decode.instance_type "
            f"({k.decode.instance_type}) differ; the eksctl target renders one EFA node group for both, so "
            "they must be equal (or write the node groups by hand)"
        )
    sizes = [group_size(r, loaded.args) for r in ROLES]
    vpc_cni: dict[str, Any] = {"name": "vpc-cni"}
    if k.network_policy:
        vpc_cni["configurationValues"] = json.dumps({"enableNetworkPolicy": "true"})
    system = {
        "name": SYSTEM_GROUP,
        "instanceType": k.head.instance_type,
        "amiFamily": "AmazonLinux2023",
        "desiredCapacity": k.system_nodes,
        "minSize": k.system_nodes,
        "maxSize": k.system_nodes,
        "volumeSize": k.system_volume_gib,
        "privateNetworking": True,
        "labels": _merge_labels(SYSTEM_GROUP, ("kubernetes.head.node_selector", k.head.selector())),
    }
    gpu = {
        "name": GPU_GROUP,
        "instanceType": k.prefill.instance_type,
        "amiFamily": "AmazonLinux2023",
        "availabilityZones": [k.gpu_zone()],
        "efaEnabled": True,
        "desiredCapacity": sum(s.replicas for s in sizes),
        "minSize": sum(s.min_replicas for s in sizes),
        "maxSize": sum(s.max_replicas for s in sizes),
        "volumeSize": k.gpu_volume_gib,
        "privateNetworking": True,
        "labels": _merge_labels(
            GPU_GROUP,
            ("kubernetes.prefill.node_selector", k.prefill.selector()),
            ("kubernetes.decode.node_selector", k.decode.selector()),
        ),
    }
    return {
        "apiVersion": "eksctl.io/v1alpha5",
        "kind": "ClusterConfig",
        "metadata": {
            "name": k.cluster_name,
            "region": k.region,
            "version": k.kubernetes_version,
            "tags": {"project": "pdserve"},
        },
        "availabilityZones": list(k.availability_zones),
        "iam": {"withOIDC": True},
        "addons": [vpc_cni, {"name": "coredns"}, {"name": "kube-proxy"}],
        "managedNodeGroups": [system, gpu],
    }


def render_eksctl(loaded: LoadedConfig, header: str) -> str:
    header += (
        "\n1. Cluster (15-20 min):  eksctl create cluster -f <this file> --without-nodegroup"
        f"\n                         eksctl create nodegroup -f <this file> --include={SYSTEM_GROUP}"
        f"\n2. GPU nodes:            eksctl create nodegroup -f <this file> --include={GPU_GROUP}"
        f"\nTeardown, last:          eksctl delete nodegroup -f <this file> --include={GPU_GROUP} --approve"
        "\n                         eksctl delete cluster -f <this file> --wait"
    )
    return yamltext.dump_all([cluster_config(loaded)], header=header, comments=COMMENTS)
