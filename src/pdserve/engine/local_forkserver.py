"""Starting and stopping the engine forkserver from ``pdserve serve`` (engine/forkserver.py is the forkserver
process itself)."""

from __future__ import annotations

import os
import sys
from typing import Any

from pdserve.engine.forkserver import common_env
from pdserve.settings import FORKSERVER_CHECKED_ENV


class LocalForkserver:
    """The forkserver of an app ``pdserve serve`` runs on a Ray instance of its own: started before Ray (which
    passes its socket on to every engine's guard, through the environment it inherits), stopped after it."""

    def __init__(self, proc: Any, sock_dir: str, log_path: Any) -> None:
        self.proc, self.sock_dir, self.log_path = proc, sock_dir, log_path

    @classmethod
    def start(cls, args: Any, app_name: str, model_path: str, local_only: bool = True) -> LocalForkserver | None:
        """Started with the engine settings read at import; None when ``cpu.fork_engines`` is off or the
        engines may run on a GPU (``args``: the app's ``PDServeArgs``; ``local_only``: Ray and the engines
        listen on loopback only, as ``pdserve serve`` on a loopback ``http.host`` runs them)."""
        import glob
        import subprocess
        import tempfile

        from pdserve.config.resources import asks_for_gpus
        from pdserve.settings import ENGINE_FORKSERVER_ENV, settings

        if not args.cpu.fork_engines or asks_for_gpus(args) or glob.glob("/dev/nvidia[0-9]*") or os.path.exists(
                "/dev/kfd"):
            return None
        common = forkserver_env(args, model_path, local_only)
        sock_dir = tempfile.mkdtemp(prefix="pdserve-forks-")
        path = os.path.join(sock_dir, "engines.sock")
        log_dir = settings().log_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        log_path = log_dir / f"{app_name}-engine-forkserver.log"
        with open(log_path, "ab") as log:
            proc = subprocess.Popen([sys.executable, "-m", "pdserve.engine.forkserver", path],
                                    env={**os.environ, **common, FORKSERVER_CHECKED_ENV: ",".join(sorted(common))},
                                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    # Not in the terminal's process group: a Ctrl-C is the app's to handle (the
                                    # engines stop with their replicas first); it ends with its parent.
                                    start_new_session=True)
        os.environ[ENGINE_FORKSERVER_ENV] = path
        return cls(proc, sock_dir, log_path)

    def stop(self) -> None:
        """It stops the servers it still has (their guards normally stopped them already)."""
        import shutil
        import subprocess

        from pdserve.settings import ENGINE_FORKSERVER_ENV

        os.environ.pop(ENGINE_FORKSERVER_ENV, None)
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5)
        shutil.rmtree(self.sock_dir, ignore_errors=True)


def forkserver_env(args: Any, model_path: str, local_only: bool) -> dict[str, str]:
    """The forkserver's engine settings: a decode engine's environment as the launcher makes it (these
    settings are the app's), less what each engine sets after the fork. Its NIXL side channel is on
    loopback where the app is local-only and on the node's address elsewhere, as the engines' will be:
    UCX's device list follows from it, and an engine whose list differs could not be forked."""
    from pdserve.engine.launcher import EnginePlacement, build_engine_command

    # (Any address that is not loopback stands for the node's own: only loopback changes the settings.)
    template = EnginePlacement(http_port=0, side_channel_port=0, side_channel_host="127.0.0.1" if local_only
                               else "0.0.0.0", engine_id="forkserver", on_cpu=True)
    return common_env(build_engine_command("decode", args, model_path, template).env)
