"""Worker membership: registration with a layout check, heartbeats, liveness, draining, and
what each worker probably caches. Who serves is read here; whom a request goes to is
gateway/routing.py's."""

from __future__ import annotations

import dataclasses
import math
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from core.config import ROLES, Role
from core.messages import Alive, Heartbeat, PullTotals, Register, RegisterReply
from engine.kv.block_hash import block_hashes
from gateway.prefix_index import PrefixIndex
from gateway.totals import WorkerTotals

PULL_FIELDS = tuple(f.name for f in dataclasses.fields(PullTotals))
# What happened to a worker's membership, as the registry saw it.
EventKind = Literal["registered", "restarted", "refused", "draining", "left", "dead", "stalled",
                    "recovered"]
_EVENT_MEMORY = 200  # the newest membership events kept


@dataclass(frozen=True)
class MembershipEvent:
    """One join, leave, death or stall, for people watching the cluster (`Registry.events`)."""

    at: float  # wall-clock time.time()
    kind: EventKind
    worker_id: str
    role: str
    host: str
    detail: str = ""


class ActiveRequests(dict[str, int]):
    """Request id -> tokens held on a worker, with their sum kept as they change: routing
    reads it for every worker of every request."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens = 0

    def __setitem__(self, request_id: str, tokens: int) -> None:
        self.tokens += tokens - self.get(request_id, 0)
        super().__setitem__(request_id, tokens)

    def __delitem__(self, request_id: str) -> None:
        self.tokens -= self[request_id]
        super().__delitem__(request_id)

    def pop(self, request_id: str, default: int | None = None) -> int | None:  # type: ignore[override]
        if request_id not in self:
            return default
        tokens = super().pop(request_id)
        self.tokens -= tokens
        return tokens

    def clear(self) -> None:
        super().clear()
        self.tokens = 0

    def update(self, other: Mapping[str, int] | None = None,  # type: ignore[override]
               /, **more: int) -> None:
        for request_id, tokens in {**(other or {}), **more}.items():
            self[request_id] = tokens


@dataclass
class WorkerInfo:
    worker_id: str
    instance_id: str
    role: Role
    kv_address: str
    block_size: int
    num_blocks: int
    last_seen: float  # its last sign of life: an Alive beat or a loop heartbeat
    load: Heartbeat | None = None  # as last reported; routing uses `active` instead
    active: ActiveRequests = field(default_factory=ActiveRequests)  # request id -> tokens held
    prefixes: PrefixIndex = field(default_factory=lambda: PrefixIndex(0))  # its cache, probably
    progressed_at: float = 0.0  # when its progress counter last moved (or it had no work)
    reported_at: float = 0.0  # its loop's last heartbeat (or its registration)
    # When its last two loop heartbeats were sent, on its own clock, and the least lag seen
    # from its clock to ours: when it sent them on ours, however late we read them.
    heartbeats_sent: tuple[float, float] = (0.0, 0.0)
    clock_lag: float = math.inf
    stalled: bool = False  # had work but no progress for the stall timeout: not routed to
    wedged: bool = False  # stalled because its loop sent no heartbeat for the stall timeout
    unreachable: bool = False  # a prefill worker could not send it KV (until its next heartbeat)
    draining: bool = False  # takes no new work; leaves once it holds none
    host: str = ""  # the machine it said it runs on
    cpus: tuple[int, ...] = ()  # the CPUs it said it may run on (empty: not known)
    threads: int = 0  # its torch threads (0: not known)
    max_running: int = 0  # the most sequences its batch holds (0: no bound known)
    isa: str = ""  # the instruction set it said its kernels run at
    prefix_caching: bool = False  # it keeps computed KV blocks: `prefixes` says which
    kv_bytes_per_token: int = 0

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def reported_twice_since(self, since: float) -> bool:
        """Whether it has sent two loop heartbeats since `since` (our clock): the second
        lists whatever reached it before the first."""
        earlier, _ = self.heartbeats_sent
        return earlier > 0 and earlier + self.clock_lag > since

    @property
    def busy(self) -> bool:
        """Whether its last heartbeat reported sequences running or waiting."""
        return self.load is not None and self.load.running + self.load.waiting > 0

    @property
    def held_tokens(self) -> int:
        """Tokens of the requests routed here and not yet released: fresh, unlike heartbeats."""
        return self.active.tokens


class Registry:
    """The workers that registered, as their messages left them: who is alive, who serves
    (`serving`: the pools gateway/routing.py picks from), and the cluster's health."""

    def __init__(self, fingerprint: str, heartbeat_timeout_s: float,
                 expect_prefill: int, expect_decode: int, stall_timeout_s: float = 10.0) -> None:
        self.fingerprint = fingerprint
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.stall_timeout_s = stall_timeout_s
        self.expected: dict[Role, int] = {"prefill": expect_prefill, "decode": expect_decode}
        self.workers: dict[str, WorkerInfo] = {}
        self.refused = 0
        self.was_ready = False  # every expected worker has served at once
        self.events: deque[MembershipEvent] = deque(maxlen=_EVENT_MEMORY)  # oldest first
        self.preemptions = WorkerTotals()  # per worker id, across its restarts
        self.guessed = WorkerTotals()  # decode workers' guessed tokens (speculation)
        self.kept_guesses = WorkerTotals()  # ... of which the draws kept
        # Decode workers' pulls of cached prefixes (core/messages.PullTotals), field by field.
        self.pulled = {name: WorkerTotals() for name in PULL_FIELDS}

    def _note(self, kind: EventKind, worker: WorkerInfo | Register, detail: str = "") -> None:
        self.events.append(MembershipEvent(time.time(), kind, worker.worker_id, worker.role,
                                           worker.host, detail))

    def register(self, message: Register) -> tuple[RegisterReply, WorkerInfo | None]:
        """Admit a worker whose KV layout matches; a re-registering id replaces the old one."""
        if message.role not in ROLES:
            return RegisterReply(False, f"unknown role {message.role!r}"), None
        if message.fingerprint != self.fingerprint:
            self.refused += 1
            reason = (f"KV layout mismatch: worker has {message.fingerprint}, "
                      f"gateway serves {self.fingerprint}")
            self._note("refused", message, reason)
            return RegisterReply(False, reason), None
        previous = self.workers.get(message.worker_id)
        info = WorkerInfo(
            worker_id=message.worker_id, instance_id=message.instance_id, role=message.role,
            kv_address=message.kv_address, block_size=message.block_size,
            num_blocks=message.num_blocks, last_seen=time.monotonic(),
            prefixes=PrefixIndex(message.cache_blocks or message.num_blocks),
            progressed_at=time.monotonic(),
            host=message.host, cpus=tuple(message.cpus), threads=message.threads,
            max_running=message.max_running, isa=message.isa,
            prefix_caching=message.prefix_caching,
            kv_bytes_per_token=message.kv_bytes_per_token,
            reported_at=time.monotonic(),
        )
        if previous is not None and previous.instance_id == message.instance_id:
            info.active = previous.active  # the same process registering again keeps its requests
            info.prefixes = previous.prefixes
        elif previous is not None:
            self._note("restarted", info, "a new process took over its id")
        else:
            self._note("registered", info)
        self.workers[message.worker_id] = info
        self.ready()  # notes a pool made whole, whether or not anyone asks
        return RegisterReply(True, ""), previous

    def heartbeat(self, message: Heartbeat) -> bool:
        """Record load; False when the sender is not (or no longer) a registered instance."""
        info = self.workers.get(message.worker_id)
        if info is None or info.instance_id != message.instance_id:
            return False
        now = time.monotonic()
        moved = info.load is not None and message.progress != info.load.progress
        if moved or not info.busy:
            info.progressed_at = now
        # Only new progress clears a stall, or a wedged loop coming back with nothing to do.
        back_idle = info.wedged and not (message.running or message.waiting)
        if info.stalled and (moved or back_idle):
            info.stalled = info.wedged = False
            self._note("recovered", info, "computing again" if moved else "its loop reports again")
        sent = message.sent_at if message.sent_at > 0 else now  # unknown: as if just sent
        info.clock_lag = min(info.clock_lag, now - sent)
        info.heartbeats_sent = (info.heartbeats_sent[1], sent)
        info.last_seen = info.reported_at = now
        info.load = message
        info.unreachable = False
        if message.draining:
            self.drain(info, "it said so")
        self.preemptions.report(message.worker_id, message.instance_id, message.preemptions)
        self.guessed.report(message.worker_id, message.instance_id, message.guessed_tokens)
        self.kept_guesses.report(message.worker_id, message.instance_id, message.kept_guesses)
        if info.role == "decode":
            for name, totals in self.pulled.items():
                totals.report(message.worker_id, message.instance_id,
                              getattr(message.pulls, name))
        return True

    def beat(self, message: Alive) -> bool:
        """A worker's liveness beat; False when the sender is not a registered instance."""
        info = self.workers.get(message.worker_id)
        if info is None or info.instance_id != message.instance_id:
            return False
        info.last_seen = time.monotonic()
        return True

    def newly_stalled(self) -> list[WorkerInfo]:
        """Mark and return the workers alive but not getting on (they get no new requests):
        those that had work and computed nothing for the stall timeout, and those whose loop
        sent no heartbeat that long (wedged in a step, while its beats go on)."""
        deadline = time.monotonic() - self.stall_timeout_s
        stalled = [w for w in self.workers.values() if not w.stalled and (
            (w.busy and w.progressed_at < deadline) or w.reported_at < deadline)]
        for worker in stalled:
            worker.stalled = True
            worker.wedged = not (worker.busy and worker.progressed_at < deadline)
            why = "no heartbeat from its loop" if worker.wedged else "no progress"
            self._note("stalled", worker, f"{why} for {self.stall_timeout_s:g} s")
        return stalled

    def expire(self) -> list[WorkerInfo]:
        """Remove and return the workers whose heartbeats stopped."""
        deadline = time.monotonic() - self.heartbeat_timeout_s
        dead = [w for w in self.workers.values() if w.last_seen < deadline]
        for worker in dead:
            del self.workers[worker.worker_id]
            self._note("dead", worker, f"no heartbeat for {self.heartbeat_timeout_s:g} s")
        return dead

    def drain(self, worker: WorkerInfo, why: str) -> None:
        """Route nothing new to `worker` from now on: it is draining. It goes on purpose, so
        its pool is expected to be that much smaller from now on (health stays "ok")."""
        if not worker.draining:
            worker.draining = True
            self._note("draining", worker, why)
            serving = len(self.serving(worker.role))
            self.expected[worker.role] = min(self.expected[worker.role], serving)

    def free_to_leave(self) -> list[WorkerInfo]:
        """The draining workers with no request in flight on them: they may leave."""
        return [w for w in self.workers.values() if w.draining and not w.active]

    def remove(self, worker_id: str) -> WorkerInfo | None:
        """A worker that said it is leaving (one that drained first was scaled down on
        purpose: see `drain`)."""
        worker = self.workers.pop(worker_id, None)
        if worker is not None:
            self._note("left", worker, "drained" if worker.draining else "")
        return worker

    def alive(self, role: Role) -> list[WorkerInfo]:
        return [w for w in self.workers.values() if w.role == role]

    def serving(self, role: Role) -> list[WorkerInfo]:
        """The live workers of `role` that are making progress and not draining: the ones
        routed to."""
        return [w for w in self.workers.values()
                if w.role == role and not w.stalled and not w.draining]

    def ready(self) -> bool:
        ready = bool(self.serving("decode")) and all(
            len(self.serving(role)) >= n for role, n in self.expected.items())
        self.was_ready = self.was_ready or ready
        return ready

    def health(self) -> str:
        """"ok": every expected worker serves. "starting": not all have joined yet.
        "degraded": one left or stalled since, and requests are still served (a decode worker
        prefills them itself when no prefill worker is left). "unavailable": no decode worker
        serves, so requests get 503."""
        if self.ready():
            return "ok"
        if not self.was_ready:
            return "starting"
        return "degraded" if self.serving("decode") else "unavailable"

    def capacity_tokens(self) -> int | None:
        """The longest sequence every live worker can hold (None while a pool is empty)."""
        if not self.alive("decode"):
            return None
        return min(w.capacity_tokens for w in self.workers.values())

    def queued_prompt_tokens(self) -> int:
        """Prompt tokens routed to prefill workers and not handed on to decode yet."""
        return sum(w.held_tokens for w in self.alive("prefill"))

    def finished(self, decode_id: str, tokens: Sequence[int], salt: str) -> None:
        """A sequence ended on a decode worker, whose cache now probably holds the KV of the
        full blocks of `tokens` (its prompt and answer, less the last token, never fed)."""
        worker = self.workers.get(decode_id)
        if worker is not None and worker.prefix_caching:
            worker.prefixes.add(block_hashes(tokens, worker.block_size, salt))
