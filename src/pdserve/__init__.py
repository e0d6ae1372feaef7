"""pdserve: prefill/decode disaggregated LLM serving on vLLM + NIXL + Ray Serve.

One YAML in, one OpenAI-compatible endpoint out. ``build_pd_openai_app`` is the Ray Serve builder
(``import_path: pdserve:build_pd_openai_app``); heavy dependencies load only when it is called.
"""

from __future__ import annotations

from typing import Any

from pdserve._version import __version__

__all__ = ["__version__", "build_pd_openai_app"]


def build_pd_openai_app(args: Any = None) -> Any:
    """Build the Ray Serve application (see :func:`pdserve.app.builder.build_pd_openai_app`)."""
    from pdserve.app.builder import build_pd_openai_app as _build

    return _build(args)
