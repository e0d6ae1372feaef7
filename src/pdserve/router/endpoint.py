"""One engine replica as the router sees it: its role, address, health, requests in flight and measured load.

The pool (:mod:`pdserve.router.pool`) holds them; routing plugins, admission and every leg read them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal

from pdserve.router.load import EngineLoad
from pdserve.router.lora_slots import LoraSlots

Role = Literal["prefill", "decode"]


@dataclass
class Endpoint:
    """One engine replica as the router sees it."""

    role: Role
    url: str  # base URL of the engine's OpenAI server, e.g. http://10.0.0.5:8123
    replica_id: str = ""
    engine_id: str = ""
    node: str = ""
    healthy: bool = True
    inflight: int = 0
    failures: int = 0
    last_ok: float = field(default_factory=time.monotonic)
    #: When a request last started on it (monotonic; 0: never).
    used: float = 0.0
    load: EngineLoad = field(default_factory=EngineLoad)
    #: The LoRA adapters of its requests in flight (vLLM's batch runs ``max_loras`` of them at once).
    loras: LoraSlots = field(default_factory=LoraSlots)
    #: The engine's bearer key (from the app's registry); never shown in status or logs.
    api_key: str = field(default="", repr=False)
    #: The server at ``url`` refused ``api_key`` (:class:`pdserve.errors.EngineRefusedKey`): it is not this
    #: engine. Kept out of rotation until the registry names the replica anew (a new Endpoint).
    refused_key: bool = False
    #: Where the engine publishes its KV cache events (``tcp://host:port``); empty when it does not.
    kv_events: str = ""
    #: Blocks of its prefix cache the router knows of (from those events); None when not followed.
    kv_blocks: int | None = None

    @property
    def key(self) -> str:
        return f"{self.role}|{self.url}"

    def start_request(self) -> None:
        """One more request in flight here, started now."""
        self.inflight += 1
        self.used = time.monotonic()

    def auth(self) -> dict[str, str]:
        """Headers that let the router past the engine's key guard."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def as_dict(self) -> dict[str, object]:
        return {
            "role": self.role,
            "url": self.url,
            "replica_id": self.replica_id,
            "engine_id": self.engine_id,
            "node": self.node,
            "healthy": self.healthy,
            **({"refused_key": True} if self.refused_key else {}),
            "inflight": self.inflight,
            **({"kv_cached_blocks": self.kv_blocks} if self.kv_blocks is not None else {}),
            **({"lora_adapters_running": n} if (n := self.loras.running()) else {}),
            **self.load.as_dict(),
        }
