"""The model names the endpoint answers to: the served model and, with ``lora_config``, its LoRA adapters.

An adapter is named ``<model_id>:<adapter>`` (Ray Serve LLM's convention) and passed to both engines as the
request's ``model``; each engine loads it on first use (:mod:`pdserve.engine.lora`). Where the router sees
the adapter store (a local or mounted path), a name with no adapter behind it is a 404 here, before any
engine works on it, and ``/v1/models`` lists the adapters; otherwise (a cloud store, or a path only the
engine hosts mount) the engines answer for it.
"""

from __future__ import annotations

import os
from typing import Any

from pdserve.config.lora import adapter_of, is_remote, list_local_adapters, local_adapter_dir
from pdserve.errors import ModelNotFound


class ServedModels:
    def __init__(self, model_id: str, created: int, lora_root: str | None = None) -> None:
        self.model_id, self.created, self.lora_root = model_id, created, lora_root

    def _visible(self) -> bool:
        """Whether the router can read the adapter store itself."""
        return bool(self.lora_root) and not is_remote(self.lora_root or "") and os.path.isdir(self.lora_root or "")

    def check(self, model: Any) -> str:
        """The ``model`` a request is sent to the engines with (the served one when it names none); else
        :class:`ModelNotFound`."""
        if model is None or model == self.model_id:
            return self.model_id
        if isinstance(model, str) and self.lora_root and (name := adapter_of(self.model_id, model)) is not None:
            if not self._visible() or local_adapter_dir(self.lora_root, name):
                return model
        raise ModelNotFound(f"The model `{model}` does not exist.", param="model", code="model_not_found")

    def card(self, model: str) -> dict[str, Any]:
        card: dict[str, Any] = {"id": model, "object": "model", "created": self.created, "owned_by": "pdserve"}
        if model != self.model_id:
            card.update(parent=self.model_id, root=os.path.join(self.lora_root or "", model.split(":", 1)[1]))
        return card

    def cards(self) -> list[dict[str, Any]]:
        names = [self.model_id]
        if self._visible():
            names += [f"{self.model_id}:{n}" for n in list_local_adapters(self.lora_root or "")]
        return [self.card(n) for n in names]
