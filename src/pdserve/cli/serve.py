"""``pdserve serve``: start or join Ray, deploy the app, report progress by phase, stop cleanly."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Any

from pdserve.app.ray_compat import (  # noqa: F401 (also named here)
    RAY_LOCAL_ONLY_ENV,
    RAY_WORKER_NICENESS_ENV,
    hush_stopping_ray,
    lean_own_ray,
    local_only_ray,
    own_ray_apart,
    own_ray_env,
    quiet_own_ray,
    unused_imports_off,
)
from pdserve.cli import progress
from pdserve.errors import PDServeError


def _say(msg: str) -> None:
    print(f"[pdserve] {msg}", file=sys.stderr, flush=True)


def _own_guards() -> list[Any]:
    """The engine guards (pdserve.engine.guard) this process started through the Ray instance it runs:
    they are its descendants while Ray is up. Another app's engines on the same host are not."""
    import psutil

    from pdserve.engine.process import GUARD_MARK

    found = []
    for p in psutil.Process().children(recursive=True):
        try:
            if GUARD_MARK.decode() in " ".join(p.cmdline()):
                found.append(p)
        except psutil.Error:
            continue
    return found


def _running(p: Any) -> bool:
    import psutil

    try:
        return bool(p.is_running()) and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def is_loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _Signals:
    """SIGTERM (Kubernetes, systemd) and SIGINT (a terminal) stop the app the same way. ``ray.init`` and Ray
    Serve install their own SIGTERM handler (exit at once, leaving the engines' vLLM processes behind), so
    :meth:`take` runs again after each of them."""

    def __init__(self) -> None:
        self.stop = threading.Event()

    def _on(self, signum: int, _frame: Any) -> None:
        if self.stop.is_set():
            return
        _say(f"received {signal.Signals(signum).name}, shutting down")
        self.stop.set()

    def take(self) -> None:
        signal.signal(signal.SIGINT, self._on)
        signal.signal(signal.SIGTERM, self._on)


def serve(file: str | None, *, host: str | None, port: int | None, address: str | None) -> int:
    """``pdserve serve``: config, model, Ray, ingress, deploy, wait for ready, serve until a signal."""
    from pdserve.config.loader import load_config

    t_start = time.monotonic()
    loaded = load_config(file)
    args = loaded.args
    if host:
        args.http.host = host
    if port:
        args.http.port = port
    for note in loaded.notes:
        _say(f"note: {note}")
    _say(f"[1/4] config: {loaded.source} (model {args.model_id}, "
         f"{args.prefill_config.num_replicas()} prefill + {args.decode_config.num_replicas()} decode)")
    own_ray = not (address or os.environ.get("RAY_ADDRESS"))
    if own_ray:
        unused_imports_off()  # (before Ray is imported here and the forkserver takes the environment)
    if (open_warning := open_to_the_network(args, keys_here=own_ray)) is not None:
        _say(f"      warning: {open_warning}")
    signals = _Signals()
    signals.take()
    # Held from before anything starts until the end (a port in use fails here, before the model is prepared
    # and with nothing started): no engine, Ray port or NIXL side channel started meanwhile can take the
    # public port that the router replicas bind later.
    held = _hold_port(args) if args.http.ingress == "direct" else []
    model_path = _prepare_model(args, address)

    import ray
    from ray import serve as rserve

    ray_address = address or os.environ.get("RAY_ADDRESS")
    started_ray = not ray_address
    _say(f"[3/4] ray: {'joining ' + ray_address if ray_address else 'starting a local instance'}")
    # Before Ray starts: it imports vLLM meanwhile, and Ray's processes (so the engines' guards) inherit
    # where it listens.
    forks = None
    if started_ray and model_path:
        from pdserve.engine.local_forkserver import LocalForkserver

        forks = LocalForkserver.start(args, loaded.app_name, model_path, local_only=is_loopback(args.http.host))
        if forks is not None:
            _say(f"      CPU engines fork from one process that imports vLLM now (cpu.fork_engines; log: "
                 f"{forks.log_path})")
    try:
        ray.init(**ray_init_kwargs(args, ray, ray_address))
    except (ConnectionError, RuntimeError, ray.exceptions.AuthenticationError) as e:
        if started_ray:
            raise
        raise join_error(str(ray_address), e) from e
    finally:
        signals.take()
    url = f"http://{'127.0.0.1' if args.http.host in ('0.0.0.0', '::') else args.http.host}:{args.http.port}"
    rc = 0
    try:
        direct, proxy_port = _ingress(args, loaded.route_prefix)
        rserve.start(http_options={"host": args.http.host, "port": proxy_port or args.http.port},
                     proxy_location="HeadOnly" if proxy_port else "Disabled")
        signals.take()
        where = _deploy(rserve, args, loaded, direct, signals, url, t_start)
        args = where.args
        if not signals.stop.is_set():
            _announce_ready(args, url, t_start, lazy_kv=where.on_cpu and args.cpu.kv_cache_lazy,
                            own_ray=started_ray)
            while not signals.stop.wait(1.0):
                pass
    except PDServeError as e:
        _say(f"error: {e}")
        rc = 1
    finally:
        _shutdown(rserve, ray, loaded.app_name, started_ray)
        if forks is not None:
            forks.stop()
        for h in held:
            h.close()
    return rc


def open_to_the_network(args: Any, *, keys_here: bool = False) -> str | None:
    """A warning when the endpoint listens beyond this host and takes requests without a key (no
    ``router.api_keys``, none in ``router.api_keys_env``'s variable, no tenant keys), else None.
    ``keys_here``: the router reads this process's environment (a Ray instance of its own), so keys it
    would refuse (a tenant with none, a key of two tenants) are refused now, before anything starts."""
    from pdserve.router.auth import ApiKeys

    try:
        enabled = ApiKeys(args.router).enabled
    except PDServeError:
        if keys_here:
            raise
        return None  # (the router refuses the keys at its start on its own node, saying why)
    if enabled or is_loopback(args.http.host):
        return None
    return (f"the endpoint listens on {args.http.host}:{args.http.port} without an API key: whoever reaches this "
            f"host's port {args.http.port} can use it (router.api_keys, or {args.router.api_keys_env} in the "
            "environment; docs/security.md)")


def _prepare_model(args: Any, address: str | None) -> str | None:
    """The model is prepared here, once, with progress on this terminal, before any engine asks (the packaged
    one converted, a hub id downloaded into the engines' hub cache: a model that cannot be had fails here,
    saying why, not as engines that fail to start); its path on this host (None when each engine's node
    prepares it)."""
    from pdserve.model.resolve import resolve_model

    source = args.prefill_config.model_loading_config.model_source
    if address is None and not os.environ.get("RAY_ADDRESS"):
        _say("[2/4] model: preparing")
        where = resolve_model(source, lambda m: _say(f"      {m}"), cache_dir=args.cache_dir, download=True)
        _say(f"      model ready: {where}")
        return str(where)
    _say("[2/4] model: prepared on each engine's node")
    return None


def ray_init_kwargs(args: Any, ray: Any, ray_address: str | None) -> dict[str, Any]:
    """``ray.init``'s arguments: join ``ray_address``, or start a local instance sized for this host (also
    what ``pdserve bench --scenario footprint`` starts its bare Ray Serve floor with)."""
    kw: dict[str, Any] = {"logging_level": "WARNING", "log_to_driver": False, "namespace": "pdserve"}
    if ray_address:
        kw["address"] = ray_address
        return kw
    kw.update(num_cpus=os.cpu_count() or 2, include_dashboard=False, object_store_memory=256 * 1024 * 1024)
    # Ray starts its workers at niceness 15, and the router and Ray Serve's proxy are such workers: on a
    # host where the engines keep every core busy, they then wait behind the engines for each request.
    # Workers start at 0 instead, level with the engines (`cpu.engine_nice` can put the engines behind).
    own_ray_env()
    lean_own_ray(ray)
    own_ray_apart()
    quiet_own_ray()
    if is_loopback(args.http.host):
        local_only_ray(ray)
    return kw


def _cannot_listen(args: Any, e: OSError) -> PDServeError:
    return PDServeError(f"cannot listen on {args.http.host}:{args.http.port}: {e.strerror} (is another server "
                        "there? choose --port, or http.port in the config)")


def _hold_port(args: Any) -> list[Any]:
    """The public port held for this app: its claim among the ``pdserve serve`` of this host, and a socket
    bound to it (:func:`pdserve.router.ingress.reserve_port`). Close both when the app is gone."""
    from pdserve.engine.allocator import claim_served_port, served_port_holder
    from pdserve.router.ingress import reserve_port

    port = args.http.port
    claim = claim_served_port(port)
    if claim is None:
        holder = served_port_holder(port)
        raise PDServeError(f"port {port} is served by another `pdserve serve` on this host"
                           f"{f' (pid {holder})' if holder else ''}: stop it first, or choose --port "
                           "(http.port in the config)")
    try:
        return [reserve_port(args.http.host, port), claim]
    except OSError as e:
        claim.close()
        raise _cannot_listen(args, e) from e


def _ingress(args: Any, route_prefix: str) -> tuple[dict[str, Any] | None, int | None]:
    """Who serves the public port: the router replicas themselves (``http.ingress: direct``; Ray Serve's proxy
    then runs only when ``http.proxy_port`` names its port), or Ray Serve's proxy. Returns the direct
    ingress and the proxy's port (None: no proxy)."""
    if args.http.ingress != "direct":
        return None, args.http.port
    from pdserve.router.ingress import reuseport_socket

    try:
        reuseport_socket(args.http.host, args.http.port).close()
    except OSError as e:
        raise _cannot_listen(args, e) from e
    proxy_port = args.http.proxy_port
    also = f"; Ray Serve's proxy serves :{proxy_port}" if proxy_port else " (Ray Serve's proxy is off)"
    _say(f"      the router serves :{args.http.port} itself{also}")
    return {"host": args.http.host, "port": args.http.port, "route_prefix": route_prefix,
            "proxy_port": proxy_port}, proxy_port


def _deploy(rserve: Any, args: Any, loaded: Any, direct: dict[str, Any] | None, signals: _Signals, url: str,
            t_start: float) -> Any:
    """Deploy the app and wait until the router routes P/D (or a signal); returns the placement deployed (the
    args as deployed, and whether its engines run on CPU)."""
    from pdserve.app import placement
    from pdserve.app.builder import build_pd_openai_app

    where = placement.decide(args, on_cpu=placement.cpu_only_cluster())
    args = where.args  # the builder keeps what is decided here; deciding first puts the choice on screen
    if where.dtype_reason:
        _say(f"      CPU engines compute in {where.dtype}: {where.dtype_reason}")
    app = build_pd_openai_app(args, direct_ingress=direct)
    _say("[4/4] deploying engines and router (first start of a CPU engine takes ~30 s)")
    err: list[BaseException] = []

    def run() -> None:
        try:
            from pdserve.app import registry

            registry.unmark_stopping(loaded.app_name)  # (left by a stop of this app that never finished)
            rserve.run(app, name=loaded.app_name, route_prefix=loaded.route_prefix)
        except BaseException as e:  # noqa: BLE001
            err.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    last = ""
    routed_wait = 0.0
    while not signals.stop.is_set():
        if err:
            raise PDServeError("\n".join([f"deployment failed: {err[0]}", *progress.deployment_failure(rserve, loaded.app_name)]))
        line = progress.status_line(rserve, loaded.app_name)
        if line and line != last:
            _say(f"      {line}  ({time.monotonic() - t_start:.0f}s)")
            last = line
        if not t.is_alive() and progress.health(url) == 200:
            # Every deployment runs, but the router learns engines by polling: ready means it routes P/D.
            missing = progress.roles_missing(url)
            if not missing:
                break
            routed_wait = routed_wait or time.monotonic()
            if time.monotonic() - routed_wait > progress.ROUTER_DISCOVERY_WAIT_S:
                _say(f"      warning: the router lists no healthy, measured {' or '.join(missing)} engine yet")
                break
        time.sleep(1.0)
    return where


def _announce_ready(args: Any, url: str, t_start: float, lazy_kv: bool = False, own_ray: bool = False) -> None:
    speeds = progress.engine_speeds(url)
    if speeds:
        _say(f"      {speeds}")
    _say(f"      {progress.footprint_line(lazy_kv, own_ray)}")
    _say(f"ready in {time.monotonic() - t_start:.0f}s: {url}/v1  (model {args.model_id})")
    print(f"pdserve ready: {url}/v1", flush=True)
    print(
        f"curl {url}/v1/chat/completions -H 'Content-Type: application/json' "
        f"-d '{{\"model\": \"{args.model_id}\", \"messages\": [{{\"role\": \"user\", "
        f"\"content\": \"What is the capital of France?\"}}], \"max_tokens\": 32, \"temperature\": 0}}'",
        flush=True,
    )


def join_error(address: str, err: BaseException) -> PDServeError:
    """Why joining a Ray cluster failed, with what to check. Ray reports a token mismatch only in its log
    lines; its exception just says it could not connect."""
    msg = (f"cannot join the Ray cluster at {address} ({err}). Check that `ray start --head` runs there and "
           "that this machine reaches it (GCS port, usually 6379)")
    if os.environ.get("RAY_AUTH_MODE", "").lower() != "token":
        msg += (". If the cluster uses token authentication (a Ray head enables it when it finds "
                "~/.ray/auth_token; its log says 'Token authentication is enabled'), set RAY_AUTH_MODE=token "
                "and the head's token in RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH here, as on every worker node")
    return PDServeError(msg)


def _shutdown(rserve: Any, ray: Any, app_name: str, started_ray: bool) -> None:
    # A second Ctrl-C or SIGTERM while stopping must not cut the stop short (and orphan engines).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _say("stopping engines")
    # Taken before Ray goes: afterwards the guards are orphans, no longer found under this process.
    guards = _own_guards() if started_ray else []
    if started_ray:
        hush_stopping_ray()
    try:
        from pdserve.app import registry

        registry.mark_stopping(app_name)  # (the engines stop without waiting for routers that are gone)
    except Exception:  # noqa: BLE001 - they then wait as for a scale-down
        pass
    try:
        if started_ray:
            rserve.shutdown()
        else:
            rserve.delete(app_name)
    except Exception as e:  # noqa: BLE001
        _say(f"serve shutdown: {e}")
    try:
        from pdserve.app import registry

        registry.clear(app_name)
    except Exception:  # noqa: BLE001
        pass
    if started_ray:
        ray.shutdown()
        # Engine guards notice their replica is gone within a second; give them time to stop vLLM.
        deadline = time.monotonic() + 20
        while any(_running(g) for g in guards) and time.monotonic() < deadline:
            time.sleep(0.5)
        for g in guards:
            if _running(g):
                try:
                    os.killpg(g.pid, signal.SIGKILL)  # the guard leads its engine's process group
                except (ProcessLookupError, PermissionError):
                    pass
    _say("stopped")
