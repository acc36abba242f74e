"""The worker loop's drain: SIGTERM or the gateway's Drain, heartbeats that say so, and the
Leave once nothing is held (or once the drain timeout runs out); SIGINT stops at once."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from core.config import load_config
from core.messages import (
    Drain,
    Drained,
    Heartbeat,
    Held,
    Leave,
    Message,
    Register,
    RegisterReply,
    decode,
    encode,
)
from core.worker import Worker, WorkerIdentity, host_name

WAIT_S = 5.0


class Holder(Worker):
    """A worker whose only state is the requests it holds, set by the test."""

    def __init__(self, control: str, drain_timeout_s: float = 30.0) -> None:
        config = load_config(None, {"gateway.control_address": control,
                                    "decode.heartbeat_interval_s": "0.05",
                                    "decode.drain_timeout_s": str(drain_timeout_s),
                                    "internal.host": "host-a"})
        super().__init__(WorkerIdentity("decode-0", "decode", "fp", 16, 64), config)
        self.held: list[Held] = []

    def handle(self, message: Message) -> None:
        raise AssertionError(f"unexpected {message}")

    def step(self) -> bool:
        return False

    def heartbeat(self) -> Heartbeat:
        return Heartbeat(self.worker_id, self.instance_id, 0, 64, 0, 0, holding=self.holding())

    def holding(self) -> list[Held]:
        return list(self.held)


class Gateway:
    """The ROUTER a worker registers with, answering its registration."""

    def __init__(self, address: str) -> None:
        self.socket: zmq.Socket = zmq.Context.instance().socket(zmq.ROUTER)
        self.socket.bind(address)

    def next(self, kind: type, timeout_s: float = WAIT_S) -> Message:
        """The next message of `kind` (others skipped; a Register is accepted)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.socket.poll(50):
                continue
            identity, frame = self.socket.recv_multipart()
            message = decode(frame)
            if isinstance(message, Register):
                self.socket.send_multipart([identity, encode(RegisterReply(True, ""))])
            if isinstance(message, kind):
                return message
        raise AssertionError(f"no {kind.__name__} within {timeout_s} s")

    def send(self, message: Message) -> None:
        self.socket.send_multipart([b"decode-0", encode(message)])


@pytest.fixture
def address(tmp_path: Path) -> str:
    return f"ipc://{tmp_path}/control.sock"


def running(worker: Worker) -> threading.Thread:
    """`worker.serve()` in a thread, its signal handlers installed from this (main) one."""
    worker.install_signal_handlers()
    thread = threading.Thread(target=worker.serve, daemon=True)
    thread.start()
    return thread


@pytest.fixture
def restore_signals() -> Iterator[None]:
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    yield
    for signum, handler in handlers.items():
        signal.signal(signum, handler)


def test_a_drain_is_announced_and_the_worker_leaves_once_nothing_is_held(
        address: str, restore_signals: None) -> None:
    gateway, worker = Gateway(address), Holder(address)
    worker.held = [Held("r1", 0)]
    thread = running(worker)
    register = gateway.next(Register)
    assert isinstance(register, Register) and register.host == "host-a"
    gateway.send(Drain("POST /admin/drain"))
    beat = gateway.next(Heartbeat)
    while isinstance(beat, Heartbeat) and not beat.draining:
        beat = gateway.next(Heartbeat)
    assert thread.is_alive()  # it still holds r1
    worker.held = []
    time.sleep(0.3)
    assert thread.is_alive()  # the gateway may still have requests on their way to it
    gateway.send(Drained())
    assert isinstance(gateway.next(Leave), Leave)
    thread.join(WAIT_S)
    assert not thread.is_alive()


def test_a_drained_before_the_drain_does_not_count(address: str,
                                                    restore_signals: None) -> None:
    gateway, worker = Gateway(address), Holder(address)
    thread = running(worker)
    gateway.next(Register)
    gateway.send(Drained())  # a stray one, from a drain that was not this one
    gateway.send(Drain("test"))
    beat = gateway.next(Heartbeat)
    while isinstance(beat, Heartbeat) and not beat.draining:
        beat = gateway.next(Heartbeat)
    time.sleep(0.2)
    assert thread.is_alive() and not worker.released
    gateway.send(Drained())
    assert isinstance(gateway.next(Leave), Leave)
    thread.join(WAIT_S)


def test_sigterm_drains_and_a_second_sigterm_stops_at_once(address: str,
                                                          restore_signals: None) -> None:
    gateway, worker = Gateway(address), Holder(address)
    worker.held = [Held("r1", 0)]
    thread = running(worker)
    gateway.next(Register)
    os.kill(os.getpid(), signal.SIGTERM)
    beat = gateway.next(Heartbeat)
    while isinstance(beat, Heartbeat) and not beat.draining:
        beat = gateway.next(Heartbeat)
    assert thread.is_alive() and worker.draining
    os.kill(os.getpid(), signal.SIGTERM)
    assert isinstance(gateway.next(Leave), Leave)  # with r1 still held
    thread.join(WAIT_S)
    assert not thread.is_alive()


def test_a_drain_that_runs_out_of_time_leaves_with_work_held(address: str,
                                                            restore_signals: None) -> None:
    gateway, worker = Gateway(address), Holder(address, drain_timeout_s=0.3)
    worker.held = [Held("r1", 0)]
    thread = running(worker)
    gateway.next(Register)
    started = time.monotonic()
    gateway.send(Drain("test"))
    assert isinstance(gateway.next(Leave), Leave)
    assert 0.3 <= time.monotonic() - started < WAIT_S
    thread.join(WAIT_S)
    assert not thread.is_alive()


def test_a_sigterm_to_a_worker_draining_already_does_not_stop_it(
        address: str, restore_signals: None) -> None:
    gateway, worker = Gateway(address), Holder(address)
    worker.held = [Held("r1", 0)]
    thread = running(worker)
    gateway.next(Register)
    gateway.send(Drain("POST /admin/drain"))
    beat = gateway.next(Heartbeat)
    while isinstance(beat, Heartbeat) and not beat.draining:
        beat = gateway.next(Heartbeat)
    os.kill(os.getpid(), signal.SIGTERM)  # its launch.sh's, a moment later: not a second one
    time.sleep(0.3)
    assert thread.is_alive() and not worker.stopping
    worker.held = []
    gateway.send(Drained())
    assert isinstance(gateway.next(Leave), Leave)
    thread.join(WAIT_S)


def test_sigint_stops_without_draining(address: str, restore_signals: None) -> None:
    gateway, worker = Gateway(address), Holder(address)
    worker.held = [Held("r1", 0)]
    thread = running(worker)
    gateway.next(Register)
    os.kill(os.getpid(), signal.SIGINT)
    assert isinstance(gateway.next(Leave), Leave)
    thread.join(WAIT_S)
    assert not thread.is_alive() and not worker.draining


def test_the_host_reported_is_the_configured_one_else_the_host_name() -> None:
    assert host_name("node-7") == "node-7"
    assert host_name("") == os.uname().nodename
