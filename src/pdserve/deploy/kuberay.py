"""KubeRay manifests of an app: Namespace, weight-cache PVC, RayService (with its Service), NetworkPolicy.

One RayService holds the Ray cluster (a head group on a CPU node, a prefill and a decode worker group on
GPU nodes with EFA) and the Serve app (see :mod:`pdserve.deploy.serve_config`). The endpoint's Service is
the RayService's ``serveService``: KubeRay keeps its selector on the proxies of the active cluster, which a
hand-written Service could not do across a cluster upgrade.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from pdserve.deploy import yamltext
from pdserve.deploy.placement import ROLES, Role, group_size, role_resource
from pdserve.deploy.serve_config import serve_config

if TYPE_CHECKING:
    from pdserve.config.kubernetes import KubernetesConfig, WorkerGroupConfig
    from pdserve.config.loader import LoadedConfig

#: Ports on the head that the KubeRay operator (another namespace) calls: the dashboard (Serve config and
#: status) and the dashboard agent.
OPERATOR_PORTS = (8265, 52365)

PRIVILEGED = (
    "privileged: NIXL registers GPU memory with the EFA device for RDMA; IPC_LOCK alone is not enough.\n"
    "A privileged container sees every GPU of its node, hence one worker pod per node asking for all."
)
INGRESS = (
    "1. Ray (GCS 6379, raylets, object transfer), the engines' HTTP ports and the NIXL side channels\n"
    "   (from port {nixl}): only between this app's pods.\n"
    "2. The OpenAI endpoint (Serve HTTP, port {serve}): from anywhere.\n"
    "3. The KubeRay operator: the head's dashboard ports.\n"
    "KV blocks move over EFA's OS-bypass path, which NetworkPolicies do not filter (the EFA security group does)."
)
COMMENTS: list[yamltext.Comment] = [
    (r"\s*privileged: true", PRIVILEGED),
    (r"\s*resources: '.*pdserve_(prefill|decode).*'",
     "This role's engine replicas ask for one unit each, so they run only in this group."),
    (r"\s*- name: VLLM_HOST_IP",
     "vLLM and NIXL advertise this address to the other pods: the pod IP, not a node or loopback one."),
    (r"\s*serveConfigV2: \|.*",
     "The app: pdserve's builder with the config file's args (its kubernetes section left out)."),
    (r"\s*ingress:", INGRESS),
]

UPGRADE_NONE = (
    "None: a changed cluster spec needs delete + apply (the GPU nodes have no room for a second cluster).\n"
    "serveConfigV2 changes apply in place."
)


def _quantities(cpu: str, memory: str, extra: dict[str, int] | None = None) -> dict[str, Any]:
    res: dict[str, Any] = {"cpu": cpu, "memory": memory, **(extra or {})}
    return {"limits": dict(res), "requests": dict(res)}


def _tolerations(items: list[Any]) -> list[dict[str, Any]]:
    return [t.model_dump(exclude_none=True) for t in items]


def _secret_env(name: str, secret: str, key: str | None = None) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": key or name}}}


def _common_env(loaded: LoadedConfig) -> list[dict[str, Any]]:
    """Environment of every Ray container: the router's replicas may run on any pod."""
    k = loaded.args.kubernetes
    env: list[dict[str, Any]] = []
    if (ref := k.api_keys_secret) is not None:
        # The keys reach the router only this way; the Serve config carries none (see render.py).
        env.append(_secret_env(loaded.args.router.api_keys_env, ref.name, ref.key))
    return env


def _head_group(loaded: LoadedConfig) -> dict[str, Any]:
    k = loaded.args.kubernetes
    h = k.head
    container: dict[str, Any] = {
        "name": "ray-head",
        "image": k.image,
        "ports": [
            {"containerPort": 6379, "name": "gcs-server"},
            {"containerPort": 8265, "name": "dashboard"},
            {"containerPort": 10001, "name": "client"},
            {"containerPort": k.serve_port, "name": "serve"},
        ],
        "resources": _quantities(h.cpu, h.memory),
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],
    }
    if env := _common_env(loaded):
        container["env"] = env
    spec: dict[str, Any] = {"nodeSelector": h.selector()}
    if h.tolerations:
        spec["tolerations"] = _tolerations(h.tolerations)
    spec["containers"] = [container]
    spec["volumes"] = [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": h.shm_size}}]
    return {
        # No GPU here: the head runs the Serve controller and proxies, and may run the router.
        "rayStartParams": {"dashboard-host": "0.0.0.0", "num-gpus": "0"},
        "template": {"metadata": {"labels": k.labels("head")}, "spec": spec},
    }


def _cache_volume(k: KubernetesConfig) -> dict[str, Any]:
    c = k.cache
    if c.kind == "hostPath":
        return {"name": "model-cache", "hostPath": {"path": c.host_path, "type": "DirectoryOrCreate"}}
    return {"name": "model-cache", "persistentVolumeClaim": {"claimName": c.claim_name or f"{k.name}-model-cache"}}


def _worker_env(loaded: LoadedConfig, w: WorkerGroupConfig) -> list[dict[str, Any]]:
    k = loaded.args.kubernetes
    env: list[dict[str, Any]] = [
        {"name": "VLLM_HOST_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        # NIXL's LIBFABRIC backend on the EFA provider.
        {"name": "FI_PROVIDER", "value": "efa"},
        {"name": "FI_EFA_FORK_SAFE", "value": "1"},
        {"name": "HF_HOME", "value": f"{k.cache.mount_path}/huggingface"},
        {"name": "PDSERVE_CACHE_DIR", "value": f"{k.cache.mount_path}/pdserve"},
        # vLLM's torch.compile / Inductor / Triton artifacts: a restarted pod skips the compilation.
        {"name": "VLLM_CACHE_ROOT", "value": f"{k.cache.mount_path}/vllm"},
    ]
    if k.hf_token_secret:
        env.append(_secret_env("HF_TOKEN", k.hf_token_secret))
    env += _common_env(loaded)
    env += [{"name": n, "value": v} for n, v in k.extra_env.items()]
    return env


def _worker_group(role: Role, loaded: LoadedConfig) -> dict[str, Any]:
    k = loaded.args.kubernetes
    w = k.prefill if role == "prefill" else k.decode
    size = group_size(role, loaded.args)
    container = {
        "name": "ray-worker",
        "image": k.image,
        "securityContext": {"privileged": True},
        "env": _worker_env(loaded, w),
        "resources": _quantities(w.cpu, w.memory, {"nvidia.com/gpu": w.gpus, "vpc.amazonaws.com/efa": w.efa_devices}),
        "volumeMounts": [
            {"name": "dshm", "mountPath": "/dev/shm"},
            {"name": "model-cache", "mountPath": k.cache.mount_path},
        ],
    }
    spec: dict[str, Any] = {"nodeSelector": w.selector()}
    if w.tolerations:
        spec["tolerations"] = _tolerations(w.tolerations)
    spec["containers"] = [container]
    spec["volumes"] = [
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": w.shm_size}},
        _cache_volume(k),
    ]
    resources = json.dumps({role_resource(role): size.engines_per_pod})
    return {
        "groupName": role,
        "replicas": size.replicas,
        "minReplicas": size.min_replicas,
        "maxReplicas": size.max_replicas,
        "rayStartParams": {
            "num-gpus": str(w.gpus),
            # KubeRay passes this through a shell: the outer double quotes keep the JSON one word.
            "resources": json.dumps(resources),
        },
        "template": {"metadata": {"labels": k.labels(role)}, "spec": spec},
    }


def rayservice(loaded: LoadedConfig) -> dict[str, Any]:
    k = loaded.args.kubernetes
    cluster: dict[str, Any] = {"rayVersion": k.ray_version}
    if any(group_size(r, loaded.args).autoscales for r in ROLES):
        cluster["enableInTreeAutoscaling"] = True
    cluster["headGroupSpec"] = _head_group(loaded)
    cluster["workerGroupSpecs"] = [_worker_group(r, loaded) for r in ROLES]
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayService",
        "metadata": {"name": k.name, "namespace": k.namespace, "labels": k.labels()},
        "spec": {
            "upgradeStrategy": {"type": k.upgrade_strategy},
            "serveService": serve_service(k),
            "rayClusterConfig": cluster,
            "serveConfigV2": yamltext.dump(serve_config(loaded)),
        },
    }


def serve_service(k: KubernetesConfig) -> dict[str, Any]:
    """The endpoint's Service (KubeRay fills in the selector)."""
    meta: dict[str, Any] = {"name": f"{k.name}-serve-svc", "namespace": k.namespace, "labels": k.labels("serve")}
    if k.service.annotations:
        meta["annotations"] = dict(k.service.annotations)
    return {
        "metadata": meta,
        "spec": {
            "type": k.service.type,
            "ports": [{"name": "serve", "port": k.serve_port, "targetPort": k.serve_port, "protocol": "TCP"}],
        },
    }


def network_policy(loaded: LoadedConfig) -> dict[str, Any]:
    k = loaded.args.kubernetes
    app = {"matchLabels": k.labels()}
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": f"{k.name}-internal", "namespace": k.namespace, "labels": k.labels()},
        "spec": {
            "podSelector": app,
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [{"podSelector": app}]},
                {"ports": [{"protocol": "TCP", "port": k.serve_port}]},
                {
                    "from": [{"namespaceSelector": {
                        "matchLabels": {"kubernetes.io/metadata.name": k.operator_namespace}}}],
                    "ports": [{"protocol": "TCP", "port": p} for p in OPERATOR_PORTS],
                },
            ],
        },
    }


def namespace(k: KubernetesConfig) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": k.namespace, "labels": k.labels()}}


def cache_claim(k: KubernetesConfig) -> dict[str, Any]:
    spec: dict[str, Any] = {
        # Prefill and decode pods on different nodes read the same weights.
        "accessModes": ["ReadWriteMany"],
        "resources": {"requests": {"storage": k.cache.size}},
    }
    if k.cache.storage_class:
        spec["storageClassName"] = k.cache.storage_class
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": f"{k.name}-model-cache", "namespace": k.namespace, "labels": k.labels()},
        "spec": spec,
    }


def manifests(loaded: LoadedConfig) -> list[dict[str, Any]]:
    """Every object, in the order ``kubectl apply`` needs them."""
    k = loaded.args.kubernetes
    docs: list[dict[str, Any]] = []
    if k.namespace != "default":
        docs.append(namespace(k))
    if k.cache.kind == "pvc" and k.cache.claim_name is None:
        docs.append(cache_claim(k))
    docs.append(rayservice(loaded))
    if k.network_policy:
        docs.append(network_policy(loaded))
    return docs


def render_kuberay(loaded: LoadedConfig, header: str) -> str:
    k = loaded.args.kubernetes
    comments = [(p, c.format(nixl=loaded.args.nixl.side_channel_port_base, serve=k.serve_port))
                for p, c in COMMENTS]
    if k.upgrade_strategy == "None":
        comments.append((r"\s*upgradeStrategy:", UPGRADE_NONE))
    header += (f"\nApply: kubectl apply -f <this file>; the endpoint is Service {k.name}-serve-svc, "
               f"port {k.serve_port}.")
    return yamltext.dump_all(manifests(loaded), header=header, comments=comments)
