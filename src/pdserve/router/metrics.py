"""Prometheus metrics of the router, and the engines' own ``vllm:*`` metrics relabelled by role/replica.

Router series (all prefixed ``pdserve_``):

- ``requests_total{route,status}``; ``errors_total{cause}``
- ``request_duration_seconds{route}``, ``time_to_first_token_seconds{route}``,
  ``time_per_output_token_seconds{route}``
- ``phase_duration_seconds{phase}``: ``prefill`` (the prefill leg), ``kv_handoff`` (prefill answer to the
  decode engine's first byte: the pull plus the first decode step), ``decode`` (first byte to the end)
- ``inflight_requests{role}`` (requests held by the router per role: the queue depth it sees)
- ``pd_decisions_total{decision,reason}``
- ``pd_share_recent``: share of the last 200 requests that ran P/D (the rest: ``pd_decisions_total`` says why)
- ``admission_refused_total{cause}``: 429/503 answers of admission, by cause (``prefill_wait``,
  ``decode_wait``, ``decode_tpot``: the work estimate; ``router_full``, ``prefill_full``,
  ``decode_full``: the count bounds; ``tenant_share``: a tenant at its share of a bound's last eighth;
  ``lora_slots``: no engine's batch can start the adapter now, router/lora_slots.py;
  ``prefill_failed_decode_busy``)
- ``engine_checks_total{outcome}``: request bodies checked by vLLM's own models on an engine
  (router/validate.py): ``passed``, ``refused`` (a 400 to the client), ``no_verdict`` (no engine answered:
  the router's own rules decided alone)
- ``kv_lease_checks_total{outcome}``: slow handoffs checked against the KV lease (``expired`` and
  ``unknown`` were recomputed: the lease-lost count)
- ``stream_migrations_total{outcome}``: streams whose decode engine failed mid-stream (:mod:`.migrate`):
  ``migrated`` (went on elsewhere), ``restarted`` (nothing had been sent: run again), ``completed`` (only the
  end was missing), ``failed`` (ended with an error event)
- ``early_first_token_total{outcome}``: streams that began with the prefill leg's token (:mod:`.early`)
- ``kv_handback_total{outcome}`` (``nixl.bidirectional``): P/D prefill legs of a prompt that starts with a
  finished request's tokens (:mod:`.handback`): ``read`` (prefill read decode's blocks), ``none`` (no such
  request noted), ``gone`` (its engine kept nothing by then), ``differs`` (fewer than a few tokens matched);
  besides, ``stalled``: a leg that read gave no answer in time and was sent again without the read
- ``router_gc_pause_seconds{generation}``: the router process's garbage-collector pauses (:mod:`.heap`)
- per engine (``role``, ``replica``): ``engine_queued_prompt_tokens``, ``engine_prompt_tokens_per_second``
  (measured), ``engine_estimated_wait_seconds``, ``engine_decode_streams``, ``engine_tpot_seconds``
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families

T = TypeVar("T")

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120, 300)
_GC = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1)
_TPOT = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class RouterMetrics:
    def tenant_admitted(self, tenant: str, prompt_tokens: int, output_tokens: int) -> None:
        self.tenant_requests.labels(tenant).inc()
        self.tenant_tokens.labels(tenant, "prompt").inc(prompt_tokens)
        self.tenant_tokens.labels(tenant, "output").inc(output_tokens)

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("pdserve_requests", "Requests answered, by route and HTTP status.",
                                ["route", "status"], registry=r)
        self.errors = Counter("pdserve_errors", "Errors by cause.", ["cause"], registry=r)
        self.tenant_requests = Counter("pdserve_tenant_admitted", "Requests admitted, by tenant.", ["tenant"],
                                       registry=r)
        self.tenant_refused = Counter("pdserve_tenant_refused", "Requests of a tenant refused, by cause (a "
                                      "tenant limit, or admission by work).", ["tenant", "cause"], registry=r)
        self.tenant_tokens = Counter("pdserve_tenant_tokens", "Tokens admitted, by tenant and kind (prompt, "
                                     "output budget).", ["tenant", "kind"], registry=r)
        self.e2e = Histogram("pdserve_request_duration_seconds", "End-to-end request time at the router.",
                             ["route"], buckets=_LATENCY, registry=r)
        self.ttft = Histogram("pdserve_time_to_first_token_seconds", "Time to the first streamed byte.",
                              ["route"], buckets=_LATENCY, registry=r)
        self.tpot = Histogram("pdserve_time_per_output_token_seconds", "Mean time per output token after the "
                              "first.", ["route"], buckets=_TPOT, registry=r)
        self.phase = Histogram("pdserve_phase_duration_seconds", "Time per P/D phase.", ["phase"],
                               buckets=_LATENCY, registry=r)
        self.inflight = Gauge("pdserve_inflight_requests", "Requests in flight at the router per role.",
                              ["role"], registry=r)
        self.decisions = Counter("pdserve_pd_decisions", "Disaggregated or local, and why.",
                                 ["decision", "reason"], registry=r)
        self.migrations = Counter("pdserve_stream_migrations", "Streams whose decode engine failed mid-stream, by "
                                  "outcome: migrated, restarted, completed or failed.", ["outcome"], registry=r)
        self.kv_lease = Counter("pdserve_kv_lease_checks", "Slow handoffs checked against the prefill engine's "
                                "KV lease: held, expired (answer recomputed) or unknown (recomputed).",
                                ["outcome"], registry=r)
        for outcome in ("held", "expired", "unknown"):
            self.kv_lease.labels(outcome)  # exposed at 0 from the start, so rates and alerts work at once
        self.engine_checks = Counter("pdserve_engine_checks", "Request bodies checked by vLLM's own models on "
                                     "an engine: passed, refused, or no_verdict (the router's rules alone).",
                                     ["outcome"], registry=r)
        for outcome in ("passed", "refused", "no_verdict"):
            self.engine_checks.labels(outcome)
        self.refused = Counter("pdserve_admission_refused", "Requests refused before any leg, by cause.",
                               ["cause"], registry=r)
        for cause in ("prefill_wait", "decode_wait", "decode_tpot"):
            self.refused.labels(cause)
        self.pd_share = Gauge("pdserve_pd_share_recent", "Share of the router's last 200 requests that ran P/D "
                              "(prompt on prefill, KV pulled by decode); see pdserve status for why the rest did not.",
                              registry=r)
        self.early_token = Counter("pdserve_early_first_token", "Streamed P/D requests whose first token came "
                                   "from the prefill leg at once: sent (decode's copy removed), mismatch "
                                   "(decode computed another first token; the stream went on from the prefill's) "
                                   "or mismatch_passed (it could not: decode's stream passed unchanged).",
                                   ["outcome"], registry=r)
        for outcome in ("sent", "mismatch", "mismatch_passed"):
            self.early_token.labels(outcome)
        for outcome in ("migrated", "restarted", "completed", "failed"):
            self.migrations.labels(outcome)
        self.handback = Counter("pdserve_kv_handback", "P/D prefill legs with nixl.bidirectional: read (prefill "
                                "read the blocks decode kept of the conversation's last turn), none (nothing "
                                "noted), gone (the engine kept nothing by then) or differs (too few tokens "
                                "matched); stalled: a leg that read gave no answer in time and was sent "
                                "again without the read.", ["outcome"], registry=r)
        for outcome in ("read", "none", "gone", "differs", "stalled"):
            self.handback.labels(outcome)
        self.gc_pause = Histogram("pdserve_router_gc_pause_seconds", "Pauses of the router process's garbage "
                                  "collector, by generation (the event loop answers nothing meanwhile).",
                                  ["generation"], buckets=_GC, registry=r)
        self._engines: Any = None

    def watch_engines(self, endpoints: Any) -> None:
        """Expose each engine's load as the router sees it (``endpoints()`` is read at scrape time)."""
        if self._engines is None:
            self._engines = _EngineLoadCollector(endpoints)
            self.registry.register(self._engines)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _EngineLoadCollector:
    _SERIES = (
        ("pdserve_engine_queued_prompt_tokens", "Prompt tokens the router sent an engine, not yet computed.",
         "queued_prompt_tokens"),
        ("pdserve_engine_prompt_tokens_per_second", "An engine's measured prompt speed.", "prompt_tokens_per_s"),
        ("pdserve_engine_estimated_wait_seconds", "How long a prompt sent now would wait on the engine.",
         "est_wait_s"),
        ("pdserve_engine_decode_streams", "Decode streams the router runs on an engine.", "streams"),
        ("pdserve_engine_tpot_seconds", "An engine's recent mean time per output token.", "tpot_s"),
    )

    def __init__(self, endpoints: Any) -> None:
        self.endpoints = endpoints

    def collect(self) -> Iterable[Metric]:
        from prometheus_client.core import GaugeMetricFamily

        eps = self.endpoints()
        for name, doc, key in self._SERIES:
            fam = GaugeMetricFamily(name, doc, labels=["role", "replica"])
            for ep in eps:
                v = ep.load.as_dict().get(key)
                if v is not None:
                    fam.add_metric([ep.role, ep.replica_id or ep.url], float(v))
            yield fam


class _Families:
    def __init__(self, fams: list[Metric]) -> None:
        self.fams = fams

    def collect(self) -> Iterable[Metric]:
        return self.fams


def merge_engine_metrics(texts: list[tuple[dict[str, str], str]]) -> bytes:
    """Engine expositions, each with extra labels, merged into one valid exposition (one family each)."""
    fams: dict[str, Metric] = {}
    for labels, text in texts:
        for fam in text_string_to_metric_families(text):
            merged = fams.get(fam.name)
            if merged is None:
                merged = fams[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
            for s in fam.samples:
                merged.add_sample(s.name, {**s.labels, **labels}, s.value, s.timestamp, s.exemplar)
    reg = CollectorRegistry()
    reg.register(_Families(list(fams.values())))  # type: ignore[arg-type]
    return generate_latest(reg)


def only_families(text: str, prefixes: tuple[str, ...]) -> str:
    """The lines of an exposition that belong to families whose names start with one of ``prefixes`` (their
    HELP/TYPE lines and samples): a vLLM engine's exposition is hundreds of kB of histograms, and a question
    about one family need not parse them all."""
    keep = []
    for line in text.splitlines():
        name = line[7:] if line.startswith(("# HELP ", "# TYPE ")) else line
        if name.startswith(prefixes):
            keep.append(line)
    return "\n".join(keep) + "\n"


#: How long the router waits for one engine's metrics when it is scraped.
ENGINE_SCRAPE_TIMEOUT_S = 2.0


#: Work under way that callers share, by what it computes (:func:`shared`).
_RUNNING: dict[tuple[Any, ...], asyncio.Task[Any]] = {}


async def shared(key: tuple[Any, ...], make: Callable[[], Awaitable[T]]) -> T:
    """``make()``'s result, computed once for every caller asking with the same ``key`` while it runs: what
    any client may ask for again and again (``/metrics`` and ``/pdserve/status`` read every engine, the
    host's memory by part reads every process) costs one run at a time, not one per client. Its own task: a
    caller that goes away (a client disconnecting) does not cancel it for the others."""
    task = _RUNNING.get(key)
    if task is None:
        task = asyncio.ensure_future(make())
        _RUNNING[key] = task

        def done(t: asyncio.Task[Any]) -> None:
            _RUNNING.pop(key, None)
            if not t.cancelled():
                t.exception()  # (retrieved: no "never retrieved" warning when every caller went away)

        task.add_done_callback(done)
    return await asyncio.shield(task)


async def scrape_engines(session: Any, endpoints: list[Any], timeout_s: float = ENGINE_SCRAPE_TIMEOUT_S,
                         families: tuple[str, ...] | None = None) -> bytes:
    """:func:`_scrape`, :func:`shared` by the callers that ask for the same engines' families at once."""
    return await shared(("scrape", tuple(ep.url for ep in endpoints), families, id(session)),
                        lambda: _scrape(session, endpoints, timeout_s, families))


async def _scrape(session: Any, endpoints: list[Any], timeout_s: float,
                  families: tuple[str, ...] | None) -> bytes:
    """The engines' expositions merged and relabelled (only the ``families`` named by prefix, when given).
    An engine that does not answer within ``timeout_s`` is left out: one whose port hangs (a server that died
    leaves its listening socket to its engine core until that is stopped) costs a scrape of the router at
    most that long, well inside a client's or Prometheus' own timeout.
    Parsing runs on a worker thread: several hundred kB per engine would otherwise hold the event loop, and
    every request the router serves, for tens of milliseconds."""
    import aiohttp

    async def one(ep: Any) -> tuple[dict[str, str], str] | None:
        try:
            async with session.get(ep.url + "/metrics", timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
                if r.status != 200:
                    return None
                text = await r.text()
                return ({"pdserve_role": ep.role, "pdserve_replica": ep.replica_id or ep.url},
                        only_families(text, families) if families else text)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return None

    got = [g for g in await asyncio.gather(*(one(e) for e in endpoints)) if g is not None]
    return await asyncio.to_thread(merge_engine_metrics, got)
