"""Turn ``model_source`` into something vLLM's ``--model`` accepts."""

from __future__ import annotations

from pathlib import Path

from pdserve.config.schema import EMBEDDED_MODEL_SOURCE
from pdserve.errors import ConfigError
from pdserve.model.cache import hub_cache
from pdserve.model.embedded import Progress, prepare_embedded_model

#: Sources named ``pdserve:NAME`` are models packaged with pdserve.
PACKAGED_PREFIX = "pdserve:"

#: What ``pdserve model pull`` fetches of a hub model: weights as safetensors, configs, tokenizer files.
HUB_PATTERNS = ["*.safetensors", "*.safetensors.index.json", "*.json", "*.jinja", "*.txt", "*.model",
                "*.tiktoken", "tokenizer*"]


def resolve_model(source: str | None, progress: Progress | None = None, *, cache_dir: str | None = None,
                  download: bool = False) -> str:
    """The packaged model is prepared on first use; a local directory is used as given.

    A hub id is passed to vLLM as it is: engines launched by pdserve download it into the cache's
    ``huggingface/`` (``HF_HOME``, see :mod:`pdserve.model.cache`) on their first start and find it there
    on the next. ``download=True`` (``pdserve model pull``) fetches it into that same place now and
    returns the local snapshot directory.
    """
    if not source or source == EMBEDDED_MODEL_SOURCE:
        return str(prepare_embedded_model(progress, root=cache_dir))
    if source.startswith(PACKAGED_PREFIX):
        raise ConfigError(f"unknown packaged model {source!r}: the packaged one is {EMBEDDED_MODEL_SOURCE!r}; "
                          "anything else is a local directory or a Hugging Face hub id")
    path = Path(source).expanduser()
    if path.exists():
        return str(path.resolve())
    if download:
        return pull_hub_model(source, progress, cache_dir=cache_dir)
    return source


def pull_hub_model(repo_id: str, progress: Progress | None = None, *, cache_dir: str | None = None) -> str:
    """Download a hub model into the hub cache the engines use; return its snapshot directory."""
    from huggingface_hub import snapshot_download

    where = hub_cache(cache_dir)
    if progress:
        progress(f"downloading {repo_id} into {where or 'the Hugging Face default cache'}")
    local = str(snapshot_download(repo_id, cache_dir=where, allow_patterns=HUB_PATTERNS))
    if progress and not any(Path(local).glob("*.safetensors")):
        progress(f"{repo_id} has no safetensors weights; the engines download its weights on first start")
    return local
