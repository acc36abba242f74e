"""What prefill and decode workers share: registration, heartbeats, signals, and the loop.

Two signals reach the gateway: `Alive` beats from a thread of their own (core/pulse.py), which
keep the worker alive however long a step takes, and the loop's `Heartbeat`s, between steps
and between model layers, which report load and progress (a loop that stops reporting them
while it has work is stalled, not dead).

A worker subclasses `Worker` and supplies `handle` (a control message), `step` (one unit of
model work, returning whether it did any), `heartbeat` (its current load) and `holding` (the
requests it holds, which the gateway checks so that a request no worker holds is not awaited
forever).

SIGINT stops a worker at once (its requests resume elsewhere). SIGTERM, or the gateway's
`Drain`, drains it: its heartbeats say so and the gateway routes nothing new to it; it serves
what it holds and leaves once `drained` (nothing held here, and the gateway's `Drained`: none
of its requests is on its way or still needs it), or when `drain_timeout_s` runs out (what is
left then resumes elsewhere, as after SIGINT). A second SIGTERM stops it at once.
"""

from __future__ import annotations

import logging
import signal
import socket
import time
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, replace

import zmq

from core.channels import ControlClient
from core.config import Config, Role
from core.cpus import pinned_cpus
from core.curve import keys_for
from core.health import HealthServer, HealthState
from core.logs import about
from core.messages import (
    Alive,
    DecodeRequest,
    Drain,
    Drained,
    Heartbeat,
    Held,
    Leave,
    Message,
    PrefillRequest,
    Register,
    RegisterAgain,
    RegisterReply,
    RequestFailed,
    RequestKey,
    choice_keys,
)
from core.pulse import Pulse
from core.tracing import make_tracer
from core.turns import CpuTurns

log = logging.getLogger(__name__)
_IDLE_POLL_MS = 20


def retry_elsewhere(control: ControlClient, request: PrefillRequest | DecodeRequest,
                    reason: str, spared: RequestKey | None = None) -> None:
    """The request's KV did not reach its decode worker whole, through no fault of its own:
    the gateway may serve each of its choices again (but `spared`)."""
    for key in choice_keys(request):
        if key != spared:
            log.warning("request %s: %s", key.request_id, reason, extra=about(key))
            control.send(RequestFailed(*key, reason, retry=True))


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
    prefix_caching: bool = False  # keeps computed KV blocks for later prompts
    kv_bytes_per_token: int = 0  # of K and V over every layer, as its cache holds them
    cache_blocks: int = 0  # the most blocks its prefix cache keeps (0: as many as its pool)


def host_name(configured: str) -> str:
    """The host a process reports (`internal.host`, else its host name): workers of one host
    hand KV over through shared memory, others over TCP."""
    return configured or socket.gethostname()


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
        self.host = host_name(config.internal.host)
        self.drain_timeout_s = config.pool(identity.role).drain_timeout_s
        self.drain_asked = ""  # why a drain was asked for (SIGTERM), until it begins
        self.sigterms = 0  # received: the second one stops at once
        self.draining_since: float | None = None  # monotonic; None: not draining
        self.released = False  # a draining worker's gateway has nothing in flight on it
        self.registered = False
        self.looped_at = time.monotonic()  # the loop's last round (or model layer)
        self.health_port = config.pool(identity.role).health_port
        self.stall_s = config.gateway.stall_timeout_s
        self.health: HealthServer | None = None
        self.progress = 0  # model layers computed since start, reported in heartbeats
        self.tracer = make_tracer(config.tracing, f"raging-{identity.role}", self.worker_id)
        # Simulated workers stand for GPUs: they sleep through steps, on no CPUs of theirs.
        self.cpus = () if config.model.sim_profile is not None else tuple(pinned_cpus())
        # `with self.turns:` around a forward pass: workers on these CPUs compute in turn,
        # where each one's threads fill them (with fewer, two can compute at once)
        fills = identity.threads == 0 or identity.threads >= len(self.cpus)
        self.turns = CpuTurns(config.engine.cpu_turns_dir if self.cpus and fills else "",
                              self.cpus, config.engine.cpu_turn_patience_s)

    def registration(self) -> Register:
        i = self.identity
        return Register(i.worker_id, self.instance_id, i.role, self.kv_address, i.fingerprint,
                        i.block_size, i.num_blocks, self.host, list(self.cpus),
                        i.threads, i.max_running, i.isa, i.prefix_caching,
                        i.kv_bytes_per_token, i.cache_blocks)

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

    def drained(self) -> bool:
        """Whether a draining worker may leave: it holds no request, nor does the gateway have
        one in flight on it."""
        return self.released and not self.holding()

    def register(self, timeout_s: float = 60.0) -> None:
        """Announce this worker and wait for the gateway's verdict."""
        self.control.send(self.registration())
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not self.stopping:
            if not self.control.socket.poll(200):
                continue
            for message in self.control.take_waiting():  # what came right behind the verdict too
                if self.registered or not isinstance(message, RegisterReply):
                    self._on_control(message)
                elif not message.accepted:
                    raise RegistrationRefused(message.reason)
                else:
                    log.info("%s registered with the gateway", self.worker_id)
                    self.registered = True
            if self.registered:
                return
        raise TimeoutError("the gateway did not answer the registration")

    def run(self) -> None:
        """Serve until SIGINT, or until drained (SIGTERM, the gateway's `Drain`)."""
        self.install_signal_handlers()
        self.serve()

    def install_signal_handlers(self) -> None:
        """SIGTERM drains (a second one stops at once); SIGINT stops at once."""
        signal.signal(signal.SIGTERM, self._on_sigterm)
        signal.signal(signal.SIGINT, self._request_stop)

    def serve(self) -> None:
        """Register, then step and heartbeat until stopped or drained; then leave."""
        self.pulse.start()
        if self.health_port:
            self.health = HealthServer(self.health_port, self.health_state, self.ask_drain,
                                       self.stall_s)
        self.register()
        self.after_registering()
        busy = False
        while not self.stopping:
            self.looped_at = time.monotonic()
            ready = dict(self.poller.poll(0 if busy else _IDLE_POLL_MS))
            if self.control.socket in ready:
                self.take_control()
            self.on_poll(ready)
            busy = self.step()
            if self.drain_asked:
                self.begin_drain(self.drain_asked)
            self.maybe_heartbeat()
            self.stopping = self.stopping or self._drain_done()
        self.close()

    @property
    def draining(self) -> bool:
        return self.draining_since is not None

    def health_state(self) -> HealthState:
        """What the health endpoint reports (read from its thread)."""
        return HealthState(self.registered, self.draining or bool(self.drain_asked),
                           time.monotonic() - self.looped_at)

    def ask_drain(self) -> None:
        """Drain from another thread (the health endpoint): the loop begins it."""
        if not self.draining:
            self.drain_asked = "POST /drain"

    def begin_drain(self, reason: str) -> None:
        """Take no new work from now on (the next heartbeat, sent now, tells the gateway)."""
        self.drain_asked = ""
        if self.draining:
            return
        self.draining_since = time.monotonic()
        log.info("%s drains (%s): %d requests held, leaving within %g s", self.worker_id,
                 reason, len(self.holding()), self.drain_timeout_s)
        self.next_heartbeat = 0.0

    def _drain_done(self) -> bool:
        """Whether a draining worker leaves now: it is drained, or its time is up."""
        if self.draining_since is None:
            return False
        if self.drained():
            log.info("%s drained in %.2f s", self.worker_id,
                     time.monotonic() - self.draining_since)
            return True
        if time.monotonic() - self.draining_since < self.drain_timeout_s:
            return False
        log.warning("%s still holds %d requests after %.0f s of draining: leaving, they resume "
                    "elsewhere", self.worker_id, len(self.holding()), self.drain_timeout_s)
        return True

    def take_control(self) -> None:
        """Handle every control message waiting now, without blocking."""
        for message in self.control.take_waiting():
            self._on_control(message)

    def _on_control(self, message: Message) -> None:
        if isinstance(message, RegisterAgain):
            log.warning("%s registers again: %s", self.worker_id, message.reason)
            self.control.send(self.registration())
        elif isinstance(message, RegisterReply):
            if not message.accepted:
                raise RegistrationRefused(message.reason)
            log.info("%s registered with the gateway again", self.worker_id)
        elif isinstance(message, Drain):
            self.begin_drain(message.reason)
        elif isinstance(message, Drained):
            self.released = self.draining
        else:
            self.handle(message)

    def after_registering(self) -> None:  # noqa: B027 (optional hook)
        """Work worth starting once the worker is ready, ahead of the requests needing it."""

    def on_poll(self, ready: dict[zmq.Socket, int]) -> None:  # noqa: B027 (optional hook)
        """Hook for workers with more sockets than the control channel."""

    def between_layers(self, layer: int) -> None:
        """Passed to the model as its layer hook: a long forward pass keeps heartbeating, and
        its heartbeats show progress."""
        self.progress += 1
        self.looped_at = time.monotonic()
        self.maybe_heartbeat()

    def maybe_heartbeat(self) -> None:
        now = time.monotonic()
        if now >= self.next_heartbeat:
            self.control.send(replace(self.heartbeat(), draining=self.draining, sent_at=now))
            self.next_heartbeat = now + self.heartbeat_interval_s

    def _request_stop(self, signum: int, frame: object) -> None:
        self.stopping = True

    def _on_sigterm(self, signum: int, frame: object) -> None:
        """The first SIGTERM drains (the loop begins it, unless a drain began already); a
        second one stops at once."""
        if self.sigterms:
            self.stopping = True
        else:
            self.drain_asked = "SIGTERM"
        self.sigterms += 1

    def close(self) -> None:
        """Tell the gateway this worker is leaving (so it stops routing here), then close."""
        self.control.send(Leave(self.worker_id, self.instance_id))
        if self.health is not None:
            self.health.close()
        self.pulse.stop()
        self.control.close(linger_ms=1000)
        self.context.term()
        if self.tracer is not None:
            self.tracer.shutdown()
        self.turns.close()
