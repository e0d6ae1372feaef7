"""The routing plugins by policy name, and building one from its settings block.

The names themselves are the fields of :class:`pdserve.config.routing.PluginSettings` (the config layer
validates YAML against them without importing the router, see that module). This registry holds the
classes and checks, when it is imported, that it has exactly one per name and that each is bound to the
settings model the config declares for it: a plugin added on one side only fails at once, not at the first
request.
"""

from __future__ import annotations

from pdserve.config.routing import PLUGIN_NAMES, PluginSettings, check_policy_name
from pdserve.router.routing.base import RoutingPlugin
from pdserve.router.routing.kv_cache import KvCache
from pdserve.router.routing.least_loaded import LeastLoaded
from pdserve.router.routing.prefix_affinity import PrefixAffinity
from pdserve.router.routing.round_robin import RoundRobin
from pdserve.router.routing.session_affinity import SessionAffinity

PLUGINS: dict[str, type[RoutingPlugin]] = {
    cls.name: cls for cls in (RoundRobin, LeastLoaded, PrefixAffinity, SessionAffinity, KvCache)
}


def _check_registry() -> None:
    if tuple(sorted(PLUGINS)) != PLUGIN_NAMES:
        raise ImportError(f"routing plugins {sorted(PLUGINS)} do not match the config's names {list(PLUGIN_NAMES)} "
                          "(pdserve.config.routing.PluginSettings)")
    for name, cls in PLUGINS.items():
        declared = PluginSettings.model_fields[name].annotation
        if cls.settings_model is not declared:
            raise ImportError(f"routing plugin {name!r} takes {cls.settings_model.__name__}, "
                              f"but router.plugins.{name} is {declared}")


_check_registry()


def make_policy(name: str, settings: PluginSettings | None = None) -> RoutingPlugin:
    """A new plugin instance for policy ``name``, built from its block of ``settings`` (default: defaults).
    An unknown name is a ``ValueError`` that lists the valid ones."""
    cls = PLUGINS[check_policy_name(name)]
    return cls(getattr(settings or PluginSettings(), name))
