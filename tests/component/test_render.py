"""``pdserve render`` in a process of its own: what rendering every target imports
(the manifests themselves: tests/unit/test_render.py)."""

import subprocess
import sys

from tests.unit.test_render import EXAMPLE, ROOT


def test_render_imports_nothing_heavy():
    code = (
        "import sys\n"
        "from pdserve.config.loader import load_config\n"
        "from pdserve.deploy.render import render, TARGETS\n"
        f"[render(load_config({str(EXAMPLE)!r}), t) for t in TARGETS]\n"
        "heavy = [m for m in ('ray', 'vllm', 'torch', 'transformers') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
