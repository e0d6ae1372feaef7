"""Tests that need something from outside the venv: skip on a developer machine that lacks it, with
the reason and the fix; fail in CI, where .ci/run provides it and sets PDSERVE_CI_REQUIRES_ALL=1."""

from __future__ import annotations

import os

import pytest


def need(available: bool, what: str, how: str) -> None:
    if available:
        return
    msg = f"{what} is missing on this machine; to run this test: {how}"
    if os.environ.get("PDSERVE_CI_REQUIRES_ALL"):
        pytest.fail(msg + " (PDSERVE_CI_REQUIRES_ALL is set: .ci/run must have provided it)")
    pytest.skip(msg + " (.ci/run installs it and sets PDSERVE_CI_REQUIRES_ALL=1, so CI fails instead of "
                "skipping)")


def need_netns() -> None:
    """What scripts/netns-cluster.sh needs to build a two-host cluster on one machine: root (network
    namespaces, veth links) and iproute2's ``ip``."""
    import shutil

    need(os.geteuid() == 0, "root privilege", "run the tests as root (network namespaces and veth links need it)")
    need(shutil.which("ip") is not None, "iproute2's `ip`", "apt-get install iproute2")
