"""Requests in flight: dispatch to a prefill/decode pair, route worker events back, abort.

Each request gets a `RequestHandle` (gateway.handle) whose queue receives `Event`s: tokens from
the prefill worker (the first) and the decode worker (the rest), or a failure. The handle
reaches exactly one terminal state; aborts go to every worker that may hold the request.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import replace

from core.channels import ControlServer
from core.logs import about
from core.messages import (
    Abort,
    Alive,
    Drain,
    Drained,
    FirstToken,
    GenerationTask,
    Heartbeat,
    Held,
    Leave,
    Message,
    PrefillRequest,
    PromptLogprobs,
    Register,
    RegisterAgain,
    RequestFailed,
    RequestKey,
    SharedPrefix,
    SharePrefix,
    Stage,
    StageTime,
    TokenBatch,
    TokenEvent,
)
from gateway.errors import service_unavailable
from gateway.handle import Assignment, Event, RequestHandle
from gateway.registry import WorkerInfo
from gateway.routing import Route, Router
from gateway.timing import RequestTiming

log = logging.getLogger(__name__)


_REABORT_MEMORY = 4096
_MAX_RESUMES = 2  # after losing a worker: a request that kills workers must not kill them all
_MAX_RECOVERIES = 8  # after losing a message or a KV hand-off: not the request's fault
_LOST = "its messages were lost too often"
_UNSERVED = "a worker could not serve the request"
_STOPPED = "a worker serving it stopped"
_NO_WORKER = "no worker is available to serve it"
_LOST_AFTER_S = 1.0  # a token still missing while later ones wait this long was lost


def _unobserved(*what: object) -> None:
    pass


class Dispatcher:
    def __init__(self, control: ControlServer, router: Router,
                 observe_stage: Callable[[Stage, float], None] = _unobserved,
                 observe_route: Callable[[float], None] = _unobserved,
                 count_message: Callable[[str], None] = _unobserved,
                 worker_wait_s: float = 0.0) -> None:
        """`router` picks each request's workers; its registry is the membership that the
        workers' messages keep here. `observe_stage` gets each stage's seconds as they become
        known, `observe_route` each routing decision's, `count_message` each control message's
        kind (the metrics). `worker_wait_s`: how long a request waits for a decode worker to
        join when the pool that served it emptied (its last worker died and is being
        restarted); 0: it fails."""
        self.control = control
        self.router = router
        self.registry = router.registry
        self.worker_wait_s = worker_wait_s
        self.waiting: dict[str, float] = {}  # request id -> until when it waits for a worker
        self.decode_gone_at: float | None = None  # when the decode pool that served emptied
        self.observe_stage = observe_stage
        self.observe_route = observe_route
        self.count_message = count_message
        self.caught_up_at = 0.0  # when it last had read every control message waiting
        self.requests: dict[str, RequestHandle] = {}
        self.aborts_sent = 0
        self.resumed = 0
        self.reaborted: OrderedDict[tuple[str, str], None] = OrderedDict()

    async def until_decode_serves(self, poll_s: float = 0.1) -> None:
        """Return once a decode worker serves, or at once when none ever did (a cluster still
        starting); while the pool that served is empty, wait for a worker to join until
        `worker_wait_s` after it emptied (a restart's window, not each request's). Either way a
        request submitted after it gets its route or its 503."""
        while (gone_at := self._decode_gone_at()) is not None \
                and time.monotonic() < gone_at + self.worker_wait_s:
            await asyncio.sleep(poll_s)

    def _decode_gone_at(self) -> float | None:
        """When the decode pool that served emptied (now, if it just did); None while a decode
        worker serves, or before the cluster ever served."""
        if self.registry.serving("decode") or not self.registry.was_ready:
            self.decode_gone_at = None
        elif self.decode_gone_at is None:
            self.decode_gone_at = time.monotonic()
        return self.decode_gone_at

    def submit(self, task: GenerationTask) -> RequestHandle:
        """Route the request and send it; 503 when no decode worker is available."""
        return self.submit_choices(task, 1)[0]

    def submit_choices(self, task: GenerationTask, n: int, arrived: float | None = None,
                       traceparent: str = "") -> list[RequestHandle]:
        """A request for `n` choices: one handle each, choice i sampling with
        `for_choice(i)`. The prompt goes out once; its decode worker forks the KV. Each
        choice is a request of its own from then on (resumed, aborted, finished alone).
        `arrived`: when its HTTP request came in (default: now); `traceparent`: its span's."""
        route = self._route(task)
        if route is None:
            raise service_unavailable("no decode worker is available", retry_after=1.0)
        handles = [RequestHandle(uuid.uuid4().hex, 0,
                                 replace(task, sampling=task.sampling.for_choice(i)),
                                 Assignment(route.prefill.worker_id, route.decode.worker_id,
                                            forked=i > 0),
                                 timing=RequestTiming(arrived or time.monotonic()),
                                 traceparent=traceparent)
                   for i in range(n)]
        now = time.monotonic()  # before the send: a stage ends before the next one starts
        for handle in handles:
            handle.timing.dispatch(now)
        self._send(handles[0], route, task, [h.request_id for h in handles[1:]])
        # once: the prompt was queued once, whatever its choices
        self.observe_stage("gateway_queue", handles[0].timing.stages["gateway_queue"])
        for handle in handles:
            self.requests[handle.request_id] = handle
        return handles

    def _send(self, handle: RequestHandle, route: Route, task: GenerationTask,
              siblings: list[str] | None = None) -> None:
        """The PrefillRequest of the handle's epoch (with its `siblings`' choices), to
        whichever worker prefills it. The prompt's tokens count once on each worker."""
        handle.assignment.prefill_worker = route.prefill.worker_id
        handle.assignment.decode_worker = route.decode.worker_id
        log.info("request %s: prefill on %s, decode on %s (%s)", handle.request_id,
                 route.prefill.worker_id, route.decode.worker_id, route.path,
                 extra=about(handle.key))
        pull = route.pull
        self.control.send(route.prefill.worker_id, PrefillRequest(
            handle.request_id, handle.epoch, task, route.decode.worker_id,
            route.decode.kv_address, siblings or [], handle.traceparent, route.decode.host,
            pull.source.worker_id if pull else "", pull.tokens if pull else 0))
        for worker in (route.prefill, route.decode):
            worker.active[handle.request_id] = len(task.prompt_ids)
            worker.active.update(dict.fromkeys(siblings or [], 0))

    def drain(self, worker_id: str, why: str) -> WorkerInfo | None:
        """Route nothing new to the worker, and ask it to finish what it holds and leave (None
        when no such worker is registered)."""
        worker = self.registry.workers.get(worker_id)
        if worker is not None:
            self.registry.drain(worker, why)
            self.control.send(worker_id, Drain(why))
        return worker

    def abort(self, handle: RequestHandle) -> None:
        """Stop a request that has not finished (client gone, stop string): tell its workers."""
        if handle.done:
            return
        self._finish(handle)
        for worker_id in handle.assignment.workers:
            self._send_abort(worker_id, handle.key)
            self._remember_abort(worker_id, handle.request_id)

    async def serve(self) -> None:
        """Route every control message; runs for the gateway's lifetime."""
        while True:
            for _ in range(64):
                worker_id, message = await self.control.recv()
                self.on_message(worker_id, message)
                if not self.control.pending():
                    self.caught_up_at = time.monotonic()
            await asyncio.sleep(0)  # a backlog of ready messages must not starve HTTP

    async def watch_liveness(self, interval_s: float = 0.25) -> None:
        """Judge the workers every `interval_s`, from a view that has caught up: not while
        messages this gateway has not read wait (the beats of live workers among them), unless
        it read every waiting message at some moment since the last round."""
        while True:
            started = time.monotonic()
            await asyncio.sleep(interval_s)
            if time.monotonic() - started > interval_s + self.registry.heartbeat_timeout_s / 2:
                continue  # this loop itself stalled: read the beats waiting before judging
            if self.control.pending() and self.caught_up_at < started:
                continue  # behind on reading (a burst, a starved CPU): read before judging
            self.check_workers()

    def check_workers(self) -> None:
        """One round of the liveness watch: the requests of dead and stalled workers resume
        elsewhere, lost tokens and requests no worker holds start over, and draining workers
        with nothing in flight are told they may leave (every round: cheap, and never lost)."""
        for worker in self.registry.expire():
            log.warning("%s sent no sign of life for %.1f s: declared dead",
                        worker.worker_id, self.registry.heartbeat_timeout_s)
            self._fail_worker_requests(worker, f"{worker.worker_id} died")
        for worker in self.registry.newly_stalled():
            log.error("%s is alive but has got nowhere for %.0f s: stalled",
                      worker.worker_id, self.registry.stall_timeout_s)
            self._fail_worker_requests(worker, f"{worker.worker_id} stalled")
        self._resume_lost_tokens()
        self._resume_unheld()
        self._resume_waiting()
        self._decode_gone_at()  # noted each round, so a request long after waits no more
        for worker in self.registry.free_to_leave():
            self.control.send(worker.worker_id, Drained())

    def _resume_lost_tokens(self) -> None:
        """A token that never came (its message lost) stalls its stream: start over from it."""
        lost_before = time.monotonic() - _LOST_AFTER_S
        for handle in list(self.requests.values()):
            gap_since = handle.output.gap_since
            if gap_since is not None and gap_since < lost_before:
                log.warning("request %s lost token %d: resuming", handle.request_id,
                            handle.output.next_index, extra=about(handle.key))
                self._recover_or_fail(handle, _LOST)

    def _resume_unheld(self) -> None:
        """A request no worker reports holding (a lost PrefillRequest, a lost last token)
        would wait forever: after a heartbeat timeout, start it over; not before each of its
        workers has sent two heartbeats since (the first may have left before the request
        came), as a worker starved of CPU reads its messages late but loses none."""
        lost_before = time.monotonic() - self.registry.heartbeat_timeout_s
        for handle in list(self.requests.values()):
            if handle.request_id in self.waiting:
                continue  # held by no worker on purpose
            if handle.held_at < lost_before and self._reported_since(handle, handle.held_at):
                log.warning("request %s is held by no worker: resuming", handle.request_id,
                            extra=about(handle.key))
                self._recover_or_fail(handle, _LOST)

    def _reported_since(self, handle: RequestHandle, since: float) -> bool:
        """Whether each live worker of the request has sent two loop heartbeats since then (sent:
        a gateway that reads them late, as a starved one does, must not count them as new)."""
        workers = (self.registry.workers.get(w) for w in handle.assignment.workers)
        return all(w is None or w.reported_twice_since(since) for w in workers)

    def _note_held(self, worker_id: str, held: list[Held]) -> None:
        worker = self.registry.workers[worker_id]
        keys = {h.key for h in held}
        now = time.monotonic()
        for request_id in worker.active:
            handle = self.requests.get(request_id)
            if handle is not None and handle.key in keys:
                handle.held_at = now

    def _route(self, task: GenerationTask) -> Route | None:
        # CPU time: on a busy host, a decision's wall time is mostly other processes' turns.
        began = time.thread_time()
        route = self.router.route(task.prompt_ids, task.cache_salt,
                                  task.prompt_logprobs is not None)
        self.observe_route(time.thread_time() - began)
        return route

    def on_message(self, worker_id: str, message: Message) -> None:
        self.count_message(type(message).__name__)
        if isinstance(message, TokenBatch):
            for event in message.events:
                if event.index == 0:
                    self._note_cached(event.request_id, event.epoch, event.cached_tokens)
                self._on_token(worker_id, event)
        elif isinstance(message, FirstToken):
            self._note_cached(message.request_id, message.epoch, message.cached_tokens)
            self._on_token(worker_id, TokenEvent(message.request_id, message.epoch, 0,
                                                 message.token_id, message.finish_reason,
                                                 message.logprob, message.top, message.stages,
                                                 embedding=message.embedding))
        elif isinstance(message, Alive):
            self.registry.beat(message)  # an unknown sender re-registers from its loop
        elif isinstance(message, Heartbeat):
            if not self.registry.heartbeat(message):
                self.control.send(worker_id, RegisterAgain("unknown worker or instance"))
            elif worker_id == message.worker_id:
                self._note_held(worker_id, message.holding)
        elif isinstance(message, RequestFailed):
            self._on_failure(worker_id, message)
        elif isinstance(message, Register):
            self._on_register(worker_id, message)
        elif isinstance(message, Leave):
            self._on_leave(worker_id, message)
        elif isinstance(message, SharePrefix):
            self._on_pull(worker_id, message)
        elif isinstance(message, PromptLogprobs):
            self._on_prompt_logprobs(worker_id, message)
        else:
            log.warning("gateway ignored %s from %s", type(message).__name__, worker_id)

    def _on_prompt_logprobs(self, worker_id: str, message: PromptLogprobs) -> None:
        """Kept for the client until the request's first token, which follows them."""
        handle = self.requests.get(message.request_id)
        if handle is not None and handle.epoch == message.epoch and \
                worker_id == handle.assignment.prefill_worker:
            handle.prompt_logprobs = message.entries

    def _on_pull(self, worker_id: str, asked: SharePrefix) -> None:
        """A decode worker expects a prefix's KV: ask its holder to send it, or, with the
        holder gone, tell the decode worker to compute it."""
        holder = self.registry.workers.get(asked.holder)
        if worker_id != asked.worker:
            log.warning("a pull for %s from %s ignored", asked.worker, worker_id)
        elif holder is None:
            self.control.send(worker_id, SharedPrefix(asked.request_id, asked.epoch, 0, ""))
        else:
            self.control.send(holder.worker_id, asked)

    def _note_cached(self, request_id: str, epoch: int, cached_tokens: int) -> None:
        """The prompt tokens the worker that prefilled found cached, as the client's usage
        reports them: from the first epoch that reaches the client (a resumed one's prompt is
        longer)."""
        handle = self.requests.get(request_id)
        if handle is not None and handle.epoch == epoch and not handle.output.delivered:
            handle.cached_tokens = min(cached_tokens, len(handle.task.prompt_ids))

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
        self._decode_gone_at()  # a pool serving again: the next outage's wait is its own
        self._resume_waiting()

    def _on_leave(self, worker_id: str, message: Leave) -> None:
        worker = self.registry.workers.get(message.worker_id)
        if worker_id == message.worker_id and worker is not None \
                and worker.instance_id == message.instance_id:
            log.info("%s left", message.worker_id)
            self.registry.remove(message.worker_id)
            self._fail_worker_requests(worker, f"{message.worker_id} stopped")

    def _on_failure(self, worker_id: str, message: RequestFailed) -> None:
        handle = self.requests.get(message.request_id)
        if handle is None or handle.epoch != message.epoch:
            return
        log.warning("request %s failed: %s", message.request_id, message.reason,
                    extra=about(message.key))
        if not message.retry:
            self._fail(handle, _UNSERVED)
            return
        assignment = handle.assignment
        if assignment.handed_off and worker_id == assignment.prefill_worker:
            self._unreachable(handle, assignment.decode_worker)
        self._recover_or_fail(handle, _UNSERVED)

    def _unreachable(self, handle: RequestHandle, decode_id: str) -> None:
        """The handle's KV could not reach `decode_id`: route around that worker until it
        heartbeats, and should it prove dead, count it as a worker the handle lost."""
        decode = self.registry.workers.get(decode_id)
        if decode is not None:
            decode.unreachable = True
        handle.retries.unreached[decode_id] = time.monotonic()

    def _on_token(self, worker_id: str, token: TokenEvent) -> None:
        handle = self.requests.get(token.request_id)
        if handle is None or handle.epoch != token.epoch:
            self._reabort(worker_id, token)  # it ended here; the worker may not know yet
            return
        if worker_id != handle.assignment.sender_of(token.index):
            log.warning("token for %s from %s, not its worker: dropped", handle.request_id,
                        worker_id)
            return
        event = Event(token.token_id, token.finish_reason, logprob=token.logprob, top=token.top,
                      embedding=token.embedding)
        if not handle.output.accept(token.index, event):
            return  # a duplicate
        if token.stages:
            self._record_stages(handle, token.stages)
        handle.held_at = time.monotonic()
        if token.index > 0:
            self._decode_progress(handle)
        for ready in handle.output.in_order():
            handle.events.put_nowait(ready)
            if ready.finish_reason is not None:
                self._cached_on_decode(handle)
                self._finish(handle)
                break
        handle.output.note_gap(time.monotonic())

    def _record_stages(self, handle: RequestHandle, stages: list[StageTime]) -> None:
        """Stages a worker measured for the handle's current epoch: observed, and kept for the
        client's breakdown."""
        for stage in stages:
            self.observe_stage(stage.stage, stage.seconds)
        handle.timing.record(stages)

    def _decode_progress(self, handle: RequestHandle) -> None:
        """The decode worker holds the request now: prefill is done with it."""
        assignment = handle.assignment
        if assignment.handed_off:
            self._release(handle.request_id, assignment.prefill_worker)
        decode = self.registry.workers.get(assignment.decode_worker)
        if decode is not None and handle.request_id in decode.active:
            decode.active[handle.request_id] += 1

    def _reabort(self, worker_id: str, token: TokenEvent) -> None:
        if token.finish_reason is not None or (worker_id, token.request_id) in self.reaborted:
            return
        self._remember_abort(worker_id, token.request_id)
        self._send_abort(worker_id, token.key)

    def _remember_abort(self, worker_id: str, request_id: str) -> None:
        self.reaborted[(worker_id, request_id)] = None
        if len(self.reaborted) > _REABORT_MEMORY:
            self.reaborted.popitem(last=False)

    def _send_abort(self, worker_id: str, key: RequestKey) -> None:
        self.control.send(worker_id, Abort(*key))
        self.aborts_sent += 1

    def _cached_on_decode(self, handle: RequestHandle) -> None:
        """A finished sequence's KV (its prompt and answer) stays in its decode worker's cache:
        a chat's next turn, which starts with them, may go there. Not when its prefill worker
        drew the last token: the decode worker never held the sequence."""
        last = len(handle.output.delivered) - 1 - handle.output.offset  # in its epoch
        if handle.assignment.sender_of(last) == handle.assignment.decode_worker:
            tokens = [*handle.task.prompt_ids, *handle.output.delivered[:-1]]
            self.registry.finished(handle.assignment.decode_worker, tokens,
                                   handle.task.cache_salt)

    def _finish(self, handle: RequestHandle) -> None:
        handle.done = True
        self.requests.pop(handle.request_id, None)
        self.waiting.pop(handle.request_id, None)
        for worker_id in handle.assignment.workers:
            self._release(handle.request_id, worker_id)

    def _release(self, request_id: str, worker_id: str) -> None:
        """The worker no longer holds the request."""
        worker = self.registry.workers.get(worker_id)
        if worker is not None:
            worker.active.pop(request_id, None)

    def _fail_worker_requests(self, worker: WorkerInfo, reason: str) -> None:
        """The worker is gone: its requests resume on live workers where they can; the others
        end with an error."""
        log.warning("%d requests on it: %s", len(worker.active), reason)
        for request_id in list(worker.active):
            handle = self.requests.get(request_id)
            if handle is not None:
                handle.retries.unreached.pop(worker.worker_id, None)
                self._resume_or_fail(handle)
        # Requests moved off it when their KV could not reach it, and it never heartbeat again:
        # it may be one of them that killed it, so each counts it against its lost workers.
        for handle in [h for h in self.requests.values()
                       if worker.worker_id in h.retries.unreached]:
            marked = handle.retries.unreached.pop(worker.worker_id)
            if worker.last_seen > marked:
                continue
            if handle.retries.worker_losses < _MAX_RESUMES:
                handle.retries.worker_losses += 1
            else:
                self._fail(handle, _STOPPED)

    def _resume_or_fail(self, handle: RequestHandle) -> None:
        """One of the handle's workers is gone."""
        if handle.retries.worker_losses < _MAX_RESUMES and self._start_again(handle):
            handle.retries.worker_losses += 1
            return
        self._fail(handle, _STOPPED)

    def _recover_or_fail(self, handle: RequestHandle, reason: str) -> None:
        """The handle's epoch was lost in passing (a lost message, a failed KV hand-off),
        through no fault of its own: start it again, up to a limit."""
        if handle.retries.message_losses >= _MAX_RECOVERIES:
            self._fail(handle, reason)
        elif self._start_again(handle):
            handle.retries.message_losses += 1
        else:
            self._fail(handle, _NO_WORKER)

    def _start_again(self, handle: RequestHandle) -> bool:
        """Resume the handle on live workers now or, with the decode pool that served emptied,
        once a worker joins (`_wait_for_worker`). False when it can do neither."""
        return self._resume(handle) or self._wait_for_worker(handle)

    def _wait_for_worker(self, handle: RequestHandle) -> bool:
        """Leave the handle's epoch and let it wait up to `worker_wait_s` for a decode worker
        (False when it may not: waiting is off, or the cluster never served)."""
        if self.worker_wait_s <= 0 or not self.registry.was_ready:
            return False
        self._leave_epoch(handle)
        self.waiting[handle.request_id] = time.monotonic() + self.worker_wait_s
        log.warning("request %s waits up to %g s for a decode worker", handle.request_id,
                    self.worker_wait_s, extra=about(handle.key))
        return True

    def _resume_waiting(self) -> None:
        """Requests waiting for a worker: resumed once one serves; past their wait, failed."""
        now = time.monotonic()
        for request_id, until in list(self.waiting.items()):
            handle = self.requests[request_id]
            if self._resume(handle):
                del self.waiting[request_id]
            elif now >= until:
                self._fail(handle, _NO_WORKER)

    def _leave_epoch(self, handle: RequestHandle) -> None:
        """End the handle's epoch on its workers: whatever they still send of it is dropped."""
        for worker_id in handle.assignment.workers:
            self._send_abort(worker_id, handle.key)
            self._release(handle.request_id, worker_id)
        handle.epoch += 1
        handle.output.new_epoch()
        handle.held_at = time.monotonic()

    def _fail(self, handle: RequestHandle, reason: str) -> None:
        self.abort(handle)
        handle.events.put_nowait(Event(None, "error", reason))

    def _resume(self, handle: RequestHandle) -> bool:
        """Start the request again under a new epoch on a live pair of workers, from its prompt
        plus the tokens the client already has, so the stream goes on with no gap and no
        repeat (anything of the old epoch is dropped everywhere). False while no decode worker
        serves, or none but those its KV could not reach (until they heartbeat again)."""
        task, delivered = handle.task, handle.output.delivered
        if delivered:  # its prompt's logprobs came before its first token
            task = replace(task, prompt_ids=[*task.prompt_ids, *delivered],
                           max_tokens=task.max_tokens - len(delivered), prompt_logprobs=None)
        route = self._route(task)
        if route is None or route.decode.unreachable:
            return False
        if handle.request_id not in self.waiting:  # a waiting one left its epoch already
            self._leave_epoch(handle)
        handle.timing.resumed += 1
        handle.assignment.forked = False
        self._send(handle, route, task)
        self.resumed += 1
        return True
