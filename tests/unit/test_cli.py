import dataclasses
import subprocess
import sys
from pathlib import Path

from pdserve.cli.main import main
from pdserve.engine import cpu_host
from pdserve.testing.cpu_probe import FAKE_PROBE

ROOT = Path(__file__).resolve().parents[2]


def test_help_and_validate_import_nothing_heavy(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"router: {{policy: round_robin}}\ncache_dir: {tmp_path}\n")
    # --show-engines decides the CPU dtype: from a cached probe here (the probe itself runs in a subprocess).
    cpu_host.write_json(cpu_host.probe_file(tmp_path),
                         {"format": 1, "probes": {cpu_host.probe_key(): dataclasses.asdict(FAKE_PROBE)}})
    code = (
        "import sys\n"
        "from pdserve.cli.main import main\n"
        f"rc = main(['validate', {str(cfg)!r}, '--show-engines'])\n"
        "heavy = [m for m in ('ray', 'vllm', 'torch', 'transformers') if m in sys.modules]\n"
        "assert rc == 0 and not heavy, (rc, heavy)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, capture_output=True, text=True)
    assert "dtype      float32 on CPU: bf16 matmul 6.4x slower" in r.stdout


def test_version(capsys):
    try:
        main(["--version"])
    except SystemExit as e:
        assert e.code == 0
    assert capsys.readouterr().out.startswith("pdserve ")


def test_validate_reports_errors(tmp_path, capsys):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("decode_config:\n  deployment_config:\n    num_replicas: 0\n")
    assert main(["validate", str(cfg)]) == 1
    err = capsys.readouterr().err
    assert "bad.yaml" in err and "decode_config.deployment_config" in err


def test_validate_ok(capsys):
    assert main(["validate", str(ROOT / "examples" / "ray-serve-llm-gpu.yaml")]) == 0
    out = capsys.readouterr().out
    assert "OK" in out and "qwen3.5-9b" in out


def test_model_pull_prints_directory_last(capsys):
    # Converts the packaged GGUF on first use (~20 s), then is instant.
    assert main(["model", "pull"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert (Path(last) / "config.json").exists()
    assert (Path(last) / "model.safetensors").exists()


def test_bench_without_the_bench_package_says_how_to_install_it(monkeypatch, capsys):
    """The benchmarks are their own distribution (bench/): without it, `pdserve bench` says how to get it."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a, **kw: None if name == "pdserve_bench" else real(name, *a, **kw))
    assert main(["bench", "--url", "http://127.0.0.1:1"]) == 2
    err = capsys.readouterr().err
    assert "pip install -e bench" in err and "make setup" in err
