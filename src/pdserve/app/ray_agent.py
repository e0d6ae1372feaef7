"""Ray's dashboard agent as an instance ``pdserve serve`` starts runs it: without its event module.

That module forwards the node's Ray events to the dashboard's head, which such an instance does not start
(app/ray_compat.py, ``lean_own_ray``); with no head to find, it asked the GCS for the head's address every
second for as long as the app ran and logged a traceback each time (about 40 KB of log a minute).

Run as ``python -m pdserve.app.ray_agent <Ray's agent.py> <its arguments>``: Ray's own command line for its
agent with this module put in front (``ray_compat.lean_own_ray``). Written against Ray 2.60.0.
"""

from __future__ import annotations

import runpy
import sys


def main(argv: list[str]) -> None:
    """Turn the event module off, then run Ray's agent script with its own arguments as ``__main__``."""
    from ray.dashboard.modules.event.event_agent import EventAgent

    EventAgent.__ray_dashboard_module_enable__ = False  # what Ray's ``dashboard_module(False)`` sets
    sys.argv = list(argv)
    runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
