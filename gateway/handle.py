"""One request in flight at the gateway: the workers serving its current epoch, its output in
the order the client gets it, and how often it was started again. Pure bookkeeping; the
dispatcher (gateway.dispatch) moves it along."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal

from core.messages import FinishReason, GenerationTask, Keyed, PromptLogprob, TopLogprob
from gateway.timing import RequestTiming

Ending = FinishReason | Literal["error"]


@dataclass(frozen=True)
class Event:
    """What the client gets next: a token (possibly the last), or the failure that ends it."""

    token_id: int | None  # None for a failure
    finish_reason: Ending | None
    error: str = ""
    logprob: float | None = None  # when the request asked for logprobs
    top: list[TopLogprob] = field(default_factory=list)
    embedding: bytes = b""  # the prompt's, on the first token of a request for it


@dataclass
class Assignment:
    """The workers serving a request's current epoch: the one that prefills it (a prefill
    worker, or its decode worker itself) and its decode worker."""

    prefill_worker: str
    decode_worker: str
    forked: bool = False  # another choice of an n > 1 request: decode draws its first token

    @property
    def workers(self) -> list[str]:
        """Each worker once (one, when the decode worker prefills the request)."""
        return list(dict.fromkeys((self.prefill_worker, self.decode_worker)))

    @property
    def handed_off(self) -> bool:
        """Whether a prefill worker hands its KV to the decode worker."""
        return self.prefill_worker != self.decode_worker

    def sender_of(self, index: int) -> str:
        """The worker that sends the epoch's token `index` (0: the first token)."""
        return self.prefill_worker if index == 0 and not self.forked else self.decode_worker


@dataclass
class ReorderBuffer:
    """A request's output in order, whatever order its tokens arrive in, across epochs: a
    resumed epoch's token 0 is the client's next one."""

    next_index: int = 0  # the output position the client gets next
    early: dict[int, Event] = field(default_factory=dict)  # arrived before their turn
    delivered: list[int] = field(default_factory=list)  # token ids the client has got
    offset: int = 0  # output position of this epoch's first token
    gap_since: float | None = None  # since when later tokens wait for a missing one

    def accept(self, index: int, event: Event) -> bool:
        """File this epoch's token `index`; False for a duplicate."""
        position = self.offset + index
        if position < self.next_index or position in self.early:
            return False
        self.early[position] = event
        return True

    def in_order(self) -> Iterator[Event]:
        """The tokens now due, in order, each counted delivered as it is taken."""
        while self.next_index in self.early:
            event = self.early.pop(self.next_index)
            self.next_index += 1
            assert event.token_id is not None
            self.delivered.append(event.token_id)
            yield event

    def note_gap(self, now: float) -> None:
        """Start or stop the clock of a missing token: tokens wait behind it, or none do."""
        self.gap_since = (self.gap_since or now) if self.early else None

    def new_epoch(self) -> None:
        """The request starts again from what the client has: nothing of the old epoch waits."""
        self.offset, self.early, self.gap_since = self.next_index, {}, None


@dataclass
class Retries:
    """How often a request was started again, and why; and the decode workers its KV could
    not reach, with when (one that heartbeats after that was alive, not killed by it)."""

    worker_losses: int = 0  # resumed after losing a worker
    message_losses: int = 0  # resumed after losing a message or a KV hand-off
    unreached: dict[str, float] = field(default_factory=dict)


@dataclass(eq=False)
class RequestHandle(Keyed):
    request_id: str
    epoch: int
    task: GenerationTask
    assignment: Assignment
    output: ReorderBuffer = field(default_factory=ReorderBuffer)
    retries: Retries = field(default_factory=Retries)
    events: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)
    done: bool = False
    cached_tokens: int = 0  # prompt tokens found cached where it prefilled (the client's usage)
    held_at: float = field(default_factory=time.monotonic)  # a worker last reported holding it
    timing: RequestTiming = field(default_factory=RequestTiming)
    traceparent: str = ""  # its gateway span's, for the workers' spans; "": not traced
    # Each prompt token's after the first, once its worker sent them (task.prompt_logprobs).
    prompt_logprobs: list[PromptLogprob] | None = None
