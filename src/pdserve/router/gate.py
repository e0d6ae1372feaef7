"""Stage 1 of the P/D flow: whether a request runs, and on which engines.

In order, cheapest refusal first: the tenant's limits and priority hold (router/tenants.py), the router's
in-flight caps (a full router spends no engine's check on a request), the request's checks against what the
engines accept (router/validate.py) and its Responses ids, the tenant's token budget, the in-flight caps again
(now claiming a slot), then admission by work (router/admission.py), which picks the prefill and decode
engines or decode alone, from the measured engine speeds, queues and the routing plugins' keys. A refused
request holds nothing; an admitted one holds its claims in a :class:`~pdserve.router.flight.Flight`.
"""

from __future__ import annotations

import asyncio
import logging
import random
from typing import TYPE_CHECKING, Any

from pdserve.config.schema import RouterConfig
from pdserve.errors import BadRequest, NotFound, Overloaded
from pdserve.router import admission, cache_aware, handoff, validate
from pdserve.router.endpoint import Endpoint
from pdserve.router.engine_client import EngineClient
from pdserve.router.flight import Flight
from pdserve.router.handback import scope as handback_scope
from pdserve.router.lora_slots import LoraAsk
from pdserve.router.metrics import RouterMetrics
from pdserve.router.pool import EnginePool
from pdserve.router.prompt_length import PromptLength
from pdserve.router.request import Request, Route, lora_adapter
from pdserve.router.routing import RoutingKey, RoutingRequest
from pdserve.router.stored import StoredResponses
from pdserve.router.tenants import Tenants

if TYPE_CHECKING:
    from pdserve.router.handback import Handbacks

log = logging.getLogger(__name__)

#: ``local_prefill_below_tokens: auto``: a prompt is computed on the decode engine itself when that holds its
#: streams up for less than this many of its idle decode steps (the handoff itself costs about one).
AUTO_LOCAL_STEPS = 2.0
#: Longest a chat prompt's rendering (for routing by cached prefix) may take before the request is routed
#: by load instead (it goes on in its worker thread; the event loop never waits for it).
RENDER_TIMEOUT_S = 2.0
#: Longest an engine's check of a body may take (router/validate.py) before the router's own rules decide
#: alone: the engine serving the request still refuses what its models refuse. (A check takes ~2 ms.)
ENGINE_CHECK_TIMEOUT_S = 2.0
#: With tenants, the share of each in-flight cap kept for tenants under their share of it (router/tenants.py).
CAP_RESERVE = 0.125


class Gate:
    def __init__(self, pool: EnginePool, cfg: RouterConfig, metrics: RouterMetrics, lengths: PromptLength,
                 limits: validate.EngineLimits | None, stored: StoredResponses, lease_s: float | None,
                 client: EngineClient | None = None) -> None:
        self.pool = pool
        self.cfg = cfg
        self.metrics = metrics
        self.lengths = lengths
        self.client = client
        # What the engines accept: checked before the first leg, so no prefill is spent on a refused request;
        # vLLM's own models run on a decode engine (router/validate.py).
        self.validator = validate.RequestValidator(lengths, limits,
                                                   self.engine_check if client is not None else None)
        self.stored = stored
        # The prefill engines' KV lease: decode must pull well within it (admission checks decode's queue).
        self.lease_s = lease_s
        self.tenants = Tenants(cfg)  # each tenant's limits and share (router/tenants.py)
        self.tenants.on_admitted = lambda t, p, o: self.metrics.tenant_admitted(t, p, o)
        self.tenants.on_refused = lambda t, cause: self.metrics.tenant_refused.labels(t, cause).inc()
        # Requests admitted and not finished, per role (a request holds its prefill slot until its
        # prefill leg ends, its decode slot until the answer is complete).
        self.admitted: dict[str, int] = {"prefill": 0, "decode": 0}
        #: ``nixl.bidirectional``: the requests whose blocks decode engines keep (router/handback.py). Every
        #: splittable prompt's ids are then rendered: the handback reads them, and a prompt that starts with a
        #: noted request's tokens costs prefill only the rest.
        self.handbacks: Handbacks | None = None

    def before_body(self, tenant: str) -> None:
        """The refusals that need no body, asked before it is read: the tenant's limits and the in-flight caps
        (a full router neither reads nor parses a body of up to ``max_body_bytes`` it would refuse)."""
        self.tenants.precheck(tenant)
        self._caps(tenant)

    def _admit_count(self, prompt_tokens: int, new_tokens: int, tenant: str | None = None) -> Flight:
        """The router's and each role's in-flight count bounds (hard caps beside admission by work)."""
        self._caps(tenant, counted=True)
        return Flight(self.admitted, self.metrics, prompt_tokens, new_tokens)

    def _caps(self, tenant: str | None = None, counted: bool = False) -> None:
        """Refuse (429) when the router or every engine of a role is at its in-flight cap. Also asked before a
        request's checks: a client flooding a full router is refused before its bodies cost an engine's check.

        With tenants, the last :data:`CAP_RESERVE` of each cap is kept for tenants under their share of it
        (the cap over the tenants in flight, two at least; ``counted``: this request is already in its
        tenant's count): a tenant with no limit of its own filled every slot with long streams, and every
        other tenant's first request was refused at once."""
        caps = [("router", self.admitted["decode"], self.cfg.max_inflight)]
        for role, per in (("decode", self.cfg.max_inflight_per_decode_engine),
                          ("prefill", self.cfg.max_inflight_per_prefill_engine)):
            healthy = self.pool.healthy(role)  # type: ignore[arg-type]
            if healthy:
                caps.append((role, self.admitted[role], per * len(healthy)))
        for what, count, cap in caps:
            if count >= cap:
                self.refused("router_full" if what == "router" else f"{what}_full")
                raise Overloaded(f"the router holds {cap} requests; retry shortly" if what == "router" else
                                 f"all {what} engines are at their in-flight limit ({cap} in all); retry shortly")
            if (tenant is not None and self.tenants.enabled and count >= cap - max(1, int(cap * CAP_RESERVE))
                    and not self.tenants.under_share(tenant, cap, counted)):
                self.refused("tenant_share")
                whose = "the router's" if what == "router" else f"the {what} engines'"
                raise Overloaded(f"tenant '{tenant}' holds its share of {whose} in-flight limit ({cap}); the rest is "
                                 "kept for other tenants; retry shortly")

    async def engine_check(self, route: Route, body: dict[str, Any]) -> dict[str, Any] | None:
        """vLLM's models' verdict on ``body``, from a healthy prefill engine (a decode engine when none is up):
        they run the same vLLM, and a prefill engine's server streams no tokens a check could delay. None when
        no engine is up to ask."""
        eps = self.pool.healthy("prefill") or self.pool.healthy("decode")
        decided = None
        try:
            if eps and self.client is not None:
                decided = await self.client.check_body(random.choice(eps), route, body, validate.CHECK_PATH,
                                                       ENGINE_CHECK_TIMEOUT_S)
        except BadRequest:
            self.metrics.engine_checks.labels("refused").inc()
            raise
        self.metrics.engine_checks.labels("no_verdict" if decided is None else "passed").inc()
        return decided

    def local_below(self) -> int:
        """Prompts shorter than this are computed on decode (``router.local_prefill_below_tokens``; ``auto``:
        from the decode engines' measured speeds, the most cautious of them, 0 until one is measured)."""
        v = self.cfg.local_prefill_below_tokens
        if v != "auto":
            return int(v)
        sizes = [int(ep.load.calibrated_rate * ep.load.tpot_single * AUTO_LOCAL_STEPS)
                 for ep in self.pool.healthy("decode") if ep.load.calibrated_rate and ep.load.tpot_single]
        return min(sizes, default=0)

    def _cache_known(self) -> bool:
        """Cache-aware disaggregation is on and the router knows of blocks on some engine (else no prompt
        need be rendered to look them up)."""
        return self.cfg.cache_aware_steps > 0 and cache_aware.holds_any(
            self.pool.healthy("decode") + self.pool.healthy("prefill"), self.pool.kv_index)

    def refused(self, cause: str) -> None:
        self.metrics.refused.labels(cause).inc()
        self.metrics.errors.labels(cause).inc()

    def routing_key(self, role: str, route: Route, body: dict[str, Any], session: str | None,
                    ids: list[int] | None) -> RoutingKey:
        """What ``role``'s routing plugin needs from this request (e.g. a prompt prefix, the session id, the
        prompt's token ids: ``ids``, from :meth:`prompt_ids`, given to the roles that want them)."""
        ids = ids if self.pool.wants_prompt_ids(role) else None
        return self.pool.routing_key(role, RoutingRequest(route, body, session, ids))  # type: ignore[arg-type]

    async def prompt_ids(self, route: Route, body: dict[str, Any]) -> list[int] | None:
        """The prompt's token ids for routing by cached prefix. A conversation's (chat, Responses, Messages)
        are rendered through the model's chat template in a worker thread, never on the event loop, and
        given up after :data:`RENDER_TIMEOUT_S` (the request is then routed by load): a template and a
        conversation are bounded by the body's size, but the loop also serves every other request and /health.
        A long completions text is encoded there too (the count's encoding, remembered, is gone when another
        request's came between: two 640,000-character prompts at once held the loop 0.35 s each)."""
        if route == "completions" and not self.lengths.is_big(route, body):
            return self.lengths.token_ids(route, body)  # (a short text's encoding is remembered from its count)
        try:
            return await asyncio.wait_for(asyncio.to_thread(self.lengths.token_ids, route, body), RENDER_TIMEOUT_S)
        except asyncio.TimeoutError:
            log.warning("rendering a chat prompt took over %.0f s; routed by load", RENDER_TIMEOUT_S)
            return None

    async def admit(self, route: Route, body: dict[str, Any], session: str | None, owner: str, tenant: str
                     ) -> tuple[Request, admission.Admitted, Flight, RoutingKey]:
        """Checks, limits and admission by work: the request as checked (:class:`Request`), the engines
        picked, its claims, decode's routing key. Raises the :class:`~pdserve.errors.RequestError` that
        refuses the request; nothing is held then."""
        self.tenants.precheck(tenant)  # a tenant over a limit is refused before the costly checks
        if self.tenants.enabled and self.tenants.outranked(tenant):
            # The priority hold, from the router's quick count, before vLLM's request models run: a flood of
            # long lower-priority prompts costs the router (and the engines' cores) little to refuse.
            try:
                # (A request with much text is counted off the loop, by the validator: here it holds nothing.)
                quick = 0 if self.lengths.is_big(route, body) else self.lengths.measure(route, body)[0]
            except Exception:  # noqa: BLE001 - a body the checks below refuse properly
                quick = 0
            self.tenants.hold(tenant, self._engine_seconds(quick))
        self._caps(tenant)  # again below, with the claim: the checks may wait on an engine
        req = await self.validator.check(route, body)
        if req.route == "responses":
            await self._response_ids(req, owner)
            if req.previous_response_id is not None:
                # The engine reads the whole stored conversation again, not only the new input.
                req = req.with_prompt_tokens(
                    req.prompt_tokens + self.stored.context_tokens(req.previous_response_id, owner))
        n_prompt, n_new = req.prompt_tokens, req.max_new_tokens or 0
        charged = req.output_charge()  # (every sequence's whole budget: what the tenant may be sent)
        if self.tenants.enabled:
            self.tenants.hold(tenant, self._engine_seconds(n_prompt))  # the priority hold (router/tenants.py)
        ticket = self.tenants.admit(tenant, n_prompt, charged)  # 429 when the tenant is over a limit
        try:
            flight = self._admit_count(n_prompt, n_new, tenant)
        except BaseException:
            self.tenants.refund(ticket, n_prompt, charged)
            self.tenants.release(ticket)
            raise
        flight.also(lambda: self.tenants.release(ticket))
        flight.sequences = req.sequences
        if (salt := self.tenants.salt(tenant, req.body.get("cache_salt"))) is not None:
            # The tenant's own prefix cache (router/tenants.py); not a field any decision reads.
            req.body["cache_salt"] = salt
        if self.tenants.enabled and self.validator.limits.priority_scheduling and route != "messages":
            # Engines that schedule by priority order their queues (and preempt) by the tenant's: vLLM runs a
            # lower value first, the config ranks a higher one first. A client's own is refused (handoff.py);
            # vLLM's Anthropic Messages model has no priority.
            req.body["priority"] = -self.tenants.priority(tenant)
        scale = self.tenants.wait_scale(tenant)
        cfg = self.cfg if scale >= 1.0 else self.cfg.model_copy(
            update={"max_queue_wait_s": self.cfg.max_queue_wait_s * scale})
        try:
            local_below = self.local_below()
            plan = handoff.plan(req, local_below=local_below)
            # Only a request that may be split can run on the decode replica holding its prompt, or be sent
            # to prefill: the prompt is rendered to look up what the engines hold (a chat template, in a
            # worker thread) only then.
            splittable = plan.reason in ("pd", handoff.SHORT_PROMPT)
            wants_ids = self.pool.wants_prompt_ids("decode") or self.pool.wants_prompt_ids("prefill")
            ids = (await self.prompt_ids(route, req.body)
                   if wants_ids or (splittable and (self._cache_known() or self.handbacks is not None)) else None)
            flight.prompt_ids = ids
            index = self.pool.kv_index
            chain = index.request_chain(ids, req.body) if ids and splittable else []
            # Prompt tokens a prefill leg would read from a decode engine's kept blocks, not compute.
            reads = (self.handbacks.peek(ids, handback_scope(owner, req.body), lora_adapter(req.body))
                     if self.handbacks is not None and ids and splittable else 0)
            on_decode = cache_aware.find(self.pool.healthy("decode"), index, self.cfg, chain, len(ids or ()),
                                         self.pool.healthy("prefill"), prefill_reads=reads)
            if on_decode is not None:
                plan = handoff.plan(req, local_below=local_below, cached_on_decode=True)
            decode_key = self.routing_key("decode", route, req.body, session, ids)
            prefill_key = self.routing_key("prefill", route, req.body, session, ids)
            lora = self._lora_ask(req, tenant)
            # Only the engine that stored the earlier response can continue it: its batch alone must take the
            # adapter (below), whatever the others run.
            held = (self.stored.where(req.previous_response_id, self.answering(), owner)
                    if plan.reason == "previous_response" and req.previous_response_id is not None else None)
            try:
                adm = admission.admit(
                    self.pool, cfg, disaggregate=plan.disaggregate, reason=plan.reason,
                    prompt_tokens=n_prompt, lease_s=self.lease_s, new_tokens=n_new, sequences=req.sequences,
                    prefill_key=prefill_key, decode_key=decode_key,
                    local_if_idle=(plan.reason == handoff.SHORT_PROMPT
                                   and self.cfg.local_prefill_below_tokens == "auto"),
                    local_on=on_decode.endpoint if on_decode is not None and plan.reason == handoff.CACHED_ON_DECODE
                    else None, lora=lora if held is None else None)
                if held is not None:
                    if lora is not None:
                        admission.lora_room([held], lora, cfg)
                    adm = admission.Admitted(None, held, plan.reason)
            except admission.Refused as e:
                self.refused(e.cause)
                self.tenants.refund(ticket, n_prompt, charged)
                self.tenants.refused(tenant, e.cause)
                raise
            if lora is not None:
                flight.lora = lora
                flight.claim_lora(adm.decode)
            # The engine computing the prompt is charged only the part its prefix cache lacks.
            computing = adm.prefill or adm.decode
            part = cache_aware.cached_part(computing, index, chain, n_prompt) if chain else None
            if adm.prefill is not None and reads > (part[0] if part else 0):
                part = (reads, n_prompt - reads)  # (what prefill reads from decode it does not compute)
            if part is not None:
                flight.held_on(computing, *part)
        except BaseException:
            flight.release()
            raise
        return req, adm, flight, decode_key

    def _lora_ask(self, req: Request, tenant: str) -> LoraAsk | None:
        """What admission checks of the engines' LoRA batch slots for ``req`` (router/lora_slots.py); None on
        the base model or where the engines' ``max_loras`` is unknown."""
        adapter, slots = lora_adapter(req.body), self.validator.limits.max_loras
        if not adapter or not slots:
            return None
        return LoraAsk(adapter, tenant, slots, fair=self.tenants.enabled,
                       cache=self.validator.limits.lora_cache or slots)

    def answering(self) -> list[Endpoint]:
        """Engines that may hold a stored response: decode engines, and prefill engines that answered whole
        requests (``router.disaggregate_by_load``)."""
        return self.pool.healthy("decode") + self.pool.healthy("prefill")

    def _engine_seconds(self, prompt_tokens: int) -> float:
        """How long a prompt would hold the least busy prefill engine (its queue's wait, then the prompt, at
        the measured speed); 0 when no speed is known yet."""
        eps = self.pool.healthy("prefill") or self.pool.healthy("decode")
        costs = [ep.load.wait_s() + prompt_tokens / r for ep in eps if (r := ep.load.rate())]
        return min(costs, default=0.0)

    async def _response_ids(self, req: Request, owner: str) -> None:
        """A Responses request may continue only its own key's responses, and may not take a known response's
        id as its own (vLLM makes a body's ``request_id`` the new response's id); the router names the new
        response when the client does not (with keys, always: router/stored.py)."""
        prev = req.previous_response_id
        # With keys, only an id made for the caller's key, kept by an engine: one another key's, or one no engine
        # keeps, would go to an engine that cannot tell whose it is.
        if prev is not None and await self.stored.locate(prev, self.answering(), owner) is None and owner:
            raise NotFound(f"Response with id '{prev}' not found.", param="previous_response_id")
        rid = req.body.get("request_id")
        if rid is not None and (not isinstance(rid, str) or len(rid) > validate.REQUEST_ID_MAX_LEN
                                or not validate.REQUEST_ID_CHARS.fullmatch(rid)):
            # The router keeps every id it notes (50,000), and vLLM stores the answer under it: a megabyte each
            # would be gigabytes of the router's memory.
            raise BadRequest(f"'request_id' must be 1 to {validate.REQUEST_ID_MAX_LEN} characters from "
                             "A-Z a-z 0-9 . _ : -", param="request_id")
        if isinstance(rid, str) and (self.stored.known(rid) or owner):
            # vLLM stores the answer under it, over any answer of that id the engine keeps: with keys, another
            # key's response (one this router may not know of) must never be replaced.
            raise BadRequest("'request_id' names a stored response; leave it out or choose a new one"
                             if self.stored.known(rid) else
                             "'request_id' of a Responses request is the router's to choose when API keys are on; "
                             "leave it out", param="request_id")
        if rid is None:
            req.body["request_id"] = self.stored.new_id(owner)
