"""pdserve doctor on this host: the real port probe, whole runs in-process and in a process of its own, and
one real NIXL transfer (the checks with single probes replaced: tests/unit/test_doctor.py)."""

from __future__ import annotations

import io
import json
import socket
import subprocess
import sys

from pdserve.cli.main import main
from pdserve.config.schema import PDServeArgs
from pdserve.doctor import checks, probes
from pdserve.doctor.checks import DoctorContext
from pdserve.doctor.report import run_checks, run_doctor
from tests.unit.test_doctor import GPU_CONFIG, ROOT, _rows

# -- ports ---------------------------------------------------------------------------------------------


def test_http_port_taken_by_another_process_is_fail(monkeypatch):
    # A real listener: the real probes must see the port busy and name this process as its owner.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        monkeypatch.setattr(probes, "http_json", lambda url, timeout=2.0: None)  # it speaks no HTTP
        args = PDServeArgs.model_validate({"http": {"port": port}})
        rows = list(checks.check_ports(DoctorContext(args=args)))
    row = _rows(rows, f"port: http {port}")
    assert row.status == "fail"
    assert "python" in row.detail or "pytest" in row.detail, row.detail
    assert "--port" in row.fix


def test_config_asking_gpus_on_gpu_less_host_fails_with_exit_1(tmp_path, monkeypatch, no_gpu):
    cfg = tmp_path / "gpu.yaml"
    cfg.write_text(GPU_CONFIG)
    out = io.StringIO()
    assert run_doctor(str(cfg), as_json=True, run_transfer=False, out=out) == 1
    report = json.loads(out.getvalue())
    gpu = next(c for c in report["checks"] if c["name"] == "gpu")
    assert gpu["status"] == "fail" and "prefill 2" in gpu["detail"]
    assert report["exit_code"] == 1 and report["summary"]["fail"] >= 1


# -- report --------------------------------------------------------------------------------------------


def test_json_shape_and_a_crashing_check_is_reported(capsys, monkeypatch):
    rc = main(["doctor", "--json", "--no-transfer"])
    report = json.loads(capsys.readouterr().out)
    assert rc == report["exit_code"]
    assert set(report) == {"pdserve", "config", "exit_code", "summary", "checks"}
    assert set(report["summary"]) == {"ok", "warn", "fail", "skip"}
    assert sum(report["summary"].values()) == len(report["checks"])
    for c in report["checks"]:
        assert set(c) == {"name", "status", "detail", "fix", "data"}
        assert c["status"] in ("ok", "warn", "fail", "skip") and c["detail"]
    names = [c["name"] for c in report["checks"]]
    for expected in ("config", "version: vllm", "cpu", "cpu: dtype", "memory", "/dev/shm", "gpu", "nixl: transfer", "efa",
                     "port: http 8000", "port: ray", "model"):
        assert expected in names
    assert report["exit_code"] == (1 if report["summary"]["fail"] else 0)

    def broken(ctx):
        raise RuntimeError("boom")
        yield  # pragma: no cover

    rows = run_checks(DoctorContext(), [broken])
    assert rows[0].status == "fail" and "boom" in rows[0].detail


def test_doctor_imports_nothing_heavy_in_its_own_process():
    code = (
        "import sys\n"
        "from pdserve.cli.main import main\n"
        "main(['doctor', '--no-transfer'])\n"
        "heavy = [m for m in ('ray', 'vllm', 'torch', 'transformers', 'nixl') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, capture_output=True)


# -- one real run on this host -------------------------------------------------------------------------


def test_real_doctor_run_reports_the_transport_nixl_really_used(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    cfg = tmp_path / "doctor.yaml"
    cfg.write_text(f"http: {{port: {free}}}\n")  # a port nothing listens on, so only the host is judged
    r = subprocess.run([sys.executable, "-m", "pdserve.cli.main", "doctor", str(cfg), "--json"],
                       check=False, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(r.stdout)
    rows = {c["name"]: c for c in report["checks"]}
    assert rows["nixl: backends"]["status"] == "ok"
    assert rows["nixl: backends"]["data"]["plugins"]["UCX"]["loadable"]
    same = rows["nixl: same host (DRAM)"]
    # The transfer really ran, moved the right bytes, and UCX named the transport that carried them.
    assert same["status"] in ("ok", "warn"), same
    assert same["data"]["data_ok"] is True and same["data"]["gbs"] > 0
    assert same["data"]["source"] in ("proto-info", "lanes") and same["data"]["transports"], same
    assert same["data"]["transports"][0] in same["detail"]
    if "CPU mode" in rows["gpu"]["detail"]:
        assert same["data"]["UCX_TLS"] == "tcp,self,sm"  # the CPU engines' own setting was the one tested
    assert "nixl: network path (DRAM)" in rows
