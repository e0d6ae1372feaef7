"""Routing plugins: which replica of a role takes a request, chosen by name per role in the YAML
(``router.policy``, ``router.prefill_policy``, ``router.decode_policy``), each with its settings block
under ``router.plugins.<name>``.

One plugin per module: ``round_robin``, ``least_loaded``, ``prefix_affinity``, ``session_affinity``
(the last two share :mod:`.affinity`), ``kv_cache`` (the engines' KV cache events, :mod:`pdserve.router.kv_index`). What a plugin is: :mod:`.base`; the names and building one:
:mod:`.registry`; the settings models: :mod:`pdserve.config.routing`.
"""

from pdserve.config.routing import AFFINITY_SLACK, PLUGIN_NAMES, PluginSettings
from pdserve.router.routing.base import RoutingKey, RoutingPlugin, RoutingRequest, Scored
from pdserve.router.routing.registry import PLUGINS, make_policy

__all__ = ["AFFINITY_SLACK", "PLUGINS", "PLUGIN_NAMES", "PluginSettings", "RoutingKey", "RoutingPlugin", "RoutingRequest",
           "Scored", "make_policy"]
