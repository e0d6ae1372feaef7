"""The CLI in a process of its own: what `pdserve validate` imports."""

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
