"""The idle cost of Ray Serve itself, for ``--scenario footprint``: what any app with as many Serve replicas
as pdserve's costs this host while nothing is asked of it.

A child process (``python -m pdserve_bench.ray_floor REPLICAS SECONDS [HOST]``) starts a Ray instance exactly as
``pdserve serve`` starts its own (:func:`pdserve.cli.serve.ray_init_kwargs`: the same Ray settings and
patches, app/ray_compat.py), Serve without a proxy, and ``REPLICAS`` no-op deployments of one replica each
(an async method that returns at once, no CPU reserved); after ``SETTLE_S`` it reads every process's CPU
time over ``SECONDS`` (pdserve.footprint, its own process counted as the driver, as ``pdserve serve`` is),
with the reference 100-Hz timer beside it, and prints one JSON line. What the app spends above that floor
is pdserve's: its engines, its router's work, its replicas' own loops.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

#: Seconds between the last replica's deployment and the window (Serve's first health checks and metrics
#: pushes done).
SETTLE_S = 10.0
#: The part the child's own process (the Ray driver) is counted as: the app's driver's part.
DRIVER_PART = "pdserve serve (driver)"
#: The JSON line's prefix on the child's stdout.
RESULT_PREFIX = "ray-floor: "
#: The host the child's Ray is started for when none is given (a loopback one: a local-only instance).
DEFAULT_HOST = "127.0.0.1"


def replicas_of(processes: dict[str, int]) -> int:
    """Serve replicas among an app's parts (pdserve.footprint's ``processes``: ``"<deployment> replica"``)."""
    return sum(n for part, n in processes.items() if part.endswith(" replica"))


def argv(replicas: int, seconds: float, host: str = DEFAULT_HOST) -> list[str]:
    """The child's command line (``host``: the app's ``http.host``, which decides whether Ray is local-only)."""
    return [sys.executable, "-m", "pdserve_bench.ray_floor", str(replicas), f"{seconds:g}", host]


def measure_floor(replicas: int, seconds: float, host: str = DEFAULT_HOST, timeout_s: float = 300.0) -> dict[str, Any]:
    """Run the child (:func:`argv`); its result (see the module's docstring)."""
    proc = subprocess.run(argv(replicas, seconds, host), capture_output=True, text=True, timeout=timeout_s,
                          check=False)
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX):])
    raise RuntimeError(f"the Ray floor's child ended ({proc.returncode}) without a result: "
                       f"{(proc.stderr or proc.stdout)[-800:]}")


def _child(replicas: int, seconds: float, host: str) -> dict[str, Any]:
    import psutil

    from pdserve.app.ray_compat import unused_imports_off

    unused_imports_off()
    import ray
    from ray import serve

    from pdserve.cli.serve import ray_init_kwargs
    from pdserve.config.schema import PDServeArgs
    from pdserve.footprint import measure
    from pdserve_bench.reference_timer import reference_timer_share

    ray.init(**ray_init_kwargs(PDServeArgs.model_validate({"http": {"host": host}}), ray, None))
    try:
        serve.start(proxy_location="Disabled")

        @serve.deployment(ray_actor_options={"num_cpus": 0})
        class NoOp:
            async def __call__(self, *_: Any) -> int:
                return 0

        for i in range(replicas):
            serve.run(NoOp.bind(), name=f"noop{i}", route_prefix=None)
        time.sleep(SETTLE_S)
        me = psutil.Process()

        def window() -> tuple[Any, float]:
            t0 = me.cpu_times()
            fp = measure(cpu_seconds=seconds, root=os.getpid())
            t1 = me.cpu_times()
            return fp, (t1.user + t1.system - t0.user - t0.system) / max(fp.seconds, 1e-9)

        (fp, driver), ref = reference_timer_share(window)
        by_part = {**fp.cpu, DRIVER_PART: fp.cpu.get(DRIVER_PART, 0.0) + driver}
        total = sum(by_part.values())
        return {"replicas": replicas, "core_share": total, "reference_timer_core_share": ref,
                "in_reference_timers": total / ref if ref > 0 else None,
                "cpu_core_share": {k: round(v, 4) for k, v in sorted(by_part.items(), key=lambda kv: -kv[1])},
                "cpu_by_thread": fp.as_dict().get("cpu_by_thread", {})}
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


def main(argv: list[str] | None = None) -> None:
    a = sys.argv[1:] if argv is None else argv
    print(RESULT_PREFIX + json.dumps(_child(int(a[0]), float(a[1]), a[2] if len(a) > 2 else DEFAULT_HOST)),
          flush=True)


if __name__ == "__main__":
    main()
