"""The one helper that runs `pdserve serve` as a child process (benchmarks and integration tests), against a
stand-in command that behaves like it: prints progress, then the ready line, and exits on a signal."""

from __future__ import annotations

import signal
import sys

import pytest
import yaml

from pdserve.config.schema import PDServeArgs
from pdserve.errors import EngineStartError
from pdserve.testing.served import ServedProcess

STAND_IN = r"""
import signal, sys, time
def bye(signum, frame):
    print("[pdserve] stopped", flush=True)
    sys.exit(0 if signum == signal.SIGTERM else 3)
signal.signal(signal.SIGTERM, bye)
signal.signal(signal.SIGINT, bye)
print("[pdserve] [1/4] config: " + sys.argv[1], file=sys.stderr, flush=True)
if sys.argv[2] == "ready":
    print("pdserve ready: http://127.0.0.1:1/v1", flush=True)
    while True:
        time.sleep(0.05)
sys.exit(7)
"""


class StandIn(ServedProcess):
    def __init__(self, behaviour: str, **kw) -> None:
        super().__init__(**kw)
        self.behaviour = behaviour

    def command(self) -> list[str]:
        return [sys.executable, "-c", STAND_IN, self._config_path(), self.behaviour]


def test_ready_lines_config_and_exit_status_by_signal():
    args = PDServeArgs.model_validate({"router": {"max_queue_wait_s": 3}})
    seen: list[str] = []
    sp = StandIn("ready", config=args, echo=seen.append).start()
    took = sp.wait_ready(timeout_s=30)
    assert sp.ready and took >= 0
    path = sp.lines[0].split("config: ", 1)[1]
    assert yaml.safe_load(open(path)) == {"router": {"max_queue_wait_s": 3.0}}  # non-default fields only
    assert sp.stop(sig=signal.SIGTERM) == 0
    assert sp.lines[-1] == "[pdserve] stopped" and seen == sp.lines
    assert not __import__("os").path.exists(path)  # the temporary config is gone with the app


def test_interrupt_is_the_default_stop():
    sp = StandIn("ready", config="x.yaml").start()
    sp.wait_ready(timeout_s=30)
    assert sp.stop() == 3  # the stand-in exits 3 on SIGINT


def test_an_app_that_exits_before_ready_is_an_error_with_its_output():
    sp = StandIn("fail", config="x.yaml").start()
    with pytest.raises(EngineStartError, match=r"exited with 7(.|\n)*config: x.yaml"):
        sp.wait_ready(timeout_s=30)
