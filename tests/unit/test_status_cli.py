"""``pdserve status`` (cli/status.py): the endpoint's key sent as a bearer token, a refused or missing key
said as such, and the router's host memory printed by part (the real command against a running app:
tests/integration/test_pd_real.py)."""

from __future__ import annotations

import io
import json
import urllib.error

import pytest

from pdserve.cli import status as cli

STATUS = {"model": "m", "version": "0.1.0", "decisions": {"pd": 3, "local": 1},
          "engines": [{"role": "decode", "replica_id": "abcdefghijklmnop", "healthy": True, "inflight": 0,
                       "node": "127.0.0.1", "url": "http://127.0.0.1:1"}],
          "pd_in_effect": {"pd_share": 0.75, "recent_requests": 4, "decode_prompt_tokens_pulled_share": 0.9},
          "host_footprint": {"pss_bytes": {"router replica": 1 << 29, "engine core": 3 << 30},
                             "total_pss_bytes": (3 << 30) + (1 << 29)}}


@pytest.fixture
def endpoint(monkeypatch):
    """A stand-in for urlopen: answers STATUS to the key ``k`` (or to anyone when no key is set)."""
    seen: list = []
    state = {"key": None}

    def urlopen(req, timeout):
        seen.append((req.full_url, req.get_header("Authorization")))
        if state["key"] and req.get_header("Authorization") != f"Bearer {state['key']}":
            raise urllib.error.HTTPError(req.full_url, 401, "Unauthorized", {}, None)
        return io.BytesIO(json.dumps(STATUS).encode())

    monkeypatch.setattr("urllib.request.urlopen", urlopen)
    monkeypatch.delenv(cli.API_KEY_ENV, raising=False)
    return seen, state


def test_status_asks_for_the_host_memory_and_prints_it_by_part(endpoint, capsys):
    seen, _ = endpoint
    assert cli.status("http://127.0.0.1:8000/") == 0
    out = capsys.readouterr().out
    assert seen == [("http://127.0.0.1:8000/pdserve/status?footprint=1", None)]
    assert "decode   abcdefghijkl True" in out and "decisions: pd=3, local=1" in out
    assert "P/D in effect: 75% of the last 4 requests; decode pulled 90%" in out
    assert out.rstrip().endswith("memory (PSS, GiB) of pdserve's processes on the router's host: 3.50 in all: "
                                 "engine core 3.00, router replica 0.50")


def test_status_sends_the_key_from_the_flag_or_the_environment_and_says_when_it_is_wanted(
        endpoint, capsys, monkeypatch):
    seen, state = endpoint
    state["key"] = "k"
    assert cli.status("http://h:1") == 1
    assert "http://h:1/pdserve/status wants an API key: pass the endpoint's key with --api-key or in " \
           "PDSERVE_API_KEY" in capsys.readouterr().err
    assert cli.status("http://h:1", api_key="wrong") == 1
    assert "refused the API key given" in capsys.readouterr().err
    assert cli.status("http://h:1", api_key="k", as_json=True) == 0
    assert json.loads(capsys.readouterr().out)["model"] == "m"
    monkeypatch.setenv(cli.API_KEY_ENV, "k")
    assert cli.status("http://h:1") == 0
    assert [auth for _, auth in seen] == [None, "Bearer wrong", "Bearer k", "Bearer k"]


def test_status_says_what_failed_when_the_endpoint_cannot_be_had(monkeypatch, capsys):
    def refused(req, timeout):
        raise urllib.error.URLError(ConnectionRefusedError(111, "Connection refused"))

    monkeypatch.setattr("urllib.request.urlopen", refused)
    assert cli.status("http://127.0.0.1:8999") == 1
    err = capsys.readouterr().err
    assert "cannot reach http://127.0.0.1:8999/pdserve/status" in err
    assert "is `pdserve serve` running?" in err and "--url" in err
    assert cli.memory_line({}) is None


def test_status_prints_a_named_tenants_view_without_addresses():
    """A named tenant's status has no engine address, node nor load (router/api/status.py): the table says
    '-'."""
    from pdserve.router.api.status import TENANT_ENGINE_FIELDS

    engine = {k: v for k, v in STATUS["engines"][0].items() if k in TENANT_ENGINE_FIELDS}
    view = {"model": STATUS["model"], "version": STATUS["version"], "engines": [engine], "tenants": {}}
    out = cli.table(view)
    assert "decode   abcdefghijkl True     -" in out and "127.0.0.1" not in out and "decisions" not in out
