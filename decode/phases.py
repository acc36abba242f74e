"""Where each request of a decode worker is: one phase at a time, each kept in its own table.
Pure bookkeeping.

A request handed off by a prefill worker is RECEIVING while its KV arrives (decode.incoming),
then COMPILING while its grammar (if any) compiles off the loop, WAITING for a decode slot
and RUNNING in the batch (decode.scheduler; a preempted
sequence waits again). A prompt sent here to prefill starts WAITING. With n > 1, the other
choices of a request are FORKING until its prompt's KV is computed or written, then fork it.
A request that finished or was aborted here is ENDED for a while, so that a late or repeated
message for it is dropped rather than served again.
"""

from __future__ import annotations

from enum import Enum

from core.messages import RequestKey, choice_keys
from decode.incoming import IncomingTable
from decode.scheduler import DecodeScheduler, DecodeSequence

TOMBSTONE_TTL_S = 120.0


class Phase(Enum):
    RECEIVING = "receiving"  # its KV on its way (with n > 1, its first choice's)
    COMPILING = "compiling"  # its grammar compiling (with n > 1, with its other choices)
    WAITING = "waiting"  # queued for a decode slot
    RUNNING = "running"  # in the batch
    FORKING = "forking"  # a choice waiting for its prompt's KV, computed for another choice
    ENDED = "ended"  # finished or aborted here


class Phases:
    """The tables a decode worker keeps its requests in, and which one holds a request."""

    def __init__(self, incoming: IncomingTable, scheduler: DecodeScheduler) -> None:
        self.incoming = incoming
        self.scheduler = scheduler
        # n > 1: choices waiting for the prompt KV of the choice they are filed under.
        self.forks: dict[RequestKey, list[DecodeSequence]] = {}
        # Sequences waiting for their grammar, each with its forks (n > 1).
        self.compiling: dict[RequestKey, tuple[DecodeSequence, list[DecodeSequence]]] = {}
        self.ended: dict[RequestKey, float] = {}  # until when each is remembered

    def of(self, key: RequestKey) -> Phase | None:
        """The request's phase here; None for a request this worker does not know."""
        if key in self.ended:
            return Phase.ENDED
        sequence = self.scheduler.find(key)
        if sequence is not None:
            return Phase.RUNNING if sequence in self.scheduler.running else Phase.WAITING
        if key in self.receiving():
            return Phase.RECEIVING
        if any(sequence.key == key for sequence in self._compiling()):
            return Phase.COMPILING
        if any(fork.key == key for forks in self.forks.values() for fork in forks):
            return Phase.FORKING
        return None

    def receiving(self) -> list[RequestKey]:
        """Every choice of the requests whose KV is arriving."""
        return [key for entry in self.incoming.pending.values()
                for key in choice_keys(entry.request)]

    def held(self) -> list[RequestKey]:
        """Every request here but the ended ones."""
        sequences = [*self.scheduler.running, *self.scheduler.waiting, *self._compiling(),
                     *(fork for forks in self.forks.values() for fork in forks)]
        return [*self.receiving(), *(sequence.key for sequence in sequences)]

    def _compiling(self) -> list[DecodeSequence]:
        return [s for sequence, forks in self.compiling.values() for s in [sequence, *forks]]

    def end(self, key: RequestKey, now: float) -> None:
        self.ended[key] = now + TOMBSTONE_TTL_S

    def forget_ended(self, now: float) -> None:
        """Forget the ended requests remembered long enough."""
        self.ended = {key: until for key, until in self.ended.items() if until > now}
