"""A stand-in for vLLM's server in the forkserver's tests: run as ``__main__`` it prints, as one JSON line,
what the process it runs in looks like, then serves until SIGTERM (exit code 3)."""

from __future__ import annotations

import json
import os
import signal
import sys
import time

#: The process that imported this module first: the forkserver, for a server forked from it.
IMPORTED_BY = os.getpid()


def main() -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(3))  # before the line that tells the test it runs
    grandchild = None
    if "--stubborn-child" in sys.argv:
        # Like vLLM's engine core: in the server's group, and SIGTERM does not stop it.
        grandchild = os.fork()
        if grandchild == 0:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            while True:
                time.sleep(0.1)
    imported = sys.modules.get("tests.component.fork_target")
    with open("/proc/self/cmdline", "rb") as f:
        cmdline = f.read().replace(b"\0", b" ").decode().strip()
    print(json.dumps({
        "pid": os.getpid(), "ppid": os.getppid(), "pgid": os.getpgid(0), "argv": sys.argv[1:],
        "var": os.environ.get("FORK_TEST_VAR"), "cwd": os.getcwd(), "cmdline": cmdline,
        "imported_by": getattr(imported, "IMPORTED_BY", None), "affinity": sorted(os.sched_getaffinity(0)),
        "grandchild": grandchild,
    }), flush=True)
    while True:
        time.sleep(0.1)


if __name__ == "__main__":
    main()
