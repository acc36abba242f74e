"""The worker's loopback health endpoint and the probe command that asks it."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

from core.health import HealthServer, HealthState, ask, main


class Worker:
    """The state a worker would report, set by the test."""

    def __init__(self) -> None:
        self.state = HealthState(registered=False, draining=False, loop_age_s=0.0)
        self.drains = 0

    def drain(self) -> None:
        self.drains += 1
        self.state = HealthState(self.state.registered, True, self.state.loop_age_s)


def serving(worker: Worker) -> HealthServer:
    return HealthServer(0, lambda: worker.state, worker.drain, stall_s=10.0)


def test_ready_while_registered_and_not_draining_live_while_the_loop_goes_round() -> None:
    worker = Worker()
    server = serving(worker)
    try:
        assert ask(server.port, "GET", "/ready") == 503  # not registered yet
        assert ask(server.port, "GET", "/live") == 200
        worker.state = HealthState(True, False, 0.5)
        assert ask(server.port, "GET", "/ready") == 200
        worker.state = HealthState(True, False, 11.0)  # wedged in a step
        assert ask(server.port, "GET", "/live") == 503
        assert ask(server.port, "GET", "/nothing") == 404
        assert ask(server.port, "POST", "/drain") == 202 and worker.drains == 1
        assert ask(server.port, "GET", "/ready") == 503
        assert ask(server.port, "POST", "/ready") == 404
    finally:
        server.close()


def test_the_probe_exits_0_on_200_and_drain_waits_until_the_worker_is_gone() -> None:
    worker = Worker()
    worker.state = HealthState(True, False, 0.0)
    server = serving(worker)
    port = str(server.port)
    assert main(["ready", port]) == 0 and main(["live", port]) == 0
    worker.state = HealthState(False, False, 0.0)
    assert main(["ready", port]) == 1
    threading.Timer(0.5, server.close).start()  # the worker leaves a moment after
    started = time.monotonic()
    assert main(["drain", port]) == 0 and worker.drains == 1
    assert time.monotonic() - started >= 0.4
    assert main(["live", port]) == 1  # nothing answers any more
    assert main(["drain", port]) == 0  # nothing left to drain
    usage = subprocess.run([sys.executable, "-m", "core.health", "ready"], capture_output=True,
                           text=True, check=False)
    assert usage.returncode == 2 and "usage" in usage.stderr
