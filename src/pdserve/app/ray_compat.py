"""Where pdserve changes Ray's own behaviour: every patch of Ray and every Ray variable pdserve sets, in one
place, each with the Ray version it was written against and why. Moving Ray's pin means reading this file.
Written against Ray 2.60.0.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

#: Ray's switch for a single-machine instance: its node address becomes loopback (instead of the host's
#: address, which ``_node_ip_address="127.0.0.1"`` still resolves to), and Ray's servers bind to it.
RAY_LOCAL_ONLY_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
#: Ray starts its workers at niceness 15 unless told; pdserve's router and proxy are Ray workers.
RAY_WORKER_NICENESS_ENV = "RAY_worker_niceness"
#: How often Ray Serve's controller runs its control loop (Ray's default 0.1 s: ten passes a second, 4.5 % of
#: a core on an idle 2-core host).
RAY_SERVE_CONTROL_LOOP_ENV = "RAY_SERVE_CONTROL_LOOP_INTERVAL_S"
#: The interval in a Ray instance ``pdserve serve`` starts itself (one host): deployments and autoscaling
#: decide at most this much later (autoscaling's own delays are tens of seconds); a user's own value is
#: kept. 1 s: the controller 0.6 % of a core idle instead of 0.9-1.0 % at 0.5 s, ready no later.
LOCAL_CONTROL_LOOP_S = 1.0
#: How often each Serve replica (and handle) hands its cached request metrics to Ray's metrics API (Ray's
#: default 100 ms: a loop of ten passes a second in every replica, though pdserve's requests do not pass
#: through Serve's handles). Ray's own export of those metrics runs every 10 s.
RAY_SERVE_METRICS_EXPORT_ENV = "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS"
#: The interval in an instance ``pdserve serve`` starts itself: Serve's request metrics up to 5 s later;
#: about 0.6 % of a core less idle with three replicas (``pdserve bench --scenario footprint``).
LOCAL_METRICS_EXPORT_MS = 5000
#: Ray's own metrics (``ray_*``: every Ray process hands its counters to the node's dashboard agent, which
#: turns them into Prometheus series): Ray's default every 10 s. pdserve's metrics are its own
#: (prometheus-client in the router); Serve's autoscaling does not read these.
RAY_METRICS_REPORT_ENV = "RAY_metrics_report_interval_ms"
#: How often the dashboard agent collects and publishes the node's physical stats (psutil over every Ray
#: process) for the dashboard and the autoscaler's status, both off in an instance ``pdserve serve``
#: starts: Ray's default every 5 s.
RAY_REPORTER_INTERVAL_ENV = "REPORTER_UPDATE_INTERVAL_MS"
#: How often the dashboard agent looks whether its raylet is still alive (it stops after five misses):
#: Ray's default 0.4 s.
RAY_AGENT_PARENT_CHECK_ENV = "RAY_DASHBOARD_AGENT_CHECK_PARENT_INTERVAL_S"
#: The three in an instance ``pdserve serve`` starts: Ray's own metrics every 30 s, node stats every 30 s,
#: the parent check every second (the agent follows a dead raylet within 5 s instead of 2). The idle
#: dashboard agent 1.1-1.2 -> 0.7 % of a core (AMD EPYC, AVX2; ``pdserve bench --scenario footprint``,
#: runs alternated with Ray's values).
LOCAL_RAY_AGENT_ENV = {RAY_METRICS_REPORT_ENV: "30000", RAY_REPORTER_INTERVAL_ENV: "30000",
                       RAY_AGENT_PARENT_CHECK_ENV: "1"}
#: The raylet's own timers in an instance ``pdserve serve`` starts (one host), each every second instead of
#: Ray's 100-250 ms: its resource report to the GCS (100 ms: a replica added by autoscaling is placed up to
#: a second later), its check whether the object store needs workers to collect garbage (100 ms), its memory
#: monitor (250 ms: Ray's out-of-memory killer acts up to a second after the host passes Ray's 95 %), the
#: object manager's timer (100 ms: pulls between nodes, which one host has none of), its retry of lost
#: objects (100 ms), its pass over idle workers (200 ms) and its look at the disk's free space (100 ms:
#: objects spilled to a disk past Ray's 95 % fail up to a second later). The idle raylet 0.67-0.70 ->
#: 0.28-0.32 % of a core (with no task events, below), ready no later (AMD EPYC, AVX-512; ``pdserve bench
#: --scenario footprint``, runs alternated).
LOCAL_RAYLET_ENV = {f"RAY_{name}": "1000" for name in (
    "raylet_report_resources_period_milliseconds", "raylet_check_gc_period_milliseconds",
    "memory_monitor_refresh_ms", "object_manager_timer_freq_ms", "reconstruct_objects_period_milliseconds",
    "kill_idle_workers_interval_ms", "local_fs_monitor_interval_ms")}
#: Ray's task events: every Ray worker (the driver, Serve's controller, each replica) records its tasks and
#: sends them to the GCS every second, for Ray's state API and the dashboard's timeline, both served by the
#: dashboard's head, which an instance ``pdserve serve`` starts does not run (``lean_own_ray``). 0: off.
RAY_TASK_EVENTS_ENV = "RAY_task_events_report_interval_ms"


#: A directory whose ``sitecustomize`` hides what Ray imports and pdserve's Ray processes never use.
RAY_SITE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_ray_site")
#: Those modules (_ray_site/sitecustomize.py says why).
UNUSED_IN_OWN_RAY = ("pandas", "pyarrow")


def unused_imports_off() -> None:
    """In ``pdserve serve`` before it imports Ray and starts an instance of its own: this process and every
    process of that instance (its PYTHONPATH ends with :data:`RAY_SITE_DIR`) import neither pandas nor
    pyarrow. Before the engines' forkserver starts: the engines' environment, which holds the PYTHONPATH
    (after their own site directory), must equal the forkserver's."""
    for name in UNUSED_IN_OWN_RAY:
        sys.modules.setdefault(name, None)  # type: ignore[arg-type]
    path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if RAY_SITE_DIR not in path:
        os.environ["PYTHONPATH"] = os.pathsep.join([*path, RAY_SITE_DIR])


def own_ray_env() -> None:
    """Ray's settings for an instance ``pdserve serve`` starts on this host (not one it joins): Ray's workers
    (the router, Serve's proxy) start at niceness 0, level with the engines, instead of 15, and Serve's
    controller passes its loop, its replicas their metrics, Ray its own metrics and node stats, and the
    raylet its timers, less often; no task events are recorded for a state API nothing serves. Set before
    Ray starts: its processes inherit them. A user's own values are kept."""
    os.environ.setdefault(RAY_WORKER_NICENESS_ENV, "0")
    for name, value in {**LOCAL_RAY_AGENT_ENV, **LOCAL_RAYLET_ENV, RAY_TASK_EVENTS_ENV: "0"}.items():
        os.environ.setdefault(name, value)
    os.environ.setdefault(RAY_SERVE_CONTROL_LOOP_ENV, f"{LOCAL_CONTROL_LOOP_S:g}")
    os.environ.setdefault(RAY_SERVE_METRICS_EXPORT_ENV, str(LOCAL_METRICS_EXPORT_MS))


def lean_own_ray(ray: Any) -> None:
    """An instance ``pdserve serve`` starts itself runs without three of Ray's head processes it has no use
    for: the log monitor (it ships workers' output to the driver, and ``log_to_driver`` is off: the engines
    and replicas log to files), the autoscaler's monitor (it adds and removes nodes; an instance started
    here is this host alone) and, as the dashboard is off, the dashboard's API server (Ray's job and state
    REST APIs, which nothing of pdserve's calls; Ray starts it even with ``include_dashboard=False``). About
    1.8 % of a core idle and 70 MB between them, on a 2-core host where the app's whole idle cost is
    measured (``pdserve bench --scenario footprint``). With no head, the dashboard agent runs without its
    event module, which forwards events to the head (app/ray_agent.py: it asked for the head every second
    and logged a traceback each time). ``ray.init`` has no argument for any of them, so the
    defaults of Ray's node parameters and the node's start of that server are changed before it starts."""
    params = ray._private.parameter.RayParams
    if getattr(params.__init__, "_pdserve_lean", False):
        return
    node = ray._private.node.Node
    start_api_server = node.start_api_server

    def no_api_server(self: Any, *, include_dashboard: bool | None, raise_on_failure: bool) -> None:
        if include_dashboard is False:
            self._webui_url = None
            return
        start_api_server(self, include_dashboard=include_dashboard, raise_on_failure=raise_on_failure)

    node.start_api_server = no_api_server
    services, agent = ray._private.services, ray._private.ray_constants.PROCESS_TYPE_DASHBOARD_AGENT
    python_command = services._build_python_executable_command_memory_profileable

    def agent_without_events(component: str, *a: Any, **kw: Any) -> list[str]:
        command = python_command(component, *a, **kw)
        if component == agent:
            command += ["-m", "pdserve.app.ray_agent"]  # (Ray appends its agent.py and arguments)
        return command

    services._build_python_executable_command_memory_profileable = agent_without_events
    ray_init = params.__init__

    def init(self: Any, *a: Any, **kw: Any) -> None:
        kw.setdefault("include_log_monitor", False)
        kw.setdefault("no_monitor", True)
        ray_init(self, *a, **kw)

    init._pdserve_lean = True  # type: ignore[attr-defined]
    params.__init__ = init


def own_ray_apart() -> None:
    """Ray's own processes of an instance ``pdserve serve`` starts (its GCS, raylet and agents, and so the
    replicas the raylet starts) each lead a process group of their own instead of joining the caller's.
    A signal sent to ``pdserve serve``'s whole group (a terminal's Ctrl-C, ``timeout``, ``kill -- -PGID``)
    then reaches ``pdserve serve`` alone, which stops the app in order: Serve stops the replicas, each
    replica its engine, then Ray goes. Without it a SIGTERM to the group stopped Ray's GCS and raylet under
    the app: Serve waited 30 s for a controller that could no longer answer, and the stop took 40-60 s
    (13 s in order). Ray's processes still end with ``pdserve serve`` when it dies outright: Ray has the
    kernel end them with their parent. Ray starts them through ``services.ConsolePopen`` (a ``Popen``)."""
    from ray._private import services

    popen = services.ConsolePopen
    if os.name != "posix" or getattr(popen, "_pdserve_apart", False):
        return

    class ApartPopen(popen):  # type: ignore[misc, valid-type]
        _pdserve_apart = True

        def __init__(self, *a: Any, **kw: Any) -> None:
            kw.setdefault("process_group", 0)
            super().__init__(*a, **kw)

    services.ConsolePopen = ApartPopen


def quiet_own_ray() -> None:
    """In the driver of an instance ``pdserve serve`` starts, which prints its own progress by phase: Ray's
    notice that token authentication is on (it is: the instance is this app's alone) and Serve's INFO lines
    ("Started Serve", "Connecting to existing Serve app ... will not be applied", "Application ... is
    ready" while the engines are still being measured) only repeated pdserve's lines or contradicted them.
    Their warnings and errors still show."""
    logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
    logging.getLogger("ray.serve").setLevel(logging.WARNING)


def hush_stopping_ray() -> None:
    """Call as ``pdserve serve`` stops the instance it started: from then on the driver no longer prints the
    task failures Ray's error channel brings it (``ray._private.worker.listen_error_messages`` prints each
    with ``print_to_stdstream``). Serve's own stop always leaves one ("Task ServeController.graceful_shutdown
    failed ... killed by `ray.kill`"), which read as a failure at every Ctrl-C."""
    try:
        from ray._private import worker
    except ImportError:
        return
    worker.print_to_stdstream = lambda *a, **kw: None


def local_only_ray(ray: Any) -> None:
    """Laptop mode (a loopback ``http.host`` and no cluster to join): the endpoint is local, so is everything
    behind it. Set before Ray starts; its processes and the replicas inherit it. The engines and their NIXL
    side channels bind to the node address (app/deployments.py), and UCX to the loopback device."""
    os.environ[RAY_LOCAL_ONLY_ENV] = "0"
    ray._private.ray_constants.ENABLE_RAY_CLUSTER = False


def keep_serve_grpc_local() -> None:
    """In a local-only Ray instance (``pdserve serve`` on a loopback address, see cli/serve.py), Serve's
    per-replica gRPC server for calls between deployments still binds every interface ("[::]:0", fixed in
    Ray Serve 2.60). Bind it to loopback instead; the node address it is reached by is loopback too.
    Call in a replica's constructor: the server starts after it."""
    if os.environ.get(RAY_LOCAL_ONLY_ENV) != "0":
        return
    try:
        from ray.serve._private import replica
    except ImportError:
        return
    bind = getattr(replica, "add_port_to_grpc_server", None)
    if bind is None or getattr(bind, "_pdserve_local", False):
        return

    def local_bind(server: Any, address: str) -> Any:
        if address.startswith("[::]:") or address.startswith("0.0.0.0:"):
            address = "127.0.0.1:" + address.rsplit(":", 1)[1]
        return bind(server, address)

    local_bind._pdserve_local = True  # type: ignore[attr-defined]
    replica.add_port_to_grpc_server = local_bind
