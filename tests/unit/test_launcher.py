import json

import pytest

from pdserve.config.schema import PDServeArgs
from pdserve.engine import allocator
from pdserve.engine.allocator import Claim, claim_cores, claim_free_port, claim_port_block
from pdserve.engine.launcher import EnginePlacement, build_engine_command, kwargs_to_flags


def test_kwargs_to_flags():
    flags = kwargs_to_flags({"max_model_len": 512, "enforce_eager": True, "enable_prefix_caching": False,
                             "kv_transfer_config": {"a": 1}, "skip": None, "allowed_origins": ["x", "y"]})
    assert flags == ["--max-model-len", "512", "--enforce-eager", "--no-enable-prefix-caching",
                     "--kv-transfer-config", '{"a":1}', "--allowed-origins", "x", "y"]


def test_engine_command_on_cpu():
    args = PDServeArgs.model_validate({"decode_config": {"engine_kwargs": {"max_model_len": 1024}},
                                       "prefill_config": {"engine_kwargs": {"max_model_len": 1024}}})
    pl = EnginePlacement(http_port=8123, side_channel_port=5601, side_channel_host="127.0.0.1",
                         engine_id="decode-0", cores=[1], on_cpu=True)
    cmd = build_engine_command("decode", args, "/models/m", pl)
    argv = cmd.argv
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert argv[argv.index("--port") + 1] == "8123"
    assert argv[argv.index("--max-model-len") + 1] == "1024"
    kv = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert kv["kv_role"] == "kv_consumer" and kv["kv_buffer_device"] == "cpu"
    assert kv["engine_id"] == "decode-0"
    assert cmd.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5601"
    assert cmd.env["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert "VLLM_CPU_KVCACHE_SPACE" not in cmd.env  # the size is an engine argument (engine/kv_size.py)
    assert "--kv-cache-memory-bytes" in argv


def test_a_one_core_cpu_engine_runs_its_model_in_the_engine_core_process():
    """No worker process beside the engine core on CPU (the uni executor, which vLLM's CPU platform allows
    only with VLLM_ENABLE_V1_MULTIPROCESSING=0); an engine_kwargs choice wins, and a GPU engine is left to
    vLLM's own default."""
    pl = EnginePlacement(http_port=8123, side_channel_port=5601, side_channel_host="127.0.0.1",
                         engine_id="decode-0", cores=[1], on_cpu=True)
    cmd = build_engine_command("decode", PDServeArgs(), "/m", pl)
    assert cmd.argv[cmd.argv.index("--distributed-executor-backend") + 1] == "uni"
    assert cmd.env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert cmd.env["PDSERVE_ENGINE_START_METHOD"] == "fork"  # the engine core inherits the API server's imports
    assert "PDSERVE_ENGINE_IDLE_SPIN_MS" not in cmd.env  # a worker's spin bound: no worker here
    mp = PDServeArgs.model_validate({"decode_config": {"engine_kwargs": {"distributed_executor_backend": "mp"}}})
    cmd = build_engine_command("decode", mp, "/m", pl)
    assert cmd.argv[cmd.argv.index("--distributed-executor-backend") + 1] == "mp"
    assert cmd.env["PDSERVE_ENGINE_IDLE_SPIN_MS"] == "20"
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in cmd.env and "PDSERVE_ENGINE_START_METHOD" not in cmd.env
    gpu = EnginePlacement(http_port=8123, side_channel_port=5601, side_channel_host="10.0.0.1",
                          engine_id="decode-0", cores=[], on_cpu=False)
    cmd = build_engine_command("decode", PDServeArgs(), "/m", gpu)
    assert "--distributed-executor-backend" not in cmd.argv and "VLLM_ENABLE_V1_MULTIPROCESSING" not in cmd.env


def test_port_blocks_do_not_collide(tmp_path, monkeypatch):
    """Claims exclude each other by their lock files (the ports' real probe is stubbed: no bind here)."""
    monkeypatch.setenv("PDSERVE_LOCK_DIR", str(tmp_path))
    monkeypatch.setattr(allocator, "port_is_free", lambda port, host="0.0.0.0": True)
    a, b = Claim(), Claim()
    pa = claim_port_block(a, 23000, 2)
    pb = claim_port_block(b, 23000, 2)
    assert set(a.ports).isdisjoint(b.ports) and pa != pb
    a.release()
    c = Claim()
    assert claim_port_block(c, 23000, 2) == pa  # released claims are reusable
    b.release(), c.release()


def test_a_free_port_is_claimed_so_two_replicas_never_get_the_same_one(tmp_path, monkeypatch):
    """The kernel may give two replicas starting together the same free port (it is free again once the probe
    socket closes): the second claim passes it over for the next one it is given."""
    monkeypatch.setenv("PDSERVE_LOCK_DIR", str(tmp_path))
    monkeypatch.setattr(allocator, "port_is_free", lambda port, host="0.0.0.0": True)
    given = iter([41000, 41000, 41000, 41001])
    a, b = Claim(), Claim()
    assert claim_free_port(a, pick=lambda host: next(given)) == 41000
    assert claim_free_port(b, pick=lambda host: next(given)) == 41001
    assert a.ports == [41000] and b.ports == [41001]
    with pytest.raises(RuntimeError, match="no free port"):
        claim_free_port(Claim(), pick=lambda host: 41000, tries=3)
    a.release()
    c = Claim()
    assert claim_free_port(c, pick=lambda host: 41000) == 41000  # released with its replica
    b.release(), c.release()


def test_cores_are_exclusive_until_oversubscribed(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_LOCK_DIR", str(tmp_path))
    claims = [Claim() for _ in range(3)]
    got = [claim_cores(c, 1, [0, 1]) for c in claims]
    assert got[0] != got[1]
    assert got[2] in ([0], [1])  # a third engine on two cores shares one
    for c in claims:
        c.release()


@pytest.mark.parametrize("order", ["pdpd", "ppdd", "ddpp", "pppd", "pdpppddd"])
def test_oversubscribed_cores_are_shared_evenly(tmp_path, monkeypatch, order):
    """Four (eight) engines on two cores, in any start order (prefill takes cores from the start, decode from
    the end, as EngineServer asks): two (four) a core, never more on one, and the roles spread: a core has a
    second engine of a role only when every core has one."""
    monkeypatch.setenv("PDSERVE_LOCK_DIR", str(tmp_path))
    placed: dict[int, list[str]] = {0: [], 1: []}
    claims = []
    for role in order:
        c = Claim()
        claims.append(c)
        (core,) = claim_cores(c, 1, [0, 1] if role == "p" else [1, 0], {"p": "prefill", "d": "decode"}[role])
        placed[core].append(role)
    assert len(placed[0]) == len(placed[1]) == len(order) // 2, placed
    if order.count("p") == order.count("d"):
        assert sorted(placed[0]) == sorted(placed[1]), placed  # e.g. pdpd: not both decode engines on core 1
    claims[0].release()  # a replica gone: its core's claim is the next replica's
    assert claim_cores(Claim(), 1, [0, 1] if order[0] == "p" else [1, 0], "prefill") == claims[0].cores
    wide = Claim()
    assert claim_cores(wide, 2, [0, 1]) == [0, 1]  # an engine of two cores shares both
    for c in claims[1:] + [wide]:
        c.release()


def test_cpu_engine_fixes_reach_the_engine_processes():
    import os

    from pdserve.engine.launcher import SITE_DIR

    pl = EnginePlacement(http_port=1, side_channel_port=2, side_channel_host="127.0.0.1", engine_id="e",
                         cores=[0], on_cpu=True)
    env = build_engine_command("prefill", PDServeArgs(), "/m", pl).env
    assert env["PDSERVE_ENGINE_CORES"] == "0" and env["PDSERVE_NIXL_PTHR_DELAY_US"] == "100000"
    assert env["PYTHONPATH"].split(os.pathsep)[0] == SITE_DIR
    assert os.path.exists(os.path.join(SITE_DIR, "sitecustomize.py"))
    gpu = build_engine_command("prefill", PDServeArgs(), "/m",
                               EnginePlacement(1, 2, "127.0.0.1", "e", [], on_cpu=False)).env
    assert "PYTHONPATH" not in gpu and "PDSERVE_ENGINE_CORES" not in gpu


def test_an_idle_engine_worker_backs_off_to_a_look_every_50_ms():
    """sitecustomize's reader sleeps 5 ms between looks right after a step, and doubles that each idle second
    up to 50 ms: 200 wake-ups a second while busy traffic pauses, 20 once the engine is idle."""
    from pdserve import idle

    assert [idle.idle_poll_ms(s) for s in (0, 0.5, 1.0, 2.0, 3.5, 4.0, 60.0, 1e9)] == [5, 5, 10, 20, 40, 50, 50, 50]
    assert idle.idle_poll_ms(-1) == 5


def test_a_uvicorn_server_ticks_once_a_second_and_still_refreshes_its_date_each_tick(monkeypatch):
    """The engines' and the router's HTTP servers tick every UVICORN_TICK_S; the counter moves as uvicorn's
    own would in that time, so on_tick's once-a-second work (the Date header) runs on every tick, and the
    server stops on the tick after it is told to."""
    import asyncio

    from pdserve import idle as pdserve_idle

    slept: list[float] = []

    async def sleep(s: float) -> None:
        slept.append(s)

    class Server:
        def __init__(self) -> None:
            self.ticks: list[int] = []

        async def on_tick(self, counter: int) -> bool:
            self.ticks.append(counter)
            return len(self.ticks) == 4

    monkeypatch.setattr(asyncio, "sleep", sleep)
    server = Server()
    asyncio.run(pdserve_idle.uvicorn_main_loop(server))
    assert server.ticks == [0, 10, 20, 30] and all(t % 10 == 0 for t in server.ticks)
    assert slept == [1.0, 1.0, 1.0] and pdserve_idle.UVICORN_TICK_S == 1.0


def test_tcmalloc_is_preloaded_first_when_the_host_has_it(tmp_path):
    from pdserve.engine.launcher import tcmalloc_preload

    lib = tmp_path / "libtcmalloc_minimal.so.4"
    assert tcmalloc_preload("", (str(lib),)) is None  # not on this host: nothing changes
    lib.write_bytes(b"")
    assert tcmalloc_preload("", (str(lib),)) == str(lib)
    assert tcmalloc_preload("/x/libfoo.so", (str(lib),)) == f"{lib}:/x/libfoo.so"
    assert tcmalloc_preload("/opt/libtcmalloc.so", (str(lib),)) is None  # the user's own wins


def test_engine_env_preloads_tcmalloc_unless_turned_off(monkeypatch, tmp_path):
    from pdserve.config.schema import PDServeArgs
    from pdserve.engine import launcher

    lib = tmp_path / "libtcmalloc_minimal.so.4"
    lib.write_bytes(b"")
    monkeypatch.setattr(launcher, "TCMALLOC_PATHS", (str(lib),))
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    pl = launcher.EnginePlacement(http_port=1, side_channel_port=2, side_channel_host="127.0.0.1", engine_id="e",
                                  cores=[0], on_cpu=True)
    assert launcher.engine_env(PDServeArgs(), pl)["LD_PRELOAD"] == str(lib)
    off = PDServeArgs.model_validate({"cpu": {"preload_tcmalloc": False}})
    assert "LD_PRELOAD" not in launcher.engine_env(off, pl)
    pl.on_cpu = False
    assert "LD_PRELOAD" not in launcher.engine_env(PDServeArgs(), pl)


def test_engine_key_is_in_the_environment_and_masked_in_logs():
    placement = EnginePlacement(http_port=8100, side_channel_port=5600, side_channel_host="127.0.0.1", engine_id="e1")
    cmd = build_engine_command("decode", PDServeArgs(), "/m", placement, api_key="s3cret-key")
    assert cmd.env["PDSERVE_ENGINE_KEY"] == cmd.env["VLLM_API_KEY"] == "s3cret-key"
    assert "s3cret-key" not in " ".join(cmd.argv)  # a command line is visible to every local user
    assert "s3cret-key" not in cmd.shell() and "PDSERVE_ENGINE_KEY=***" in cmd.shell()
    plain = build_engine_command("decode", PDServeArgs(), "/m", placement)
    assert "PDSERVE_ENGINE_KEY" not in plain.env


def test_engines_get_the_bounds_of_stored_responses_and_read_them_back():
    from pdserve.engine.responses_store import Bounds, bounds_from_env

    placement = EnginePlacement(http_port=8100, side_channel_port=5600, side_channel_host="127.0.0.1", engine_id="e1")
    args = PDServeArgs.model_validate({"router": {"stored_responses_per_owner": 7, "stored_responses_per_engine": 70,
                                                  "stored_responses_mib_per_owner": 2,
                                                  "stored_responses_mib_per_engine": 3}})
    assert bounds_from_env(build_engine_command("decode", args, "/m", placement).env) == Bounds(7, 70, 2 << 20, 3 << 20)
    assert bounds_from_env(build_engine_command("decode", PDServeArgs(), "/m", placement).env) == Bounds(
        1000, 10000, 256 << 20, 1024 << 20)


def test_pins_are_shared_fairly_only_in_apps_with_tenants():
    placement = EnginePlacement(http_port=8100, side_channel_port=5600, side_channel_host="127.0.0.1", engine_id="e1")
    bidir = {"nixl": {"bidirectional": True}}
    env = build_engine_command("decode", PDServeArgs.model_validate(bidir), "/m", placement).env
    assert env["PDSERVE_KV_PIN_SHARE"] == "0.5" and "PDSERVE_KV_PIN_FAIR" not in env
    tenants = {**bidir, "router": {"tenants": {"acme": {"keys_env": "ACME_KEYS"}}}}
    env = build_engine_command("decode", PDServeArgs.model_validate(tenants), "/m", placement).env
    assert env["PDSERVE_KV_PIN_FAIR"] == "1"


def test_loopback_hosts():
    from pdserve.cli.serve import is_loopback

    assert all(is_loopback(h) for h in ("127.0.0.1", "localhost", "::1", "127.0.0.2"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "10.0.0.5", "example.com"))


def test_packaged_tokenizer_source_reaches_vllm_resolved(monkeypatch, tmp_path):
    """``tokenizer_source: pdserve:…`` is prepared like ``model_source``; vLLM gets a directory, not the name."""
    import pytest

    from pdserve.config.schema import EMBEDDED_MODEL_SOURCE
    from pdserve.errors import ConfigError
    from pdserve.model import resolve

    prepared = tmp_path / "smollm2"
    monkeypatch.setattr(resolve, "prepare_embedded_model", lambda progress=None, root=None: prepared)
    args = PDServeArgs.model_validate({"prefill_config": {"model_loading_config": {
        "tokenizer_source": EMBEDDED_MODEL_SOURCE}}})
    tok = resolve.resolve_model(args.prefill_config.model_loading_config.tokenizer_source)
    assert tok == str(prepared)
    placement = EnginePlacement(http_port=1, side_channel_port=2, side_channel_host="127.0.0.1", engine_id="e")
    argv = build_engine_command("prefill", args, "/m", placement, tokenizer_path=tok).argv
    assert argv[argv.index("--tokenizer") + 1] == str(prepared)
    with pytest.raises(ConfigError, match="unknown packaged model"):
        resolve.resolve_model("pdserve:nope")
    with pytest.raises(ValueError, match="unknown packaged model"):
        PDServeArgs.model_validate({"decode_config": {"model_loading_config": {"tokenizer_source": "pdserve:nope"}}})


def test_local_only_app_keeps_ucx_on_loopback(monkeypatch):
    monkeypatch.delenv("UCX_NET_DEVICES", raising=False)
    local = EnginePlacement(http_port=1, side_channel_port=2, side_channel_host="127.0.0.1", engine_id="e")
    cluster = EnginePlacement(http_port=1, side_channel_port=2, side_channel_host="10.0.0.7", engine_id="e")
    cmd = build_engine_command("prefill", PDServeArgs(), "/m", local)
    assert cmd.env["UCX_NET_DEVICES"] == "lo" and cmd.argv[cmd.argv.index("--host") + 1] == "127.0.0.1"
    cmd = build_engine_command("prefill", PDServeArgs(), "/m", cluster)
    assert "UCX_NET_DEVICES" not in cmd.env and cmd.argv[cmd.argv.index("--host") + 1] == "0.0.0.0"


def test_tracing_reaches_the_engines_only_when_set():
    pl = EnginePlacement(http_port=8123, side_channel_port=5601, side_channel_host="127.0.0.1",
                         engine_id="prefill-r1-abc", cores=[0], on_cpu=True)
    off = build_engine_command("prefill", PDServeArgs(), "/m", pl)
    assert "--otlp-traces-endpoint" not in off.argv and "OTEL_SERVICE_NAME" not in off.env
    args = PDServeArgs.model_validate({"tracing": {"otlp_endpoint": "http://127.0.0.1:4318/v1/traces"}})
    on = build_engine_command("prefill", args, "/m", pl)
    assert on.argv[on.argv.index("--otlp-traces-endpoint") + 1] == "http://127.0.0.1:4318/v1/traces"
    assert on.env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] == "http/protobuf"
    assert on.env["OTEL_SERVICE_NAME"] == "pdserve-prefill"
    quiet = PDServeArgs.model_validate({"tracing": {"otlp_endpoint": "http://x:4318/v1/traces", "engines": False}})
    assert "--otlp-traces-endpoint" not in build_engine_command("prefill", quiet, "/m", pl).argv


def test_a_cpu_engines_kv_cache_is_sized_to_the_model(tmp_path, monkeypatch):
    """``cpu.kv_cache_gib: auto``: four whole contexts for a decode engine, two for a prefill engine, at the
    model's KV bytes per token in the engine's dtype; a fraction of a GiB when given; the user's engine
    argument wins; 1 GiB when the model's shape is unknown."""
    import json

    from pdserve.engine.kv_size import GIB, cpu_kv_cache_bytes
    from pdserve.engine.launcher import engine_kwargs_for

    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    # SmolLM2-135M's shape: 30 layers, 9 heads of 64, 3 KV heads.
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 30, "num_attention_heads": 9,
                                                      "num_key_value_heads": 3, "hidden_size": 576}))
    fp32 = PDServeArgs.model_validate({f"{r}_config": {"engine_kwargs": {"dtype": "float32"}}
                                       for r in ("prefill", "decode")})
    kw = engine_kwargs_for("decode", fp32, on_cpu=True, model_path=str(tmp_path))
    per_token = 2 * 30 * 3 * 64 * 4
    assert kw["kv_cache_memory_bytes"] >= 4 * 4096 * per_token > kw["kv_cache_memory_bytes"] - (16 << 20)
    prefill = engine_kwargs_for("prefill", fp32, on_cpu=True, model_path=str(tmp_path))
    assert prefill["kv_cache_memory_bytes"] >= 2 * 4096 * per_token > prefill["kv_cache_memory_bytes"] - (16 << 20)
    # By load, prefill answers whole requests too and holds their conversations: decode's size.
    by_load = fp32.model_copy(update={"router": fp32.router.model_copy(update={"disaggregate_by_load": True})})
    both = engine_kwargs_for("prefill", by_load, on_cpu=True, model_path=str(tmp_path))
    assert both["kv_cache_memory_bytes"] == kw["kv_cache_memory_bytes"]
    bf16 = cpu_kv_cache_bytes("auto", str(tmp_path), {"dtype": "bfloat16", "max_model_len": 4096})
    assert bf16 < kw["kv_cache_memory_bytes"] * 0.52  # half, rounded up to 16 MiB
    assert cpu_kv_cache_bytes(0.25, None, {}) == GIB // 4
    assert cpu_kv_cache_bytes("auto", None, {"max_model_len": 4096}) == GIB  # no model at hand
    mine = PDServeArgs.model_validate({"prefill_config": {"engine_kwargs": {"kv_cache_memory_bytes": 12345}}})
    assert engine_kwargs_for("prefill", mine, on_cpu=True, model_path=str(tmp_path))["kv_cache_memory_bytes"] == 12345
    assert "kv_cache_memory_bytes" not in engine_kwargs_for("prefill", fp32, on_cpu=False, model_path=str(tmp_path))
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")  # vLLM lets the variable win: pdserve then sets nothing
    assert "kv_cache_memory_bytes" not in engine_kwargs_for("prefill", fp32, on_cpu=True, model_path=str(tmp_path))


def test_a_uni_engine_core_is_forked_from_the_api_server(monkeypatch):
    """The site hook's patch of vLLM's CPU platform: after vLLM's own config check (which forces ``spawn``),
    a ``uni`` engine's start method is the launcher's; a worker-process engine keeps vLLM's."""
    import os
    import types

    site = _load_site(monkeypatch)

    class CpuPlatform:
        @classmethod
        def check_and_update_config(cls, vllm_config):
            os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"

    monkeypatch.setenv("PDSERVE_ENGINE_START_METHOD", "fork")
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "")
    site._patch_start_method(types.SimpleNamespace(CpuPlatform=CpuPlatform))

    def config(backend):
        return types.SimpleNamespace(parallel_config=types.SimpleNamespace(distributed_executor_backend=backend))

    CpuPlatform.check_and_update_config(config("uni"))
    assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "fork"
    CpuPlatform.check_and_update_config(config("mp"))
    assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"


def test_the_site_hook_lets_the_kv_event_publisher_wait_for_its_next_batch(monkeypatch):
    """vLLM's KV-event publisher (stand-in with its shape) takes batches off a queue with a 0.1-s timeout;
    without a replay socket the patched queue waits until a batch or the stop's sentinel comes, and with
    one it keeps the timeout (the thread looks at the socket between batches)."""
    import queue
    import threading
    import types

    site = _load_site(monkeypatch)

    class ZmqEventPublisher:
        def __init__(self, replay_endpoint=None):
            self._event_queue = queue.Queue(maxsize=10)
            self._replay = object() if replay_endpoint else None

    module = types.SimpleNamespace(ZmqEventPublisher=ZmqEventPublisher, Queue=queue.Queue)
    site._patch_kv_events_wait(module)
    plain, replaying = ZmqEventPublisher(), ZmqEventPublisher(replay_endpoint="tcp://*:5558")
    with pytest.raises(queue.Empty):
        replaying._event_queue.get(timeout=0.01)  # as vLLM's
    with pytest.raises(queue.Empty):
        plain._event_queue.get(block=False)
    got = []
    t = threading.Thread(target=lambda: got.append(plain._event_queue.get(timeout=0.01)))
    t.start()
    t.join(0.3)
    assert t.is_alive() and not got  # still waiting, well past the timeout it was given
    plain._event_queue.put(None)  # vLLM's stop
    t.join(5)
    assert got == [None]


@pytest.mark.parametrize("local_only, node", [(True, "127.0.0.1"), (False, "10.0.0.5")])
def test_the_forkserver_shares_every_setting_an_engine_reads_at_import(local_only, node):
    """pdserve serve's forkserver is started with the settings its engines will read at import: a prefill
    and a decode engine on the node's address (loopback where the app is local-only) can be forked from it.
    On a host that serves beyond loopback (`--host 0.0.0.0`) the forkserver had loopback's UCX device list,
    so every engine started afresh (slower, 0.7 GiB more)."""
    from pdserve.engine.forkserver import mismatched
    from pdserve.engine.local_forkserver import forkserver_env
    from pdserve.settings import FORKSERVER_CHECKED_ENV

    args = PDServeArgs()
    common = forkserver_env(args, "/m", local_only)
    started = {**common, FORKSERVER_CHECKED_ENV: ",".join(sorted(common))}
    for role in ("prefill", "decode"):
        placement = EnginePlacement(http_port=8100, side_channel_port=5600, side_channel_host=node,
                                    engine_id=f"{role}-1", cores=[0], on_cpu=True)
        assert mismatched(build_engine_command(role, args, "/m", placement).env, started) == []
    assert ("UCX_NET_DEVICES" in common) is local_only


def _load_site(monkeypatch):
    """The engines' site hook (engine/_site/sitecustomize.py) loaded in this process for its patch functions;
    the import hook it installs is for engine processes and is taken out again."""
    import importlib.util
    import os
    import sys

    from pdserve.engine.launcher import SITE_DIR

    monkeypatch.syspath_prepend(SITE_DIR)
    before = list(sys.meta_path)
    spec = importlib.util.spec_from_file_location("_pdserve_site_under_test", os.path.join(SITE_DIR, "sitecustomize.py"))
    site = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(site)
    finally:
        sys.meta_path[:] = before
    return site
