"""The CLI in a process of its own (what `pdserve validate` imports), and `pdserve status` and `pdserve bench
--url` against a running stack (fake engines) whose endpoint wants an API key."""

import dataclasses
import subprocess
import sys
from pathlib import Path

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


def test_status_and_bench_against_an_endpoint_with_api_keys(tmp_path, capsys, monkeypatch):
    """`pdserve status` and `pdserve bench --url` send the endpoint's key (a flag, or PDSERVE_API_KEY):
    with it they read the app and time requests; without it status
    says the key is wanted and every bench request fails with 401."""
    import json

    from pdserve.cli.main import main
    from tests.component.test_router import MODEL, System

    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    with System(api_keys=["key-a"]) as s:
        assert main(["status", "--url", s.router.url]) == 1
        assert "wants an API key" in capsys.readouterr().err
        assert main(["status", "--url", s.router.url, "--api-key", "key-a"]) == 0
        out = capsys.readouterr().out
        assert "decode" in out and "decisions:" in out  # (the memory line needs a real app: test_pd_real)
        bench = ["bench", "--url", s.router.url, "--model", MODEL, "--requests", "2", "--prompt-len", "8", "--output-len", "2",
                 "--load", "concurrency:1", "--out", str(tmp_path)]
        assert main(bench) == 0
        runs = json.loads((tmp_path / "endpoint.json").read_text())["runs"]
        assert runs["concurrency:1"]["succeeded"] == 0 and "HTTP 401" in runs["concurrency:1"]["errors"][0]
        monkeypatch.setenv("PDSERVE_API_KEY", "key-a")
        assert main(bench) == 0
        runs = json.loads((tmp_path / "endpoint.json").read_text())["runs"]
        assert runs["concurrency:1"]["succeeded"] == 2
