"""``pdserve status``: a running endpoint's replicas, roles, health and load, what its router decided, and
the memory of pdserve's processes on the router's host (PSS by part, as the KV caches have filled so far)."""

from __future__ import annotations

import json
import sys
from typing import Any

from pdserve.settings import Settings, settings

#: Where ``pdserve status`` takes the endpoint's API key from when ``--api-key`` is not given.
API_KEY_ENV = Settings.client_api_key.name
GIB = 1 << 30


def fetch(url: str, api_key: str | None, timeout_s: float = 10.0) -> tuple[dict[str, Any] | None, str]:
    """The router's ``/pdserve/status`` with the host's memory; (None, why) when it cannot be had."""
    import urllib.error
    import urllib.request

    target = url.rstrip("/") + "/pdserve/status"
    req = urllib.request.Request(target + "?footprint=1",
                                 headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return json.load(r), ""
    except urllib.error.HTTPError as e:
        if e.code in (401, 403):
            said = "refused the API key given" if api_key else "wants an API key"
            return None, f"{target} {said}: pass the endpoint's key with --api-key or in {API_KEY_ENV}"
        return None, f"{target} answered {e.code} {e.reason}"
    except (urllib.error.URLError, OSError, ValueError) as e:
        why = getattr(e, "reason", e)
        hint = ""
        if isinstance(why, ConnectionRefusedError):
            hint = (" (nothing listens there: is `pdserve serve` running? Another address or port: "
                    "--url http://HOST:PORT)")
        return None, f"cannot reach {target}: {why}{hint}"


def memory_line(footprint: dict[str, Any]) -> str | None:
    """One line of the host's memory by part, largest first; None when nothing was counted."""
    parts = sorted((footprint.get("pss_bytes") or {}).items(), key=lambda kv: -kv[1])
    if not parts:
        return None
    total = footprint.get("total_pss_bytes") or sum(v for _, v in parts)
    return (f"memory (PSS, GiB) of pdserve's processes on the router's host: {total / GIB:.2f} in all: "
            + ", ".join(f"{k} {v / GIB:.2f}" for k, v in parts))


def table(data: dict[str, Any]) -> str:
    """What ``pdserve status`` prints."""
    lines = [f"model {data['model']}   pdserve {data['version']}",
             f"{'ROLE':8} {'REPLICA':12} {'HEALTHY':8} {'INFLIGHT':8} {'NODE':15} URL"]
    for e in data["engines"]:
        lines.append(f"{e['role']:8} {e['replica_id'][:12]:12} {e['healthy']!s:8} {e.get('inflight', '-')!s:<8} "
                     f"{e.get('node', '-'):15} {e.get('url', '-')}")  # (a named tenant is not told where nor load)
    if "decisions" in data:
        lines.append("decisions: " + ", ".join(f"{k}={v}" for k, v in data["decisions"].items()))
    effect = data.get("pd_in_effect") or {}
    if effect.get("pd_share") is not None:
        line = f"P/D in effect: {effect['pd_share']:.0%} of the last {effect['recent_requests']} requests"
        if effect.get("decode_prompt_tokens_pulled_share") is not None:
            line += f"; decode pulled {effect['decode_prompt_tokens_pulled_share']:.0%} of its prompt tokens over NIXL"
        lines.append(line)
    if effect.get("warning"):
        lines.append(f"warning: {effect['warning']}")
    mem = memory_line(data.get("host_footprint") or {})
    if mem:
        lines.append(mem)
    return "\n".join(lines)


def status(url: str, *, api_key: str | None = None, as_json: bool = False) -> int:
    data, why = fetch(url, api_key or settings().client_api_key or None)
    if data is None:
        print(f"pdserve status: {why}", file=sys.stderr)
        return 1
    print(json.dumps(data, indent=2) if as_json else table(data))
    return 0
