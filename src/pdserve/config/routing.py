"""The routing plugins' names and settings blocks (``router.plugins.<name>``).

A routing plugin (``pdserve/router/routing/<name>.py``) is the behaviour: what it reads from a request,
how it filters, scores and picks replicas. Its settings are data, and they live here, one pydantic model
per plugin, gathered in :class:`PluginSettings` under the plugin's name. Why here and not in the plugin's
module: config is the bottom layer and imports nothing from the router (enforced by a test), yet a YAML
file is checked when it is loaded (``pdserve validate``, ``render``), with the file and the dotted path of
a bad field, and the reference (docs/config-reference.md) is generated from the schema. Both need the
names and the settings models without the router.

So the fields of :class:`PluginSettings` are *the* list of policy names: :data:`PLUGIN_NAMES` is read off
them, the schema checks ``router.policy`` / ``prefill_policy`` / ``decode_policy`` against it
(:func:`check_policy_name`), and the router's registry (``pdserve.router.routing.registry``) asserts when it
is imported that it holds exactly one plugin class per name, each bound to the settings model named here.
Adding a plugin is: its settings model and a field here, its class in ``router/routing/``, one line in the
registry.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

#: Default of the affinity plugins' ``slack``: the affine replica is given up when it holds more than this
#: many in-flight requests above the least loaded candidate.
AFFINITY_SLACK = 8


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True)


class RoundRobinSettings(_Strict):
    """``round_robin``: the baseline, replicas in turn. Nothing to set."""


class LeastLoadedSettings(_Strict):
    """``least_loaded``: power of d choices on in-flight requests."""

    choices: int = Field(
        2, ge=2,
        description="Replicas drawn at random per request; the one with the fewest in-flight requests wins.",
    )


class PrefixAffinitySettings(_Strict):
    """``prefix_affinity``: prompts that start alike go to the same replica, so its prefix cache hits."""

    tokens: int = Field(
        256, ge=1,
        description=(
            "Leading prompt tokens hashed into the routing key (for a text prompt or chat messages: 4x this "
            "many characters of its JSON). Also spelled `router.prefix_affinity_tokens`."
        ),
    )
    slack: int = Field(
        AFFINITY_SLACK, ge=0,
        description=(
            "The replica the prefix hashes to is skipped when it holds more than this many in-flight requests "
            "above the least loaded one (the next replica in hash order takes the request)."
        ),
    )


class SessionAffinitySettings(_Strict):
    """``session_affinity``: requests with the same ``X-Session-Id`` header go to the same replica."""

    slack: int = Field(
        AFFINITY_SLACK, ge=0,
        description=(
            "The session's replica is skipped when it holds more than this many in-flight requests above "
            "the least loaded one (the next replica in hash order takes the request)."
        ),
    )


class KvCacheSettings(_Strict):
    """``kv_cache``: the replica that holds the longest cached prefix of the prompt, from the engines' own KV
    cache events (vLLM ``--kv-events-config``, set up by pdserve)."""

    slack: int = Field(
        AFFINITY_SLACK, ge=0,
        description=(
            "A replica is passed over when it holds more than this many in-flight requests above the least "
            "loaded one, however much of the prompt it has cached."
        ),
    )
    min_blocks: int = Field(
        1, ge=1,
        description="Cached blocks a replica needs before the cache decides; fewer: the least loaded replica.",
    )


class PluginSettings(_Strict):
    """Settings of each routing plugin, under its policy name; every block is optional."""

    round_robin: RoundRobinSettings = Field(
        default_factory=RoundRobinSettings, description="`round_robin`: replicas in turn; no settings."
    )
    least_loaded: LeastLoadedSettings = Field(
        default_factory=LeastLoadedSettings,
        description="`least_loaded`: power of d choices on in-flight requests (the default policy).",
    )
    prefix_affinity: PrefixAffinitySettings = Field(
        default_factory=PrefixAffinitySettings,
        description=(
            "`prefix_affinity`: rendezvous hashing on the prompt's first tokens, so shared prefixes hit one "
            "replica's prefix cache."
        ),
    )
    kv_cache: KvCacheSettings = Field(
        default_factory=KvCacheSettings,
        description=(
            "`kv_cache`: the replica with the longest cached prefix of the prompt, known from each engine's KV "
            "cache events (exact, unlike `prefix_affinity`'s hash of the first tokens); load decides between "
            "equals and when nothing is cached."
        ),
    )
    session_affinity: SessionAffinitySettings = Field(
        default_factory=SessionAffinitySettings,
        description=(
            "`session_affinity`: rendezvous hashing on the `X-Session-Id` header, so a conversation stays on "
            "one replica; least_loaded for requests without the header."
        ),
    )


#: Every valid ``router.policy`` value, sorted: the fields of :class:`PluginSettings`.
PLUGIN_NAMES: tuple[str, ...] = tuple(sorted(PluginSettings.model_fields))


def check_policy_name(name: str) -> str:
    """``name`` if a routing plugin has it, else ``ValueError`` listing the valid names."""
    if name not in PLUGIN_NAMES:
        raise ValueError(f"unknown routing policy {name!r}; valid: {', '.join(PLUGIN_NAMES)}")
    return name
