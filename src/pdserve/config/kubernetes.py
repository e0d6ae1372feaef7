"""The ``kubernetes:`` section of a pdserve config: where ``pdserve render`` puts the app.

Read by :mod:`pdserve.deploy` (the manifests) and by the doctor (EFA devices per worker pod).

Nothing here reaches the router or the engines (the section is removed from the args embedded in the
RayService). The defaults describe the seed deployment: EKS in us-west-2, one m7i.xlarge CPU node for the
Ray head and the KubeRay operator, one g6.8xlarge (1x L4, 1 EFA interface) per prefill or decode engine.

This module is imported by :mod:`pdserve.config.schema`, so it must not import it back.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pdserve._version import __version__

#: Ray in the cluster image; equal to the ``ray[serve]`` pin in pyproject.toml (a test checks).
RAY_VERSION = "2.60.0"
#: KubeRay operator (Helm chart and image). The manifests use only fields KubeRay has had since v1.3.
KUBERAY_VERSION = "1.5.2"
#: The tag docker/Dockerfile.gpu is built as (docker/README.md); push it to a registry and name that copy.
DEFAULT_IMAGE = f"pdserve:{__version__}"

_DNS_LABEL = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
# A Kubernetes resource quantity as people write them: 2, 500m, 8Gi, 1.5G.
_QUANTITY = r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|Ki|Mi|Gi|Ti|Pi)?$"
# Names of Secrets (DNS subdomains) and the keys of their data.
_DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"
_SECRET_KEY = r"^[-._a-zA-Z0-9]+$"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True)


class Toleration(_Strict):
    """One toleration of a pod (Kubernetes' own keys)."""

    key: str | None = Field(None, description="Taint key; empty with operator `Exists` tolerates every taint.")
    operator: Literal["Exists", "Equal"] = Field("Exists", description="`Exists` (any value) or `Equal`.")
    value: str | None = Field(None, description="Taint value, with operator `Equal`.")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        None, description="Taint effect; empty matches every effect."
    )


class HeadConfig(_Strict):
    """The Ray head pod: on a CPU node (no GPU); runs the Serve controller and proxies, often the router."""

    instance_type: str = Field("m7i.xlarge", description="EC2 instance type of the CPU system node group.")
    node_selector: dict[str, str] | None = Field(
        None, description="Node labels the pod must match; empty: `node.kubernetes.io/instance-type: <instance_type>`."
    )
    tolerations: list[Toleration] = Field(default_factory=list, description="Tolerations of the head pod.")
    cpu: str = Field("2", pattern=_QUANTITY, description="CPU request and limit of the head container.")
    memory: str = Field("8Gi", pattern=_QUANTITY, description="Memory request and limit of the head container.")
    shm_size: str = Field("2Gi", pattern=_QUANTITY, description="Size of /dev/shm (memory-backed emptyDir).")

    def selector(self) -> dict[str, str]:
        return dict(self.node_selector) if self.node_selector is not None else {
            "node.kubernetes.io/instance-type": self.instance_type}


class WorkerGroupConfig(_Strict):
    """One GPU worker group (prefill or decode): a Ray worker pod that takes a whole GPU node."""

    instance_type: str = Field(
        "g6.8xlarge",
        description="EC2 instance type of the GPU nodes. Prefill and decode share one EFA node group, so equal.",
    )
    node_selector: dict[str, str] | None = Field(
        None, description="Node labels the pod must match; empty: `node.kubernetes.io/instance-type: <instance_type>`."
    )
    tolerations: list[Toleration] = Field(
        default_factory=lambda: [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        description="Tolerations of the worker pods (the default tolerates the usual GPU-node taint).",
    )
    gpus: int = Field(
        1, ge=1,
        description=(
            "`nvidia.com/gpu` per worker pod. The pod is privileged and sees every GPU of its node, so ask "
            "for all of them."
        ),
    )
    efa_devices: int = Field(1, ge=1, description="`vpc.amazonaws.com/efa` interfaces per worker pod.")
    cpu: str = Field("28", pattern=_QUANTITY, description="CPU request and limit of the worker container.")
    memory: str = Field("112Gi", pattern=_QUANTITY, description="Memory request and limit of the worker container.")
    shm_size: str = Field(
        "32Gi", pattern=_QUANTITY,
        description="Size of /dev/shm (memory-backed emptyDir; Ray's object store and NIXL use it).",
    )

    def selector(self) -> dict[str, str]:
        return dict(self.node_selector) if self.node_selector is not None else {
            "node.kubernetes.io/instance-type": self.instance_type}


class CacheConfig(_Strict):
    """Where engines keep downloaded weights (HF_HOME), so a restarted pod does not download them again."""

    kind: Literal["hostPath", "pvc"] = Field(
        "hostPath",
        description=(
            "`hostPath`: a directory on each GPU node's root volume. `pvc`: a PersistentVolumeClaim shared "
            "by all workers (needs a ReadWriteMany storage class, e.g. EFS or FSx for Lustre)."
        ),
    )
    host_path: str = Field("/opt/pdserve/cache", description="Node directory, with kind `hostPath`.")
    claim_name: str | None = Field(
        None, description="With kind `pvc`: an existing claim to use. Empty: render one named `<name>-model-cache`."
    )
    storage_class: str | None = Field(
        None, description="Storage class of the rendered claim; empty: the cluster's default."
    )
    size: str = Field("200Gi", pattern=_QUANTITY, description="Size of the rendered claim.")
    mount_path: str = Field("/models", description="Where the volume is mounted in the worker containers.")


class SecretKeyRef(_Strict):
    """One key of a Secret in the app's namespace; the pods get its value as an environment variable."""

    name: str = Field(..., pattern=_DNS_SUBDOMAIN, max_length=253, description="Name of the Secret.")
    key: str | None = Field(
        None, pattern=_SECRET_KEY, max_length=253,
        description="Key in the Secret's data; empty: the name of the environment variable it fills.",
    )


class ServiceConfig(_Strict):
    """The Kubernetes Service of the OpenAI endpoint (KubeRay points it at the active cluster's proxies)."""

    type: Literal["ClusterIP", "LoadBalancer", "NodePort"] = Field(
        "ClusterIP", description="`ClusterIP` (reach it with kubectl port-forward or an Ingress) or `LoadBalancer`."
    )
    annotations: dict[str, str] = Field(
        default_factory=dict,
        description="Service annotations, e.g. `service.beta.kubernetes.io/aws-load-balancer-scheme: internal`.",
    )


class KubernetesConfig(_Strict):
    """Cluster-specific values for `pdserve render` (KubeRay RayService, eksctl ClusterConfig, Helm values)."""

    name: str = Field(
        "pdserve", pattern=_DNS_LABEL, max_length=40,
        description="Name of the RayService; prefixes the other objects' names.",
    )
    namespace: str = Field("pdserve", pattern=_DNS_LABEL, max_length=63, description="Namespace of the app.")
    image: str = Field(
        DEFAULT_IMAGE,
        description=(
            "Image of the head and the workers: Ray `ray_version`, pdserve with its `gpu` extra, and libfabric "
            "with the EFA provider, as docker/Dockerfile.gpu builds it (see docker/README.md). Push it to a "
            "registry the nodes can pull from and name that copy here."
        ),
    )
    ray_version: str = Field(RAY_VERSION, description="Ray version in the image (RayCluster `rayVersion`).")
    head: HeadConfig = Field(default_factory=HeadConfig, description="The Ray head pod (CPU node).")
    prefill: WorkerGroupConfig = Field(default_factory=WorkerGroupConfig, description="Prefill worker pods.")
    decode: WorkerGroupConfig = Field(default_factory=WorkerGroupConfig, description="Decode worker pods.")
    cache: CacheConfig = Field(default_factory=CacheConfig, description="Model and weight cache volume.")
    service: ServiceConfig = Field(default_factory=ServiceConfig, description="The endpoint's Service.")
    serve_port: int = Field(8000, ge=1, le=65535, description="Ray Serve HTTP port (the OpenAI endpoint).")
    network_policy: bool = Field(
        True,
        description=(
            "Render a NetworkPolicy: Ray, engine and NIXL ports open only between the app's pods; from "
            "elsewhere only `serve_port` (and the dashboard, for the KubeRay operator)."
        ),
    )
    upgrade_strategy: Literal["None", "NewCluster"] = Field(
        "None",
        description=(
            "How KubeRay applies a changed cluster spec. `NewCluster`: a second cluster, then a switch (needs "
            "spare GPU nodes for it). `None`: delete and apply again. Serve config changes apply in place either way."
        ),
    )
    extra_env: dict[str, str] = Field(
        default_factory=dict,
        description="More environment for the worker containers (libfabric, NIXL, vLLM), e.g. `FI_LOG_LEVEL: info`.",
    )
    hf_token_secret: str | None = Field(
        None, description="Secret in the namespace whose key `HF_TOKEN` the workers get (gated models)."
    )
    api_keys_secret: SecretKeyRef | None = Field(
        None,
        description=(
            "Where the router's API keys come from on the cluster: `{name: SECRET, key: KEY}`, or just the "
            "Secret's name (its key then is the `router.api_keys_env` name, `PDSERVE_API_KEYS`). Every Ray pod "
            "gets the variable `router.api_keys_env` from it (`secretKeyRef`); the keys are comma- or "
            "newline-separated. `pdserve render` refuses `router.api_keys`, which it would have to write in clear."
        ),
    )
    cluster_name: str = Field("pdserve", pattern=_DNS_LABEL, max_length=100, description="EKS cluster name.")
    region: str = Field("us-west-2", description="AWS region.")
    availability_zones: list[str] = Field(
        default_factory=lambda: ["us-west-2a", "us-west-2b"],
        min_length=2,
        description="Availability zones of the cluster's VPC (EKS needs two or more).",
    )
    gpu_availability_zone: str | None = Field(
        None,
        description=(
            "The one zone of the GPU node group (EFA traffic cannot cross zones); empty: the first of "
            "`availability_zones`. Pick one that offers the GPU instance type."
        ),
    )
    kubernetes_version: str = Field("1.34", pattern=r"^1\.[0-9]+$", description="EKS Kubernetes version.")
    system_nodes: int = Field(1, ge=1, description="Nodes in the CPU system node group.")
    system_volume_gib: int = Field(50, ge=20, description="Root volume of each system node, GiB.")
    gpu_volume_gib: int = Field(
        200, ge=50, description="Root volume of each GPU node, GiB (image layers and, with hostPath, weights)."
    )
    kuberay_version: str = Field(KUBERAY_VERSION, description="KubeRay operator version (Helm chart and image).")
    operator_namespace: str = Field(
        "kuberay-system", pattern=_DNS_LABEL, description="Namespace of the KubeRay operator."
    )

    @field_validator("api_keys_secret", mode="before")
    @classmethod
    def _secret_name_alone(cls, v: Any) -> Any:
        return {"name": v} if isinstance(v, str) else v

    @model_validator(mode="after")
    def _zones(self) -> KubernetesConfig:
        wrong = [z for z in self.availability_zones if not z.startswith(self.region)]
        if wrong:
            raise ValueError(f"availability_zones {wrong} are not in region {self.region!r}")
        if self.gpu_availability_zone is not None and self.gpu_availability_zone not in self.availability_zones:
            raise ValueError(
                f"gpu_availability_zone {self.gpu_availability_zone!r} is not one of availability_zones "
                f"{self.availability_zones}"
            )
        return self

    def gpu_zone(self) -> str:
        return self.gpu_availability_zone or self.availability_zones[0]

    def labels(self, component: str | None = None) -> dict[str, str]:
        """Labels of every object and pod of this app (the NetworkPolicy selects pods by them)."""
        out = {"app.kubernetes.io/part-of": "pdserve", "app.kubernetes.io/instance": self.name}
        if component:
            out["app.kubernetes.io/component"] = component
        return out
