"""One admitted request's claims on the router, owned by one object and given back exactly once.

A request holds, while it runs: an admission slot per role (the count bounds), the prompt tokens it queued
on the engine computing its prompt (admission's work estimate), and a decode stream on its decode engine.
Each claim is given back when its phase ends, and :meth:`Flight.release` gives back whatever is left. It is
idempotent, and the HTTP layer calls it when the response has finished or was cancelled (see
:class:`pdserve.router.api.OwnedStream`), so a stream that the client abandons before its first byte, and
whose generator therefore never runs, still gives everything back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from pdserve.router.tracing import OFF, Trace

if TYPE_CHECKING:
    from pdserve.router.endpoint import Endpoint
    from pdserve.router.load import StreamMark
    from pdserve.router.lora_slots import LoraAsk
    from pdserve.router.metrics import RouterMetrics

ROLES = ("prefill", "decode")


class Flight:
    def __init__(self, admitted: dict[str, int], metrics: RouterMetrics, prompt_tokens: int,
                 new_tokens: int = 0, sequences: int = 1) -> None:
        self._admitted = admitted
        self._metrics = metrics
        self.prompt_tokens = prompt_tokens
        self.new_tokens = new_tokens  # max_tokens as asked (0: not given): by load weighs stalls against it
        #: Sequences it generates at once (``n``, a batch of prompts): its engine runs each as a stream.
        self.sequences = max(1, sequences)
        self._slots = dict.fromkeys(ROLES, True)
        for role in ROLES:
            admitted[role] += 1
            metrics.inflight.labels(role).set(admitted[role])
        self._prompt: tuple[Endpoint, int, bool] | None = None  # (engine, tokens queued, teaches its speed)
        #: Per engine (by URL) that holds part of the prompt: (tokens it holds, tokens it would compute).
        self._held: dict[str, tuple[int, int]] = {}
        self._stream: Endpoint | None = None
        self._stream_mark: StreamMark | None = None
        self._bound_for: Endpoint | None = None
        self._due: float | None = None  # when it is expected there (EngineLoad.add_pending)
        self._also: list[Callable[[], None]] = []  # more claims held elsewhere (the tenant's slot)
        #: Its adapter, as admission checked it (router/lora_slots.py; None: the base model).
        self.lora: LoraAsk | None = None
        #: Its slot in that adapter's batch (the engine its tokens stream from, the give-back).
        self._slot: tuple[Endpoint, Callable[[], None]] | None = None
        #: The request's trace (router/tracing.py; records nothing when tracing is off).
        self.trace: Trace = OFF
        #: The prompt's token ids as the router rendered them, when it did (router/gate.py).
        self.prompt_ids: list[int] | None = None

    # -- on its way to decode -------------------------------------------------------------------------

    def bound_for(self, ep: Endpoint, prefill: Endpoint | None = None) -> None:
        """A P/D request in its prefill leg will stream on ``ep``: that engine is not idle for spills. With
        ``prefill`` (the engine its prompt is about to queue on), it is expected there once that engine's
        queue and the prompt's part it would compute are done."""
        self.arrived()
        due_in = None
        if prefill is not None:
            svc = prefill.load.service_s(self._tokens_on(prefill))
            due_in = None if svc is None else prefill.load.wait_s() + svc
        self._due = ep.load.add_pending(self.new_tokens, due_in)
        self._bound_for = ep

    def arrived(self) -> None:
        if self._bound_for is not None:
            ep, self._bound_for = self._bound_for, None
            ep.load.end_pending(self.new_tokens, self._due)
            self._due = None

    # -- the prompt ---------------------------------------------------------------------------------

    def held_on(self, ep: Endpoint, cached: int, uncached: int) -> None:
        """``ep`` holds ``cached`` of the prompt's tokens in its prefix cache and would compute ``uncached``
        (router/cache_aware.py): sent there, only those are queued, and only those count as computed."""
        self._held[ep.url] = (cached, uncached)

    def _tokens_on(self, ep: Endpoint) -> int:
        """The prompt's tokens ``ep`` would compute: those its prefix cache lacks, where that is known."""
        held = self._held.get(ep.url)
        return held[1] if held is not None else self.prompt_tokens

    def queue_prompt(self, ep: Endpoint) -> None:
        """The prompt goes to ``ep`` (a prefill leg, or a decode engine computing it locally); a previous
        engine's claim (a failed attempt) is given back."""
        self.end_prompt(None)
        tokens = self._tokens_on(ep)
        # A prompt whose engine loads the adapter first says nothing of its speed (router/lora_slots.py).
        teaches = not self._loads(ep)
        ep.load.add_prompt(tokens, teaches)
        self._prompt = (ep, tokens, teaches)

    def end_prompt(self, computed: int | None) -> None:
        """The prompt is computed (``computed`` tokens, for the engine's measured speed) or abandoned."""
        if self._prompt is not None:
            ep, reserved, teaches = self._prompt
            self._prompt = None
            held = self._held.get(ep.url)
            if computed and held is not None:
                computed = max(1, computed - held[0])
            ep.load.end_prompt(reserved, computed, teaches)

    @property
    def prompt_engine(self) -> Endpoint | None:
        return self._prompt[0] if self._prompt else None

    # -- the decode stream --------------------------------------------------------------------------

    def claim_lora(self, ep: Endpoint) -> None:
        """Hold a slot of ``ep``'s batch for its adapter (:attr:`lora`, router/lora_slots.py) until the request
        ends; a stream that moves to another engine takes it along."""
        assert self.lora is not None
        if self._slot is not None:
            self._slot[1]()
        self._slot = (ep, ep.loras.claim(self.lora.adapter, self.lora.tenant))

    def lora_fits(self, ep: Endpoint) -> bool:
        """Whether ``ep``'s batch can run this request's adapter now (always, on the base model): where a stream
        goes on after its engine failed, an engine with room is preferred (router/moves.py, legs.py)."""
        return self.lora is None or self.lora.fits(ep.loras)

    def _loads(self, ep: Endpoint) -> bool:
        """Whether ``ep`` loads this request's adapter for it (noting that it is sent there)."""
        return self.lora is not None and ep.loras.loads(self.lora.adapter, self.lora.cache)

    def start_stream(self, ep: Endpoint) -> None:
        self.arrived()
        self.end_stream(None)
        self._loads(ep)
        if self._slot is not None and self._slot[0] is not ep:
            self.claim_lora(ep)
        self._stream_mark = ep.load.add_stream(self.sequences)
        ep.load.add_answer(self.new_tokens, self.sequences)
        self._stream = ep

    def end_stream(self, tpot_s: float | None) -> None:
        if self._stream is not None:
            ep, self._stream = self._stream, None
            # (A time per token of several sequences interleaved is no one stream's.)
            ep.load.end_stream(tpot_s if self.sequences == 1 else None, self._stream_mark, self.sequences)
            ep.load.end_answer(self.new_tokens, self.sequences)

    # -- admission slots ----------------------------------------------------------------------------

    def end_slot(self, role: str) -> None:
        if self._slots[role]:
            self._slots[role] = False
            self._admitted[role] -= 1
            self._metrics.inflight.labels(role).set(self._admitted[role])

    def also(self, give_back: Callable[[], None]) -> None:
        """Another claim the request holds elsewhere, given back with the rest (once)."""
        self._also.append(give_back)

    def release(self) -> None:
        """Give back every claim still held. Safe to call any number of times."""
        while self._also:
            self._also.pop()()
        if self._slot is not None:
            self._slot[1]()
            self._slot = None
        self.end_prompt(None)
        self.end_stream(None)
        self.arrived()
        for role in ROLES:
            self.end_slot(role)

    @property
    def released(self) -> bool:
        return (not any(self._slots.values()) and self._prompt is None and self._stream is None
                and self._bound_for is None and self._slot is None)
