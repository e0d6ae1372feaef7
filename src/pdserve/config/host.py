"""Where and how the app runs on its hosts: the HTTP endpoint, CPU engines, NIXL."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from pdserve.config.base import _Strict

#: A prefill engine declines to read a decode engine's kept blocks this close to the end of their pin (vLLM's
#: ``_KV_BLOCKS_EXPIRY_SAFETY_MARGIN``, nixl/pull_worker.py) and computes those tokens instead.
VLLM_READ_MARGIN_S = 5.0
#: The router gives a note up this much earlier still: the engine's clock started a little before its own.
HANDBACK_SLACK_S = 1.0
#: The shortest pin ``nixl.bidirectional`` takes: a next turn must come within the pin less both margins
#: (router/handback.py ``read_window_s``), here 4 s.
MIN_PIN_S = 10


def check_pin_s(ttl: object, name: str) -> None:
    """Raise when a handback pin of ``ttl`` seconds (the setting ``name``) is too short to be read."""
    if not (isinstance(ttl, (int, float)) and not isinstance(ttl, bool) and ttl >= MIN_PIN_S):
        raise ValueError(f"{name}: {ttl!r} is too short for nixl.bidirectional; at least {MIN_PIN_S} seconds: "
                         f"vLLM declines a read in a pin's last {VLLM_READ_MARGIN_S:g} s")


class HttpConfig(_Strict):
    """Where the endpoint listens (`pdserve serve`; with `serve run` Ray's `http_options` apply)."""

    host: str = Field("127.0.0.1", description="Listen address. Use 0.0.0.0 to accept remote clients.")
    port: int = Field(8000, ge=1, le=65535, description="Listen port.")
    ingress: Literal["direct", "proxy"] = Field(
        "direct",
        description=(
            "Who serves `port` under `pdserve serve`: `direct`, the router replicas themselves (SO_REUSEPORT; "
            "a request skips Ray Serve's HTTP proxy hop), or `proxy`, Ray Serve's proxy. With `direct`, Ray "
            "Serve's proxy runs only when `proxy_port` is set. `serve run` and KubeRay always use Ray's proxy."
        ),
    )
    proxy_port: int | None = Field(
        None, ge=1, le=65535,
        description="With `ingress: direct`, a port where Ray Serve's proxy serves the app too (null: no "
                    "proxy; one process and ~1 % of a core less while idle).",
    )
    # The public port's limits (direct ingress; pdserve/router/edge.py). Ray Serve's proxy has its own.
    max_header_bytes: int = Field(
        32 * 1024, ge=1024, le=16 * 1024 * 1024,
        description="Request line and headers, bytes, at most; beyond: 431 and the connection closed.")
    header_timeout_s: float = Field(
        10.0, gt=0, le=3600,
        description="Seconds from a request's first byte (or the connection's opening) to the end of its "
                    "headers; beyond: 408 and the connection closed.")
    body_timeout_s: float = Field(
        60.0, gt=0, le=3600,
        description="Seconds from the end of a request's headers to the end of its body; beyond: 408 and "
                    "the connection closed.")
    write_timeout_s: float = Field(
        60.0, gt=0, le=3600,
        description="Seconds an answer may wait for a client that reads none of it (the connection's send "
                    "buffer full); beyond: the connection closed and the engine's request aborted. A client "
                    "that never reads a long stream held its decode slot until it went away.")
    max_connections: int = Field(
        512, ge=1, le=1_000_000,
        description="Open client connections per router replica; beyond: 503 and the new connection closed "
                    "(the router needs file descriptors for its engine connections too).")
    max_requests_per_connection: int = Field(
        1000, ge=1,
        description="Requests one keep-alive connection may carry; the last answer says `Connection: close`.")


class CpuConfig(_Strict):
    """Engine settings used only on hosts without a GPU."""

    kv_cache_gib: Annotated[float, Field(gt=0)] | Literal["auto"] = Field(
        "auto",
        description=(
            "KV cache per engine, GiB (fractions allowed; vLLM's `kv_cache_memory_bytes`). `auto`: room for "
            "four prompts of the engine's whole context (`max_model_len`) on a decode engine, two on a prefill "
            "engine (it holds a prompt until decode has read it; four with `router.disaggregate_by_load`, where "
            "it also answers whole requests), at the model's KV bytes per token in the "
            "engine's dtype (the packaged model in float32 at 4,096 tokens: 0.70 and 0.35 GiB). "
            "`engine_kwargs.kv_cache_memory_bytes`, when set, wins."
        ),
    )
    kv_cache_lazy: bool = Field(
        True,
        description=(
            "The KV cache takes memory as it fills, not all at start: its buffer's pages become resident when "
            "an engine first writes a block there (vLLM zeroes the whole buffer at start; engine/kv_memory.py). "
            "The embedded default is 1.4 GiB lighter until the caches fill; a busy engine reaches the full "
            "size. Only where the host has twice the cache available (else vLLM's: all at start, and its "
            "start-up check against free memory). `false`: all of it at start, always."
        ),
    )
    share_weights: Literal["packed", "mapped", "off"] = Field(
        "packed",
        description=(
            "How the CPU engines of one host hold the model's weights. `packed`: vLLM's packed oneDNN copies, "
            "packed once by the engines' forkserver (`cpu.fork_engines`) and inherited by every engine it "
            "forks, from weight files the engines write to the weight cache (`<cache>/shared-weights`) at "
            "their first start; same speed and numbers as vLLM's own (engine/prepack.py). The embedded "
            "default in float32 from its second start: 0.5 GiB less. `mapped`: every engine maps the files "
            "and computes the linear layers with `F.linear` on them (engine/weight_share.py): page-cache "
            "pages the kernel may drop under memory pressure, but slower decode batches (time per token of "
            "one stream 0.92x, of four 1.23x; AMD EPYC, AVX2; `pdserve bench --scenario cpu-env --opt "
            "variant=shared-weights`) and each engine packs its own output head (0.1 GiB more than `packed` "
            "for the embedded default). `off`: each engine its own copy, nothing on disk. `true` and `false` "
            "read as `mapped` and `off`. Costs the weights' size on disk (not with `off`)."
        ),
    )
    cores_per_engine: int = Field(
        1, ge=1, description="Cores each engine is bound to (VLLM_CPU_OMP_THREADS_BIND)."
    )
    bind_cores: bool = Field(
        True, description="Give each engine on a host its own cores so engines don't fight over them."
    )
    preload_tcmalloc: bool = Field(
        True,
        description=(
            "Preload gperftools' tcmalloc into CPU engines when the host has it (Debian/Ubuntu: "
            "libtcmalloc-minimal4; `make setup` installs it when it can): vLLM's CPU worker asks for it, and "
            "it measured +7.7 % prompt speed, -5.3 % time per output token."
        ),
    )
    engine_nice: int = Field(
        0, ge=0, le=19,
        description=(
            "Scheduling niceness CPU engine processes add to their own (0: none). A positive value lets the "
            "router, Ray Serve's proxy and Ray run ahead of engines that keep every core busy, but it is not "
            "free: at 10, on a 2-core host, a decode engine's time per output token at low load went from 53 "
            "to 95 ms (Ray's and the router's wake-ups on the engine's core preempt it), and refusals under "
            "overload stayed within 100 ms without it."
        ),
    )
    shared_core_nice: int = Field(
        10, ge=0, le=19,
        description=(
            "Where a prefill engine shares a core with a decode engine (a host with more engines than cores: "
            "`bind_cores` puts one of each role on a core), the prefill engine runs at this niceness, so the "
            "decode engine's steps, which every stream there waits on, take the core whenever they want it "
            "and prompts the rest (engine/core_share.py). Two prefill and two decode engines on two cores, "
            "agent conversations: decode's time per output token p50 130 ms at 0, 92 at 10, 74 at 19 "
            "(prompts wait longer: first-token p90 9.1, 6.9, 15.2 s; AMD EPYC, AVX-512, "
            "`pdserve bench --scenario multiturn --opt topology=2p2d`). 0: the two share the core equally."
        ),
    )
    idle_spin_ms: float | None = Field(
        20, ge=0, le=1000,
        description=(
            "How long a CPU engine's worker process spins (yields the core in a loop) waiting for its next "
            "step before it sleeps until the step comes. vLLM's own is a second after every step, not "
            "settable: a second of a whole core after every request, taken from the other engine on a small "
            "host; null keeps vLLM's. Applies only to engines with a worker process "
            "(`engine_kwargs.distributed_executor_backend: mp`; a one-core CPU engine has none by default)."
        ),
    )
    fork_engines: bool = Field(
        True,
        description=(
            "`pdserve serve` starting a local Ray instance on a host with no GPU: one process imports vLLM's "
            "server while Ray starts, and each CPU engine's server is forked from it instead of importing "
            "torch and vLLM itself (engine/forkserver.py): the engines share those pages and skip the import "
            "(the embedded default on a 2-core AVX2 host: 5.17 GiB instead of 5.49, ready in 24 s instead of "
            "36). An engine it cannot fork starts afresh. No effect on a cluster."
        ),
    )
    dtype: Literal["auto", "bfloat16", "float32"] = Field(
        "auto",
        description=(
            "What CPU engines compute in (both roles get the same: the KV layout must match). `auto` takes "
            "bfloat16 only where it is no slower than float32 (one matmul of each, timed on this host) "
            "and faithful to the model (bf16 predicts the same next token as float32 at >= 99 % of the "
            "positions of a fixed text); both are measured once per host, torch and model and cached in "
            "`<cache_dir>/host/`. On AVX2-only CPUs bf16 can be 6x slower; small models such as the "
            "packaged one (~98 %) answer differently in bf16. `engine_kwargs.dtype`, when set, wins."
        ),
    )

    @model_validator(mode="before")
    @classmethod
    def _share_weights_bool(cls, data: object) -> object:
        if isinstance(data, dict) and isinstance(data.get("share_weights"), bool):
            data = {**data, "share_weights": "mapped" if data["share_weights"] else "off"}
        return data


class NixlConfig(_Strict):
    """How the KV cache moves from prefill to decode (feeds vLLM's `kv_transfer_config`)."""

    backend: Literal["UCX", "LIBFABRIC"] = Field(
        "UCX", description="NIXL backend. LIBFABRIC for AWS EFA; UCX elsewhere."
    )
    side_channel_port_base: int = Field(
        5600, ge=1024, le=65000, description="First NIXL side-channel port tried on each host."
    )
    kv_lease_duration_s: int | None = Field(
        None, ge=1,
        description=(
            "Seconds prefill keeps a request's blocks for decode to pull before freeing them "
            "(vLLM's kv_lease_duration; decode renews it while waiting). Default: vLLM's (30)."
        ),
    )
    bidirectional: bool = Field(
        False,
        description=(
            "Conversations: a decode engine keeps each finished request's blocks (prompt and answer) for "
            "`decode_blocks_ttl_s`, and the next turn's prefill reads them over NIXL instead of computing the "
            "last answer and the history's last partial block (vLLM's `bidirectional_kv_xfer`; the router "
            "checks that the new prompt starts with exactly those tokens). Every API, streamed or not. Costs "
            "decode KV capacity: a finished P/D request's blocks stay pinned until read or the TTL, within "
            "`decode_pin_share`."
        ),
    )
    decode_blocks_ttl_s: int = Field(
        30, ge=1, le=3600,
        description=(
            "With `bidirectional`: seconds a decode engine keeps a finished request's blocks for the next "
            "turn (vLLM's `decoder_kv_blocks_ttl`; at least 10). Longer than the think time between turns: "
            "vLLM declines a read in a pin's last 5 s, so the next turn's prefill reads them only if it starts "
            "within this less 6 s; later, it computes those tokens."
        ),
    )
    decode_pin_share: float = Field(
        0.5, gt=0, le=1,
        description=(
            "With `bidirectional`: the share of a decode engine's KV cache that the blocks it keeps for next "
            "turns may hold together (a block kept for two requests, as consecutive turns of a conversation "
            "share their history's blocks, counts once); the streams it runs always have the rest. A finished "
            "request that would pass it is not kept (its next turn's prefill computes the last answer, as "
            "without `bidirectional`). 1 bounds nothing."
        ),
    )
    kv_load_failure_policy: Literal["recompute", "fail"] = Field(
        "recompute",
        description="When a KV pull fails: `recompute` the prompt on decode (correct, slower) or `fail` it.",
    )
    cpu_progress_thread_delay_us: int | None = Field(
        100000, ge=0,
        description=(
            "CPU hosts: how long NIXL's progress thread sleeps in poll() between wake-ups (a transfer's own "
            "events wake it sooner). NIXL's own 0 makes it spin on a whole core, halving a one-core engine's "
            "speed; 1,000 took ~3 % of a core per idle engine, 20,000 ~0.23 %, 100,000 under 0.07 %. READs of "
            "1-64 MiB over TCP and over shared memory took as long at 20,000, 100,000 and 1,000,000 (the "
            "holder idle), and a P/D handoff as long at 20,000 and 100,000 (`pdserve bench --scenario "
            "handoff`). null keeps NIXL's value."
        ),
    )
    ucx_tls: str | None = Field(
        None,
        description=(
            "UCX transports (UCX_TLS). Default: pdserve picks shared memory + TCP on CPU hosts, UCX's own "
            "choice on GPU hosts."
        ),
    )

    @model_validator(mode="after")
    def _pins_long_enough(self) -> NixlConfig:
        if self.bidirectional:
            check_pin_s(self.decode_blocks_ttl_s, "nixl.decode_blocks_ttl_s")
        return self
