"""Every ``PDSERVE_*`` environment variable, in one place.

Two kinds:

* :class:`Settings`: what a person (or an image, or a Kubernetes manifest) may set for pdserve's own
  processes. Each variable is one typed attribute, read from the environment when the attribute is read,
  never at import time, so a value set after ``import pdserve`` counts::

      from pdserve.settings import settings
      settings().lock_dir                      # $PDSERVE_LOCK_DIR, else <tmp>/pdserve-locks
      settings({"PDSERVE_LOG_DIR": "/x"})      # the same, over another mapping (tests)

  An empty value counts as unset. A value that does not parse raises :class:`~pdserve.errors.ConfigError`
  naming the variable.

* :data:`ENGINE_PROTOCOL`: variables pdserve sets for the vLLM engine processes it starts (the launcher
  writes them, code inside the engine reads them). They are listed so that nothing about them is hidden;
  they are not meant to be set by hand.

The page ``docs/environment.md`` is generated from this module::

    python -m pdserve.settings > docs/environment.md
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar, overload

from pdserve.errors import ConfigError

T = TypeVar("T")


class EnvVar(Generic[T]):
    """One environment variable as an attribute of :class:`Settings`: name, parser, default, meaning."""

    def __init__(self, name: str, parse: Callable[[str], T], default: Callable[[], T], *,
                 default_text: str, doc: str, read_by: str) -> None:
        self.name = name
        self.parse = parse
        self.default = default
        self.default_text = default_text
        self.doc = doc
        self.read_by = read_by
        self.attr = ""

    def __set_name__(self, owner: type, attr: str) -> None:
        self.attr = attr

    @overload
    def __get__(self, obj: None, owner: type) -> EnvVar[T]: ...
    @overload
    def __get__(self, obj: Settings, owner: type) -> T: ...

    def __get__(self, obj: Settings | None, owner: type) -> EnvVar[T] | T:
        if obj is None:
            return self
        return self.read(obj.environ)

    def read(self, environ: Mapping[str, str]) -> T:
        raw = environ.get(self.name, "")
        if not raw.strip():
            return self.default()
        try:
            return self.parse(raw.strip())
        except (TypeError, ValueError) as e:
            raise ConfigError(f"environment variable {self.name}={raw!r}: {e}") from None


def _path(raw: str) -> Path:
    return Path(raw).expanduser()


def _positive_float(raw: str) -> float:
    value = float(raw)
    if not value > 0:
        raise ValueError("must be a number of seconds above 0")
    return value


class Settings:
    """pdserve's environment variables, each read when its attribute is read."""

    cache_dir: EnvVar[Path | None] = EnvVar(
        "PDSERVE_CACHE_DIR", _path, lambda: None,
        default_text="unset: `$XDG_CACHE_HOME/pdserve`, else `~/.cache/pdserve`",
        doc=(
            "Root of the weight cache (prepared models; with it the engines' `HF_HOME` and `VLLM_CACHE_ROOT` "
            "default under it) when the config sets no `cache_dir`. The images and rendered KubeRay "
            "workers set it to their cache volume."
        ),
        read_by="pdserve.model.cache",
    )
    lock_dir: EnvVar[Path] = EnvVar(
        "PDSERVE_LOCK_DIR", _path, lambda: Path(tempfile.gettempdir()) / "pdserve-locks",
        default_text="`<tmp>/pdserve-locks` (`<tmp>`: `$TMPDIR`, else `/tmp`)",
        doc=(
            "Directory of the per-host lock files with which engine replicas on one host claim their ports "
            "and CPU cores. Every pdserve process of a host must use the same one."
        ),
        read_by="pdserve.engine.allocator",
    )
    log_dir: EnvVar[Path] = EnvVar(
        "PDSERVE_LOG_DIR", _path, lambda: Path("/tmp/pdserve-logs"),
        default_text="`/tmp/pdserve-logs`",
        doc=("Where each engine replica writes its vLLM server's log (`<app>-<role>-<replica>.log`), and "
             "`pdserve serve` its engine forkserver's (`<app>-engine-forkserver.log`)."),
        read_by="pdserve.app.deployments, pdserve.cli.serve",
    )
    engine_start_timeout_s: EnvVar[float] = EnvVar(
        "PDSERVE_ENGINE_START_TIMEOUT_S", _positive_float, lambda: 900.0,
        default_text="`900`",
        doc=(
            "Seconds an engine replica waits for its vLLM server to become healthy (weights loaded, "
            "compiled) before its start fails."
        ),
        read_by="pdserve.app.deployments",
    )
    constraints: EnvVar[Path | None] = EnvVar(
        "PDSERVE_CONSTRAINTS", _path, lambda: None,
        default_text="unset: the source checkout's `constraints.txt`",
        doc="The `constraints.txt` whose pins `pdserve doctor` checks installed versions against.",
        read_by="pdserve.doctor.probes",
    )
    api_keys: EnvVar[str] = EnvVar(
        "PDSERVE_API_KEYS", str, lambda: "",
        default_text="unset: no keys from the environment",
        doc=(
            "More API keys the router accepts (`Authorization: Bearer KEY`), separated by commas or newlines; "
            "read when the router starts. This is the default name: `router.api_keys_env` in the YAML "
            "names another variable instead (read with :meth:`Settings.named`)."
        ),
        read_by="pdserve.router.auth",
    )
    client_api_key: EnvVar[str] = EnvVar(
        "PDSERVE_API_KEY", str, lambda: "",
        default_text="unset: no key sent",
        doc=(
            "The key `pdserve status` and `pdserve bench --url` send to an endpoint that wants one "
            "(`Authorization: Bearer KEY`) when no `--api-key` is given."
        ),
        read_by="pdserve.cli.status",
    )

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        self.environ: Mapping[str, str] = os.environ if environ is None else environ

    def named(self, name: str) -> str:
        """The raw value of a variable whose name comes from the config (``router.api_keys_env``)."""
        return self.environ.get(name, "")

    @classmethod
    def variables(cls) -> list[EnvVar[Any]]:
        return [v for v in vars(cls).values() if isinstance(v, EnvVar)]


def settings(environ: Mapping[str, str] | None = None) -> Settings:
    """The settings over ``environ`` (default: this process's environment, as it is when read)."""
    return Settings(environ)


@dataclass(frozen=True)
class EngineVar:
    """A variable of the engine processes pdserve starts, read inside the engine."""

    name: str
    set_by: str
    constant: str
    read_by: str
    doc: str


ENGINE_KEY_ENV = "PDSERVE_ENGINE_KEY"
KV_EVENTS_FILE_ENV = "PDSERVE_KV_EVENTS_FILE"
ENGINE_CORES_ENV = "PDSERVE_ENGINE_CORES"
ENGINE_NICE_ENV = "PDSERVE_ENGINE_NICE"
NIXL_PTHR_DELAY_US_ENV = "PDSERVE_NIXL_PTHR_DELAY_US"
NIXL_PROG_THREAD_ENV = "PDSERVE_NIXL_PROG_THREAD"
ENGINE_IDLE_SPIN_MS_ENV = "PDSERVE_ENGINE_IDLE_SPIN_MS"
ENGINE_START_METHOD_ENV = "PDSERVE_ENGINE_START_METHOD"
LORA_PATH_ENV = "PDSERVE_LORA_PATH"
LORA_MODEL_ENV = "PDSERVE_LORA_MODEL"
LORA_CACHE_ENV = "PDSERVE_LORA_CACHE"
KV_EVENTS_CURVE_ENV = "PDSERVE_KV_EVENTS_CURVE"
ENGINE_FORKSERVER_ENV = "PDSERVE_ENGINE_FORKSERVER"
FORKSERVER_CHECKED_ENV = "PDSERVE_FORKSERVER_CHECKED"
KV_HANDBACK_TTL_ENV = "PDSERVE_KV_HANDBACK_TTL_S"
KV_PIN_SHARE_ENV = "PDSERVE_KV_PIN_SHARE"
KV_PIN_FAIR_ENV = "PDSERVE_KV_PIN_FAIR"
KV_LAZY_ENV = "PDSERVE_KV_LAZY"
SHARED_WEIGHTS_ENV = "PDSERVE_SHARED_WEIGHTS"
PACKED_WEIGHTS_ENV = "PDSERVE_PACKED_WEIGHTS"
NO_TRITON_ENV = "PDSERVE_NO_TRITON"
STORED_PER_OWNER_ENV = "PDSERVE_STORED_RESPONSES_PER_OWNER"
STORED_PER_ENGINE_ENV = "PDSERVE_STORED_RESPONSES_PER_ENGINE"
STORED_BYTES_PER_OWNER_ENV = "PDSERVE_STORED_RESPONSES_BYTES_PER_OWNER"
STORED_BYTES_PER_ENGINE_ENV = "PDSERVE_STORED_RESPONSES_BYTES_PER_ENGINE"

_LAUNCHER = "pdserve (launcher)"


def kv_events_curve_keys(engine_key: str) -> dict[str, bytes]:
    """The ZeroMQ CURVE key pairs of one engine's KV-event publisher (``server_*``) and of the routers that
    follow it (``client_*``), Z85-encoded, derived from the engine's key: the engine (its vLLM plugin) and
    the router (from the app's registry) hold that key already, and nobody else does."""
    import hashlib

    import zmq
    from zmq.utils import z85

    keys: dict[str, bytes] = {}
    for side in ("server", "client"):
        secret = z85.encode(hashlib.sha256(f"pdserve kv-events {side}\0{engine_key}".encode()).digest())
        keys[f"{side}_secret"] = secret
        keys[f"{side}_public"] = zmq.curve_public(secret)
    return keys


#: The only host an engine may fetch media from when the config names none (vLLM's ``allowed_media_domains``
#: reads an empty list as every host): a name that never resolves (router/media.py).
NO_MEDIA_HOST = "media-fetch-disabled.invalid"


def media_hosts(given: object) -> list[str]:
    """``allowed_media_domains`` as given in ``engine_kwargs`` (a list, or one name as a string): lower-case,
    without a trailing dot, as the router compares them with a URL's host and as vLLM is given them."""
    names = [given] if isinstance(given, str) else list(given) if isinstance(given, (list, tuple)) else []
    return [h for h in (str(n).strip().lower().rstrip(".") for n in names) if h]

#: A Responses answer's id as the router makes it (router/stored.py) and the engines read it
#: (engine/responses_store.py): this prefix, then hex digits: the owner's tag, a random part, a seal.
RESPONSE_ID_PREFIX = "resp_"
RESPONSE_TAG_HEX = 16
RESPONSE_RANDOM_HEX = 16
RESPONSE_SEAL_HEX = 32
#: The tag of the anonymous owner (an app without keys), and of every id the router did not make.
ANONYMOUS_TAG = "0" * RESPONSE_TAG_HEX
_RESPONSE_ID_LENGTH = len(RESPONSE_ID_PREFIX) + RESPONSE_TAG_HEX + RESPONSE_RANDOM_HEX + RESPONSE_SEAL_HEX
_HEX_DIGITS = frozenset("0123456789abcdef")


def response_owner_tag(response_id: object) -> str:
    """The owner's tag in a router-made ``response_id``; :data:`ANONYMOUS_TAG` for any other."""
    if (isinstance(response_id, str) and len(response_id) == _RESPONSE_ID_LENGTH
            and response_id.startswith(RESPONSE_ID_PREFIX)
            and _HEX_DIGITS.issuperset(response_id[len(RESPONSE_ID_PREFIX):])):
        return response_id[len(RESPONSE_ID_PREFIX):len(RESPONSE_ID_PREFIX) + RESPONSE_TAG_HEX]
    return ANONYMOUS_TAG


#: The engine-process protocol: set by pdserve for its engines (pdserve.engine.launcher), read inside them.
ENGINE_PROTOCOL: tuple[EngineVar, ...] = (
    EngineVar(
        ENGINE_KEY_ENV, _LAUNCHER, "pdserve.engine.launcher.ENGINE_KEY_ENV, pdserve.engine.vllm_plugin.ENV_KEY",
        "pdserve.engine.vllm_plugin",
        "The bearer key of one engine (with `VLLM_API_KEY`): the engine answers every path but health and "
        "metrics only to callers that send it (the router reads it from the app's registry).",
    ),
    EngineVar(
        KV_EVENTS_FILE_ENV, _LAUNCHER, "pdserve.engine.vllm_plugin.ENV_FILE", "pdserve.engine.vllm_plugin",
        "File where the engine's pdserve vLLM plugins record expired KV leases (request ids); the engine "
        "answers `GET /pdserve/kv-lease/{request_id}` from it. The plugins are inert without it.",
    ),
    EngineVar(
        KV_HANDBACK_TTL_ENV, _LAUNCHER, "pdserve.settings.KV_HANDBACK_TTL_ENV", "pdserve.engine.kv_handback",
        "With `nixl.bidirectional`: how long (s) a decode engine keeps a finished request's blocks for the next "
        "turn's prefill (vLLM's `decoder_kv_blocks_ttl`); the engine notes their KV transfer params and answers "
        "`GET /pdserve/kv-handback/{request_id}` with them once. Unset: off.",
    ),
    EngineVar(
        KV_PIN_SHARE_ENV, _LAUNCHER, "pdserve.settings.KV_PIN_SHARE_ENV", "pdserve.engine.kv_handback",
        "With `nixl.bidirectional`: the share of a decode engine's KV blocks that the blocks it keeps for next "
        "turns may hold together (`nixl.decode_pin_share`); a finished request that would pass it is not kept "
        "(its blocks are freed at once). Unset: no bound.",
    ),
    EngineVar(
        KV_PIN_FAIR_ENV, _LAUNCHER, "pdserve.settings.KV_PIN_FAIR_ENV", "pdserve.engine.kv_handback",
        "`1` with `nixl.bidirectional` and `router.tenants`: the last quarter of the pins' bound is kept for "
        "tenants holding less than their share of it (a tenant's turns filled the whole bound for a pin's time, "
        "and no other tenant's turn was kept), and the notes of kept blocks give way by tenant; unset, every "
        "request is one owner's (a client's own salt names none).",
    ),
    EngineVar(
        STORED_PER_OWNER_ENV, _LAUNCHER, "pdserve.settings.STORED_PER_OWNER_ENV", "pdserve.engine.responses_store",
        "`router.stored_responses_per_owner`: the Responses API answers the engine keeps for one owner (read "
        "from the response id) where vLLM's store is on; past it the owner's oldest go. Unset (with the next "
        "unset too): vLLM's unbounded store.",
    ),
    EngineVar(
        STORED_PER_ENGINE_ENV, _LAUNCHER, "pdserve.settings.STORED_PER_ENGINE_ENV", "pdserve.engine.responses_store",
        "`router.stored_responses_per_engine`: the Responses API answers the engine keeps in all; past it the "
        "oldest of the owner keeping the most goes.",
    ),
    EngineVar(
        STORED_BYTES_PER_OWNER_ENV, _LAUNCHER, "pdserve.settings.STORED_BYTES_PER_OWNER_ENV",
        "pdserve.engine.responses_store",
        "`router.stored_responses_mib_per_owner` in bytes: the memory the Responses API answers the engine keeps "
        "for one owner may hold (each with its whole conversation); past it the owner's oldest go. Unset or 0: "
        "no bound on bytes.",
    ),
    EngineVar(
        STORED_BYTES_PER_ENGINE_ENV, _LAUNCHER, "pdserve.settings.STORED_BYTES_PER_ENGINE_ENV",
        "pdserve.engine.responses_store",
        "`router.stored_responses_mib_per_engine` in bytes: the memory the Responses API answers the engine keeps "
        "may hold in all; past it the oldest of the owner keeping the most goes. Unset or 0: no bound on bytes.",
    ),
    EngineVar(
        KV_LAZY_ENV, _LAUNCHER, "pdserve.settings.KV_LAZY_ENV", "pdserve.engine.kv_memory",
        "CPU engines, `1` with `cpu.kv_cache_lazy`: the KV cache's buffer is an anonymous mapping whose pages "
        "take memory when first written, instead of vLLM's `torch.zeros`, resident from the start. Unset: vLLM's.",
    ),
    EngineVar(
        SHARED_WEIGHTS_ENV, _LAUNCHER, "pdserve.settings.SHARED_WEIGHTS_ENV", "pdserve.engine.weight_share",
        "CPU engines with `cpu.share_weights: mapped`: the weight cache's directory for this model; each large "
        "2-D weight, once loaded, is written there (once per host) and mapped from its file, so the host's "
        "engines share one copy. Unset: vLLM's own copy per engine.",
    ),
    EngineVar(
        NO_TRITON_ENV, _LAUNCHER, "pdserve.settings.NO_TRITON_ENV", "pdserve.engine._site.sitecustomize",
        "CPU engines and their forkserver, `1`: Triton is hidden from the process (vLLM and torch find no such "
        "module), which has no CPU backend and only cost memory: 71 MiB of relocated library each process "
        "that imports vLLM held. Unset: Triton imported where installed.",
    ),
    EngineVar(
        PACKED_WEIGHTS_ENV, _LAUNCHER, "pdserve.settings.PACKED_WEIGHTS_ENV",
        "pdserve.engine.prepack, pdserve.engine.forkserver",
        "CPU engines forked from the forkserver with `cpu.share_weights: packed` (the default): the weight "
        "cache's directory for this model. The forkserver packs the weight files there for oneDNN once, before "
        "it forks the engine; an engine whose loaded weight equals a file computes with the inherited packed "
        "copy, and writes the files its model lacks there for the next start. Unset: vLLM's own copy per engine.",
    ),
    EngineVar(
        ENGINE_CORES_ENV, _LAUNCHER, "pdserve.settings.ENGINE_CORES_ENV",
        "pdserve.engine.guard, pdserve.engine._site.sitecustomize",
        "CPU engines: the cores claimed for this engine (comma-separated). The guard pins the whole engine "
        "to them, and every later affinity request inside the engine is clamped into them.",
    ),
    EngineVar(
        ENGINE_NICE_ENV, _LAUNCHER, "pdserve.settings.ENGINE_NICE_ENV", "pdserve.engine.guard",
        "CPU engines: the niceness the guard gives itself before it starts the engine, so every engine "
        "process runs below the router and Ray (from `cpu.engine_nice`).",
    ),
    EngineVar(
        NIXL_PTHR_DELAY_US_ENV, _LAUNCHER, "pdserve.settings.NIXL_PTHR_DELAY_US_ENV",
        "pdserve.engine._site.sitecustomize",
        "CPU engines: microseconds NIXL's progress thread sleeps in poll() between wake-ups "
        "(from `nixl.cpu_progress_thread_delay_us`); NIXL's own 0 spins on a whole core.",
    ),
    EngineVar(
        ENGINE_IDLE_SPIN_MS_ENV, _LAUNCHER, "pdserve.settings.ENGINE_IDLE_SPIN_MS_ENV",
        "pdserve.engine._site.sitecustomize",
        "CPU engines: milliseconds vLLM's worker spins waiting for its next step before it sleeps "
        "(from `cpu.idle_spin_ms`); vLLM's own is a whole second after every step.",
    ),
    EngineVar(
        ENGINE_START_METHOD_ENV, _LAUNCHER, "pdserve.settings.ENGINE_START_METHOD_ENV",
        "pdserve.engine._site.sitecustomize",
        "CPU engines without a worker process (the `uni` executor): how vLLM's API server starts its engine "
        "core process (`fork`: it inherits the imported modules instead of importing torch and vLLM again; "
        "vLLM's CPU platform otherwise always spawns).",
    ),
    EngineVar(
        LORA_PATH_ENV, _LAUNCHER, "pdserve.settings.LORA_PATH_ENV", "pdserve.engine.lora",
        "With `lora_config`: the adapter store (`dynamic_lora_loading_path`); the engine's LoRA resolver "
        "loads `<model_id>:<adapter>` from it on first use. The resolver is inert without it.",
    ),
    EngineVar(
        LORA_MODEL_ENV, _LAUNCHER, "pdserve.settings.LORA_MODEL_ENV", "pdserve.engine.lora",
        "With `lora_config`: the served model id that adapter names start with (`<model_id>:`).",
    ),
    EngineVar(
        LORA_CACHE_ENV, _LAUNCHER, "pdserve.settings.LORA_CACHE_ENV", "pdserve.engine.lora",
        "With `lora_config` on a cloud store: the directory adapters are copied to (the weight cache).",
    ),
    EngineVar(
        KV_EVENTS_CURVE_ENV, _LAUNCHER, "pdserve.settings.KV_EVENTS_CURVE_ENV", "pdserve.engine.vllm_plugin",
        "`1` when the engine publishes its KV cache events over TCP (an app not on loopback): the publisher "
        "takes ZeroMQ CURVE keys derived from the engine's key and accepts only subscribers holding the "
        "router's derived key (the events carry every tenant's prompt tokens). The engine fails to start "
        "rather than publish in the clear.",
    ),
    EngineVar(
        ENGINE_FORKSERVER_ENV, "pdserve serve", "pdserve.settings.ENGINE_FORKSERVER_ENV", "pdserve.engine.guard",
        "CPU engines of a local app (`cpu.fork_engines`): the Unix socket of the engine forkserver, which has "
        "imported vLLM's server once; an engine's guard asks it for the server instead of starting one, and "
        "starts one afresh when it cannot. Reaches the guards through the Ray instance's environment.",
    ),
    EngineVar(
        FORKSERVER_CHECKED_ENV, "pdserve serve", "pdserve.settings.FORKSERVER_CHECKED_ENV",
        "pdserve.engine.forkserver",
        "In the engine forkserver's own environment: the engine settings it was started with that are read "
        "at import (comma-separated names); it forks a server only for an engine whose values are the same.",
    ),
    EngineVar(
        NIXL_PROG_THREAD_ENV, "you, optionally", "pdserve.settings.NIXL_PROG_THREAD_ENV",
        "pdserve.engine._site.sitecustomize",
        "CPU engines: `0` turns NIXL's progress thread off, `1` on. Engines inherit it from the environment "
        "of the engine host's Ray worker; it takes effect only where pdserve's engine site hook is loaded "
        "(CPU engines with core binding or a progress-thread delay).",
    ),
)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _names(text: str) -> str:
    return ", ".join(f"`{c.strip()}`" for c in text.split(","))


def render_markdown() -> str:
    """The page ``docs/environment.md``."""
    out = [
        "# pdserve environment variables",
        "",
        "Generated from `src/pdserve/settings.py` (`python -m pdserve.settings`); do not edit by hand.",
        "",
        "Everything else is in the YAML (see [config-reference.md](config-reference.md)). Each variable is",
        "read when it is used, not when pdserve is imported; an empty value counts as unset.",
        "",
        "## Settings",
        "",
        "| variable | default | meaning | read by |",
        "|---|---|---|---|",
    ]
    for v in Settings.variables():
        doc = _cell(v.doc).replace(":meth:`Settings.named`", "`Settings.named`")
        out.append(f"| `{v.name}` | {v.default_text} | {doc} | `{v.read_by}` |")
    out += [
        "",
        "## Set by pdserve for its engines",
        "",
        "The launcher (`pdserve.engine.launcher`) puts these in the environment of each vLLM engine process it",
        "starts (all but those whose \"set by\" says otherwise); code inside the engine reads them. They are",
        "the protocol between the two, not settings.",
        "",
        "| variable | set by | meaning | name defined in | read by |",
        "|---|---|---|---|---|",
    ]
    for e in ENGINE_PROTOCOL:
        out.append(f"| `{e.name}` | {e.set_by} | {_cell(e.doc)} | {_names(e.constant)} | {_names(e.read_by)} |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render_markdown())
