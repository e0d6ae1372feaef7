"""``pdserve render``: manifests checked offline against the KubeRay CRDs, the eksctl schema and Kubernetes'
own schemas (kubernetes-validate), plus golden files for the example.

Golden files (tests/golden/*.yaml) are regenerated with:

    PDSERVE_UPDATE_GOLDEN=1 .venv/bin/python -m pytest -q tests/unit/test_render.py

then reviewed with ``git diff tests/golden``.
"""

from __future__ import annotations

import copy
import difflib
import json
import os
import re
import socket
import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdserve.config.kubernetes import RAY_VERSION
from pdserve.config.loader import LoadedConfig, load_config, parse_args
from pdserve.config.schema import PDServeArgs
from pdserve.deploy import helm, kuberay
from pdserve.deploy.cli import add_render_parser
from pdserve.deploy.render import TARGETS, render
from pdserve.errors import ConfigError
from tests.needs import need

ROOT = Path(__file__).resolve().parents[2]
SCHEMAS = ROOT / ".." / "shared" / "schemas"
EXAMPLE = ROOT / "examples" / "eks.yaml"
GOLDEN = ROOT / "tests" / "golden"
UPDATE = os.environ.get("PDSERVE_UPDATE_GOLDEN") == "1"
REGENERATE = "PDSERVE_UPDATE_GOLDEN=1 .venv/bin/python -m pytest -q tests/unit/test_render.py"


def _loaded(extra: str = "", *, base: Path = EXAMPLE) -> LoadedConfig:
    """The example, with ``extra`` YAML deep-merged over it."""
    data = yaml.safe_load(base.read_text())

    def merge(into: dict[str, Any], new: dict[str, Any]) -> None:
        for k, v in new.items():
            if isinstance(v, dict) and isinstance(into.get(k), dict):
                merge(into[k], v)
            else:
                into[k] = v

    merge(data, yaml.safe_load(textwrap.dedent(extra)) or {})
    return LoadedConfig(args=parse_args(data, source="test.yaml"), source="test.yaml")


def _docs(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(text) if d]


def _by_kind(text: str) -> dict[str, dict[str, Any]]:
    return {d["kind"]: d for d in _docs(text)}


def _embedded_args(rayservice: dict[str, Any]) -> dict[str, Any]:
    serve = yaml.safe_load(rayservice["spec"]["serveConfigV2"])
    (app,) = serve["applications"]
    assert app["import_path"] == "pdserve:build_pd_openai_app"
    return app["args"]


def _group(rayservice: dict[str, Any], name: str) -> dict[str, Any]:
    groups = rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    return next(g for g in groups if g["groupName"] == name)


# --- schemas -------------------------------------------------------------------------------------------


def _require_schemas() -> Path:
    need(SCHEMAS.is_dir(), f"the KubeRay/eksctl schemas at {SCHEMAS.resolve()}",
         "they ship in ../shared/schemas next to the repository")
    return SCHEMAS


def _strict(schema: Any) -> Any:
    """Forbid unknown fields where the CRD lists the fields. The API server would silently drop them
    (structural pruning), so a typo would deploy as a missing setting; here it fails the test."""
    if isinstance(schema, dict):
        if (schema.get("type") == "object" and "properties" in schema and "additionalProperties" not in schema
                and not schema.get("x-kubernetes-preserve-unknown-fields")):
            schema["additionalProperties"] = False
        for v in schema.values():
            _strict(v)
    elif isinstance(schema, list):
        for v in schema:
            _strict(v)
    return schema


def _crd_validator(name: str) -> Any:
    import jsonschema

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    crd = yaml.load((_require_schemas() / "kuberay" / name).read_text(), Loader=loader)
    schema = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")["schema"]["openAPIV3Schema"]
    return jsonschema.Draft7Validator(_strict(schema))


@pytest.fixture(scope="module")
def rayservice_validator() -> Any:
    return _crd_validator("ray.io_rayservices.yaml")


@pytest.fixture(scope="module")
def raycluster_validator() -> Any:
    return _crd_validator("ray.io_rayclusters.yaml")


@pytest.fixture(scope="module")
def eksctl_validator() -> Any:
    import jsonschema

    schema = json.loads((_require_schemas() / "eksctl" / "clusterconfig.v1alpha5.schema.json").read_text())
    return jsonschema.Draft7Validator(schema)


def _errors(validator: Any, obj: dict[str, Any]) -> list[str]:
    return [f"{'.'.join(str(p) for p in e.absolute_path)}: {e.message[:300]}" for e in validator.iter_errors(obj)]


def _check_kuberay(text: str, rs_validator: Any, rc_validator: Any, k8s_version: str) -> None:
    import kubernetes_validate

    for doc in _docs(text):
        if doc["kind"] == "RayService":
            assert not _errors(rs_validator, doc), _errors(rs_validator, doc)
            cluster = {"apiVersion": "ray.io/v1", "kind": "RayCluster", "metadata": {"name": "c"},
                       "spec": doc["spec"]["rayClusterConfig"]}
            assert not _errors(rc_validator, cluster), _errors(rc_validator, cluster)
            service = {"apiVersion": "v1", "kind": "Service", **doc["spec"]["serveService"]}
            kubernetes_validate.validate(service, k8s_version, strict=True)
            PDServeArgs.model_validate(_embedded_args(doc))
        else:
            kubernetes_validate.validate(doc, k8s_version, strict=True)


CASES = {
    "example": "",
    "autoscaling": """
        prefill_config:
          deployment_config: {num_replicas: null, autoscaling_config: {min_replicas: 1, max_replicas: 3}}
        """,
    "pvc-tp2-secrets": """
        prefill_config: {engine_kwargs: {tensor_parallel_size: 2}}
        decode_config: {engine_kwargs: {tensor_parallel_size: 2}}
        kubernetes:
          namespace: default
          cache: {kind: pvc, storage_class: efs-sc}
          prefill: {gpus: 4, efa_devices: 2, node_selector: {pdserve.io/node-group: gpu}}
          decode: {gpus: 4, efa_devices: 2, instance_type: g6.8xlarge}
          head: {tolerations: [{key: dedicated, operator: Equal, value: system, effect: NoSchedule}]}
          service: {type: LoadBalancer, annotations: {service.beta.kubernetes.io/aws-load-balancer-scheme: internal}}
          hf_token_secret: hf
          api_keys_secret: keys
          extra_env: {FI_EFA_USE_DEVICE_RDMA: "1"}
          upgrade_strategy: NewCluster
          network_policy: false
        """,
}


@pytest.mark.parametrize("case", list(CASES))
def test_kuberay_validates_against_crds_and_k8s_schemas(case, rayservice_validator, raycluster_validator):
    loaded = _loaded(CASES[case])
    _check_kuberay(render(loaded, "kuberay"), rayservice_validator, raycluster_validator,
                   loaded.args.kubernetes.kubernetes_version)


def test_default_config_renders_valid_manifests(rayservice_validator, raycluster_validator, eksctl_validator):
    loaded = load_config(None)
    _check_kuberay(render(loaded, "kuberay"), rayservice_validator, raycluster_validator, "1.34")
    assert not _errors(eksctl_validator, yaml.safe_load(render(loaded, "eksctl")))


def test_strict_crd_check_catches_a_misspelt_field(rayservice_validator):
    doc = kuberay.rayservice(_loaded())
    bad = copy.deepcopy(doc)
    bad["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]["nodeSelektor"] = {}
    assert not _errors(rayservice_validator, doc)
    assert any("nodeSelektor" in e for e in _errors(rayservice_validator, bad))


@pytest.mark.parametrize("case", list(CASES))
def test_eksctl_validates_against_schema(case, eksctl_validator):
    text = render(_loaded(CASES[case]), "eksctl")
    cfg = yaml.safe_load(text)
    assert not _errors(eksctl_validator, cfg), _errors(eksctl_validator, cfg)


def test_kubernetes_validate_needs_no_network(monkeypatch):
    import kubernetes_validate

    def no_network(*a: Any, **kw: Any) -> None:
        raise AssertionError("kubernetes-validate tried to use the network")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    policy = kuberay.network_policy(_loaded())
    kubernetes_validate.validate(policy, "1.34", strict=True)
    policy["spec"]["podSelektor"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(policy, "1.34", strict=True)


# --- what the RayService says --------------------------------------------------------------------------


def test_rayservice_shape():
    docs = _by_kind(render(_loaded(), "kuberay"))
    assert list(docs) == ["Namespace", "RayService", "NetworkPolicy"]
    rs = docs["RayService"]
    head = rs["spec"]["rayClusterConfig"]["headGroupSpec"]
    (hc,) = head["template"]["spec"]["containers"]
    assert "nvidia.com/gpu" not in hc["resources"]["limits"] and head["rayStartParams"]["num-gpus"] == "0"
    assert head["template"]["spec"]["nodeSelector"] == {"node.kubernetes.io/instance-type": "m7i.xlarge"}
    for role in ("prefill", "decode"):
        g = _group(rs, role)
        assert (g["replicas"], g["minReplicas"], g["maxReplicas"]) == (1, 1, 1)
        assert json.loads(json.loads(g["rayStartParams"]["resources"])) == {f"pdserve_{role}": 1}
        spec = g["template"]["spec"]
        (c,) = spec["containers"]
        assert c["securityContext"] == {"privileged": True}
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert c["resources"]["limits"]["vpc.amazonaws.com/efa"] == 1
        assert c["resources"]["limits"] == c["resources"]["requests"]
        env = {e["name"]: e for e in c["env"]}
        assert env["VLLM_HOST_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        assert env["FI_PROVIDER"]["value"] == "efa"
        assert env["HF_HOME"]["value"] == "/models/huggingface"
        vols = {v["name"]: v for v in spec["volumes"]}
        assert vols["dshm"]["emptyDir"]["medium"] == "Memory"
        assert vols["model-cache"]["hostPath"]["path"] == "/opt/pdserve/cache"
        assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
        assert spec["nodeSelector"] == {"node.kubernetes.io/instance-type": "g6.8xlarge"}
        assert spec["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    svc = rs["spec"]["serveService"]
    assert svc["metadata"]["name"] == "pdserve-serve-svc" and svc["spec"]["ports"][0]["port"] == 8000


def test_privileged_has_its_reason_right_above():
    lines = render(_loaded(), "kuberay").splitlines()
    hits = [i for i, line in enumerate(lines) if line.strip() == "privileged: true"]
    assert len(hits) == 2
    for i in hits:
        above = " ".join(lines[i - 2:i])
        assert lines[i - 1].lstrip().startswith("#") and "EFA" in above and "IPC_LOCK" in above


def test_embedded_args():
    loaded = _loaded()
    args = _embedded_args(kuberay.rayservice(loaded))
    assert "kubernetes" not in args
    parsed = PDServeArgs.model_validate(args)
    assert parsed.nixl.backend == "LIBFABRIC"
    assert parsed.prefill_config.engine_kwargs == {"max_model_len": 4096}
    assert parsed.prefill_config.deployment_config.ray_actor_options == {"resources": {"pdserve_prefill": 1}}
    assert parsed.decode_config.deployment_config.ray_actor_options == {"resources": {"pdserve_decode": 1}}
    # The rendering does not change the loaded config.
    assert loaded.args.prefill_config.deployment_config.ray_actor_options is None


def test_embedded_args_keep_the_files_own_choices():
    loaded = _loaded("""
        nixl: {backend: UCX}
        decode_config: {deployment_config: {ray_actor_options: {num_gpus: 1, resources: {mine: 1}}}}
        """)
    args = PDServeArgs.model_validate(_embedded_args(kuberay.rayservice(loaded)))
    assert args.nixl.backend == "UCX"
    assert args.decode_config.deployment_config.ray_actor_options == {"num_gpus": 1, "resources": {"mine": 1}}
    assert args.prefill_config.deployment_config.ray_actor_options == {"resources": {"pdserve_prefill": 1}}


def test_default_nixl_backend_becomes_libfabric():
    args = _embedded_args(kuberay.rayservice(_loaded(base=ROOT / "examples" / "default.yaml")))
    assert args["nixl"] == {"backend": "LIBFABRIC"}


def test_multi_gpu_engine_carries_the_resource_in_its_first_bundle():
    loaded = _loaded("""
        prefill_config: {engine_kwargs: {tensor_parallel_size: 2}}
        kubernetes: {prefill: {gpus: 4}}
        """)
    rs = kuberay.rayservice(loaded)
    pg = PDServeArgs.model_validate(_embedded_args(rs)).prefill_config.placement_group_config
    assert pg is not None and pg.strategy == "STRICT_PACK"
    assert pg.bundles == [{"GPU": 1, "CPU": 1, "pdserve_prefill": 1}, {"GPU": 1, "CPU": 1}]
    # Two TP=2 engines fit on a 4-GPU pod.
    assert json.loads(json.loads(_group(rs, "prefill")["rayStartParams"]["resources"])) == {"pdserve_prefill": 2}


def test_autoscaling_sizes_the_worker_group():
    loaded = _loaded("""
        decode_config:
          deployment_config:
            num_replicas: null
            autoscaling_config: {min_replicas: 1, initial_replicas: 2, max_replicas: 4}
        """)
    rs = kuberay.rayservice(loaded)
    g = _group(rs, "decode")
    assert (g["replicas"], g["minReplicas"], g["maxReplicas"]) == (2, 1, 4)
    assert rs["spec"]["rayClusterConfig"]["enableInTreeAutoscaling"] is True
    gpu = yaml.safe_load(render(loaded, "eksctl"))["managedNodeGroups"][1]
    assert (gpu["desiredCapacity"], gpu["minSize"], gpu["maxSize"]) == (3, 2, 5)


def test_fixed_replicas_do_not_turn_on_the_autoscaler():
    assert "enableInTreeAutoscaling" not in kuberay.rayservice(_loaded())["spec"]["rayClusterConfig"]


def test_pvc_cache():
    docs = _by_kind(render(_loaded("kubernetes: {cache: {kind: pvc, size: 500Gi}}"), "kuberay"))
    pvc = docs["PersistentVolumeClaim"]
    assert pvc["metadata"]["name"] == "pdserve-model-cache"
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"] and pvc["spec"]["resources"]["requests"]["storage"] == "500Gi"
    vols = {v["name"]: v for v in _group(docs["RayService"], "decode")["template"]["spec"]["volumes"]}
    assert vols["model-cache"] == {"name": "model-cache", "persistentVolumeClaim": {"claimName": "pdserve-model-cache"}}
    existing = _by_kind(render(_loaded("kubernetes: {cache: {kind: pvc, claim_name: weights}}"), "kuberay"))
    assert "PersistentVolumeClaim" not in existing


def test_network_policy_opens_only_the_endpoint_to_other_namespaces():
    policy = kuberay.network_policy(_loaded())
    app = {"matchLabels": {"app.kubernetes.io/part-of": "pdserve", "app.kubernetes.io/instance": "pdserve"}}
    assert policy["spec"]["podSelector"] == app
    internal, endpoint, operator = policy["spec"]["ingress"]
    assert internal == {"from": [{"podSelector": app}]}  # every port, this app's pods only
    assert endpoint == {"ports": [{"protocol": "TCP", "port": 8000}]}
    assert operator["from"] == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kuberay-system"}}}]
    assert {p["port"] for p in operator["ports"]} == {8265, 52365}
    # Every pod of the RayService carries the labels the policy selects.
    rs = kuberay.rayservice(_loaded())
    templates = [rs["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]] + [
        g["template"] for g in rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]]
    for t in templates:
        assert app["matchLabels"].items() <= t["metadata"]["labels"].items()
    assert "from port 5600" in render(_loaded(), "kuberay")


def test_secrets_and_extra_env():
    rs = kuberay.rayservice(_loaded("""
        router: {api_keys_env: MY_KEYS}
        kubernetes: {hf_token_secret: hf, api_keys_secret: keys, extra_env: {FI_LOG_LEVEL: warn}}
        """))
    (c,) = _group(rs, "prefill")["template"]["spec"]["containers"]
    env = {e["name"]: e for e in c["env"]}
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf", "key": "HF_TOKEN"}
    assert env["MY_KEYS"]["valueFrom"]["secretKeyRef"] == {"name": "keys", "key": "MY_KEYS"}
    assert env["FI_LOG_LEVEL"]["value"] == "warn"
    (hc,) = rs["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"]
    assert [e["name"] for e in hc["env"]] == ["MY_KEYS"]  # the router may run on the head


def test_api_keys_secret_with_its_own_key():
    rs = kuberay.rayservice(_loaded("kubernetes: {api_keys_secret: {name: gateway-keys, key: tokens}}"))
    (hc,) = rs["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"]
    assert hc["env"] == [{"name": "PDSERVE_API_KEYS",
                          "valueFrom": {"secretKeyRef": {"name": "gateway-keys", "key": "tokens"}}}]
    with pytest.raises(ConfigError, match=r"api_keys_secret\.name"):
        _loaded("kubernetes: {api_keys_secret: {name: Not_A_Name}}")
    with pytest.raises(ConfigError, match=r"api_keys_secret\.name.*Field required"):
        _loaded("kubernetes: {api_keys_secret: {key: tokens}}")


@pytest.mark.parametrize("target", list(TARGETS))
def test_render_refuses_inline_api_keys(target):
    loaded = _loaded("router: {api_keys: [sk-inline-1234]}")
    with pytest.raises(ConfigError) as e:
        render(loaded, target)
    msg = str(e.value)
    assert msg.startswith("test.yaml: router.api_keys: API keys would be written in clear")
    assert "sk-inline-1234" not in msg
    # It says what to do instead: the Secret, the command that makes it and the field that names it.
    assert "kubectl -n pdserve create secret generic pdserve-api-keys --from-literal=PDSERVE_API_KEYS=KEY1,KEY2" in msg
    assert "api_keys_secret: {name: pdserve-api-keys, key: PDSERVE_API_KEYS}" in msg
    # `pdserve serve` still takes them from the same file.
    assert loaded.args.router.api_keys == ["sk-inline-1234"]


def test_render_refuses_api_keys_in_extra_env():
    with pytest.raises(ConfigError, match=r"kubernetes\.extra_env\.MY_KEYS: API keys would be written in clear"):
        render(_loaded("""
            router: {api_keys_env: MY_KEYS}
            kubernetes: {api_keys_secret: keys, extra_env: {MY_KEYS: sk-inline}}
            """), "kuberay")


def test_cli_render_with_inline_api_keys_fails(tmp_path, capsys):
    cfg = tmp_path / "app.yaml"
    data = yaml.safe_load(EXAMPLE.read_text())
    data.setdefault("router", {})["api_keys"] = ["sk-inline-1234"]
    cfg.write_text(yaml.safe_dump(data))
    out = tmp_path / "rayservice.yaml"
    from pdserve.cli.main import main

    assert main(["render", str(cfg), "-o", str(out)]) != 0
    err = capsys.readouterr().err
    assert err.startswith("pdserve: error: app.yaml: router.api_keys: ")
    assert "kubectl -n pdserve create secret generic" in err and "sk-inline-1234" not in err
    assert not out.exists()


def test_api_keys_from_a_secret_leave_no_key_in_the_manifests(monkeypatch, rayservice_validator,
                                                              raycluster_validator):
    """The keys reach the router only as an env var from the Secret; the Serve config names none."""
    monkeypatch.setenv("PDSERVE_API_KEYS", "sk-rendering-shell")  # render must not pick these up either
    loaded = _loaded("kubernetes: {api_keys_secret: {name: pdserve-api-keys}}")
    text = render(loaded, "kuberay")
    _check_kuberay(text, rayservice_validator, raycluster_validator, loaded.args.kubernetes.kubernetes_version)
    rs = _by_kind(text)["RayService"]
    cluster = rs["spec"]["rayClusterConfig"]
    ref = {"name": "PDSERVE_API_KEYS", "valueFrom": {"secretKeyRef": {"name": "pdserve-api-keys",
                                                                      "key": "PDSERVE_API_KEYS"}}}
    # Every container a router replica can land on: the head and both worker groups.
    containers = [cluster["headGroupSpec"]["template"]["spec"]["containers"]] + [
        g["template"]["spec"]["containers"] for g in cluster["workerGroupSpecs"]]
    for (c,) in containers:
        assert [e for e in c["env"] if e["name"] == "PDSERVE_API_KEYS"] == [ref]
    args = _embedded_args(rs)
    assert "api_keys" not in args.get("router", {}) and "kubernetes" not in args
    router = PDServeArgs.model_validate(args).router
    assert router.api_keys == [] and router.api_keys_env == ref["name"]  # what the router reads
    for target in TARGETS:
        assert "sk-rendering-shell" not in render(loaded, target)


def test_auto_replicas_cannot_size_a_group():
    with pytest.raises(ConfigError, match="num_replicas.*auto"):
        render(_loaded("prefill_config: {deployment_config: {num_replicas: auto}}"), "kuberay")


def test_engine_needing_more_gpus_than_the_pod_is_an_error():
    with pytest.raises(ConfigError, match=r"kubernetes\.decode\.gpus"):
        render(_loaded("decode_config: {engine_kwargs: {tensor_parallel_size: 2}}"), "kuberay")


# --- eksctl and helm -----------------------------------------------------------------------------------


def test_eksctl_gpu_group_is_one_efa_zone():
    text = render(_loaded(), "eksctl")
    cfg = yaml.safe_load(text)
    system, gpu = cfg["managedNodeGroups"]
    assert system["instanceType"] == "m7i.xlarge" and not system.get("efaEnabled")
    assert gpu["instanceType"] == "g6.8xlarge" and gpu["efaEnabled"] is True
    assert gpu["availabilityZones"] == ["us-west-2a"]
    assert (gpu["desiredCapacity"], gpu["minSize"], gpu["maxSize"]) == (2, 2, 2)
    assert cfg["availabilityZones"] == ["us-west-2a", "us-west-2b"]
    assert re.search(r"#.*EFA.*availability zones.*\n\s+availabilityZones:", text)
    assert json.loads(cfg["addons"][0]["configurationValues"]) == {"enableNetworkPolicy": "true"}


def test_eksctl_node_groups_carry_the_pods_selector_labels():
    cfg = yaml.safe_load(render(_loaded("""
        kubernetes:
          prefill: {node_selector: {pdserve.io/node-group: gpu, pool: efa}}
          decode: {node_selector: {pool: efa}}
        """), "eksctl"))
    assert cfg["managedNodeGroups"][1]["labels"] == {"pdserve.io/node-group": "gpu", "pool": "efa"}
    with pytest.raises(ConfigError, match="conflicts"):
        render(_loaded("kubernetes: {prefill: {node_selector: {pool: a}}, decode: {node_selector: {pool: b}}}"),
               "eksctl")


def test_eksctl_needs_one_gpu_instance_type():
    with pytest.raises(ConfigError, match="instance_type"):
        render(_loaded("kubernetes: {decode: {instance_type: g6.12xlarge}}"), "eksctl")


def test_zones_must_be_in_the_region_and_hold_the_gpu_zone():
    with pytest.raises(ConfigError, match="not in region"):
        _loaded("kubernetes: {region: us-east-1}")
    with pytest.raises(ConfigError, match="gpu_availability_zone"):
        _loaded("kubernetes: {gpu_availability_zone: us-west-2c}")
    with pytest.raises(ConfigError, match="kubernetes.head.memory"):
        _loaded("kubernetes: {head: {memory: 8GB}}")


#: Top-level keys of the kuberay-operator chart's values.yaml that the rendered values may use.
HELM_KEYS = {"image", "nodeSelector", "tolerations", "resources", "affinity", "labels", "annotations", "env"}


def test_helm_values():
    loaded = _loaded("kubernetes: {head: {tolerations: [{key: dedicated, operator: Exists}]}}")
    values = yaml.safe_load(render(loaded, "helm-values"))
    assert set(values) <= HELM_KEYS
    assert values["image"] == {"repository": "quay.io/kuberay/operator", "tag": "v1.5.2"}
    assert values["nodeSelector"] == {"node.kubernetes.io/instance-type": "m7i.xlarge"}
    assert values["tolerations"] == [{"key": "dedicated", "operator": "Exists"}]
    assert values == helm.operator_values(loaded)


def test_unknown_target():
    with pytest.raises(ConfigError, match="valid: kuberay, eksctl, helm-values"):
        render(_loaded(), "terraform")


def test_ray_version_matches_the_pin():
    pin = re.search(r'"ray\[serve\]==([^"]+)"', (ROOT / "pyproject.toml").read_text())
    assert pin and pin.group(1) == RAY_VERSION


# --- golden files --------------------------------------------------------------------------------------


@pytest.mark.parametrize("target", list(TARGETS))
def test_golden(target):
    path = GOLDEN / f"{target}.yaml"
    text = render(load_config(EXAMPLE), target)
    if UPDATE:
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
    if not path.exists():
        pytest.fail(f"{path.relative_to(ROOT)} is missing; create it with: {REGENERATE}")
    want = path.read_text()
    if text != want:
        diff = "".join(difflib.unified_diff(
            want.splitlines(True), text.splitlines(True), f"{path.name} (golden)", f"{path.name} (rendered)"))
        pytest.fail(
            f"{path.relative_to(ROOT)} is stale (the rendering of examples/eks.yaml changed).\n"
            f"If the change is intended, regenerate and review: {REGENERATE}; git diff tests/golden\n"
            + "\n".join(diff.splitlines()[:60]),
            pytrace=False,
        )


# --- command line --------------------------------------------------------------------------------------


def _run(argv: list[str]) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="pdserve")
    add_render_parser(p.add_subparsers(dest="command"))
    ns = p.parse_args(argv)
    return ns.func(ns)


def test_cli_writes_file(tmp_path, capsys):
    out = tmp_path / "eksctl.yaml"
    assert _run(["render", str(EXAMPLE), "--target", "eksctl", "-o", str(out)]) == 0
    assert out.read_text() == render(load_config(EXAMPLE), "eksctl")
    assert _run(["render", str(EXAMPLE)]) == 0
    assert capsys.readouterr().out == render(load_config(EXAMPLE), "kuberay")


def test_cli_rejects_unknown_target():
    with pytest.raises(SystemExit):
        _run(["render", str(EXAMPLE), "--target", "nope"])


def test_cli_unwritable_output(tmp_path, capsys):
    assert _run(["render", str(EXAMPLE), "-o", str(tmp_path / "missing" / "x.yaml")]) == 1
    assert "cannot write" in capsys.readouterr().err
