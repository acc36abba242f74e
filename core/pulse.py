"""A worker's liveness beat, independent of how long its loop's step takes.

A thread of its own sends `Alive` to the gateway every heartbeat interval, on a control socket
of its own (ZeroMQ sockets stay single-threaded) whose identity is the worker id with
`PULSE_SUFFIX`. It stops only with the process (or `stop`), so the gateway declares a worker
dead exactly when its process is gone or cut off; a loop that is alive but computes nothing is
the registry's stall detection's to find, from the loop's own heartbeats.
"""

from __future__ import annotations

import threading

import zmq

from core.channels import ControlClient
from core.curve import CurveKeys
from core.messages import Alive

PULSE_SUFFIX = "/pulse"
_STOP_WAIT_S = 5.0


class Pulse:
    def __init__(self, context: zmq.Context, address: str, beat: Alive, interval_s: float,
                 keys: CurveKeys | None = None) -> None:
        self.context = context
        self.address = address
        self.beat = beat
        self.interval_s = interval_s
        self.keys = keys
        self.sent = 0
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"{beat.worker_id}-pulse")

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop beating; returns once the thread has closed its socket."""
        self._stopping.set()
        if self._thread.ident is not None:  # started
            self._thread.join(_STOP_WAIT_S)

    def _run(self) -> None:
        identity = self.beat.worker_id + PULSE_SUFFIX
        client = ControlClient(self.context, self.address, identity, self.keys)
        try:
            while not self._stopping.is_set():
                client.send(self.beat)
                self.sent += 1
                self._stopping.wait(self.interval_s)
        finally:
            client.close()
