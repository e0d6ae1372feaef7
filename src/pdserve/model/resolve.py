"""Turn ``model_source`` into something vLLM's ``--model`` accepts."""

from __future__ import annotations

from pathlib import Path

from pdserve.config.schema import EMBEDDED_MODEL_SOURCE
from pdserve.errors import ConfigError, ModelError
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
    """Download a hub model into the hub cache the engines use (what is there already is not fetched
    again); return its snapshot directory. A model that cannot be had (no such repository, gated, the hub
    out of reach and nothing cached) is a :class:`ModelError` that says which and what to do."""
    from huggingface_hub import snapshot_download

    where = hub_cache(cache_dir)
    if progress:
        cache = where or _default_hub_cache()
        try:
            snapshot_download(repo_id, cache_dir=where, allow_patterns=HUB_PATTERNS, local_files_only=True)
            progress(f"{repo_id}: found in {cache}; checking the hub for newer files")
        except Exception:  # noqa: BLE001 - not cached (huggingface_hub's LocalEntryNotFoundError and kin)
            progress(f"downloading {repo_id} into {cache}")
    try:
        local = str(snapshot_download(repo_id, cache_dir=where, allow_patterns=HUB_PATTERNS))
    except Exception as e:  # noqa: BLE001 - huggingface_hub's errors, told apart by name below
        raise ModelError(hub_error(repo_id, e, where)) from e
    if progress and not any(Path(local).glob("*.safetensors")):
        progress(f"{repo_id} has no safetensors weights; the engines download its weights on first start")
    return local


def hub_error(repo_id: str, e: BaseException, where: str | None) -> str:
    """What to tell a user whose hub model could not be fetched (``e``: huggingface_hub's error)."""
    kinds = {c.__name__ for c in type(e).__mro__}
    cache = where or _default_hub_cache()
    if "GatedRepoError" in kinds:
        why = "the repository is gated: accept its terms on the hub and set HF_TOKEN"
    elif "RepositoryNotFoundError" in kinds or "RevisionNotFoundError" in kinds:
        why = "no such repository on the hub (or it is private: set HF_TOKEN)"
    elif "LocalEntryNotFoundError" in kinds or isinstance(e, (ConnectionError, TimeoutError)):
        why = f"the hub cannot be reached from this host and {cache} does not hold it"
    else:
        why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".rstrip(": ")
    return (f"model {repo_id!r}: {why}. Give model_source a local directory, or fetch the model where the hub "
            f"is reachable (`pdserve model pull FILE`) into {cache}")


def _default_hub_cache() -> str:
    try:
        from huggingface_hub import constants

        return str(constants.HF_HUB_CACHE)
    except (ImportError, AttributeError):
        return "the Hugging Face default cache"
