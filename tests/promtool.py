"""``promtool check metrics`` on an exposition (Debian package ``prometheus``; CI installs it)."""

from __future__ import annotations

import shutil
import subprocess

from tests.needs import need


def check_metrics(text: str) -> None:
    exe = shutil.which("promtool")
    need(exe is not None, "promtool", "apt-get install prometheus")
    assert exe is not None
    r = subprocess.run([exe, "check", "metrics"], input=text, text=True, capture_output=True)
    # promtool exits 1 on lint problems too; only errors in the format itself are failures here.
    problems = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()]
    errors = [ln for ln in problems if "error" in ln.lower()]
    assert not errors, "\n".join(problems)
    lint = [ln for ln in problems if not any(ok in ln for ok in ALLOWED_LINT)]
    assert not lint, "\n".join(lint)


# vLLM's own families use a few names promtool's linter dislikes; they are vLLM's, not ours.
ALLOWED_LINT = ("vllm:", "counter metrics should have \"_total\" suffix")
