import textwrap
from pathlib import Path

import pytest

from pdserve.config.kv_transfer import build_kv_transfer_config
from pdserve.config.loader import load_config, parse_args
from pdserve.config.schema import EMBEDDED_MODEL_SOURCE, NixlConfig, PDServeArgs
from pdserve.errors import ConfigError

RAY_SERVE_LLM_FILE = """
applications:
  - name: pd-disaggregation
    route_prefix: /
    import_path: pdserve:build_pd_openai_app
    args:
      prefill_config:
        model_loading_config:
          model_id: qwen
          model_source: /models/qwen
        engine_kwargs:
          max_model_len: 4096
          kv_transfer_config:
            kv_connector: NixlConnector
            kv_role: kv_both
        deployment_config:
          autoscaling_config:
            min_replicas: 1
            max_replicas: 2
        accelerator_type: L4
      decode_config:
        model_loading_config:
          model_id: qwen
          model_source: /models/qwen
        engine_kwargs:
          max_model_len: 4096
          kv_transfer_config:
            kv_connector: NixlConnector
            kv_role: kv_both
        deployment_config:
          num_replicas: 2
          max_ongoing_requests: 32
        runtime_env:
          env_vars: {FOO: "1"}
        placement_group_config:
          bundles: [{GPU: 1, CPU: 4}]
http_options:
  host: 0.0.0.0
  port: 9000
"""


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "cfg.yaml"
    p.write_text(textwrap.dedent(text))
    return p


def test_defaults_are_the_embedded_model():
    a = PDServeArgs()
    assert a.prefill_config.model_loading_config.source() == EMBEDDED_MODEL_SOURCE
    assert a.prefill_config.num_replicas() == 1 and a.decode_config.num_replicas() == 1
    assert (a.http.host, a.http.port) == ("127.0.0.1", 8000)


def test_ray_serve_llm_file_loads(tmp_path):
    loaded = load_config(write(tmp_path, RAY_SERVE_LLM_FILE))
    a = loaded.args
    assert loaded.app_name == "pd-disaggregation"
    assert a.model_id == "qwen"
    assert a.prefill_config.num_replicas() == 1
    assert a.decode_config.num_replicas() == 2
    assert a.decode_config.placement_group_config.bundles == [{"GPU": 1, "CPU": 4}]
    assert (a.http.host, a.http.port) == ("0.0.0.0", 9000)


def test_ray_import_path_is_accepted_with_a_note(tmp_path):
    loaded = load_config(write(tmp_path, RAY_SERVE_LLM_FILE.replace("pdserve:build", "ray.serve.llm:build")))
    assert loaded.notes and "pdserve" in loaded.notes[0]


def test_bare_args_file(tmp_path):
    loaded = load_config(write(tmp_path, """
        prefill_config:
          deployment_config: {num_replicas: 2}
        router: {policy: round_robin}
        cpu: {kv_cache_gib: 2}
    """))
    assert loaded.args.prefill_config.num_replicas() == 2
    assert loaded.args.router.policy == "round_robin"


def test_unknown_key_names_file_and_field(tmp_path):
    path = write(tmp_path, """
        prefill_config:
          deployment_config: {num_replica: 2}
    """)
    with pytest.raises(ConfigError) as e:
        load_config(path)
    msg = str(e.value)
    assert str(path) in msg
    assert "prefill_config.deployment_config.num_replica" in msg
    assert "unknown field; did you mean `num_replicas`?" in msg


def test_unknown_key_far_from_any_field_lists_what_that_mapping_takes(tmp_path):
    # A newcomer's guess at the schema: nothing close, so the error says what the top level takes.
    path = write(tmp_path, """
        model: smollm2
        prefill: {replicas: 1}
    """)
    with pytest.raises(ConfigError) as e:
        load_config(path)
    lines = str(e.value).splitlines()
    top = next(line for line in lines if ": model: " in line)
    assert "this mapping takes: " in top and "prefill_config" in top and "decode_config" in top
    assert any(": prefill: unknown field; did you mean `prefill_config`?" in line for line in lines)


def test_unknown_key_hint_inside_a_serve_config_application(tmp_path):
    path = write(tmp_path, """
        applications:
          - name: pd
            import_path: pdserve:build_pd_openai_app
            args:
              router: {polcy: round_robin}
    """)
    with pytest.raises(ConfigError) as e:
        load_config(path)
    msg = str(e.value)
    assert "router.polcy: unknown field; did you mean `policy`?" in msg


def test_known_fields_walks_the_schema():
    from pdserve.config.loader import known_fields

    assert "num_replicas" in known_fields(("decode_config", "deployment_config"))
    assert "policy" in known_fields(("router",))
    assert known_fields(("no_such",)) == []


def test_wrong_type_in_serve_config_names_application_path(tmp_path):
    path = write(tmp_path, RAY_SERVE_LLM_FILE.replace("num_replicas: 2", "num_replicas: two"))
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert "applications[0].args.decode_config.deployment_config.num_replicas" in str(e.value)


@pytest.mark.parametrize("bad, needle", [
    ({"prefill_config": {"model_loading_config": {"model_id": "a"}}}, "same model_id"),
    ({"decode_config": {"model_loading_config": {"model_source": "/x"}}}, "same model_source"),
    ({"decode_config": {"engine_kwargs": {"model": "x"}}}, "model_loading_config"),
    ({"decode_config": {"engine_kwargs": {"port": 1}}}, "chosen by pdserve"),
    ({"decode_config": {"deployment_config": {"num_replicas": 1,
                                              "autoscaling_config": {"max_replicas": 2}}}}, "not both"),
    ({"decode_config": {"deployment_config": {"autoscaling_config": {"min_replicas": 3,
                                                                     "max_replicas": 2}}}}, "min_replicas"),
    ({"router": {"policy": "fastest"}}, "router.policy"),
    ({"prefill_config": {"engine_kwargs": {"block_size": 16}}}, "block_size"),
    ({"prefill_config": {"engine_kwargs": {"block_size": 32}}, "decode_config": {"engine_kwargs": {"block_size": 48}}},
     "multiple of prefill"),
    ({"prefill_config": {"engine_kwargs": {"tensor_parallel_size": 2}},
      "decode_config": {"engine_kwargs": {"tensor_parallel_size": 3}}}, "tensor_parallel_size"),
    ({"decode_config": {"engine_kwargs": {"kv_cache_dtype": "fp8"}}}, "kv_cache_dtype"),
    # vLLM's bidirectional transfer on one side only: decode would keep blocks nobody reads (or prefill
    # would look for blocks decode never kept)
    ({"decode_config": {"engine_kwargs": {"kv_transfer_config": {
        "kv_connector_extra_config": {"bidirectional_kv_xfer": True}}}}}, "set nixl.bidirectional instead"),
    ({"nixl": {"bidirectional": True}, "prefill_config": {"engine_kwargs": {"kv_transfer_config": {
        "kv_connector_extra_config": {"bidirectional_kv_xfer": False}}}}}, "bidirectional_kv_xfer must be equal"),
    ({"decode_config": {"engine_kwargs": {"kv_transfer_config": "NixlConnector"}}}, "must be a mapping"),
    ({"prefill_config": {"engine_kwargs": {"kv_transfer_config": {"kv_connector_extra_config": []}}}},
     "must be a mapping"),
])
def test_cross_field_errors(bad, needle):
    with pytest.raises(ConfigError) as e:
        parse_args(bad, source="x.yaml")
    assert needle in str(e.value)


def test_bidirectional_transfer_set_on_both_sides_in_engine_kwargs_is_accepted():
    both = {"kv_transfer_config": {"kv_connector_extra_config": {"bidirectional_kv_xfer": True}}}
    a = parse_args({"prefill_config": {"engine_kwargs": both}, "decode_config": {"engine_kwargs": both}})
    assert not a.nixl.bidirectional


def test_compatible_unequal_layouts_are_accepted():
    a = parse_args({"prefill_config": {"engine_kwargs": {"tensor_parallel_size": 2, "block_size": 16}},
                    "decode_config": {"engine_kwargs": {"tensor_parallel_size": 4, "block_size": 32,
                                                        "max_num_batched_tokens": 512}}})
    assert a.decode_config.engine_kwargs["tensor_parallel_size"] == 4


def test_not_yaml_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(write(tmp_path, "a: [1, 2"))
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="no application with import_path"):
        load_config(write(tmp_path, "applications: [{import_path: x:y}]"))


def test_kv_transfer_defaults_per_role():
    n = NixlConfig()
    p = build_kv_transfer_config("prefill", None, n, on_cpu=True)
    d = build_kv_transfer_config("decode", None, n, on_cpu=True)
    assert p["kv_connector"] == d["kv_connector"] == "NixlConnector"
    assert (p["kv_role"], d["kv_role"]) == ("kv_producer", "kv_consumer")
    assert p["kv_buffer_device"] == "cpu"
    assert p["kv_load_failure_policy"] == "recompute"
    g = build_kv_transfer_config("decode", None, n, on_cpu=False)
    assert "kv_buffer_device" not in g


def test_kv_both_is_made_explicit_and_bad_roles_rejected():
    n = NixlConfig()
    assert build_kv_transfer_config("prefill", {"kv_role": "kv_both"}, n, on_cpu=False)["kv_role"] == "kv_producer"
    with pytest.raises(ConfigError, match="kv_consumer"):
        build_kv_transfer_config("decode", {"kv_role": "kv_producer"}, n, on_cpu=False)
    with pytest.raises(ConfigError, match="valid: NixlConnector"):
        build_kv_transfer_config("decode", {"kv_connector": "LMCacheConnectorV1"}, n, on_cpu=False)
    with pytest.raises(ConfigError, match="cpu"):
        build_kv_transfer_config("decode", {"kv_buffer_device": "cuda"}, n, on_cpu=True)


def test_examples_validate():
    root = Path(__file__).resolve().parents[2] / "examples"
    files = sorted(root.glob("*.yaml"))
    assert files, "examples/ should hold example configs"
    for f in files:
        load_config(f)


def test_config_reference_is_current():
    from pdserve.config.reference import render_markdown

    doc = Path(__file__).resolve().parents[2] / "docs" / "config-reference.md"
    assert doc.read_text() == render_markdown(), "run: python -m pdserve.config.reference > docs/config-reference.md"


def test_config_reference_paths_are_what_a_file_writes():
    """Keys under a mapping of names read ``<name>``, keys of list items ``[]``, and constrained types their
    base type: the paths a user copies into a file and the types they read."""
    from pdserve.config.reference import render_markdown

    text = render_markdown()
    assert "| `router.tenants.<name>.keys_env` | str | required |" in text
    assert "| `kubernetes.head.tolerations[].key` |" in text
    assert "| `router.local_prefill_below_tokens` | int \\| \"auto\" |" in text
    assert "router.tenants.keys_env" not in text and "annotation=" not in text


def test_readme_yaml_example_validates(tmp_path):
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    block = readme.split("```yaml", 1)[1].split("```", 1)[0]
    assert load_config(write(tmp_path, block)).args.decode_config.num_replicas() == 2


def test_config_imports_nothing_above_it():
    """config is the bottom layer: app, deploy, router, engine, testing, cli, doctor and model import it."""
    import ast

    above = ("app", "deploy", "router", "engine", "testing", "cli", "doctor", "model")
    src = Path(__file__).resolve().parents[2] / "src" / "pdserve"
    bad = []
    for f in [*sorted((src / "config").glob("*.py")), src / "settings.py", src / "errors.py"]:
        for node in ast.walk(ast.parse(f.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            bad += [f"{f.name}: {n}" for n in names if n.split(".")[:2] in (["pdserve", a] for a in above)]
    assert bad == []
