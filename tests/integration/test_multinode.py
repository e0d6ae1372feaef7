"""Two hosts, one Ray cluster: prefill on one node, decode on the other, the KV cache over the network.

The hosts are two network namespaces on this machine joined by a veth pair (scripts/netns-cluster.sh):
a Ray head in ``pdserve-a`` (10.77.0.1, resource ``pdserve_prefill``) and a Ray worker in ``pdserve-b``
(10.77.0.2, resource ``pdserve_decode``). ``pdserve serve multinode.yaml --address 10.77.0.1:6379`` runs
on host A, as a user runs it on a real head node. UCX is limited to TCP there: the namespaces share one
kernel and /dev/shm, so with shared memory allowed the KV would never touch the link. This test process
is the client on a third address (the machine's own namespace, routed through host A).
"""

from __future__ import annotations

import random
import subprocess
import sys
import time
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest

from tests.integration.conftest import ROOT, ServeProcess, SystemSlot, engine_processes
from tests.integration.test_pd_real import by_source, complete, engine_metrics, metric
from tests.needs import need_netns

pytestmark = pytest.mark.integration

SCRIPT = ROOT / "scripts" / "netns-cluster.sh"
CONFIG = ROOT / "tests" / "integration" / "multinode.yaml"
NS_A, NS_B = "pdserve-a", "pdserve-b"
HOST_A, HOST_B = "10.77.0.1", "10.77.0.2"
LINK_B = "pdserve-ba"  # host B's end of the veth pair between the hosts
PORT = 8000
LENGTHS = [16, 130, 257, 512, 800]
# SmolLM2-135M: 30 layers x (K, V) x 3 KV heads x 64 dims; 2 bytes each in bf16 (23,040), 4 in float32.
KV_BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 4


def _script(cmd: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(SCRIPT), cmd], cwd=ROOT, text=True, capture_output=True, timeout=timeout,
                          check=False)


def _in_ns(ns: str, *cmd: str) -> str:
    return subprocess.run(["ip", "netns", "exec", ns, *cmd], text=True, capture_output=True, check=True,
                          timeout=30).stdout


def rx_bytes_on_b() -> int:
    """Bytes host B received over the link from host A (the namespace's own /sys view)."""
    return int(_in_ns(NS_B, "cat", f"/sys/class/net/{LINK_B}/statistics/rx_bytes"))


def _say(msg: str) -> None:
    sys.stderr.write(f"[multinode] {msg}\n")


@pytest.fixture(scope="module")
def cluster(system_slot: SystemSlot) -> Iterator[ServeProcess]:
    need_netns()
    system_slot.release_shared()
    t0 = time.monotonic()
    sp: ServeProcess | None = None
    _script("down", 120)  # leftovers of an interrupted run
    try:
        up = _script("up", 180)
        assert up.returncode == 0, f"netns-cluster.sh up failed:\n{up.stderr[-4000:]}"
        _say(f"cluster up in {time.monotonic() - t0:.0f}s")
        # Host A's view of the cluster: its address and auth token, as on a real head node.
        client_env = _script("env", 10).stdout.split()
        sp = system_slot.own(CONFIG, engines=2, what="the two-host system", port=PORT, prefix=["ip", "netns", "exec", NS_A, "env", *client_env],
                          args=["--address", f"{HOST_A}:6379"], host=HOST_A)
        sp.wait_ready()
        _say(f"pdserve ready {time.monotonic() - t0:.0f}s after start")
        yield sp
    finally:
        if sp is not None:
            sp.stop()
        down = _script("down", 120)
        _say(f"cluster down ({down.returncode}) {time.monotonic() - t0:.0f}s after start")


def test_each_role_runs_on_its_own_host(cluster: ServeProcess):
    engines = {e["role"]: e for e in cluster.status()["engines"]}
    assert set(engines) == {"prefill", "decode"}, engines
    for role, host in (("prefill", HOST_A), ("decode", HOST_B)):
        assert urlsplit(engines[role]["url"]).hostname == host, engines[role]
        assert engines[role]["node"] == host, engines[role]
        assert engines[role]["healthy"], engines[role]
    # The router replica serves the port itself: on the host `pdserve serve` runs on (A), the address its
    # user reaches, wherever Ray would have placed it.
    pid = cluster.status()["router"]["pid"]
    where = subprocess.run(["ip", "netns", "identify", str(pid)], text=True, capture_output=True, check=True)
    assert where.stdout.split() == [NS_A], (pid, where.stdout)


def test_pd_across_hosts_equals_single_engine_and_kv_crosses_the_link(cluster: ServeProcess):
    prefill_url, decode_url = cluster.engine_url("prefill"), cluster.engine_url("decode")
    rng = random.Random(4321)
    prompts = [[rng.randrange(200, 40000) for _ in range(n)] for n in LENGTHS]
    before = engine_metrics(decode_url)
    rx_before = rx_bytes_on_b()
    t0 = time.monotonic()
    mismatches = []
    for p in prompts:
        # The reference first, on the prefill engine alone (host A), so decode has never seen the prompt.
        ref = complete(prefill_url, p)["choices"][0]
        got = complete(cluster.url, p)["choices"][0]
        if got["token_ids"] != ref["token_ids"]:
            mismatches.append((len(p), ref["text"], got["text"]))
    took = time.monotonic() - t0
    rx = rx_bytes_on_b() - rx_before
    after = engine_metrics(decode_url)
    assert not mismatches, f"P/D across hosts differs from the single engine: {mismatches}"

    xfers = metric(after, "vllm:nixl_xfer_time_seconds_count") - metric(before, "vllm:nixl_xfer_time_seconds_count")
    moved = metric(after, "vllm:nixl_bytes_transferred_sum") - metric(before, "vllm:nixl_bytes_transferred_sum")
    pulled = by_source(after, "external_kv_transfer") - by_source(before, "external_kv_transfer")
    _say(f"{len(prompts)} prompts ({sum(LENGTHS)} tokens) in {took:.1f}s: {xfers:.0f} NIXL transfers, "
         f"{moved / 1e6:.1f} MB by NIXL, {pulled:.0f} prompt tokens pulled, {rx / 1e6:.1f} MB received "
         f"on host B's link")
    # The KV was pulled over NIXL, not recomputed on decode...
    assert xfers >= sum(1 for n in LENGTHS if n >= 257), after[-3000:]
    assert pulled >= sum(max(0, n - 256) for n in LENGTHS), (pulled, after[-3000:])
    assert metric(after, "vllm:nixl_num_failed_transfers_total") == 0
    # ...and it crossed the link between the hosts: host B received at least the KV of what it pulled.
    assert moved >= pulled * KV_BYTES_PER_TOKEN, (moved, pulled)
    assert rx >= moved, f"host B received {rx} bytes on {LINK_B}, NIXL moved {moved}"
    assert metric(engine_metrics(prefill_url), "vllm:nixl_num_kv_expired_reqs_total") == 0


def _kv_events_port(cluster: ServeProcess) -> int:
    """The TCP port the cluster's prefill engine publishes its KV cache events on (from its command line; an
    engine another test left stopping on this host publishes elsewhere and is not the cluster's)."""
    import json

    import psutil

    seen = []
    for p in psutil.process_iter(["cmdline"]):
        argv = p.info["cmdline"] or []
        if "--kv-events-config" not in argv or "kv_producer" not in " ".join(argv):
            continue
        endpoint = json.loads(argv[argv.index("--kv-events-config") + 1])["endpoint"]
        seen.append((p.pid, endpoint, p.pid in cluster.preexisting))
        if endpoint.startswith("tcp://") and p.pid not in cluster.preexisting:
            return int(endpoint.rsplit(":", 1)[1])
    raise AssertionError(f"no prefill engine of the cluster publishes KV cache events over TCP: {seen}")


def test_kv_events_cross_the_link_to_the_router_only(cluster: ServeProcess):
    """The prefill engine's KV events (every cached block's prompt tokens) leave its host over TCP: the router
    reads them (its index fills), a subscriber without the engine's key reads nothing."""
    import zmq

    address = f"tcp://{HOST_A}:{_kv_events_port(cluster)}"
    ctx = zmq.Context()
    stranger = ctx.socket(zmq.SUB)
    stranger.setsockopt(zmq.SUBSCRIBE, b"")
    stranger.connect(address)
    try:
        rng = random.Random(99)
        for _ in range(3):
            complete(cluster.url, [rng.randrange(200, 40000) for _ in range(300)])
        got_any = bool(stranger.poll(3000))
    finally:
        stranger.close(linger=0)
        ctx.term()
    routing = cluster.status().get("kv_cache_routing") or {}
    blocks = sum(e["blocks"] for e in routing.get("engines", {}).values())
    assert blocks > 0 and not got_any, (routing, got_any)


def test_zz_stop_and_down_leave_nothing(cluster: ServeProcess):
    """Last: stop the app, take the cluster down, and check no process, namespace or link is left."""
    assert cluster.stop() == 0, "\n".join(cluster.lines)
    down = _script("down", 120)
    assert down.returncode == 0, down.stderr
    assert not set(engine_processes()) - cluster.preexisting
    listed = subprocess.run(["ip", "netns", "list"], text=True, capture_output=True, check=True).stdout
    assert NS_A not in listed and NS_B not in listed, listed
    links = subprocess.run(["ip", "-br", "link"], text=True, capture_output=True, check=True).stdout
    assert not [ln for ln in links.splitlines() if ln.startswith("pdserve-")], links
