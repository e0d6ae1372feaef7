"""The reference an idle figure is read against: a process that wakes 100 times a second (a Python loop of
10-ms sleeps) and its own share of a core over the same window. What a wake-up costs differs between hosts
and between moments on one host, so an idle app's share of a core reads best in such timers
(``--scenario footprint``, pdserve_bench/ray_floor.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Any

#: The reference process: a 100-Hz timer, as cheap as a Python loop makes one.
REFERENCE_TIMER = "import time\nwhile True:\n    time.sleep(0.01)\n"


def cpu_ticks(stat: str) -> int:
    """User + system clock ticks from a ``/proc/PID/stat`` line (the command name may hold spaces)."""
    fields = stat.rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def reference_timer_share(window: Any) -> tuple[Any, float]:
    """Run ``window()`` while the reference timer runs; its result and the timer's share of one core."""
    proc = subprocess.Popen([sys.executable, "-c", REFERENCE_TIMER])
    try:
        time.sleep(1.0)  # (started, imports done)
        with open(f"/proc/{proc.pid}/stat", encoding="ascii") as f:
            t0, w0 = cpu_ticks(f.read()), time.monotonic()
        out = window()
        with open(f"/proc/{proc.pid}/stat", encoding="ascii") as f:
            t1, w1 = cpu_ticks(f.read()), time.monotonic()
    finally:
        proc.kill()
        proc.wait()
    return out, (t1 - t0) / os.sysconf("SC_CLK_TCK") / max(w1 - w0, 1e-9)
