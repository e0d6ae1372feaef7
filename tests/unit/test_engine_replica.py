"""An engine replica whose engine exits by itself (app/deployments.py): it leaves the registry and ends its
own actor, so that Serve replaces it at its next health check; not while the whole app stops."""

from __future__ import annotations

from types import SimpleNamespace

from tests.unit.test_drain import FakeKv


def test_an_engine_that_exits_by_itself_takes_its_replica_out_of_the_registry_and_down(monkeypatch):
    import ray

    from pdserve.app import deployments, registry

    kv = FakeKv()
    monkeypatch.setattr(registry, "_store", lambda: kv)
    killed: list[tuple[object, bool]] = []
    monkeypatch.setattr(ray, "kill", lambda actor, no_restart=True: killed.append((actor, no_restart)))
    monkeypatch.setattr(ray, "get_runtime_context", lambda: SimpleNamespace(current_actor="this replica"))
    server = object.__new__(deployments.EngineServer)
    server.role, server.app_name, server.replica_id, server.proc = "decode", "app", "r1", None
    registry.register("app", "r1", {"role": "decode"})
    registry.register("app", "r2", {"role": "prefill"})

    server._engine_exited(-9)
    assert killed == [("this replica", True)]
    assert registry.key("app", "r1") not in kv.kv and registry.key("app", "r2") in kv.kv

    # The whole app stops (Ctrl-C): Serve stops every replica itself; an engine gone first changes nothing.
    registry.mark_stopping("app")
    server.replica_id = "r2"
    server._engine_exited(0)
    assert killed == [("this replica", True)] and registry.key("app", "r2") in kv.kv
