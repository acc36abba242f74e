"""Worker membership: registration with a layout check, heartbeats, liveness, and routing."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from core.messages import Heartbeat, Register, RegisterReply


@dataclass
class WorkerInfo:
    worker_id: str
    instance_id: str
    role: str
    kv_address: str
    block_size: int
    num_blocks: int
    last_seen: float
    load: Heartbeat | None = None
    assigned_tokens: int = 0  # routed here since the last heartbeat, not yet in its load
    active: set[str] = field(default_factory=set)  # request ids this worker holds

    @property
    def free_blocks(self) -> int:
        reported = self.num_blocks if self.load is None else self.load.free_blocks
        return reported - -(-self.assigned_tokens // self.block_size)

    @property
    def queued_tokens(self) -> int:
        reported = 0 if self.load is None else self.load.queued_tokens
        return reported + self.assigned_tokens


class Registry:
    def __init__(self, fingerprint: str, heartbeat_timeout_s: float,
                 expect_prefill: int, expect_decode: int) -> None:
        self.fingerprint = fingerprint
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.expected = {"prefill": expect_prefill, "decode": expect_decode}
        self.workers: dict[str, WorkerInfo] = {}
        self.refused = 0

    def register(self, message: Register) -> tuple[RegisterReply, WorkerInfo | None]:
        """Admit a worker whose KV layout matches; a re-registering id replaces the old one."""
        if message.role not in self.expected:
            return RegisterReply(False, f"unknown role {message.role!r}"), None
        if message.fingerprint != self.fingerprint:
            self.refused += 1
            reason = (f"KV layout mismatch: worker has {message.fingerprint}, "
                      f"gateway serves {self.fingerprint}")
            return RegisterReply(False, reason), None
        previous = self.workers.get(message.worker_id)
        info = WorkerInfo(
            worker_id=message.worker_id, instance_id=message.instance_id, role=message.role,
            kv_address=message.kv_address, block_size=message.block_size,
            num_blocks=message.num_blocks, last_seen=time.monotonic(),
        )
        if previous is not None and previous.instance_id == message.instance_id:
            info.active = previous.active  # the same process registering again keeps its requests
        self.workers[message.worker_id] = info
        return RegisterReply(True, ""), previous

    def heartbeat(self, message: Heartbeat) -> bool:
        """Record load; False when the sender is not (or no longer) a registered instance."""
        info = self.workers.get(message.worker_id)
        if info is None or info.instance_id != message.instance_id:
            return False
        info.last_seen = time.monotonic()
        info.load = message
        info.assigned_tokens = 0
        return True

    def expire(self) -> list[WorkerInfo]:
        """Remove and return the workers whose heartbeats stopped."""
        deadline = time.monotonic() - self.heartbeat_timeout_s
        dead = [w for w in self.workers.values() if w.last_seen < deadline]
        for worker in dead:
            del self.workers[worker.worker_id]
        return dead

    def remove(self, worker_id: str) -> WorkerInfo | None:
        return self.workers.pop(worker_id, None)

    def alive(self, role: str) -> list[WorkerInfo]:
        return [w for w in self.workers.values() if w.role == role]

    def ready(self) -> bool:
        return all(len(self.alive(role)) >= n for role, n in self.expected.items())

    def capacity_tokens(self) -> int | None:
        """The longest sequence both pools can hold (None while a pool is empty)."""
        per_role = [max((w.num_blocks * w.block_size for w in self.alive(role)), default=0)
                    for role in self.expected]
        return min(per_role) or None

    def pick_prefill(self) -> WorkerInfo | None:
        """The prefill worker with the fewest queued tokens."""
        return min(self.alive("prefill"), key=lambda w: w.queued_tokens, default=None)

    def pick_decode(self) -> WorkerInfo | None:
        """The decode worker with the most free KV blocks (then the fewest running)."""
        def score(w: WorkerInfo) -> tuple[int, int]:
            return w.free_blocks, -(0 if w.load is None else w.load.running)
        return max(self.alive("decode"), key=score, default=None)
