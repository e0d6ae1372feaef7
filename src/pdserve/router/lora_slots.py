"""The LoRA adapters an engine's batch runs at once, whose requests hold them, and which it has loaded.

vLLM runs at most ``max_loras`` distinct adapters in one batch: its scheduler passes over a waiting request
whose adapter is not among the running requests' once that many run. Such a request waits inside the engine
until a stream holding one of them ends, however long that takes, while admission counts it as running.
So one client streaming long answers on ``max_loras`` adapters held every other client's adapter requests on
that engine, past any wait the router had promised them.

The router counts the adapters of the requests it admitted to each engine (:class:`LoraSlots`, on each
:class:`~pdserve.router.endpoint.Endpoint`) from admission until the request ends, on the engine its tokens
stream from, and admission (router/admission.py) sends a request for an adapter only to an engine that runs
that adapter already or has a slot free (:class:`LoraAsk`). With tenants, the last free slot of an engine
goes only to a tenant holding less than its share of the engine's slots (the slots over the tenants holding
any, two at least): a tenant alone takes ``max_loras - 1``. When no engine can start the adapter now the
request gets a 429 (cause ``lora_slots``).

Requests on the base model hold no slot. Prompt legs on prefill engines are not counted: they end once their
prompt is computed.

An engine loads an adapter on its first request for it, and again after it left the engine's cache of
``max_cpu_loras`` adapters: seconds on a CPU engine, which a prompt's time would then include. The router
keeps the order each engine was last sent each adapter in, and a prompt that makes its engine load one
teaches admission nothing about the engine's speed (router/load.py): four adapters' first prompts had
made the measured speed of a prefill engine so low that a 40-token prompt was refused as a 29-s wait.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.owned import fair_share


class LoraSlots:
    """The adapters of one engine's requests in flight: adapter -> tenant -> requests."""

    def __init__(self) -> None:
        self._held: dict[str, dict[str, int]] = {}
        self._sent: OrderedDict[str, None] = OrderedDict()  # adapters sent here, the least recent first

    def loads(self, adapter: str, cache: int) -> bool:
        """Note a request on ``adapter`` sent here; whether the engine must load it for this one (it was not
        among the last ``cache`` adapters sent here: vLLM keeps that many)."""
        loaded = adapter in self._sent
        self._sent[adapter] = None
        self._sent.move_to_end(adapter)
        while len(self._sent) > max(1, cache):
            self._sent.popitem(last=False)
        return not loaded

    def running(self) -> int:
        """Distinct adapters in flight."""
        return len(self._held)

    def held_by(self, tenant: str) -> int:
        """Distinct adapters ``tenant`` has requests on."""
        return sum(1 for users in self._held.values() if tenant in users)

    def fits(self, adapter: str, tenant: str, slots: int, fair: bool) -> bool:
        """Whether a request of ``tenant``'s on ``adapter`` would start here now, where the batch runs at most
        ``slots`` adapters (``fair``: the last free slot is kept for tenants under their share)."""
        if adapter in self._held:
            return True
        free = slots - len(self._held)
        if free <= 0:
            return False
        if free > 1 or not fair:
            return True
        tenants = {t for users in self._held.values() for t in users} | {tenant}
        return self.held_by(tenant) < fair_share(slots, len(tenants))

    def claim(self, adapter: str, tenant: str) -> Callable[[], None]:
        """Count one request of ``tenant``'s on ``adapter``; the callable gives it back (once)."""
        users = self._held.setdefault(adapter, {})
        users[tenant] = users.get(tenant, 0) + 1
        done = False

        def release() -> None:
            nonlocal done
            if done:
                return
            done = True
            users = self._held.get(adapter)
            if users is None or tenant not in users:
                return
            users[tenant] -= 1
            if users[tenant] <= 0:
                del users[tenant]
            if not users:
                del self._held[adapter]

        return release


@dataclass(frozen=True)
class LoraAsk:
    """What admission checks for a request on an adapter: ``slots`` is the engines' ``max_loras``; ``fair``
    (an app with tenants) keeps each engine's last free slot for tenants under their share."""

    adapter: str
    tenant: str
    slots: int
    fair: bool
    #: The adapters an engine keeps loaded (vLLM's ``max_cpu_loras``).
    cache: int = 1

    def fits(self, slots: LoraSlots) -> bool:
        return slots.fits(self.adapter, self.tenant, self.slots, self.fair)

    def refusal(self, engines: list[LoraSlots]) -> str:
        """Why no engine can start it now (the 429's message)."""
        if self.fair and any(s.running() < self.slots for s in engines):
            return (f"tenant '{self.tenant}' holds its share of the engines' LoRA batch slots ({self.slots} "
                    f"adapters at once per engine); the last one is kept for other tenants; retry when one of "
                    "its adapter requests has ended")
        return (f"every engine runs {self.slots} other LoRA adapters at once (vLLM's max_loras), so adapter "
                f"'{self.adapter}' cannot start now; retry shortly")
