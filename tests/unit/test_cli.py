from pathlib import Path

from pdserve.cli.main import main

ROOT = Path(__file__).resolve().parents[2]


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
