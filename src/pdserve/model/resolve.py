"""Turn ``model_source`` into something vLLM's ``--model`` accepts."""

from __future__ import annotations

from pathlib import Path

from pdserve.config.schema import EMBEDDED_MODEL_SOURCE
from pdserve.model.embedded import Progress, prepare_embedded_model


def resolve_model(source: str | None, progress: Progress | None = None) -> str:
    """The packaged model is prepared on first use; a local directory or a hub id is used as given."""
    if not source or source == EMBEDDED_MODEL_SOURCE:
        return str(prepare_embedded_model(progress))
    path = Path(source).expanduser()
    if path.exists():
        return str(path.resolve())
    return source
