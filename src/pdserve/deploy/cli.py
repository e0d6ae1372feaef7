"""The ``pdserve render`` subcommand (wired into :mod:`pdserve.cli.main` with :func:`add_render_parser`)."""

from __future__ import annotations

import argparse
import sys
from typing import Any


def _cmd_render(ns: argparse.Namespace) -> int:
    from pdserve.config.loader import load_config
    from pdserve.deploy.render import render

    loaded = load_config(ns.file)
    for note in loaded.notes:
        print(f"note: {note}", file=sys.stderr)
    text = render(loaded, ns.target)
    if not ns.output or ns.output == "-":
        sys.stdout.write(text)
        return 0
    try:
        with open(ns.output, "w") as f:
            f.write(text)
    except OSError as e:
        print(f"pdserve render: cannot write {ns.output}: {e.strerror or e}", file=sys.stderr)
        return 1
    print(f"wrote {ns.output} ({ns.target})", file=sys.stderr)
    return 0


def add_render_parser(sub: Any) -> None:
    """Add ``render`` to the subparsers ``sub`` of the ``pdserve`` parser."""
    from pdserve.deploy.render import TARGETS

    r = sub.add_parser(
        "render",
        help="write deployment manifests for a config: KubeRay RayService, eksctl cluster, Helm values",
        description="Render manifests for KubeRay on EKS; cluster values come from the file's `kubernetes:` "
        "section (see docs/deploy-eks.md).",
    )
    r.add_argument("file", help="pdserve YAML (bare args or a Ray Serve config)")
    r.add_argument("--target", choices=list(TARGETS), default="kuberay",
                   help="what to render (default %(default)s)")
    r.add_argument("-o", "--output", help="write to this file instead of stdout")
    r.set_defaults(func=_cmd_render)
