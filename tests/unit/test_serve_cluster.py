"""`pdserve serve` on a cluster: a cluster that cannot be joined gives an error that says what to check
(serve itself, and "ready" polling a router: tests/component/test_serve_cluster.py)."""

from __future__ import annotations

import pytest

from pdserve.cli.serve import join_error


def test_join_error_names_the_address_and_the_token_settings(monkeypatch):
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    msg = str(join_error("10.0.0.1:6379", ConnectionError("Failed to connect to Ray cluster")))
    assert "10.0.0.1:6379" in msg and "Failed to connect" in msg
    assert "RAY_AUTH_MODE=token" in msg and "RAY_AUTH_TOKEN_PATH" in msg


def test_join_error_leaves_out_the_token_hint_when_token_mode_is_set(monkeypatch):
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    msg = str(join_error("head:6379", ConnectionError("x")))
    assert "head:6379" in msg and "RAY_AUTH_MODE" not in msg


def test_an_own_ray_instance_starts_without_the_monitors_and_the_dashboards_api_server():
    """Ray's own node parameters (stand-in classes here) default to no log monitor and no autoscaler monitor
    once pdserve starts its own instance, a node with the dashboard off starts no API server, and the
    dashboard agent starts through pdserve's wrapper (no event module); what a caller passes still wins,
    and applying it twice is once."""
    import types

    from pdserve.app.ray_compat import lean_own_ray

    class RayParams:
        def __init__(self, include_log_monitor=None, no_monitor=False, num_cpus=None):
            self.include_log_monitor, self.no_monitor, self.num_cpus = include_log_monitor, no_monitor, num_cpus

    class Node:
        started: list = []

        def start_api_server(self, *, include_dashboard, raise_on_failure):
            self._webui_url = "127.0.0.1:8265"
            Node.started.append(include_dashboard)

    def python_command(component, session_dir, unbuffered=True):
        return ["python", "-u"]

    ray = types.SimpleNamespace(_private=types.SimpleNamespace(
        parameter=types.SimpleNamespace(RayParams=RayParams), node=types.SimpleNamespace(Node=Node),
        services=types.SimpleNamespace(_build_python_executable_command_memory_profileable=python_command),
        ray_constants=types.SimpleNamespace(PROCESS_TYPE_DASHBOARD_AGENT="dashboard_agent")))
    lean_own_ray(ray)
    lean_own_ray(ray)
    build = ray._private.services._build_python_executable_command_memory_profileable
    assert build("dashboard_agent", "/tmp/s") == ["python", "-u", "-m", "pdserve.app.ray_agent"]
    assert build("dashboard", "/tmp/s") == ["python", "-u"]
    p = RayParams(num_cpus=2)
    assert (p.include_log_monitor, p.no_monitor, p.num_cpus) == (False, True, 2)
    assert RayParams(include_log_monitor=True, no_monitor=False).include_log_monitor is True
    off, default = Node(), Node()
    off.start_api_server(include_dashboard=False, raise_on_failure=False)
    default.start_api_server(include_dashboard=None, raise_on_failure=False)
    assert off._webui_url is None and default._webui_url == "127.0.0.1:8265"
    assert Node.started == [None]


def test_an_own_ray_instance_passes_serves_loops_less_often_and_keeps_a_users_values(monkeypatch):
    """Serve's controller loop and its replicas' metrics hand-off run at pdserve's slower pace in an
    instance it starts itself (Ray's processes inherit the variables), unless the user set their own."""
    import os

    from pdserve.app import ray_compat

    for name in (ray_compat.RAY_WORKER_NICENESS_ENV, ray_compat.RAY_SERVE_CONTROL_LOOP_ENV,
                 ray_compat.RAY_SERVE_METRICS_EXPORT_ENV, *ray_compat.LOCAL_RAY_AGENT_ENV,
                 *ray_compat.LOCAL_RAYLET_ENV, ray_compat.RAY_TASK_EVENTS_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(ray_compat.RAY_SERVE_CONTROL_LOOP_ENV, "0.2")
    monkeypatch.setenv(ray_compat.RAY_REPORTER_INTERVAL_ENV, "7000")
    monkeypatch.setenv("RAY_memory_monitor_refresh_ms", "250")
    ray_compat.own_ray_env()
    assert os.environ["RAY_raylet_report_resources_period_milliseconds"] == "1000"
    assert os.environ["RAY_kill_idle_workers_interval_ms"] == "1000"
    assert os.environ[ray_compat.RAY_TASK_EVENTS_ENV] == "0"
    assert os.environ["RAY_memory_monitor_refresh_ms"] == "250"  # the user's
    assert os.environ[ray_compat.RAY_SERVE_METRICS_EXPORT_ENV] == "5000"
    assert os.environ[ray_compat.RAY_METRICS_REPORT_ENV] == "30000"
    assert os.environ[ray_compat.RAY_AGENT_PARENT_CHECK_ENV] == "1"
    assert os.environ[ray_compat.RAY_REPORTER_INTERVAL_ENV] == "7000"  # the user's
    assert os.environ[ray_compat.RAY_SERVE_CONTROL_LOOP_ENV] == "0.2"
    assert os.environ[ray_compat.RAY_WORKER_NICENESS_ENV] == "0"


def test_an_own_ray_instance_keeps_its_processes_out_of_the_callers_process_group(monkeypatch):
    """Ray starts its GCS, raylet and agents through ``services.ConsolePopen`` (a stand-in here): in an instance
    pdserve starts, each leads a process group of its own, so a signal to ``pdserve serve``'s group reaches
    it alone; a caller's own ``process_group`` wins, and applying it twice is once."""
    from ray._private import services

    from pdserve.app.ray_compat import own_ray_apart

    class Popen:
        def __init__(self, args, **kw):
            self.args, self.kw = args, kw

    monkeypatch.setattr(services, "ConsolePopen", Popen)
    own_ray_apart()
    once = services.ConsolePopen
    own_ray_apart()
    assert services.ConsolePopen is once and issubclass(once, Popen)
    assert services.ConsolePopen(["raylet"], stdout=None).kw == {"stdout": None, "process_group": 0}
    assert services.ConsolePopen(["gcs_server"], process_group=7).kw == {"process_group": 7}


def test_a_failed_deployment_says_why_from_serves_status_message():
    """Serve's message of a deployment whose engine did not start (its shape as Ray Serve 2.60 gives it,
    shortened): the error pdserve raised, with the engine's log, and the engine's own last exception."""
    import types

    from pdserve.cli.progress import failure_detail

    message = (
        "The deployment failed to start 3 times in a row. This may be due to a problem with its constructor "
        "or initial health check failing. See controller logs for details. Error:\n"
        "\x1b[36mray::ServeReplica:pdserve:prefill.initialize_and_get_metadata()\x1b[39m (pid=3976)\n"
        "RuntimeError: Traceback (most recent call last):\n"
        '  File "/src/pdserve/engine/process.py", line 128, in wait_ready\n'
        "    raise EngineStartError(\n"
        "pdserve.errors.EngineStartError: prefill engine xu exited with code 1 during startup; "
        "log: /tmp/pdserve-logs/pdserve-prefill-xu.log\n"
        "    await run_server_worker(listen_address, sock, args, **uvicorn_kwargs)\n"
        "pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig\n"
        "  Value error, User-specified max_model_len (100000) is greater than the derived max_model_len\n"
        "    For further information visit https://errors.pydantic.dev/2.14/v/value_error\n")
    timeout = ("The deployment failed to start 3 times in a row. Error:\nRuntimeError: Traceback\n"
               "pdserve.errors.EngineStartError: decode engine ab not ready after 600s; log: /tmp/d.log\n")
    deployments = {
        "prefill": types.SimpleNamespace(status=types.SimpleNamespace(value="DEPLOY_FAILED"), message=message),
        "decode": types.SimpleNamespace(status="DEPLOY_FAILED", message=timeout),
        "router": types.SimpleNamespace(status=types.SimpleNamespace(value="HEALTHY"), message=""),
    }
    assert failure_detail(deployments) == [
        "  decode: decode engine ab not ready after 600s; log: /tmp/d.log",
        "  prefill: prefill engine xu exited with code 1 during startup; log: /tmp/pdserve-logs/pdserve-prefill-xu.log",
        "    pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig",
        "    Value error, User-specified max_model_len (100000) is greater than the derived max_model_len",
    ]


def test_an_own_ray_instance_prints_pdserves_progress_not_rays_notices(monkeypatch):
    """Ray's token notice and Serve's INFO lines are left out of an own instance's driver, its warnings are
    not; once it stops, the task failures Serve's own stop leaves are not printed."""
    import logging

    from ray._private import worker

    from pdserve.app.ray_compat import hush_stopping_ray, quiet_own_ray

    serve_log, token_log = logging.getLogger("ray.serve"), logging.getLogger(
        "ray._private.authentication.authentication_token_setup")
    saved = serve_log.level, token_log.level
    try:
        quiet_own_ray()
        assert not serve_log.isEnabledFor(logging.INFO) and serve_log.isEnabledFor(logging.WARNING)
        assert not token_log.isEnabledFor(logging.WARNING) and token_log.isEnabledFor(logging.ERROR)
    finally:
        serve_log.setLevel(saved[0])
        token_log.setLevel(saved[1])
    printed = []
    monkeypatch.setattr(worker, "print_to_stdstream", lambda data, **kw: printed.append(data))
    hush_stopping_ray()
    worker.print_to_stdstream({"lines": ["Task ServeController.graceful_shutdown failed"], "pid": "raylet"})
    assert printed == []


def test_serve_warns_when_the_endpoint_is_open_beyond_this_host_without_a_key(monkeypatch):
    from pdserve.cli.serve import open_to_the_network
    from pdserve.config.schema import PDServeArgs

    monkeypatch.delenv("PDSERVE_API_KEYS", raising=False)
    assert open_to_the_network(PDServeArgs()) is None  # loopback: this host only
    wide = PDServeArgs.model_validate({"http": {"host": "0.0.0.0", "port": 8001}})
    assert "0.0.0.0:8001 without an API key" in open_to_the_network(wide)
    monkeypatch.setenv("PDSERVE_API_KEYS", "k1")
    assert open_to_the_network(wide) is None
    keyed = PDServeArgs.model_validate({"http": {"host": "0.0.0.0"}, "router": {"api_keys": ["k2"]}})
    monkeypatch.delenv("PDSERVE_API_KEYS")
    assert open_to_the_network(keyed) is None


def test_serve_refuses_a_tenant_no_key_reaches_before_anything_starts(monkeypatch):
    """With a Ray instance of its own the router reads ``pdserve serve``'s environment: a tenant whose keys
    are not exported is refused at once, saying which (on a cluster the router's node decides)."""
    from pdserve.cli.serve import open_to_the_network
    from pdserve.config.schema import PDServeArgs
    from pdserve.errors import ConfigError

    monkeypatch.delenv("KEYS_ACME", raising=False)
    args = PDServeArgs.model_validate({"router": {"tenants": {"acme": {"keys_env": "KEYS_ACME"}}}})
    with pytest.raises(ConfigError, match="router.tenants.acme"):
        open_to_the_network(args, keys_here=True)
    assert open_to_the_network(args) is None
    monkeypatch.setenv("KEYS_ACME", "a1")
    assert open_to_the_network(args, keys_here=True) is None


def test_rays_agent_runs_its_own_script_with_its_arguments_and_without_the_event_module(tmp_path, monkeypatch):
    """``python -m pdserve.app.ray_agent AGENT.py ARGS``: Ray's agent script runs as ``__main__`` with its own
    arguments, and the event module (which would look for the dashboard's head every second) is off."""
    import json

    from ray.dashboard.modules.event.event_agent import EventAgent

    from pdserve.app import ray_agent

    monkeypatch.setattr(EventAgent, "__ray_dashboard_module_enable__", True, raising=False)
    monkeypatch.setattr("sys.argv", ["before"])
    script = tmp_path / "agent.py"
    out = tmp_path / "out.json"
    script.write_text(
        "import json, sys\n"
        "from ray.dashboard.modules.event.event_agent import EventAgent\n"
        f"open({str(out)!r}, 'w').write(json.dumps([__name__, sys.argv, EventAgent.__ray_dashboard_module_enable__]))\n")
    ray_agent.main([str(script), "--node-id=abc", "--temp-dir=/tmp/ray"])
    assert json.loads(out.read_text()) == ["__main__", [str(script), "--node-id=abc", "--temp-dir=/tmp/ray"], False]


def test_an_own_ray_instance_imports_neither_pandas_nor_pyarrow(monkeypatch):
    """``pdserve serve`` starting its own Ray: this process hides both, and every process of that instance
    gets the directory whose sitecustomize hides them at the end of its PYTHONPATH (once)."""
    import os
    import sys

    from pdserve.app import ray_compat

    for name in ray_compat.UNUSED_IN_OWN_RAY:  # (each restored, or removed, after the test)
        monkeypatch.setitem(sys.modules, name, None)
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setenv("PYTHONPATH", "/mine")
    ray_compat.unused_imports_off()
    ray_compat.unused_imports_off()
    assert os.environ["PYTHONPATH"] == os.pathsep.join(["/mine", ray_compat.RAY_SITE_DIR])
    assert all(sys.modules[name] is None for name in ray_compat.UNUSED_IN_OWN_RAY)
    with pytest.raises(ModuleNotFoundError):
        import pandas  # noqa: F401
    site = open(os.path.join(ray_compat.RAY_SITE_DIR, "sitecustomize.py")).read()
    assert all(f'"{name}"' in site for name in ray_compat.UNUSED_IN_OWN_RAY)
