"""The router's config: routing policies and plugins, admission, timeouts, API keys, tenants."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from pdserve.config.base import _Strict
from pdserve.config.routing import PLUGIN_NAMES, PluginSettings, check_policy_name
from pdserve.config.tenants import TENANT_NAME, TenantConfig


class RouterConfig(_Strict):
    """The OpenAI-compatible front: timeouts and replica choice."""

    policy: str = Field(
        "least_loaded",
        description=(
            f"How a replica of each role is picked: one of {', '.join(f'`{n}`' for n in PLUGIN_NAMES)} (a routing "
            "plugin, pdserve/router/routing/; its settings under `router.plugins.<name>`)."
        ),
    )
    prefill_policy: str | None = Field(None, description="Policy for prefill replicas only; default `policy`.")
    decode_policy: str | None = Field(None, description="Policy for decode replicas only; default `policy`.")
    prefix_affinity_tokens: int | None = Field(
        None, ge=1,
        description="Older spelling of `router.plugins.prefix_affinity.tokens` (still accepted; null: that one).",
    )
    plugins: PluginSettings = Field(
        default_factory=PluginSettings,
        description="Settings of the routing plugins, by policy name; each block is optional.",
    )
    prefill_timeout_s: float = Field(120.0, gt=0, description="Longest wait for the prefill leg.")
    decode_timeout_s: float = Field(600.0, gt=0, description="Longest time the decode leg may take in all.")
    connect_timeout_s: float = Field(5.0, gt=0, description="Longest wait to open a connection to an engine.")
    max_body_bytes: int = Field(
        16 * 1024 * 1024, ge=1024, description="Largest accepted request body; larger gets 413."
    )
    num_replicas: int = Field(1, ge=1, description="Router replicas.")
    early_first_token: bool = Field(
        True,
        description=(
            "Streamed P/D requests get the first token from the prefill leg's answer at once, instead of after "
            "the KV pull and decode's first step; decode's copy of it is removed from its stream. Unseeded "
            "sampling gets a router-chosen seed on both legs. If the two engines break a near-tie differently "
            "(measured: 2 of 84 greedy bfloat16 streams), decode's stream is dropped and the decode engine goes "
            "on from the prefill's token (`pdserve_early_first_token_total{outcome=\"mismatch\"}`), so greedy "
            "answers still equal one engine's; a stream that cannot be continued so (structured outputs, echo) "
            "passes as decode computed it, one token longer "
            "(`outcome=\"mismatch_passed\"`): set false where such answers must equal one engine's."
        ),
    )
    migrate_streams: bool = Field(
        True,
        description=(
            "A chat or completions stream whose decode engine fails mid-stream goes on on another engine "
            "(another decode replica, else a prefill engine) from the prompt and the tokens already sent: the "
            "client reads one stream, each token once; greedy answers equal one engine's where the numerics "
            "allow (the continuation recomputes the context in one prefill; in bfloat16 a near-tie may then "
            "break the other way). Streams with "
            "logprobs, stop strings, tools or structured outputs are not moved (they end with an error event)."
        ),
    )
    engine_refresh_s: float = Field(
        1.0, gt=0,
        description=("How often the router reads the engine list and probes the engines' health while requests "
                     "come; 30 s after the last one, every 10 s (a request reads a list older than twice this "
                     "first)."))
    prefill_fallback: Literal["decode", "error"] = Field(
        "decode",
        description=(
            "When no prefill replica can take a request: `decode` prefills it on the decode replica "
            "(the client sees no error), `error` answers 503."
        ),
    )
    kv_lease_check: bool = Field(
        True,
        description=(
            "Guard against expired KV leases: when a handoff takes longer than half the prefill engine's "
            "`kv_lease_duration`, the router asks that engine whether the request's blocks were freed "
            "before decode pulled them, and if so (or if it cannot tell) answers from a recompute instead "
            "of possibly wrong tokens. Costs nothing on fast handoffs."
        ),
    )
    local_prefill_below_tokens: Annotated[int, Field(ge=0)] | Literal["auto"] = Field(
        "auto",
        description=(
            "Conditional disaggregation: prompts shorter than this many tokens are prefilled on the "
            "decode replica itself, skipping the hop. 0 disaggregates every request. `auto`: the tokens a "
            "decode engine computes in two of its idle decode steps, from its measured prompt speed and "
            "time per token (a prompt that short holds decode's streams up less than the handoff costs; "
            "0 until both are measured), and only while a decode replica is idle (nothing queued, "
            "streaming or on its way): under load such prompts are disaggregated like the rest, so they "
            "never queue on decode. `/pdserve/status` shows the value in use. A prompt a decode replica "
            "mostly holds in its cache is decided first by `cache_aware_steps`, by its uncached part."
        ),
    )
    cache_aware_steps: float = Field(
        4.0, ge=0,
        description=(
            "Cache-aware disaggregation: a request whose prompt part not cached on a decode replica takes that "
            "replica at most this many of its decode steps to compute (its measured prompt speed × its "
            "single-stream step time) runs there alone: no prefill leg, no KV handoff. Every engine then "
            "publishes its KV cache events (prompt and generated blocks) and the router follows them: "
            "prefill's, so admission queues on a prefill engine only the part of a prompt its prefix cache "
            "lacks; decode's, so a "
            "conversation's next turn lands on the decode replica that holds it, while that replica is not "
            "overloaded (its queue wait fits `max_queue_wait_s`, its in-flight count is at most "
            "`plugins.kv_cache.slack` above the least loaded decode replica's, and the part it computes stalls "
            "the streams running there by at most 8 % of the shortest one's decode time). Past that budget the "
            "holder still takes it when P/D would give the first token much later (prefill's queue and the part "
            "its own cache lacks, at its measured speed) and the request gains more than the streams there lose "
            "together. Not applied until the replica's "
            "speeds are measured. Beside `local_prefill_below_tokens`, which looks at a prompt's whole length, "
            "this looks at the part decode would have to compute. 0 turns it off (plain P/D)."
        ),
    )
    disaggregate_by_load: bool = Field(
        False,
        description=(
            "Conditional disaggregation by load: each request's prompt goes to the engine that would finish it "
            "clearly sooner (the prefill replica, or the decode replica computing it itself: while streams run "
            "there only if the stall costs the shortest of them at most 8 % of its decode time, while none do "
            "only if the P/D requests on their way there wait less in all than it gains; so also when "
            "prefill's queue is past `max_queue_wait_s`, where plain P/D refuses), and its tokens to the "
            "engine with the lower expected time per token (the decode replica, or the prefill replica "
            "answering the whole request), each engine's measured speed slowed by its share of time spent "
            "on prompts (a prefill CPU engine's `auto` KV cache is then decode's size). Idle, every request is "
            "disaggregated; loaded, engines share both phases as colocated ones do. For hosts where one "
            "decode engine cannot take every stream (small CPU deployments)."
        ),
    )
    max_queue_wait_s: float = Field(
        8.0, gt=0,
        description=(
            "Admission by work: a request is admitted only if the prompts already queued on the engines it "
            "would use (in tokens, at each engine's measured speed) let it start within this many seconds; "
            "else 429 at once, with Retry-After from the estimate. Keep it well under the KV lease "
            "(nixl.kv_lease_duration_s) and prefill_timeout_s."
        ),
    )
    max_tpot_s: float | None = Field(
        1.0, gt=0,
        description=(
            "A decode engine takes one more stream only if its measured time per output token, scaled to "
            "one more stream (a request's every sequence), stays within this many seconds; else 429. An idle "
            "engine takes any request. null: no bound."
        ),
    )
    max_inflight_per_prefill_engine: int = Field(
        32, ge=1,
        description="Hard cap on requests in flight per healthy prefill engine (beside max_queue_wait_s); then 429.",
    )
    max_inflight_per_decode_engine: int = Field(
        128, ge=1,
        description="Hard cap on requests in flight per healthy decode engine (beside max_queue_wait_s); then 429.",
    )
    max_inflight: int = Field(
        512, ge=1,
        description="Requests one router replica holds at once; past that it answers 429 with Retry-After.",
    )
    api_keys: list[str] = Field(
        default_factory=list,
        description=(
            "Accepted API keys (`Authorization: Bearer KEY`), for `pdserve serve`. Empty, no "
            "PDSERVE_API_KEYS in the environment and no `tenants`: no authentication (a tenant's keys are "
            "accepted as well). `/health` stays open for probes. "
            "`pdserve render` refuses them (they would be in the manifests in clear): use "
            "`kubernetes.api_keys_secret`."
        ),
    )
    api_keys_env: str = Field(
        "PDSERVE_API_KEYS",
        pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description=(
            "Environment variable with more accepted keys, separated by commas or newlines; read at the "
            "router's start. Rendered pods get it from `kubernetes.api_keys_secret`."
        ),
    )
    tenants: dict[str, TenantConfig] = Field(
        default_factory=dict,
        description=(
            "Tenants by name: each names the environment variable with its API keys and may set a priority "
            "and limits (requests/s, prompt and output tokens per minute, concurrent requests); see "
            "pdserve/config/tenants.py. A tenant's stored responses and prefix cache are its own."
        ),
    )
    stored_responses_per_owner: int = Field(
        1000, ge=1,
        description=(
            "Responses API answers each engine keeps for one owner (a tenant, else an API key; without keys "
            "all clients are one owner) where vLLM's store is on (`VLLM_ENABLE_RESPONSES_API_STORE=1`): past "
            "it the owner's oldest are forgotten (404 when named later), never another owner's."
        ),
    )
    stored_responses_per_engine: int = Field(
        10000, ge=1,
        description=("Responses API answers each engine keeps in all, whoever owns them; past it the owner "
                     "keeping the most loses its oldest."),
    )
    stored_responses_mib_per_owner: int = Field(
        256, ge=1,
        description=(
            "Memory (MiB) the Responses API answers each engine keeps for one owner may hold, as measured when "
            "stored: each answer keeps its whole conversation, so a long conversation's turns cost up to the "
            "model's context each. Past it the owner's oldest are forgotten, never another owner's."
        ),
    )
    stored_responses_mib_per_engine: int = Field(
        1024, ge=1,
        description=("Memory (MiB) the Responses API answers each engine keeps may hold in all; past it the owner "
                     "keeping the most loses its oldest."),
    )

    @field_validator("tenants")
    @classmethod
    def _tenant_names(cls, v: dict[str, TenantConfig]) -> dict[str, TenantConfig]:
        for name in v:
            if not TENANT_NAME.fullmatch(name):
                raise ValueError(f"tenant name {name!r}: letters, digits, '.', '_', '-', at most 64")
        return v

    @field_validator("policy", "prefill_policy", "decode_policy")
    @classmethod
    def _known_policy(cls, v: str | None) -> str | None:
        return v if v is None else check_policy_name(v)

    @model_validator(mode="after")
    def _fold_prefix_affinity_tokens(self) -> RouterConfig:
        """The older flat spelling sets the prefix_affinity plugin's ``tokens`` (both given: they must agree)."""
        n = self.prefix_affinity_tokens
        block = self.plugins.prefix_affinity
        if n is not None and n != block.tokens:
            if "tokens" in block.model_fields_set:
                raise ValueError(f"prefix_affinity_tokens ({n}) and plugins.prefix_affinity.tokens "
                                 f"({block.tokens}) disagree; set only plugins.prefix_affinity.tokens")
            self.plugins = self.plugins.model_copy(
                update={"prefix_affinity": block.model_copy(update={"tokens": n})})
        return self
