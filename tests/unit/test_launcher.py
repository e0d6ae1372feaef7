import json

from pdserve.config.schema import PDServeArgs
from pdserve.engine.allocator import Claim, claim_cores, claim_port_block
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
    assert cmd.env["VLLM_CPU_KVCACHE_SPACE"] == "1"


def test_port_blocks_do_not_collide(tmp_path, monkeypatch):
    monkeypatch.setattr("pdserve.engine.allocator.LOCK_DIR", tmp_path)
    a, b = Claim(), Claim()
    pa = claim_port_block(a, 23000, 2)
    pb = claim_port_block(b, 23000, 2)
    assert set(a.ports).isdisjoint(b.ports) and pa != pb
    a.release()
    c = Claim()
    assert claim_port_block(c, 23000, 2) == pa  # released claims are reusable
    b.release(), c.release()


def test_cores_are_exclusive_until_oversubscribed(tmp_path, monkeypatch):
    monkeypatch.setattr("pdserve.engine.allocator.LOCK_DIR", tmp_path)
    claims = [Claim() for _ in range(3)]
    got = [claim_cores(c, 1, [0, 1]) for c in claims]
    assert got[0] != got[1]
    assert got[2] in ([0], [1])  # a third engine on two cores shares one
    for c in claims:
        c.release()
