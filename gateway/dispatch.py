"""Requests in flight: dispatch to a prefill/decode pair, route worker events back, abort.

Each request gets a `RequestHandle` whose queue receives `Event`s: tokens from the prefill worker
(the first) and the decode worker (the rest), or a failure. The handle reaches exactly one
terminal state; aborts go to every worker that may hold the request.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass, field

from core.channels import ControlServer
from core.messages import (
    Abort,
    FirstToken,
    GenerationTask,
    Heartbeat,
    Message,
    PrefillRequest,
    Register,
    RegisterAgain,
    RequestFailed,
    TokenBatch,
    TokenEvent,
)
from gateway.errors import service_unavailable
from gateway.registry import Registry, WorkerInfo

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Event:
    token_id: int | None  # None for a failure
    finish_reason: str | None  # "stop", "length", or "error"
    error: str = ""


@dataclass(eq=False)
class RequestHandle:
    request_id: str
    epoch: int
    task: GenerationTask
    prefill_worker: str
    decode_worker: str
    events: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)
    done: bool = False


class Dispatcher:
    def __init__(self, control: ControlServer, registry: Registry) -> None:
        self.control = control
        self.registry = registry
        self.requests: dict[str, RequestHandle] = {}
        self.aborts_sent = 0

    def submit(self, task: GenerationTask) -> RequestHandle:
        """Pick a prefill and a decode worker and send the request; 503 when a pool is empty."""
        prefill, decode = self.registry.pick_prefill(), self.registry.pick_decode()
        if prefill is None or decode is None:
            raise service_unavailable("no prefill or decode worker is available", retry_after=1.0)
        handle = RequestHandle(uuid.uuid4().hex, 0, task, prefill.worker_id, decode.worker_id)
        self.requests[handle.request_id] = handle
        for worker in (prefill, decode):
            worker.assigned_tokens += len(task.prompt_ids)
            worker.active.add(handle.request_id)
        self.control.send(prefill.worker_id, PrefillRequest(
            handle.request_id, handle.epoch, task, decode.worker_id, decode.kv_address))
        return handle

    def abort(self, handle: RequestHandle) -> None:
        """Stop a request that has not finished (client gone, stop string): tell its workers."""
        if handle.done:
            return
        self._finish(handle)
        for worker_id in (handle.prefill_worker, handle.decode_worker):
            self.control.send(worker_id, Abort(handle.request_id, handle.epoch))
            self.aborts_sent += 1

    async def serve(self) -> None:
        """Route every control message; runs for the gateway's lifetime."""
        while True:
            worker_id, message = await self.control.recv()
            self.on_message(worker_id, message)

    async def watch_liveness(self, interval_s: float = 0.5) -> None:
        while True:
            await asyncio.sleep(interval_s)
            for worker in self.registry.expire():
                log.warning("%s stopped heartbeating: declared dead", worker.worker_id)
                self._fail_worker_requests(worker, f"{worker.worker_id} died")

    def on_message(self, worker_id: str, message: Message) -> None:
        if isinstance(message, TokenBatch):
            for event in message.events:
                self._on_token(event)
        elif isinstance(message, FirstToken):
            self._release(message.request_id, worker_id)
            self._on_token(message)
        elif isinstance(message, Heartbeat):
            if not self.registry.heartbeat(message):
                self.control.send(worker_id, RegisterAgain("unknown worker or instance"))
        elif isinstance(message, RequestFailed):
            self._deliver(message.request_id, message.epoch, Event(None, "error", message.reason))
        elif isinstance(message, Register):
            self._on_register(worker_id, message)
        else:
            log.warning("gateway ignored %s from %s", type(message).__name__, worker_id)

    def _on_register(self, worker_id: str, message: Register) -> None:
        if worker_id != message.worker_id:
            log.warning("registration of %s from %s ignored", message.worker_id, worker_id)
            return
        reply, previous = self.registry.register(message)
        self.control.send(worker_id, reply)
        if not reply.accepted:
            log.error("refused %s: %s", worker_id, reply.reason)
        elif previous is not None and previous.instance_id != message.instance_id:
            self._fail_worker_requests(previous, f"{worker_id} restarted")

    def _on_token(self, event: FirstToken | TokenEvent) -> None:
        self._deliver(event.request_id, event.epoch, Event(event.token_id, event.finish_reason))

    def _deliver(self, request_id: str, epoch: int, event: Event) -> None:
        handle = self.requests.get(request_id)
        if handle is None or handle.epoch != epoch or handle.done:
            return  # a late event for a request that already ended
        handle.events.put_nowait(event)
        if event.finish_reason is not None:
            self._finish(handle)

    def _finish(self, handle: RequestHandle) -> None:
        handle.done = True
        self.requests.pop(handle.request_id, None)
        for worker_id in (handle.prefill_worker, handle.decode_worker):
            self._release(handle.request_id, worker_id)

    def _release(self, request_id: str, worker_id: str) -> None:
        """The worker no longer holds the request."""
        worker = self.registry.workers.get(worker_id)
        if worker is not None:
            worker.active.discard(request_id)

    def _fail_worker_requests(self, worker: WorkerInfo, reason: str) -> None:
        for request_id in list(worker.active):
            handle = self.requests.get(request_id)
            if handle is not None:
                self.abort(handle)
                handle.events.put_nowait(Event(None, "error", reason))
