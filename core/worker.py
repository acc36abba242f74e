"""What prefill and decode workers share: registration, heartbeats, signals, and the loop.

Two signals reach the gateway: `Alive` beats from a thread of their own (core/pulse.py), which
keep the worker alive however long a step takes, and the loop's `Heartbeat`s, between steps
and between model layers, which report load and progress (a loop that stops reporting them
while it has work is stalled, not dead).

A worker subclasses `Worker` and supplies `handle` (a control message), `step` (one unit of
model work, returning whether it did any), `heartbeat` (its current load) and `holding` (the
requests it holds, which the gateway checks so that a request no worker holds is not awaited
forever).
"""

from __future__ import annotations

import logging
import signal
import socket
import time
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass

import zmq

from core.channels import ControlClient
from core.config import Config, Role
from core.cpus import pinned_cpus
from core.curve import keys_for
from core.messages import (
    Alive,
    Heartbeat,
    Held,
    Leave,
    Message,
    Register,
    RegisterAgain,
    RegisterReply,
)
from core.pulse import Pulse
from core.tracing import make_tracer
from core.turns import CpuTurns

log = logging.getLogger(__name__)
_IDLE_POLL_MS = 20


class RegistrationRefused(RuntimeError):
    """The gateway refused this worker (for example, a KV layout mismatch)."""


@dataclass(frozen=True)
class WorkerIdentity:
    """What a worker tells the gateway about itself when it registers."""

    worker_id: str
    role: Role
    fingerprint: str  # KV layout: workers exchanging KV must agree on it
    block_size: int
    num_blocks: int
    threads: int = 0  # torch threads it computes with (0: not known)
    max_running: int = 0  # sequences its batch holds at most (0: no bound, prefill)
    isa: str = ""  # the instruction set its kernels run at ("torch": none built)


class Worker(ABC):
    def __init__(self, identity: WorkerIdentity, config: Config) -> None:
        """Connects to the gateway at `gateway.control_address`, with the cluster's CURVE keys
        when `internal.curve` is on (they secure every socket of the worker)."""
        self.identity = identity
        self.worker_id = identity.worker_id
        self.instance_id = uuid.uuid4().hex
        self.kv_address = ""  # where this worker receives KV, if it does
        self.keys = keys_for(config.internal)
        self.context = zmq.Context()
        self.control = ControlClient(self.context, config.gateway.control_address,
                                     self.worker_id, self.keys)
        self.poller = zmq.Poller()
        self.poller.register(self.control.socket, zmq.POLLIN)
        self.heartbeat_interval_s = config.pool(identity.role).heartbeat_interval_s
        self.pulse = Pulse(self.context, config.gateway.control_address,
                           Alive(self.worker_id, self.instance_id), self.heartbeat_interval_s,
                           self.keys)
        self.next_heartbeat = 0.0
        self.stopping = False
        self.progress = 0  # model layers computed since start, reported in heartbeats
        self.tracer = make_tracer(config.tracing, f"raging-{identity.role}", self.worker_id)
        # `with self.turns:` around a forward pass: workers on these CPUs compute in turn
        self.turns = CpuTurns(config.engine.cpu_turns_dir, pinned_cpus())

    def registration(self) -> Register:
        i = self.identity
        return Register(i.worker_id, self.instance_id, i.role, self.kv_address, i.fingerprint,
                        i.block_size, i.num_blocks, socket.gethostname(), pinned_cpus(),
                        i.threads, i.max_running, i.isa)

    @abstractmethod
    def handle(self, message: Message) -> None: ...

    @abstractmethod
    def step(self) -> bool:
        """One unit of model work; False when there was nothing to do."""

    @abstractmethod
    def heartbeat(self) -> Heartbeat: ...

    @abstractmethod
    def holding(self) -> list[Held]:
        """Every request this worker holds now (queued, computing, or receiving KV)."""

    def register(self, timeout_s: float = 60.0) -> None:
        """Announce this worker and wait for the gateway's verdict."""
        self.control.send(self.registration())
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not self.stopping:
            if self.control.socket.poll(200):
                for message in self.control.drain():
                    if isinstance(message, RegisterReply):
                        if not message.accepted:
                            raise RegistrationRefused(message.reason)
                        log.info("%s registered with the gateway", self.worker_id)
                        return
                    self.handle(message)
        raise TimeoutError("the gateway did not answer the registration")

    def run(self) -> None:
        """Serve until SIGTERM or SIGINT."""
        signal.signal(signal.SIGTERM, self._request_stop)
        signal.signal(signal.SIGINT, self._request_stop)
        self.pulse.start()
        self.register()
        busy = False
        while not self.stopping:
            ready = dict(self.poller.poll(0 if busy else _IDLE_POLL_MS))
            if self.control.socket in ready:
                self.take_control()
            self.on_poll(ready)
            busy = self.step()
            self.maybe_heartbeat()
        self.close()

    def take_control(self) -> None:
        """Handle every control message waiting now, without blocking."""
        for message in self.control.drain():
            self._on_control(message)

    def _on_control(self, message: Message) -> None:
        if isinstance(message, RegisterAgain):
            log.warning("%s registers again: %s", self.worker_id, message.reason)
            self.control.send(self.registration())
        elif isinstance(message, RegisterReply):
            if not message.accepted:
                raise RegistrationRefused(message.reason)
            log.info("%s registered with the gateway again", self.worker_id)
        else:
            self.handle(message)

    def on_poll(self, ready: dict[zmq.Socket, int]) -> None:  # noqa: B027 (optional hook)
        """Hook for workers with more sockets than the control channel."""

    def between_layers(self, layer: int) -> None:
        """Passed to the model as its layer hook: a long forward pass keeps heartbeating, and
        its heartbeats show progress."""
        self.progress += 1
        self.maybe_heartbeat()

    def maybe_heartbeat(self) -> None:
        now = time.monotonic()
        if now >= self.next_heartbeat:
            self.control.send(self.heartbeat())
            self.next_heartbeat = now + self.heartbeat_interval_s

    def _request_stop(self, signum: int, frame: object) -> None:
        self.stopping = True

    def close(self) -> None:
        """Tell the gateway this worker is leaving (so it stops routing here), then close."""
        self.control.send(Leave(self.worker_id, self.instance_id))
        self.pulse.stop()
        self.control.close(linger_ms=1000)
        self.context.term()
        if self.tracer is not None:
            self.tracer.shutdown()
        self.turns.close()
