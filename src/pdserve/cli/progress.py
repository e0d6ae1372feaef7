"""What ``pdserve serve`` reads about the app while it starts, and says: Serve's deployment states, the router's
view of its engines (healthy, measured), the app's memory, and why a deployment failed."""

from __future__ import annotations

import os
import re
import urllib.error
import urllib.request
from typing import Any


def health(url: str) -> int:
    try:
        with urllib.request.urlopen(url + "/health", timeout=3) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)
    except (urllib.error.URLError, OSError):
        return 0


def footprint_line(lazy_kv: bool = False, own_ray: bool = False) -> str:
    """One line: the app's memory (PSS) by part, largest first; ``lazy_kv``: it grows as CPU engines fill
    their KV caches (``cpu.kv_cache_lazy``). ``own_ray``: this process started the app's Ray instance, so
    the whole app is under it and only that is counted; else every such process on this host is."""
    from pdserve.footprint import measure

    try:
        fp = measure(root=os.getpid() if own_ray else None)
    except Exception as e:  # noqa: BLE001 - a figure for the user, never worth a failure
        return f"memory: not measured ({e})"
    parts = ", ".join(f"{k} {v / 2**30:.2f}" for k, v in sorted(fp.pss.items(), key=lambda kv: -kv[1]))
    grows = " (and more as CPU engines fill their KV caches: cpu.kv_cache_lazy)" if lazy_kv else ""
    where = "of this app" if own_ray else "on this host"
    return f"memory (PSS, GiB) {where}: {fp.total_pss / 2**30:.1f} in all{grows}: {parts}"


#: How long `serve` waits, once every deployment runs, for the router to list an engine of each role.
ROUTER_DISCOVERY_WAIT_S = 30.0


def roles_missing(url: str) -> list[str]:
    """Engine roles the router at ``url`` has no healthy engine for (from ``/pdserve/status``).

    Empty when it cannot tell (e.g. the status needs an API key): readiness then rests on ``/health``."""
    import json

    try:
        with urllib.request.urlopen(url + "/pdserve/status", timeout=3) as r:
            engines = json.load(r).get("engines", [])
    except urllib.error.HTTPError:
        return []
    except (urllib.error.URLError, OSError, ValueError):
        return ["prefill", "decode"]
    # Ready also means measured: the router admits by each engine's prompt speed, found with a calibration
    # prompt right after it discovers the engine.
    have = {e.get("role") for e in engines if e.get("healthy") and e.get("prompt_tokens_per_s", 1)}
    return [role for role in ("prefill", "decode") if role not in have]


def engine_speeds(url: str) -> str:
    """One line with each engine's measured prompt speed, from ``/pdserve/status``."""
    import json

    try:
        with urllib.request.urlopen(url + "/pdserve/status", timeout=3) as r:
            engines = json.load(r).get("engines", [])
    except (urllib.error.URLError, OSError, ValueError):
        return ""
    parts = [f"{e['role']} {e['prompt_tokens_per_s']:,.0f}" for e in engines if e.get("prompt_tokens_per_s")]
    return "engine prompt speed (tokens/s, as admission uses it): " + ", ".join(parts) if parts else ""


#: A line that names an exception (``ValueError: ...``, ``pydantic_core._pydantic_core.ValidationError: ...``).
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception)\b")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def failure_detail(deployments: dict[str, Any]) -> list[str]:
    """Why each failed deployment failed, from Serve's status message of it (``deployments``: the app's
    ``DeploymentStatusOverview`` by name): pdserve's own error (an engine that did not start names its log)
    and the last exception its message holds (an engine's: the tail of its log), with the lines under it."""
    out = []
    for name, d in sorted(deployments.items()):
        status = str(getattr(d.status, "value", d.status))
        if status not in ("DEPLOY_FAILED", "UNHEALTHY") or not d.message:
            continue
        lines = [_ANSI.sub("", ln).rstrip() for ln in str(d.message).splitlines()]
        ours = next((ln.split(": ", 1)[1] for ln in lines if ln.startswith("pdserve.errors.") and ": " in ln), "")
        last = max((i for i, ln in enumerate(lines) if _EXCEPTION_LINE.match(ln)), default=None)
        cause = [] if last is None else [lines[last]] + [
            ln.strip() for ln in lines[last + 1:last + 3] if ln.startswith(" ") and "further information" not in ln]
        out.append(f"  {name}: {ours or status.lower()}")
        out += [f"    {c}" for c in cause if not (ours and ours in c)]
    return out


def deployment_failure(rserve: Any, app_name: str) -> list[str]:
    try:
        st = rserve.status().applications.get(app_name)
    except Exception:  # noqa: BLE001
        return []
    return failure_detail(st.deployments) if st is not None else []


def status_line(rserve: Any, app_name: str) -> str:
    try:
        st = rserve.status().applications.get(app_name)
    except Exception:  # noqa: BLE001
        return ""
    if st is None:
        return "waiting for the Serve controller"
    parts = []
    for name, d in sorted(st.deployments.items()):
        counts = ", ".join(f"{n} {s.lower()}" for s, n in sorted(d.replica_states.items()))
        parts.append(f"{name}: {d.status.lower()}{' (' + counts + ')' if counts else ''}")
    return "; ".join(parts)
