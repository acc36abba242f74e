"""Liveness beats from a thread of their own: they keep coming while the worker's loop is
busy in one long step, on a socket of their own, and stop when told."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from core.config import load_config
from core.messages import Alive, Heartbeat, Held, Message, decode
from core.pulse import PULSE_SUFFIX, Pulse
from core.worker import Worker, WorkerIdentity

INTERVAL_S = 0.1
STEP_S = 2.0


class Gateway:
    """A ROUTER standing in for the gateway's control socket, read by a thread of its own:
    every message with its sender's identity and when it came."""

    def __init__(self, context: zmq.Context, address: str) -> None:
        self.received: list[tuple[float, str, Message]] = []
        self._stopping = threading.Event()
        self._bound = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(context, address))
        self._thread.start()
        assert self._bound.wait(5)

    def _run(self, context: zmq.Context, address: str) -> None:
        socket = context.socket(zmq.ROUTER)
        socket.bind(address)
        self._bound.set()
        while not self._stopping.is_set():
            if socket.poll(20):
                identity, frame = socket.recv_multipart()
                self.received.append((time.monotonic(), identity.decode(), decode(frame)))
        socket.close(linger=0)

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join(5)

    def times(self, kind: type, since: float = 0.0, until: float = float("inf")) -> list[float]:
        return [at for at, _, m in self.received if isinstance(m, kind) and since <= at <= until]


@pytest.fixture
def gateway(context: zmq.Context, tmp_path: Path) -> Iterator[Gateway]:
    running = Gateway(context, f"ipc://{tmp_path}/ctl")
    yield running
    running.stop()


def busy(seconds: float) -> None:
    """Python work that holds the GIL but for the interpreter's switches."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        sum(range(1000))


def largest_gap(times: list[float]) -> float:
    return max((later - earlier for earlier, later in itertools.pairwise(times)), default=0.0)


def test_beats_keep_coming_while_the_caller_computes(context: zmq.Context, gateway: Gateway,
                                                     tmp_path: Path) -> None:
    pulse = Pulse(context, f"ipc://{tmp_path}/ctl", Alive("w1", "inst"), INTERVAL_S)
    pulse.start()
    started = time.monotonic()
    busy(STEP_S)
    ended = time.monotonic()
    pulse.stop()
    sent = pulse.sent
    # beats sent before the stop may still be on their way (a loaded machine): all arrive,
    # and then no more
    deadline = time.monotonic() + 5
    while len(gateway.times(Alive)) < sent and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(3 * INTERVAL_S)
    assert len(gateway.times(Alive)) == sent == pulse.sent
    beats = gateway.times(Alive, started, ended)
    assert len(beats) >= STEP_S / INTERVAL_S / 2, len(beats)
    assert largest_gap(beats) < 10 * INTERVAL_S
    assert {(ident, m) for _, ident, m in gateway.received} == {
        ("w1" + PULSE_SUFFIX, Alive("w1", "inst"))}


class _SlowWorker(Worker):
    """A worker whose one unit of work takes STEP_S, with no layer hook to beat from."""

    def handle(self, message: Message) -> None: ...

    def step(self) -> bool:
        busy(STEP_S)
        return True

    def heartbeat(self) -> Heartbeat:
        return Heartbeat(self.worker_id, self.instance_id, 0, 1, 1, 0, holding=self.holding())

    def holding(self) -> list[Held]:
        return []


def test_a_long_step_stops_the_loops_heartbeats_but_not_its_beats(
        gateway: Gateway, tmp_path: Path) -> None:
    config = load_config(overrides={"gateway.control_address": f"ipc://{tmp_path}/ctl",
                                    "decode.heartbeat_interval_s": INTERVAL_S})
    worker = _SlowWorker(WorkerIdentity("decode-7", "decode", "fp", 16, 1), config)
    try:
        worker.pulse.start()
        worker.maybe_heartbeat()
        started = time.monotonic()
        worker.step()
        ended = time.monotonic()
        worker.maybe_heartbeat()
    finally:
        worker.close()
    heartbeats = gateway.times(Heartbeat)
    assert len(heartbeats) == 2 and heartbeats[1] - heartbeats[0] > STEP_S / 2  # none mid-step
    beats = gateway.times(Alive, started, ended)
    assert len(beats) >= STEP_S / INTERVAL_S / 2 and largest_gap(beats) < 10 * INTERVAL_S
    senders = {ident for _, ident, m in gateway.received if isinstance(m, Alive)}
    assert senders == {"decode-7" + PULSE_SUFFIX}
