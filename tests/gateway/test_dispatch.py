"""The dispatcher over a real ControlServer, with workers as real ControlClients over ipc."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from functools import partial
from pathlib import Path

import pytest
import zmq
import zmq.asyncio

from core.channels import ControlClient, ControlServer
from core.config import Role
from core.messages import (
    Abort,
    Alive,
    Drain,
    Drained,
    FinishReason,
    FirstToken,
    GenerationTask,
    Heartbeat,
    Held,
    Leave,
    Message,
    PrefillRequest,
    PromptLogprob,
    PromptLogprobs,
    Register,
    RegisterAgain,
    RegisterReply,
    RequestFailed,
    Sampling,
    StageTime,
    TokenBatch,
    TokenEvent,
)
from engine.kv.block_hash import block_hashes
from gateway import dispatch
from gateway.dispatch import (
    _MAX_RECOVERIES,
    _MAX_RESUMES,
    _REABORT_MEMORY,
    Dispatcher,
)
from gateway.errors import APIError
from gateway.handle import Assignment, Event, RequestHandle
from gateway.registry import Registry, WorkerInfo
from gateway.routing import Router

FP = "tiny|float32|2|2|16|16"
WAIT_S = 5.0
TASK = GenerationTask([1, 2, 3, 4, 5], Sampling(seed=1), 8, [2], False)
PROMPT_LEN = len(TASK.prompt_ids)
STOPPED = "a worker serving it stopped"
FAILED = "a worker could not serve the request"
LOST = "its messages were lost too often"
NO_WORKER = "no worker is available to serve it"
_FLUSH_INSTANCE = "flush"


async def until(condition: Callable[[], bool], what: str = "condition") -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.005)


def resumed_past(handle: RequestHandle, resumes: int) -> bool:
    return handle.retries.worker_losses > resumes or handle.done


class FakeWorker:
    """A worker's control side only: a real ControlClient driven from the test."""

    def __init__(self, context: zmq.Context, address: str, worker_id: str, role: Role,
                 kv_address: str, instance_id: str = "i0", num_blocks: int = 100) -> None:
        self.worker_id, self.role, self.instance_id = worker_id, role, instance_id
        self.kv_address, self.num_blocks = kv_address, num_blocks
        self.client = ControlClient(context, address, worker_id)
        self.inbox: list[Message] = []
        self.forgotten: set[str] = set()  # request ids its heartbeats leave out (lost here)

    def registration(self, fingerprint: str = FP) -> Register:
        return Register(self.worker_id, self.instance_id, self.role, self.kv_address,
                        fingerprint, 16, self.num_blocks, prefix_caching=True)

    def heartbeat(self, queued: int = 0, free: int = 100, running: int = 0) -> Heartbeat:
        return Heartbeat(self.worker_id, self.instance_id, queued, free, running, 0)

    def send(self, message: Message) -> None:
        self.client.send(message)

    def tokens(self, request_id: str, *events: tuple[int, int, FinishReason | None],
               epoch: int = 0) -> None:
        """One TokenBatch of (index, token, finish_reason) events, as a decode step sends."""
        self.send(TokenBatch([TokenEvent(request_id, epoch, *e) for e in events]))

    async def expect(self, count: int) -> list[Message]:
        """The next `count` messages from the gateway."""
        def arrived() -> bool:
            self.inbox += self.client.take_waiting()
            return len(self.inbox) >= count

        await until(arrived, f"{count} messages for {self.worker_id}")
        got, self.inbox = self.inbox[:count], self.inbox[count:]
        return got

    async def flush(self) -> list[Message]:
        """What the gateway sent here in answer to everything this worker sent before now.

        A heartbeat from an instance the gateway does not know is answered with RegisterAgain,
        after every message this worker sent earlier has been handled: a marker on the pipe.
        """
        self.send(Heartbeat(self.worker_id, _FLUSH_INSTANCE, 0, 0, 0, 0))

        def marked() -> bool:
            self.inbox += self.client.take_waiting()
            return any(isinstance(m, RegisterAgain) for m in self.inbox)

        await until(marked, f"the flush marker for {self.worker_id}")
        at = next(i for i, m in enumerate(self.inbox) if isinstance(m, RegisterAgain))
        got, self.inbox = self.inbox[:at], self.inbox[at + 1:]
        return got

    async def quiet(self) -> list[Message]:
        """Anything else that arrives within a short while (expected: nothing)."""
        await asyncio.sleep(0.1)
        self.inbox += self.client.take_waiting()
        got, self.inbox = self.inbox, []
        return got


class Gateway:
    """A dispatcher serving a real ControlServer on ipc, plus helpers to attach workers."""

    def __init__(self, tmp_path: Path, heartbeat_timeout_s: float,
                 stall_timeout_s: float = 10.0, worker_wait_s: float = 0.0) -> None:
        self.address = f"ipc://{tmp_path}/ctl"
        self.async_context = zmq.asyncio.Context()
        self.context = zmq.Context()
        self.server = ControlServer(self.async_context, self.address)
        self.registry = Registry(FP, heartbeat_timeout_s, 1, 1, stall_timeout_s)
        self.router = Router(self.registry)
        self.dispatcher = Dispatcher(self.server, self.router, worker_wait_s=worker_wait_s)
        self.beating: dict[str, FakeWorker] = {}
        self.tasks = [asyncio.create_task(self.dispatcher.serve()),
                      asyncio.create_task(self._beat())]

    async def worker(self, worker_id: str, role: Role, kv_address: str = "",
                     instance_id: str = "i0", num_blocks: int = 100,
                     queued: int = 0, free: int = 100, running: int = 0) -> FakeWorker:
        """A registered worker whose first heartbeat the registry has recorded."""
        worker = FakeWorker(self.context, self.address, worker_id, role, kv_address,
                            instance_id, num_blocks)
        worker.send(worker.registration())
        assert await worker.expect(1) == [RegisterReply(True, "")]
        beat = worker.heartbeat(queued, free, running)
        worker.send(beat)
        await until(lambda: self.registry.workers[worker_id].load == beat, "a heartbeat")
        return worker

    async def _beat(self) -> None:
        """Keep the workers in `beating` alive, as their loops would, each holding what was
        routed to it (less what it `forgot`)."""
        while True:
            for worker in list(self.beating.values()):
                info = self.registry.workers.get(worker.worker_id)
                if info is not None and info.load is not None:
                    worker.send(replace(info.load, holding=self.held(info, worker.forgotten)))
            await asyncio.sleep(0.03)

    def held(self, info: WorkerInfo, forgotten: set[str]) -> list[Held]:
        requests = self.dispatcher.requests
        return [Held(rid, requests[rid].epoch) for rid in info.active
                if rid in requests and rid not in forgotten]

    def active(self, worker_id: str) -> dict[str, int]:
        return self.registry.workers[worker_id].active

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self.server.close()
        self.async_context.destroy(linger=0)
        self.context.destroy(linger=0)


@contextlib.asynccontextmanager
async def gateway(tmp_path: Path, heartbeat_timeout_s: float = 30.0,
                  stall_timeout_s: float = 10.0,
                  worker_wait_s: float = 0.0) -> AsyncIterator[Gateway]:
    gw = Gateway(tmp_path, heartbeat_timeout_s, stall_timeout_s, worker_wait_s)
    try:
        yield gw
    finally:
        await gw.close()


async def pair(gw: Gateway) -> tuple[FakeWorker, FakeWorker]:
    prefill = await gw.worker("p1", "prefill")
    decode = await gw.worker("d1", "decode", kv_address="tcp://127.0.0.1:7001")
    return prefill, decode


async def submitted(gw: Gateway, prefill: FakeWorker,
                    task: GenerationTask = TASK) -> RequestHandle:
    """A submitted request whose PrefillRequest the prefill worker has received."""
    handle = gw.dispatcher.submit(task)
    (message,) = await prefill.expect(1)
    assert isinstance(message, PrefillRequest) and message.request_id == handle.request_id
    return handle


async def next_event(handle: RequestHandle) -> Event:
    return await asyncio.wait_for(handle.events.get(), WAIT_S)


def pending(handle: RequestHandle) -> list[Event]:
    """The events queued on the handle now (taken off it)."""
    events = []
    while not handle.events.empty():
        events.append(handle.events.get_nowait())
    return events


async def no_more_events(handle: RequestHandle) -> None:
    await asyncio.sleep(0.1)
    assert handle.events.empty(), f"unexpected {handle.events.get_nowait()}"


# -- submit and routing ------------------------------------------------------------------------


def test_submit_sends_a_prefill_request_naming_the_decode_worker(tmp_path: Path) -> None:
    async def body() -> None:
        async with gateway(tmp_path) as gw:
            prefill, decode = await pair(gw)
            handle = gw.dispatcher.submit(TASK)
            assignment = handle.assignment
            assert (assignment.prefill_worker, assignment.decode_worker) == ("p1", "d1")
            assert handle.epoch == 0
            assert handle.output.next_index == 0 and handle.output.early == {} and not handle.done
            assert await prefill.expect(1) == [
                PrefillRequest(handle.request_id, 0, TASK, "d1", "tcp://127.0.0.1:7001")]
            assert await decode.quiet() == []
            for worker_id in ("p1", "d1"):
                assert gw.active(worker_id) == {handle.request_id: PROMPT_LEN}
            assert gw.dispatcher.requests == {handle.request_id: handle}

    asyncio.run(body())


def test_a_submit_whose_send_fails_leaves_no_trace(tmp_path: Path) -> None:
    """The request is recorded only once its PrefillRequest went out."""
    async def body() -> None:
        async with gateway(tmp_path) as gw:
            await pair(gw)

            def refuse(worker_id: str, message: Message) -> None:
                raise zmq.Again()

            gw.server.send = refuse  # type: ignore[method-assign]
            with pytest.raises(zmq.Again):
                gw.dispatcher.submit(TASK)
            assert gw.dispatcher.requests == {}
            assert gw.active("p1") == {} and gw.active("d1") == {}

    asyncio.run(body())


def test_submit_picks_the_least_loaded_workers(tmp_path: Path) -> None:
    async def body() -> None:
        async with gateway(tmp_path) as gw:
            # What the heartbeats claim is stale by design and must not steer routing.
            p1 = await gw.worker("p1", "prefill", queued=0)
            p2 = await gw.worker("p2", "prefill", queued=100_000)
            await gw.worker("d1", "decode", kv_address="tcp://127.0.0.1:7001",
                            num_blocks=100, free=0, running=99)  # 1600 tokens
            await gw.worker("d2", "decode", kv_address="tcp://127.0.0.1:7002",
                            num_blocks=20, free=20)  # 320 tokens
            workers = {"p1": p1, "p2": p2}

            async def route(prompt_len: int) -> tuple[str, str]:
                handle = gw.dispatcher.submit(
                    GenerationTask(list(range(prompt_len)), Sampling(), 4, [], False))
                (message,) = await workers[handle.assignment.prefill_worker].expect(1)
                assert isinstance(message, PrefillRequest)
                assert message.request_id == handle.request_id
                assert message.decode_worker == handle.assignment.decode_worker
                return handle.assignment.prefill_worker, handle.assignment.decode_worker

            first_prefill, first_decode = await route(150)
            assert first_decode == "d1"  # 1600 free against 320
            other = "p2" if first_prefill == "p1" else "p1"
            assert await route(5) == (other, "d1")  # 0 held against 150; 1450 free against 320
            assert await route(1300) == (other, "d1")  # 5 against 150; 1445 against 320
            assert gw.registry.workers["d1"].held_tokens == 1455
            assert await route(5) == (first_prefill, "d2")  # 150 against 1305; 145 against 320
            assert await p1.quiet() == [] and await p2.quiet() == []

    asyncio.run(body())


def test_ended_requests_no_longer_count_for_routing(tmp_path: Path) -> None:
    async def body() -> None:
        async with gateway(tmp_path) as gw:
            p1 = await gw.worker("p1", "prefill")
            p2 = await gw.worker("p2", "prefill")
            await gw.worker("d1", "decode", kv_address="tcp://127.0.0.1:7001")
            big = gw.dispatcher.submit(GenerationTask(list(range(50)), Sampling(), 4, [], False))
            busy, idle = (p1, p2) if big.assignment.prefill_worker == "p1" else (p2, p1)
            assert (await busy.expect(1))[0] == PrefillRequest(
                big.request_id, 0, big.task, "d1", "tcp://127.0.0.1:7001")
            assert gw.dispatcher.submit(TASK).assignment.prefill_worker == idle.worker_id
            busy.send(FirstToken(big.request_id, 0, 2, "stop"))
            assert await next_event(big) == Event(2, "stop")
            assert gw.registry.workers[busy.worker_id].held_tokens == 0
            assert gw.dispatcher.submit(TASK).assignment.prefill_worker == busy.worker_id

    asyncio.run(body())


def test_submit_with_an_empty_pool_raises_503(tmp_path: Path) -> None:
    async def body() -> None:
        async with gateway(tmp_path) as gw:
            with pytest.raises(APIError) as caught:
                gw.dispatcher.submit(TASK)
            assert caught.value.status == 503
            prefill = await gw.worker("p1", "prefill")
            with pytest.raises(APIError) as caught:
                gw.dispatcher.submit(TASK)  # still no decode worker
            assert caught.value.status == 503
            assert not gw.dispatcher.requests and await prefill.quiet() == []
            assert gw.active("p1") == {}

    asyncio.run(body())


# -- tokens ------------------------------------------------------------------------------------


def test_events_reach_the_handle_in_order_and_it_ends_once(tmp_path: Path) -> None:
    async def body() -> None:
        async with gateway(tmp_path) as gw:
            prefill, decode = await pair(gw)
            handle = await submitted(gw, prefill)
            rid = handle.request_id
            prefill.send(FirstToken(rid, 0, 5, None))
            assert await next_event(handle) == Event(5, None)
            decode.tokens(rid, (1, 6, None), (2, 7, None))
            assert [await next_event(handle) for _ in range(2)] == [Event(6, None), Event(7, None)]
            assert gw.active("d1") == {rid: PROMPT_LEN + 2}  # one more token held per token
            decode.tokens(rid, (3, 8, "length"))
            assert await next_event(handle) == Event(8, "length")
            assert handle.done and rid not in gw.dispatcher.requests
            assert gw.active("p1") == {} and gw.active("d1") == {}
            decode.tokens(rid, (3, 8, "length"))  # the final token again
            decode.send(RequestFailed(rid, 0, "late failure"))
            assert await decode.flush() == [] and await prefill.flush() == []
            assert pending(handle) == []
            gw.dispatcher.abort(handle)  # after the end: nothing to stop
            assert await prefill.quiet() == [] and await decode.quiet() == []
            assert gw.dispatcher.aborts_sent == 0  # a normal end aborts nothing

    asyncio.run(body())


def test_a_finished_answer_is_remembered_as_cached_on_its_decode_worker(tmp_path: Path) -> None:
    async def body() -> None:
        async with gateway(tmp_path) as gw:
            prefill, decode = await pair(gw)
            task = replace(TASK, prompt_ids=list(range(100, 129)), cache_salt="tenant-a")
            handle = await submitted(gw, prefill, task)
            rid = handle.request_id
            prefill.send(FirstToken(rid, 0, 5, None))
            decode.tokens(rid, (1, 6, None), (2, 7, None), (3, 8, "stop"))
            await until(lambda: handle.done, "the request ends")
            # 29 prompt tokens and 3 of the answer computed (not the last): two full blocks
            chain = block_hashes([*task.prompt_ids, 5, 6, 7, 8, 9], 16, "tenant-a")
            assert gw.dispatcher.registry.workers["d1"].prefixes.matched(chain) == 2
            one = await submitted(gw, prefill, replace(task, prompt_ids=list(range(60, 110))))
            prefill.send(FirstToken(one.request_id, 0, 5, "length"))  # never reached decode
            await until(lambda: one.done, "the one-token request ends")
            aborted = await submitted(gw, prefill, replace(task, prompt_ids=list(range(50))))
            gw.dispatcher.abort(aborted)
            for prompt in (range(50), range(60, 110)):
                chain = block_hashes(list(prompt), 16, "tenant-a")
                assert gw.dispatcher.registry.workers["d1"].prefixes.matched(chain) == 0

    asyncio.run(body())


def test_prefill_is_released_only_at_the_first_decode_token(tmp_path: Path) -> None:
    async def body() -> None:
        async with gateway(tmp_path) as gw:
            prefill, decode = await pair(gw)
            handle = await submitted(gw, prefill)
            rid = handle.request_id
            prefill.send(FirstToken(rid, 0, 5, None))
            assert await next_event(handle) == Event(5, None)
            # The KV may still be on its way: prefill still holds the request.
            assert gw.active("p1") == {rid: PROMPT_LEN}
            assert gw.active("d1") == {rid: PROMPT_LEN}
            decode.tokens(rid, (1, 6, None))
            assert await next_event(handle) == Event(6, None)
            assert gw.active("p1") == {}
            assert gw.active("d1") == {rid: PROMPT_LEN + 1}

    asyncio.run(body())


def test_tokens_that_arrive_early_wait_for_their_turn(tmp_path: Path) -> None:
    async def body() -> None:
        async with gateway(tmp_path) as gw:
            prefill, decode = await pair(gw)
            handle = await submitted(gw, prefill)
            rid = handle.request_id
            decode.tokens(rid, (3, 9, None))
            decode.tokens(rid, (1, 7, None), (2, 8, None))  # decode's first step, late
            assert await decode.flush() == []
            assert pending(handle) == [] and handle.output.next_index == 0
            assert sorted(handle.output.early) == [1, 2, 3]
            assert gw.active("p1") == {}  # decode has it: prefill is done with it
            prefill.send(FirstToken(rid, 0, 6, None))
            got = [await next_event(handle) for _ in range(4)]
            assert got == [Event(6, None), Event(7, None), Event(8, None), Event(9, None)]
            assert handle.output.next_index == 4 and handle.output.early == {} and not handle.done
            decode.tokens(rid, (4, 10, "stop"))
            assert await next_event(handle) == Event(10, "stop")
            assert handle.done

    asyncio.run(body())


def test_an_early_final_token_ends_the_request_only_in_its_turn(tmp_path: Path) -> None:
    async def body() -> None:
        async with gateway(tmp_path) as gw:
            prefill, decode = await pair(gw)
            handle = await submitted(gw, prefill)
            rid = handle.request_id
            decode.tokens(rid, (2, 8, "length"))
            assert await decode.flush() == []
            assert pending(handle) == [] and not handle.done
            assert rid in gw.dispatcher.requests
            prefill.send(FirstToken(rid, 0, 6, None))
            assert await next_event(handle) == Event(6, None)
            assert await prefill.flush() == []
            assert pending(handle) == [] and not handle.done  # index 1 is still missing
            decode.tokens(rid, (1, 7, None))
            assert [await next_event(handle) for _ in range(2)] == [
                Event(7, None), Event(8, "length")]
            assert handle.done and rid not in gw.dispatcher.requests
            assert gw.active("p1") == {} and gw.active("d1") == {}
            assert await decode.flush() == [] and gw.dispatcher.aborts_sent == 0

    asyncio.run(body())


def test_duplicate_tokens_are_dropped(tmp_path: Path) -> None:
    async def body() -> None:
        async with gateway(tmp_path) as gw:
            prefill, decode = await pair(gw)
            handle = await submitted(gw, prefill)
            rid = handle.request_id
            decode.tokens(rid, (2, 8, None), (2, 80, None))  # early, twice: the first stays
            decode.tokens(rid, (2, 81, "stop"))  # a duplicate cannot end it either
            assert await decode.flush() == []
            assert handle.output.early == {2: Event(8, None)} and pending(handle) == []
            assert gw.active("d1") == {rid: PROMPT_LEN + 1}  # held once, not once per copy
            prefill.send(FirstToken(rid, 0, 6, None))
            prefill.send(FirstToken(rid, 0, 60, None))
            assert await prefill.flush() == []
            assert pending(handle) == [Event(6, None)]
            decode.tokens(rid, (1, 7, None), (1, 70, None))
            decode.tokens(rid, (1, 71, None), (2, 82, None))
            assert await decode.flush() == []
            assert pending(handle) == [Event(7, None), Event(8, None)]
            assert handle.output.next_index == 3 and handle.output.early == {} and not handle.done
            assert gw.active("d1") == {rid: PROMPT_LEN + 2}  # indices 1 and 2, once each
            decode.tokens(rid, (3, 9, "stop"), (3, 90, "stop"))
            assert await decode.flush() == []
            assert pending(handle) == [Event(9, "stop")] and handle.done
            assert gw.dispatcher.aborts_sent == 0  # duplicates are not strays

    asyncio.run(body())


def test_tokens_from_a_worker_not_serving_the_request_are_dropped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Index 0 only from the request's prefill worker, the rest only from its decode worker."""
    async def body() -> None:
        async with gateway(tmp_path) as gw:
            prefill, decode = await pair(gw)
            handle = await submitted(gw, prefill)
            rid = handle.request_id
            other_prefill = await gw.worker("p2", "prefill")
            other_decode = await gw.worker("d2", "decode", kv_address="tcp://127.0.0.1:7002")
            stranger = FakeWorker(gw.context, gw.address, "x9", "decode", "")
            caplog.set_level(logging.WARNING, logger="gateway.dispatch")
            decode.send(FirstToken(rid, 0, 50, "stop"))  # index 0 is the prefill worker's
            decode.tokens(rid, (0, 51, None))
            prefill.tokens(rid, (1, 52, "stop"))  # the rest are the decode worker's
            other_prefill.send(FirstToken(rid, 0, 53, "stop"))
            other_decode.tokens(rid, (1, 54, None), (2, 55, "length"))
            stranger.tokens(rid, (1, 56, None))
            for worker in (prefill, decode, other_prefill, other_decode, stranger):
                assert await worker.flush() == []  # dropped: neither delivered nor aborted
            assert pending(handle) == [] and handle.output.early == {}
            assert handle.output.next_index == 0 and not handle.done
            assert gw.active("p1") == {rid: PROMPT_LEN}  # not released by a false decode token
            assert gw.active("d1") == {rid: PROMPT_LEN}  # nor counted as held
            assert gw.active("p2") == {} and gw.active("d2") == {}
            assert gw.dispatcher.aborts_sent == 0
            dropped = [r for r in caplog.records
                       if r.name == "gateway.dispatch" and rid in r.getMessage()]
            assert len(dropped) == 7 and all(r.levelno == logging.WARNING for r in dropped)
            prefill.send(FirstToken(rid, 0, 5, None))
            decode.tokens(rid, (1, 6, None), (2, 7, "stop"))
            assert [await next_event(handle) for _ in range(3)] == [
                Event(5, None), Event(6, None), Event(7, "stop")]
            assert handle.done and gw.dispatcher.aborts_sent == 0

    asyncio.run(body())


def test_a_first_token_that_finishes_ends_the_request(tmp_path: Path) -> None:
    async def body() -> None:
        async with gateway(tmp_path) as gw:
            prefill, decode = await pair(gw)
            handle = await submitted(gw, prefill)
            prefill.send(FirstToken(handle.request_id, 0, 2, "stop"))
            assert await next_event(handle) == Event(2, "stop")
            assert handle.done and gw.active("d1") == {} and gw.active("p1") == {}
            await no_more_events(handle)
            assert await prefill.flush() == [] and await decode.quiet() == []
            assert gw.dispatcher.aborts_sent == 0

    asyncio.run(body())


def test_events_for_unknown_or_old_requests_are_not_delivered(tmp_path: Path) -> None:
    """Each is aborted back at the worker that sent it, unless it was that request's last."""
    async def body() -> None:
        async with gateway(tmp_path) as gw:
            prefill, decode = await pair(gw)
            handle = await submitted(gw, prefill)
            rid = handle.request_id
            prefill.send(FirstToken("unknown", 0, 1, None))
            prefill.send(FirstToken(rid, 1, 1, None))  # a later epoch than this request's
            decode.tokens("unknown", (1, 2, "stop"))
            decode.tokens(rid, (1, 2, "stop"), epoch=3)
            decode.send(RequestFailed("unknown", 0, "x"))
            decode.send(RequestFailed(rid, 2, "x"))
            assert await prefill.flush() == [Abort("unknown", 0), Abort(rid, 1)]
            assert await decode.flush() == []
            assert pending(handle) == [] and handle.output.next_index == 0
            prefill.send(FirstToken(rid, 0, 3, None))
            decode.tokens(rid, (1, 4, None))
            assert await next_event(handle) == Event(3, None)
            assert await next_event(handle) == Event(4, None)
            await no_more_events(handle)
            assert not handle.done and rid in gw.dispatcher.requests
            assert gw.dispatcher.aborts_sent == 2

    asyncio.run(body())


def test_tokens_that_crossed_an_abort_are_not_aborted_again(tmp_path: Path) -> None:
    async def body() -> None:
        async with gateway(tmp_path) as gw:
            prefill, decode = await pair(gw)
            handle = await submitted(gw, prefill)
            rid = handle.request_id
            prefill.send(FirstToken(rid, 0, 5, None))
            assert await next_event(handle) == Event(5, None)
            decode.tokens(rid, (1, 6, None))
            assert await next_event(handle) == Event(6, None)
            gw.dispatcher.abort(handle)  # the client went away
            assert await prefill.expect(1) == [Abort(rid, 0)]
            assert await decode.expect(1) == [Abort(rid, 0)]
            assert {("p1", rid), ("d1", rid)} <= set(gw.dispatcher.reaborted)
            # Decode's next steps crossed the abort: it has been told already.
            decode.tokens(rid, (2, 7, None))
            decode.tokens(rid, (3, 8, None), (4, 9, None))
            prefill.send(FirstToken(rid, 0, 5, None))
            assert await decode.flush() == [] and await prefill.flush() == []
            assert gw.dispatcher.aborts_sent == 2
            assert pending(handle) == []

    asyncio.run(body())


def test_a_worker_still_sending_for_an_ended_request_is_aborted_once(tmp_path: Path) -> None:
    """The gateway never aborted it: the request ended by itself, yet a worker goes on."""
    async def body() -> None:
        async with gateway(tmp_path) as gw:
            prefill, decode = await pair(gw)
            handle = await submitted(gw, prefill)
            rid = handle.request_id
            prefill.send(FirstToken(rid, 0, 5, None))
            assert await next_event(handle) == Event(5, None)
            decode.tokens(rid, (1, 6, "length"))
            assert await next_event(handle) == Event(6, "length")
            assert handle.done and gw.dispatcher.aborts_sent == 0
            decode.tokens(rid, (2, 7, None))
            decode.tokens(rid, (3, 8, None), (4, 9, None))
            assert await decode.flush() == [Abort(rid, 0)]
            decode.tokens(rid, (5, 10, None))
            assert await decode.flush() == []  # once per worker and request
            prefill.send(FirstToken(rid, 0, 5, None))  # another worker gets its own once
            prefill.send(FirstToken(rid, 0, 5, None))
            assert await prefill.flush() == [Abort(rid, 0)]
            assert gw.dispatcher.aborts_sent == 2
            assert pending(handle) == []

    asyncio.run(body())


def test_a_final_token_for_an_ended_request_is_not_aborted(tmp_path: Path) -> None:
    async def body() -> None:
        async with gateway(tmp_path) as gw:
            prefill, decode = await pair(gw)
            handle = await submitted(gw, prefill)
            rid = handle.request_id
            prefill.send(FirstToken(rid, 0, 2, "stop"))  # it ends by itself, not aborted
            assert await next_event(handle) == Event(2, "stop")
            decode.tokens(rid, (1, 7, "length"))  # the worker is done with it by itself
            prefill.send(FirstToken(rid, 0, 2, "stop"))
            decode.tokens("never-seen", (4, 7, "stop"))
            assert await decode.flush() == [] and await prefill.flush() == []
            assert gw.dispatcher.aborts_sent == 0
            decode.tokens(rid, (2, 7, None))  # but it still sends: one abort
            assert await decode.flush() == [Abort(rid, 0)]

    asyncio.run(body())


class RecordingControl:
    """A ControlServer stand-in: records what the dispatcher sends."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, Message]] = []

    def send(self, worker_id: str, message: Message) -> None:
        self.sent.append((worker_id, message))


def test_the_memory_of_re_aborts_is_bounded() -> None:
    control = RecordingControl()
    dispatcher = Dispatcher(control, Router(Registry(FP, 30.0, 1, 1)))  # type: ignore[arg-type]
    extra = 10
    for i in range(_REABORT_MEMORY + extra):
        dispatcher.on_message("d1", TokenBatch([TokenEvent(f"r{i}", 0, 1, 1, None)]))
    assert len(dispatcher.reaborted) == _REABORT_MEMORY
    assert control.sent == [("d1", Abort(f"r{i}", 0)) for i in range(_REABORT_MEMORY + extra)]
    control.sent.clear()
    newest = _REABORT_MEMORY + extra - 1
    dispatcher.on_message("d1", TokenBatch([TokenEvent(f"r{newest}", 0, 2, 1, None)]))
    assert control.sent == []  # still remembered
    dispatcher.on_message("d1", TokenBatch([TokenEvent("r0", 0, 2, 1, None)]))
    assert control.sent == [("d1", Abort("r0", 0))]  # the oldest was forgotten
    assert len(dispatcher.reaborted) == _REABORT_MEMORY
    assert dispatcher.aborts_sent == _REABORT_MEMORY + extra + 1


def test_the_gateways_own_aborts_share_that_bounded_memory() -> None:
    control = RecordingControl()
    dispatcher = Dispatcher(control, Router(Registry(FP, 30.0, 1, 1)))  # type: ignore[arg-type]
    handle = RequestHandle("r", 0, TASK, Assignment("p1", "d1"))
    dispatcher.requests["r"] = handle
    dispatcher.abort(handle)
    assert control.sent == [("p1", Abort("r", 0)), ("d1", Abort("r", 0))]
    assert list(dispatcher.reaborted) == [("p1", "r"), ("d1", "r")]
    control.sent.clear()
    dispatcher.on_message("d1", TokenBatch([TokenEvent("r", 0, 1, 1, None)]))
    dispatcher.on_message("p1", FirstToken("r", 0, 1, None))
    assert control.sent == []  # both were told already
    for i in range(_REABORT_MEMORY - 1):  # strays nobody aborted: one Abort each
        dispatcher.on_message("d9", TokenBatch([TokenEvent(f"s{i}", 0, 1, 1, None)]))
    assert len(control.sent) == _REABORT_MEMORY - 1
    assert len(dispatcher.reaborted) == _REABORT_MEMORY
    control.sent.clear()
    dispatcher.on_message("d1", TokenBatch([TokenEvent("r", 0, 2, 1, None)]))
    assert control.sent == []  # still remembered
    dispatcher.on_message("p1", FirstToken("r", 0, 1, None))
    assert control.sent == [("p1", Abort("r", 0))]  # the oldest was forgotten
    assert dispatcher.aborts_sent == 2 + _REABORT_MEMORY - 1 + 1


# -- failures ----------------------------------------------------------------------------------


def test_request_failed_ends_the_handle_with_an_error(tmp_path: Path) -> None:
    async def body() -> None:
        async with gateway(tmp_path) as gw:
            prefill, decode = await pair(gw)
            handle = await submitted(gw, prefill)
            decode.send(RequestFailed(handle.request_id, 0, "KV never arrived at 10.0.0.7"))
            event = await next_event(handle)
            assert event == Event(None, "error", FAILED)  # the worker's reason stays inside
            assert handle.done and not gw.dispatcher.requests
            abort = Abort(handle.request_id, 0)
            assert await decode.flush() == [abort]
            assert await prefill.expect(1) == [abort] and await prefill.quiet() == []
            assert gw.dispatcher.aborts_sent == 2
            assert gw.active("p1") == {} and gw.active("d1") == {}
            decode.tokens(handle.request_id, (1, 1, None))  # sent before it failed
            assert await decode.flush() == []  # the failure's abort said it all
            await no_more_events(handle)
            assert gw.dispatcher.aborts_sent == 2

    asyncio.run(body())


def test_a_failed_kv_hand_off_serves_the_request_again(tmp_path: Path) -> None:
    """Its decode worker could not be reached: the request is not at fault, so it starts over
    under a new epoch (aborted where it was) on another decode worker, until the first one
    heartbeats again."""
    async def body() -> None:
        async with gateway(tmp_path) as gw:
            prefill, decode = await pair(gw)
            handle = await submitted(gw, prefill)
            await gw.worker("d2", "decode", kv_address="tcp://127.0.0.1:7002")
            assert handle.assignment.decode_worker == "d1"
            prefill.send(RequestFailed(handle.request_id, 0, "KV receiver not reachable",
                                       retry=True))
            abort, again = await prefill.expect(2)
            assert abort == Abort(handle.request_id, 0)
            assert isinstance(again, PrefillRequest) and again.epoch == 1
            assert again.decode_worker == "d2"  # not the one it could not reach
            assert await decode.expect(1) == [abort]
            retries = handle.retries
            assert (retries.message_losses, retries.worker_losses, handle.done) == (1, 0, False)
            prefill.send(FirstToken(handle.request_id, 1, 5, None))
            assert await next_event(handle) == Event(5, None)
            assert gw.router.pick_decode() is gw.registry.workers["d2"]
            decode.send(decode.heartbeat())  # alive after all: routed to again
            await until(lambda: not gw.registry.workers["d1"].unreachable, "d1 heard from")
            assert gw.router.pick_decode() is gw.registry.workers["d1"]

    asyncio.run(body())


def test_abort_tells_both_workers_once(tmp_path: Path) -> None:
    async def body() -> None:
        async with gateway(tmp_path) as gw:
            prefill, decode = await pair(gw)
            handle = await submitted(gw, prefill)
            gw.dispatcher.abort(handle)
            gw.dispatcher.abort(handle)  # a no-op
            abort = Abort(handle.request_id, 0)
            assert await prefill.expect(1) == [abort] and await decode.expect(1) == [abort]
            assert await prefill.quiet() == [] and await decode.quiet() == []
            assert gw.dispatcher.aborts_sent == 2 and handle.done
            assert not gw.dispatcher.requests
            assert all(not w.active for w in gw.registry.workers.values())
            decode.tokens(handle.request_id, (1, 1, None))  # crossed the abort
            prefill.send(FirstToken(handle.request_id, 0, 1, None))
            assert await decode.flush() == [] and await prefill.flush() == []  # told already
            assert gw.dispatcher.aborts_sent == 2
            await no_more_events(handle)

    asyncio.run(body())


def test_a_worker_that_stops_heartbeating_fails_its_requests(tmp_path: Path) -> None:
    async def body() -> None:
        async with gateway(tmp_path, heartbeat_timeout_s=0.6) as gw:
            prefill, decode = await pair(gw)
            gw.beating.update(p1=prefill, d1=decode)
            past_prefill = await submitted(gw, prefill)
            prefill.send(FirstToken(past_prefill.request_id, 0, 5, None))
            assert await next_event(past_prefill) == Event(5, None)
            decode.tokens(past_prefill.request_id, (1, 6, None))
            assert await next_event(past_prefill) == Event(6, None)
            stuck = await submitted(gw, prefill)
            del gw.beating["p1"]
            gw.tasks.append(asyncio.create_task(gw.dispatcher.watch_liveness(0.05)))
            abort, again = await decode.expect(2)  # no prefill pool: decode prefills it
            assert abort == Abort(stuck.request_id, 0) and "p1" not in gw.registry.workers
            assert isinstance(again, PrefillRequest) and again.epoch == 1
            assert again.decode_worker == "d1" and stuck.assignment.prefill_worker == "d1"
            assert not past_prefill.done  # it no longer needs the prefill worker
            assert gw.active("d1") == {past_prefill.request_id: PROMPT_LEN + 1,
                                       stuck.request_id: PROMPT_LEN}
            decode.tokens(stuck.request_id, (0, 7, "stop"), epoch=1)
            assert await next_event(stuck) == Event(7, "stop") and stuck.done
            await no_more_events(stuck)
            assert gw.dispatcher.submit(TASK).assignment.prefill_worker == "d1"
            assert gw.router.decisions["local_no_prefill"] == 2

    asyncio.run(body())


def test_a_restarted_prefill_worker_gets_its_unstarted_requests_again(tmp_path: Path) -> None:
    """Lost before its first token, a request goes out again under a new epoch; what the
    workers hold of the old epoch is aborted."""
    async def body() -> None:
        async with gateway(tmp_path) as gw:
            prefill, decode = await pair(gw)
            handle = await submitted(gw, prefill)
            prefill.client.close()
            restarted = await gw.worker("p1", "prefill", instance_id="i1")
            assert await decode.expect(1) == [Abort(handle.request_id, 0)]
            abort, again = await restarted.flush()
            assert abort == Abort(handle.request_id, 0) and isinstance(again, PrefillRequest)
            assert (again.request_id, again.epoch, again.task) == (handle.request_id, 1,
                                                                   handle.task)
            assert not handle.done and gw.dispatcher.resumed == 1
            restarted.send(FirstToken(handle.request_id, 0, 9, None))  # the old epoch: ignored
            restarted.send(FirstToken(handle.request_id, 1, 5, None))
            assert await next_event(handle) == Event(5, None)

    asyncio.run(body())


def test_a_streaming_request_resumes_from_what_the_client_has(tmp_path: Path) -> None:
    """Its decode worker lost, a request is prefilled again from its prompt plus the tokens
    already streamed, and goes on at the next output position: no gap, no repeat."""
    async def body() -> None:
        async with gateway(tmp_path) as gw:
            prefill, decode = await pair(gw)
            handle = await submitted(gw, prefill)
            prefill.send(FirstToken(handle.request_id, 0, 5, None))
            decode.tokens(handle.request_id, (1, 6, None), (2, 7, None))
            assert [await next_event(handle) for _ in range(3)] == [
                Event(5, None), Event(6, None), Event(7, None)]
            decode.client.close()
            fresh = await gw.worker("d1", "decode", instance_id="i1")
            abort, again = await prefill.expect(2)
            assert abort == Abort(handle.request_id, 0) and isinstance(again, PrefillRequest)
            assert again.epoch == 1 and again.decode_worker == "d1"
            assert again.task.prompt_ids == [*TASK.prompt_ids, 5, 6, 7]
            assert again.task.max_tokens == TASK.max_tokens - 3
            prefill.send(FirstToken(handle.request_id, 1, 8, None))
            fresh.tokens(handle.request_id, (1, 9, None), epoch=1)
            assert [await next_event(handle) for _ in range(2)] == [Event(8, None),
                                                                    Event(9, None)]
            assert handle.output.delivered == [5, 6, 7, 8, 9] and gw.dispatcher.resumed == 1

    asyncio.run(body())


def test_a_registering_again_instance_keeps_its_requests(tmp_path: Path) -> None:
    async def body() -> None:
        async with gateway(tmp_path) as gw:
            prefill, _ = await pair(gw)
            handle = await submitted(gw, prefill)
            prefill.send(prefill.registration())  # as after a RegisterAgain
            assert await prefill.expect(1) == [RegisterReply(True, "")]
            assert gw.active("p1") == {handle.request_id: PROMPT_LEN}
            prefill.send(FirstToken(handle.request_id, 0, 5, None))
            assert await next_event(handle) == Event(5, None)
            assert not handle.done and gw.dispatcher.aborts_sent == 0

    asyncio.run(body())


# -- membership --------------------------------------------------------------------------------


def test_leave_removes_the_worker_and_fails_its_requests(tmp_path: Path) -> None:
    async def body() -> None:
        async with gateway(tmp_path) as gw:
            prefill, decode = await pair(gw)
            on_decode = await submitted(gw, prefill)
            prefill.send(FirstToken(on_decode.request_id, 0, 5, None))
            decode.tokens(on_decode.request_id, (1, 6, None))
            assert [await next_event(on_decode) for _ in range(2)] == [
                Event(5, None), Event(6, None)]
            on_prefill = await submitted(gw, prefill)
            prefill.send(Leave("p1", "i0"))
            abort, again = await decode.expect(2)  # resumed: prefilled on the decode worker
            assert abort == Abort(on_prefill.request_id, 0) and "p1" not in gw.registry.workers
            assert isinstance(again, PrefillRequest) and again.epoch == 1
            assert not on_decode.done  # prefill had finished with it
            assert gw.dispatcher.submit(TASK).assignment.prefill_worker == "d1"  # not to the leaver
            prefill.send(prefill.heartbeat())  # a beat that was already on its way
            abort, reply = await prefill.expect(2)
            assert abort == Abort(on_prefill.request_id, 0) and isinstance(reply, RegisterAgain)
            assert await prefill.quiet() == []
            assert "p1" not in gw.registry.workers
            decode.send(Leave("d1", "i0"))
            assert await next_event(on_decode) == Event(None, "error", STOPPED)
            assert await next_event(on_prefill) == Event(None, "error", STOPPED)
            assert gw.registry.workers == {} and gw.dispatcher.requests == {}

    asyncio.run(body())


# -- prompt logprobs ---------------------------------------------------------------------------


def test_a_prompt_to_score_is_prefilled_whole_on_a_decode_worker_and_its_logprobs_kept(
        tmp_path: Path) -> None:
    """Echo with logprobs: the decode worker computes the prompt (every position's logits);
    its PromptLogprobs count only from that worker, for that epoch. Resumed once the client
    has tokens, the request does not ask for them again."""
    async def body() -> None:
        async with gateway(tmp_path) as gw:
            prefill, decode = await pair(gw)
            other = await gw.worker("d2", "decode", kv_address="tcp://127.0.0.1:7002")
            handle = gw.dispatcher.submit(replace(TASK, prompt_logprobs=2))
            assert handle.assignment.prefill_worker == handle.assignment.decode_worker
            on, off = (decode, other) if handle.assignment.decode_worker == "d1" else (
                other, decode)
            (request,) = await on.expect(1)
            assert isinstance(request, PrefillRequest) and request.task.prompt_logprobs == 2
            entries = [PromptLogprob(-1.0, []) for _ in range(PROMPT_LEN - 1)]
            for sender, epoch in ((prefill, 0), (on, 1)):
                sender.send(PromptLogprobs(handle.request_id, epoch, entries[:1]))
            await prefill.flush()
            await on.flush()
            assert handle.prompt_logprobs is None
            on.send(PromptLogprobs(handle.request_id, 0, entries))
            on.tokens(handle.request_id, (0, 5, None))
            assert await next_event(handle) == Event(5, None)
            assert handle.prompt_logprobs == entries
            on.send(Leave(on.worker_id, "i0"))
            await until(lambda: handle.epoch == 1, "the resume")
            sent = [*await prefill.flush(), *await off.flush()]
            (again,) = [m for m in sent if isinstance(m, PrefillRequest)]
            assert again.task.prompt_logprobs is None and again.decode_worker == off.worker_id
            assert again.task.prompt_ids == [*TASK.prompt_ids, 5]

    asyncio.run(body())


# -- waiting for a worker ----------------------------------------------------------------------


def test_a_request_whose_last_decode_worker_died_waits_and_resumes_on_its_restart(
        tmp_path: Path) -> None:
    """With no decode worker left, the request waits (nothing of its old epoch counts), and
    goes on where the client is once a new process registers under the id."""
    async def body() -> None:
        async with gateway(tmp_path, worker_wait_s=30.0) as gw:
            prefill, decode = await pair(gw)
            handle = await submitted(gw, prefill)
            prefill.send(FirstToken(handle.request_id, 0, 5, None))
            assert await next_event(handle) == Event(5, None)
            decode.send(Leave("d1", "i0"))
            assert await prefill.expect(1) == [Abort(handle.request_id, 0)]
            assert set(gw.dispatcher.waiting) == {handle.request_id} and not handle.done
            decode.tokens(handle.request_id, (1, 6, None))  # a straggler of the old epoch
            gw.dispatcher.check_workers()
            await no_more_events(handle)
            fresh = await gw.worker("d1", "decode", instance_id="i1")
            (again,) = await prefill.expect(1)
            assert isinstance(again, PrefillRequest) and again.epoch == 1
            assert again.task.prompt_ids == [*TASK.prompt_ids, 5]
            assert gw.dispatcher.waiting == {} and handle.retries.worker_losses == 1
            prefill.send(FirstToken(handle.request_id, 1, 7, None))
            fresh.tokens(handle.request_id, (1, 8, "length"), epoch=1)
            assert [await next_event(handle) for _ in range(2)] == [
                Event(7, None), Event(8, "length")]
            assert handle.output.delivered == [5, 7, 8] and gw.dispatcher.requests == {}

    asyncio.run(body())


def test_a_hand_off_the_only_decode_worker_missed_waits_until_it_heartbeats(
        tmp_path: Path) -> None:
    """Its KV could not reach the only decode worker (killed, not yet declared dead; or a
    network blip): sending it there again at once would fail the same way, so the request
    waits until that worker heartbeats (or a new one joins), then resumes."""
    async def body() -> None:
        async with gateway(tmp_path, worker_wait_s=30.0) as gw:
            prefill, decode = await pair(gw)
            handle = await submitted(gw, prefill)
            prefill.send(RequestFailed(handle.request_id, 0, "KV receiver not reachable",
                                       retry=True))
            assert await prefill.expect(1) == [Abort(handle.request_id, 0)]
            assert handle.request_id in gw.dispatcher.waiting
            gw.dispatcher.check_workers()
            assert await prefill.quiet() == []  # still unreachable: not sent there again
            decode.send(decode.heartbeat())
            await until(lambda: not gw.registry.workers["d1"].unreachable, "the heartbeat")
            gw.dispatcher.check_workers()
            (again,) = await prefill.expect(1)
            assert isinstance(again, PrefillRequest) and again.epoch == 1
            assert again.decode_worker == "d1" and gw.dispatcher.waiting == {}
            assert handle.retries.message_losses == 1 and not handle.done

    asyncio.run(body())


async def left_waiting(gw: Gateway) -> tuple[FakeWorker, RequestHandle]:
    """A request whose only decode worker left: it waits (its old epoch aborted on prefill)."""
    prefill, decode = await pair(gw)
    handle = await submitted(gw, prefill)
    decode.send(Leave("d1", "i0"))
    assert await prefill.expect(1) == [Abort(handle.request_id, 0)]
    assert set(gw.dispatcher.waiting) == {handle.request_id}
    return prefill, handle


def test_a_waiting_request_fails_when_no_worker_joins_in_time(tmp_path: Path) -> None:
    async def body() -> None:
        async with gateway(tmp_path, worker_wait_s=0.3) as gw:
            _, handle = await left_waiting(gw)
            until = gw.dispatcher.waiting[handle.request_id]
            assert until - time.monotonic() > 0.2  # its wait: 0.3 s from the leave
            gw.tasks.append(asyncio.create_task(gw.dispatcher.watch_liveness(0.02)))
            assert await next_event(handle) == Event(None, "error", NO_WORKER)
            assert time.monotonic() >= until
            assert gw.dispatcher.waiting == {} and gw.dispatcher.requests == {}
            assert gw.active("p1") == {}

    asyncio.run(body())


def test_a_waiting_request_the_client_gave_up_on_is_forgotten(tmp_path: Path) -> None:
    async def body() -> None:
        async with gateway(tmp_path, worker_wait_s=30.0) as gw:
            prefill, handle = await left_waiting(gw)
            gw.dispatcher.abort(handle)
            assert gw.dispatcher.waiting == {} and gw.dispatcher.requests == {}
            assert await prefill.expect(1) == [Abort(handle.request_id, 1)]
            await gw.worker("d1", "decode", instance_id="i1")
            assert await prefill.quiet() == []  # nothing resumed

    asyncio.run(body())


def test_without_a_wait_a_request_with_no_decode_worker_left_fails_at_once(
        tmp_path: Path) -> None:
    async def body() -> None:
        async with gateway(tmp_path, worker_wait_s=0.0) as gw:
            prefill, decode = await pair(gw)
            handle = await submitted(gw, prefill)
            decode.send(Leave("d1", "i0"))
            assert await next_event(handle) == Event(None, "error", STOPPED)
            assert gw.dispatcher.waiting == {}

    asyncio.run(body())


def test_a_cluster_that_never_served_does_not_make_requests_wait(tmp_path: Path) -> None:
    """Before any decode worker has served, a request is refused at once (503), as /health
    says the cluster is starting; a pool that emptied since makes a new request wait."""
    async def body() -> None:
        async with gateway(tmp_path, worker_wait_s=30.0) as gw:
            began = time.monotonic()
            await gw.dispatcher.until_decode_serves()
            assert time.monotonic() - began < 0.05
            _, decode = await pair(gw)
            decode.send(Leave("d1", "i0"))
            await until(lambda: "d1" not in gw.registry.workers, "the leave")
            waiting = asyncio.create_task(gw.dispatcher.until_decode_serves(poll_s=0.01))
            await asyncio.sleep(0.1)
            assert not waiting.done()
            await gw.worker("d1", "decode", instance_id="i1")
            await asyncio.wait_for(waiting, WAIT_S)
            assert gw.dispatcher.submit(TASK).assignment.decode_worker == "d1"

    asyncio.run(body())


def test_a_new_request_waits_no_longer_than_the_wait(tmp_path: Path) -> None:
    async def body() -> None:
        async with gateway(tmp_path, worker_wait_s=0.2) as gw:
            _, decode = await pair(gw)
            decode.send(Leave("d1", "i0"))
            await until(lambda: "d1" not in gw.registry.workers, "the leave")
            began = time.monotonic()
            await gw.dispatcher.until_decode_serves(poll_s=0.01)
            assert 0.2 <= time.monotonic() - began < 1.0
            with pytest.raises(APIError) as refused:
                gw.dispatcher.submit(TASK)
            assert refused.value.status == 503

    asyncio.run(body())


def test_the_wait_counts_from_when_the_pool_emptied_not_from_each_request(
        tmp_path: Path) -> None:
    """A request that comes after the wait has run out since the last decode worker went is
    refused at once: the wait is a restart's window, not each request's."""
    async def body() -> None:
        async with gateway(tmp_path, worker_wait_s=0.3) as gw:
            _, decode = await pair(gw)
            gw.tasks.append(asyncio.create_task(gw.dispatcher.watch_liveness(0.02)))
            decode.send(Leave("d1", "i0"))
            await until(lambda: "d1" not in gw.registry.workers, "the leave")
            await asyncio.sleep(0.5)  # no request meanwhile: the watch notes the empty pool
            began = time.monotonic()
            await gw.dispatcher.until_decode_serves(poll_s=0.01)
            assert time.monotonic() - began < 0.05
            d1 = await gw.worker("d1", "decode", instance_id="i1")
            assert gw.dispatcher.submit(TASK).assignment.decode_worker == "d1"
            await until(lambda: gw.dispatcher.decode_gone_at is None, "serving noted")
            d1.send(Leave("d1", "i1"))  # a second outage has a window of its own
            await until(lambda: "d1" not in gw.registry.workers, "the second leave")
            began = time.monotonic()
            await gw.dispatcher.until_decode_serves(poll_s=0.01)
            assert 0.2 <= time.monotonic() - began < 1.0

    asyncio.run(body())


def test_a_drained_worker_finishes_its_requests_and_leaves_without_a_resume(
        tmp_path: Path) -> None:
    async def body() -> None:
        async with gateway(tmp_path) as gw:
            prefill, decode = await pair(gw)
            handle = await submitted(gw, prefill)
            assert gw.dispatcher.drain("d9", "asked") is None  # not registered
            drained = gw.dispatcher.drain("d1", "asked")
            assert drained is not None and drained.worker_id == "d1"
            assert await decode.expect(1) == [Drain("asked")]
            assert gw.registry.workers["d1"].draining
            with pytest.raises(APIError) as refused:  # no other decode worker for new work
                gw.dispatcher.submit(TASK)
            assert refused.value.status == 503
            prefill.send(FirstToken(handle.request_id, 0, 5, None))
            gw.dispatcher.check_workers()
            assert await decode.flush() == []  # its request is on its way: not yet
            decode.tokens(handle.request_id, (1, 6, "length"))
            assert [await next_event(handle) for _ in range(2)] == [
                Event(5, None), Event(6, "length")]
            gw.dispatcher.check_workers()
            assert await decode.expect(1) == [Drained()]
            decode.send(Leave("d1", "i0"))
            assert await decode.flush() == [] and await prefill.flush() == []
            assert "d1" not in gw.registry.workers and gw.dispatcher.resumed == 0
            assert gw.registry.expected["decode"] == 0

    asyncio.run(body())


def test_a_leave_naming_another_instance_is_ignored(tmp_path: Path) -> None:
    async def body() -> None:
        async with gateway(tmp_path) as gw:
            prefill, decode = await pair(gw)
            handle = await submitted(gw, prefill)
            prefill.send(Leave("p1", "an-old-instance"))
            decode.send(Leave("d9", "i0"))  # a worker that is not registered
            assert await prefill.flush() == [] and await decode.flush() == []
            assert set(gw.registry.workers) == {"p1", "d1"}
            assert not handle.done and pending(handle) == []
            assert gw.active("p1") == {handle.request_id: PROMPT_LEN}
            prefill.send(FirstToken(handle.request_id, 0, 5, None))
            assert await next_event(handle) == Event(5, None)
            assert gw.dispatcher.aborts_sent == 0

    asyncio.run(body())


def test_a_leave_from_another_workers_connection_is_ignored(tmp_path: Path) -> None:
    async def body() -> None:
        async with gateway(tmp_path) as gw:
            prefill, decode = await pair(gw)
            handle = await submitted(gw, prefill)
            stranger = FakeWorker(gw.context, gw.address, "x9", "prefill", "")
            decode.send(Leave("p1", "i0"))  # the right id and instance, the wrong connection
            stranger.send(Leave("p1", "i0"))
            prefill.send(Leave("d1", "i0"))
            for worker in (prefill, decode, stranger):
                assert await worker.flush() == []
            assert set(gw.registry.workers) == {"p1", "d1"}
            assert not handle.done and pending(handle) == []
            assert gw.active("p1") == {handle.request_id: PROMPT_LEN}
            assert gw.active("d1") == {handle.request_id: PROMPT_LEN}
            assert gw.dispatcher.aborts_sent == 0
            prefill.send(Leave("p1", "i0"))  # from its own connection: honoured
            abort, again = await decode.expect(2)  # resumed on the decode worker alone
            assert abort == Abort(handle.request_id, 0) and isinstance(again, PrefillRequest)
            assert set(gw.registry.workers) == {"d1"}

    asyncio.run(body())


def test_a_heartbeat_from_an_unknown_worker_or_instance_gets_register_again(
    tmp_path: Path,
) -> None:
    async def body() -> None:
        async with gateway(tmp_path) as gw:
            prefill, _ = await pair(gw)
            ghost = FakeWorker(gw.context, gw.address, "g1", "decode", "")
            ghost.send(ghost.heartbeat())
            (reply,) = await ghost.expect(1)
            assert isinstance(reply, RegisterAgain)
            assert "g1" not in gw.registry.workers
            stale = Heartbeat("p1", "old-instance", 0, 100, 0, 0)
            prefill.send(stale)
            (reply,) = await prefill.expect(1)
            assert isinstance(reply, RegisterAgain)
            assert gw.registry.workers["p1"].load != stale
            prefill.send(prefill.heartbeat(queued=3))  # the registered instance: no reply
            assert await prefill.quiet() == [] and await ghost.quiet() == []
            assert gw.registry.workers["p1"].load == prefill.heartbeat(queued=3)

    asyncio.run(body())


def test_a_mismatched_worker_is_refused_over_the_wire(tmp_path: Path) -> None:
    async def body() -> None:
        async with gateway(tmp_path) as gw:
            worker = FakeWorker(gw.context, gw.address, "p9", "prefill", "")
            worker.send(worker.registration(fingerprint="other|bfloat16"))
            (reply,) = await worker.expect(1)
            assert isinstance(reply, RegisterReply) and not reply.accepted
            assert "other|bfloat16" in reply.reason and FP in reply.reason
            assert "p9" not in gw.registry.workers

    asyncio.run(body())


def test_a_registration_for_another_id_is_ignored(tmp_path: Path) -> None:
    async def body() -> None:
        async with gateway(tmp_path) as gw:
            impostor = FakeWorker(gw.context, gw.address, "x1", "prefill", "")
            impostor.send(Register("p1", "i0", "prefill", "", FP, 16, 100))
            assert await impostor.quiet() == []
            assert "p1" not in gw.registry.workers and "x1" not in gw.registry.workers

    asyncio.run(body())


class EndlessControl(RecordingControl):
    """A control plane with a backlog that never runs dry: `recv` never has to wait."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.received, self.limit = 0, limit

    async def recv(self) -> tuple[str, Message]:
        self.received += 1
        if self.received > self.limit:
            raise RuntimeError("the backlog starved everything else")
        return "ghost", Heartbeat("ghost", "i0", 0, 0, 0, 0)

    def pending(self) -> bool:
        return True


def test_serve_yields_to_the_event_loop_under_a_backlog() -> None:
    async def body() -> None:
        control = EndlessControl(limit=10_000)
        dispatcher = Dispatcher(control, Router(Registry(FP, 30.0, 1, 1)))  # type: ignore[arg-type]
        task = asyncio.create_task(dispatcher.serve())
        seen = []
        for _ in range(5):
            await asyncio.sleep(0)
            seen.append(control.received)
        assert not task.done(), "serve() ran the whole backlog without yielding"
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        steps = [b - a for a, b in zip([0, *seen[:-1]], seen, strict=True)]
        assert all(0 < step <= 64 for step in steps), steps
        assert len(control.sent) == control.received  # every one was handled
        assert all(m == ("ghost", RegisterAgain("unknown worker or instance"))
                   for m in control.sent)

    asyncio.run(body())


def test_a_token_lost_on_the_way_resumes_the_stream_from_it(tmp_path: Path) -> None:
    """Decode tokens wait behind a first token that never comes: after a second the request
    starts over under a new epoch; reordering shorter than that resumes nothing."""
    async def body() -> None:
        async with gateway(tmp_path) as gw:
            gw.tasks.append(asyncio.create_task(gw.dispatcher.watch_liveness(0.05)))
            prefill, decode = await pair(gw)
            late = await submitted(gw, prefill)
            decode.tokens(late.request_id, (1, 6, None))
            await asyncio.sleep(0.3)
            prefill.send(FirstToken(late.request_id, 0, 5, None))  # late, not lost
            assert [await next_event(late) for _ in range(2)] == [Event(5, None),
                                                                  Event(6, None)]
            lost = await submitted(gw, prefill)
            decode.tokens(lost.request_id, (1, 6, None), (2, 7, None))
            abort, again = await prefill.expect(2)
            assert abort == Abort(lost.request_id, 0) and isinstance(again, PrefillRequest)
            assert again.epoch == 1 and again.task == lost.task
            assert gw.dispatcher.resumed == 1 and late.epoch == 0

    asyncio.run(body())


def test_a_request_no_worker_holds_is_resumed(tmp_path: Path) -> None:
    """A lost PrefillRequest, or a last token lost after decode let the request go: no worker
    holds it, so after a heartbeat timeout it starts over from what the client has."""
    async def body() -> None:
        async with gateway(tmp_path, heartbeat_timeout_s=0.6) as gw:
            prefill, decode = await pair(gw)
            gw.beating.update(p1=prefill, d1=decode)
            gw.tasks.append(asyncio.create_task(gw.dispatcher.watch_liveness(0.05)))
            held, lost = await submitted(gw, prefill), await submitted(gw, prefill)
            for worker in (prefill, decode):  # the PrefillRequest was lost: nobody has it
                worker.forgotten.add(lost.request_id)
            abort, again = await prefill.expect(2)
            prefill.forgotten.clear()
            decode.forgotten.clear()
            assert abort == Abort(lost.request_id, 0)
            assert isinstance(again, PrefillRequest) and again.epoch == 1
            assert again.task == lost.task and held.epoch == 0

            prefill.send(FirstToken(held.request_id, 0, 5, None))
            decode.tokens(held.request_id, (1, 6, None))
            assert [await next_event(held) for _ in range(2)] == [Event(5, None), Event(6, None)]
            decode.forgotten.add(held.request_id)  # it finished; its last token was lost
            abort, again = await prefill.expect(2)
            assert abort == Abort(held.request_id, 0) and isinstance(again, PrefillRequest)
            assert again.task.prompt_ids == [*TASK.prompt_ids, 5, 6]
            assert again.task.max_tokens == TASK.max_tokens - 2
            assert gw.dispatcher.resumed == 2 and not held.done and not lost.done

    asyncio.run(body())


def test_a_worker_that_reads_its_messages_late_keeps_its_requests(tmp_path: Path) -> None:
    """A loop starved of CPU sends no heartbeat for longer than the timeout (its Alive beats
    go on): its requests are not taken for lost before it has sent two heartbeats without
    them, and it holds them when it does report."""
    async def body() -> None:
        async with gateway(tmp_path, heartbeat_timeout_s=0.4) as gw:
            prefill, decode = await pair(gw)
            gw.tasks.append(asyncio.create_task(gw.dispatcher.watch_liveness(0.05)))

            async def alive() -> None:  # their pulse threads beat on
                while True:
                    for worker in (prefill, decode):
                        worker.send(Alive(worker.worker_id, "i0"))
                    await asyncio.sleep(0.05)
            gw.tasks.append(asyncio.create_task(alive()))
            handle = await submitted(gw, prefill)
            await asyncio.sleep(1.0)  # no heartbeat from either: they may not have read it
            assert await prefill.quiet() == [] and gw.dispatcher.resumed == 0
            gw.beating.update(p1=prefill, d1=decode)  # they report again, holding it
            await asyncio.sleep(1.0)
            assert await prefill.quiet() == [] and gw.dispatcher.resumed == 0
            assert not handle.done

    asyncio.run(body())


def test_no_worker_is_judged_while_its_beats_wait_unread(tmp_path: Path) -> None:
    """A gateway behind on reading (a burst, a starved CPU) judges no worker dead on beats it
    has not read; once it has read them, a worker that really went silent is declared dead."""
    async def body() -> None:
        async with gateway(tmp_path, heartbeat_timeout_s=0.4) as gw:
            prefill, decode = await pair(gw)
            serving = gw.tasks[0]
            serving.cancel()  # nothing reads the control socket now
            with contextlib.suppress(asyncio.CancelledError):
                await serving
            for _ in range(12):  # 0.6 s of beats, waiting unread
                for worker in (prefill, decode):
                    worker.send(Alive(worker.worker_id, "i0"))
                await asyncio.sleep(0.05)
            await until(gw.server.pending, "beats waiting")
            watching = asyncio.create_task(gw.dispatcher.watch_liveness(0.05))
            await asyncio.sleep(0.3)
            assert set(gw.registry.workers) == {"p1", "d1"}  # judged on nothing read: no one
            gw.tasks.append(asyncio.create_task(gw.dispatcher.serve()))
            await until(lambda: not gw.server.pending(), "the beats read")
            await until(lambda: not gw.registry.workers, "both declared dead after all")
            watching.cancel()

    asyncio.run(body())


def test_a_decode_worker_that_dies_after_a_failed_hand_off_counts_as_lost(
        tmp_path: Path) -> None:
    """A request whose KV could not reach a decode worker may be what killed it: when that
    worker proves dead, it counts against the request's lost workers, however it resumed
    (or waits for a worker it can reach)."""
    async def body() -> None:
        async with gateway(tmp_path, worker_wait_s=30.0) as gw:
            prefill, decode = await pair(gw)
            handle = await submitted(gw, prefill)
            other = await gw.worker("d2", "decode", kv_address="tcp://127.0.0.1:7002")
            handle.retries.worker_losses = _MAX_RESUMES - 1
            prefill.send(RequestFailed(handle.request_id, 0, "KV receiver not reachable",
                                       retry=True))
            await prefill.expect(2)  # the abort, and the request again (to d2)
            assert handle.assignment.decode_worker == "d2"
            assert set(handle.retries.unreached) == {"d1"}
            decode.send(Leave("d1", "i0"))
            await until(lambda: handle.retries.worker_losses == _MAX_RESUMES, "the loss counted")
            assert not handle.done and not handle.retries.unreached
            prefill.send(RequestFailed(handle.request_id, 1, "KV receiver not reachable",
                                       retry=True))
            assert await prefill.expect(1) == [Abort(handle.request_id, 1)]
            assert handle.request_id in gw.dispatcher.waiting  # d2, the last, is unreachable
            other.send(Leave("d2", "i0"))  # a third worker lost: past the limit
            assert await next_event(handle) == Event(None, "error", STOPPED)

    asyncio.run(body())


def test_a_decode_worker_that_heartbeats_after_a_failed_hand_off_was_not_killed_by_it(
        tmp_path: Path) -> None:
    """Alive after the hand-off failed, the worker was not killed by the request: its later
    loss does not count against the request, which never ran there."""
    async def body() -> None:
        async with gateway(tmp_path) as gw:
            prefill, decode = await pair(gw)
            handle = await submitted(gw, prefill)
            await gw.worker("d2", "decode", kv_address="tcp://127.0.0.1:7002")
            handle.retries.worker_losses = _MAX_RESUMES - 1
            prefill.send(RequestFailed(handle.request_id, 0, "KV receiver not reachable",
                                       retry=True))
            await prefill.expect(2)
            assert handle.assignment.decode_worker == "d2"
            assert set(handle.retries.unreached) == {"d1"}
            decode.send(decode.heartbeat())
            decode.send(Leave("d1", "i0"))
            await decode.flush()
            assert "d1" not in gw.dispatcher.registry.workers
            assert handle.retries.worker_losses == _MAX_RESUMES - 1
            assert not handle.retries.unreached
            assert not handle.done

    asyncio.run(body())


def test_lost_messages_resume_a_request_until_their_own_limit(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each lost first token resumes the request, more times than losing a worker would (a
    lossy channel is not the request's fault); past that limit the request fails."""
    monkeypatch.setattr(dispatch, "_LOST_AFTER_S", 0.05)

    async def body() -> None:
        async with gateway(tmp_path) as gw:
            prefill, decode = await pair(gw)
            gw.tasks.append(asyncio.create_task(gw.dispatcher.watch_liveness(0.02)))
            handle = await submitted(gw, prefill)
            assert _MAX_RECOVERIES > _MAX_RESUMES
            for epoch in range(_MAX_RECOVERIES):
                decode.tokens(handle.request_id, (1, 6, None), epoch=epoch)
                abort, again = await prefill.expect(2)
                assert abort == Abort(handle.request_id, epoch)
                assert isinstance(again, PrefillRequest) and again.epoch == epoch + 1
            assert handle.retries.worker_losses == 0 and not handle.done
            decode.tokens(handle.request_id, (1, 6, None), epoch=_MAX_RECOVERIES)
            assert await next_event(handle) == Event(None, "error", LOST)
            assert handle.done and gw.dispatcher.requests == {}

    asyncio.run(body())


def test_losing_workers_resumes_a_request_twice_whatever_its_lost_messages(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A request whose workers keep dying may be what kills them: after two resumes it fails,
    and the resumes a lost message caused do not count against that."""
    monkeypatch.setattr(dispatch, "_LOST_AFTER_S", 0.05)

    async def body() -> None:
        async with gateway(tmp_path) as gw:
            prefills = [await gw.worker(f"p{i}", "prefill") for i in range(_MAX_RESUMES + 1)]
            decode = await gw.worker("d1", "decode", kv_address="tcp://127.0.0.1:7001")
            gw.tasks.append(asyncio.create_task(gw.dispatcher.watch_liveness(0.02)))
            handle = gw.dispatcher.submit(TASK)
            decode.tokens(handle.request_id, (1, 6, None))  # its first token lost
            await until(lambda: handle.retries.message_losses == 1, "a recovery")
            for resumes in range(_MAX_RESUMES + 1):
                assert handle.retries.worker_losses == resumes
                on = next(p for p in prefills if p.worker_id == handle.assignment.prefill_worker)
                on.send(Leave(on.worker_id, on.instance_id))
                await until(partial(resumed_past, handle, resumes), "a resume")
            assert await next_event(handle) == Event(None, "error", STOPPED)
            assert handle.retries.worker_losses == _MAX_RESUMES
            assert handle.retries.message_losses == 1

    asyncio.run(body())


def test_a_worker_with_work_and_no_progress_is_stalled(tmp_path: Path) -> None:
    """Heartbeats that keep saying `running` with the same progress count: the worker gets
    no new requests, its requests resume elsewhere, and it serves again once it progresses."""
    async def body() -> None:
        async with gateway(tmp_path, heartbeat_timeout_s=30.0, stall_timeout_s=0.5) as gw:
            prefill = await gw.worker("p1", "prefill")
            wedged = await gw.worker("d1", "decode", kv_address="tcp://127.0.0.1:7001",
                                     running=1)
            handle = await submitted(gw, prefill)
            assert handle.assignment.decode_worker == "d1"
            healthy = await gw.worker("d2", "decode", kv_address="tcp://127.0.0.1:7002")
            gw.beating.update(p1=prefill, d1=wedged, d2=healthy)
            gw.tasks.append(asyncio.create_task(gw.dispatcher.watch_liveness(0.05)))
            abort, again = await prefill.expect(2)
            assert abort == Abort(handle.request_id, 0)
            assert isinstance(again, PrefillRequest) and again.decode_worker == "d2"
            assert await wedged.expect(1) == [Abort(handle.request_id, 0)]
            assert gw.registry.workers["d1"].stalled and gw.registry.ready()
            assert all(gw.router.pick_decode() is gw.registry.workers["d2"] for _ in range(3))
            del gw.beating["d2"]
            gw.registry.remove("d2")
            assert not gw.registry.ready()  # the only decode worker left is stalled
            load = gw.registry.workers["d1"].load
            assert load is not None
            wedged.send(replace(load, progress=load.progress + 30))
            await until(lambda: not gw.registry.workers["d1"].stalled, "progress to clear it")
            assert gw.registry.ready()

    asyncio.run(body())


def test_stages_are_observed_once_each_and_kept_for_the_breakdown(tmp_path: Path) -> None:
    """gateway_queue at dispatch; each worker's stages as its token is accepted: not again for
    a duplicate, never for another epoch's; a resumed epoch's stages replace the old ones."""
    async def body() -> None:
        async with gateway(tmp_path) as gw:
            observed: list[tuple[str, float]] = []
            gw.dispatcher.observe_stage = lambda stage, seconds: observed.append((stage, seconds))
            prefill, decode = await pair(gw)
            await gw.worker("d2", "decode", kv_address="tcp://127.0.0.1:7002")
            handle = gw.dispatcher.submit_choices(TASK, 1, time.monotonic() - 0.05, "tp-1")[0]
            (request,) = await prefill.expect(1)
            assert isinstance(request, PrefillRequest) and request.traceparent == "tp-1"
            assert observed[0][0] == "gateway_queue" and observed[0][1] >= 0.05
            rid = handle.request_id
            first = FirstToken(rid, 0, 5, None, stages=[StageTime("prefill_wait", 0.01),
                                                        StageTime("prefill_compute", 0.2)])
            prefill.send(first)
            prefill.send(first)  # a duplicate
            decode.send(TokenBatch([TokenEvent(rid, 3, 1, 6, None,
                                               stages=[StageTime("first_decode", 9.0)])]))
            decode.send(TokenBatch([TokenEvent(rid, 0, 1, 6, None, stages=[
                StageTime("kv_transfer", 0.003), StageTime("first_decode", 0.04)])]))
            assert await next_event(handle) == Event(5, None)
            assert await next_event(handle) == Event(6, None)
            assert observed[1:] == [("prefill_wait", 0.01), ("prefill_compute", 0.2),
                                    ("kv_transfer", 0.003), ("first_decode", 0.04)]
            prefill.send(RequestFailed(rid, 0, "KV receiver not reachable", retry=True))
            await until(lambda: handle.epoch == 1, "the request resumed")
            prefill.send(FirstToken(rid, 1, 7, None,
                                    stages=[StageTime("prefill_compute", 0.3)]))
            assert await next_event(handle) == Event(7, None)
            assert observed[-1] == ("prefill_compute", 0.3)
            stages = handle.timing.stages
            assert stages["prefill_compute"] == 0.3 and stages["first_decode"] == 0.04
            assert handle.timing.resumed == 1 and len(observed) == 6  # gateway_queue once

    asyncio.run(body())


def test_every_route_is_timed_and_every_control_message_counted(tmp_path: Path) -> None:
    async def body() -> None:
        async with gateway(tmp_path) as gw:
            routes: list[float] = []
            kinds: list[str] = []
            gw.dispatcher.observe_route = routes.append
            gw.dispatcher.count_message = kinds.append
            prefill, _ = await pair(gw)
            assert kinds.count("Register") == 2 and "Heartbeat" in kinds
            handle = gw.dispatcher.submit_choices(TASK, 1)[0]
            await prefill.expect(1)
            prefill.send(FirstToken(handle.request_id, 0, 5, None))
            assert await next_event(handle) == Event(5, None)
            assert len(routes) == 1 and 0 < routes[0] < 0.1
            assert "FirstToken" in kinds
    asyncio.run(body())
