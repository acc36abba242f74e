"""The dispatcher over a real ControlServer, with workers as real ControlClients over ipc."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import zmq
import zmq.asyncio

from core.channels import ControlClient, ControlServer
from core.messages import (
    Abort,
    FirstToken,
    GenerationTask,
    Heartbeat,
    Message,
    PrefillRequest,
    Register,
    RegisterReply,
    RequestFailed,
    Sampling,
    TokenBatch,
    TokenEvent,
)
from gateway.dispatch import Dispatcher, Event, RequestHandle
from gateway.errors import APIError
from gateway.registry import Registry

FP = "tiny|float32|2|2|16|16"
WAIT_S = 5.0
TASK = GenerationTask([1, 2, 3, 4, 5], Sampling(seed=1), 8, [2], False)


async def until(condition: Callable[[], bool], what: str = "condition") -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.005)


class FakeWorker:
    """A worker's control side only: a real ControlClient driven from the test."""

    def __init__(self, context: zmq.Context, address: str, worker_id: str, role: str,
                 kv_address: str, instance_id: str = "i0") -> None:
        self.worker_id, self.role, self.instance_id = worker_id, role, instance_id
        self.kv_address = kv_address
        self.client = ControlClient(context, address, worker_id)
        self.inbox: list[Message] = []

    def registration(self, fingerprint: str = FP) -> Register:
        return Register(self.worker_id, self.instance_id, self.role, self.kv_address,
                        fingerprint, 16, 100)

    def heartbeat(self, queued: int = 0, free: int = 100, running: int = 0) -> Heartbeat:
        return Heartbeat(self.worker_id, self.instance_id, queued, free, running, 0)

    def send(self, message: Message) -> None:
        self.client.send(message)

    async def expect(self, count: int) -> list[Message]:
        """The next `count` messages from the gateway."""
        def arrived() -> bool:
            self.inbox += self.client.drain()
            return len(self.inbox) >= count

        await until(arrived, f"{count} messages for {self.worker_id}")
        got, self.inbox = self.inbox[:count], self.inbox[count:]
        return got

    async def quiet(self) -> list[Message]:
        """Anything else that arrives within a short while (expected: nothing)."""
        await asyncio.sleep(0.1)
        self.inbox += self.client.drain()
        got, self.inbox = self.inbox, []
        return got


class Gateway:
    """A dispatcher serving a real ControlServer on ipc, plus helpers to attach workers."""

    def __init__(self, tmp_path: Path, heartbeat_timeout_s: float) -> None:
        self.address = f"ipc://{tmp_path}/ctl"
        self.async_context = zmq.asyncio.Context()
        self.context = zmq.Context()
        self.server = ControlServer(self.async_context, self.address)
        self.registry = Registry(FP, heartbeat_timeout_s, 1, 1)
        self.dispatcher = Dispatcher(self.server, self.registry)
        self.beating: dict[str, FakeWorker] = {}
        self.tasks = [asyncio.create_task(self.dispatcher.serve()),
                      asyncio.create_task(self._beat())]

    async def worker(self, worker_id: str, role: str, queued: int = 0, free: int = 100,
                     kv_address: str = "", instance_id: str = "i0") -> FakeWorker:
        """A registered worker whose first heartbeat the registry has recorded."""
        worker = FakeWorker(self.context, self.address, worker_id, role, kv_address, instance_id)
        worker.send(worker.registration())
        assert await worker.expect(1) == [RegisterReply(True, "")]
        beat = worker.heartbeat(queued, free)
        worker.send(beat)
        await until(lambda: self.registry.workers[worker_id].load == beat, "a heartbeat")
        return worker

    async def _beat(self) -> None:
        """Keep the workers in `beating` alive, as their loops would."""
        while True:
            for worker in list(self.beating.values()):
                load = self.registry.workers.get(worker.worker_id)
                if load is not None and load.load is not None:
                    worker.send(load.load)
            await asyncio.sleep(0.03)

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self.server.close()
        self.async_context.destroy(linger=0)
        self.context.destroy(linger=0)


@contextlib.asynccontextmanager
async def gateway(tmp_path: Path, heartbeat_timeout_s: float = 30.0) -> AsyncIterator[Gateway]:
    gw = Gateway(tmp_path, heartbeat_timeout_s)
    try:
        yield gw
    finally:
        await gw.close()


async def pair(gw: Gateway) -> tuple[FakeWorker, FakeWorker]:
    prefill = await gw.worker("p1", "prefill")
    decode = await gw.worker("d1", "decode", kv_address="tcp://127.0.0.1:7001")
    return prefill, decode


async def submitted(gw: Gateway, prefill: FakeWorker) -> RequestHandle:
    """A submitted request whose PrefillRequest the prefill worker has received."""
    handle = gw.dispatcher.submit(TASK)
    (message,) = await prefill.expect(1)
    assert isinstance(message, PrefillRequest) and message.request_id == handle.request_id
    return handle


async def next_event(handle: RequestHandle) -> Event:
    return await asyncio.wait_for(handle.events.get(), WAIT_S)


async def no_more_events(handle: RequestHandle) -> None:
    await asyncio.sleep(0.1)
    assert handle.events.empty(), f"unexpected {handle.events.get_nowait()}"


def test_submit_sends_a_prefill_request_naming_the_decode_worker(tmp_path: Path) -> None:
    async def body() -> None:
        async with gateway(tmp_path) as gw:
            prefill, decode = await pair(gw)
            handle = gw.dispatcher.submit(TASK)
            assert (handle.prefill_worker, handle.decode_worker, handle.epoch) == ("p1", "d1", 0)
            assert await prefill.expect(1) == [
                PrefillRequest(handle.request_id, 0, TASK, "d1", "tcp://127.0.0.1:7001")]
            assert await decode.quiet() == []
            for worker_id in ("p1", "d1"):
                info = gw.registry.workers[worker_id]
                assert info.active == {handle.request_id} and info.assigned_tokens == 5
            assert gw.dispatcher.requests == {handle.request_id: handle}

    asyncio.run(body())


def test_submit_picks_the_least_loaded_workers(tmp_path: Path) -> None:
    async def body() -> None:
        async with gateway(tmp_path) as gw:
            busy = await gw.worker("p1", "prefill", queued=100)
            idle = await gw.worker("p2", "prefill", queued=0)
            await gw.worker("d1", "decode", free=10, kv_address="tcp://127.0.0.1:7001")
            await gw.worker("d2", "decode", free=90, kv_address="tcp://127.0.0.1:7002")
            first = gw.dispatcher.submit(GenerationTask(list(range(150)), Sampling(), 4, [], False))
            assert await idle.expect(1) == [
                PrefillRequest(first.request_id, 0, first.task, "d2", "tcp://127.0.0.1:7002")]
            second = gw.dispatcher.submit(TASK)  # p2 now has 150 tokens assigned, p1 100 queued
            (message,) = await busy.expect(1)
            assert isinstance(message, PrefillRequest)
            assert message.request_id == second.request_id and message.decode_worker == "d2"
            assert await idle.quiet() == []

    asyncio.run(body())


def test_events_reach_the_handle_in_order_and_it_ends_once(tmp_path: Path) -> None:
    async def body() -> None:
        async with gateway(tmp_path) as gw:
            prefill, decode = await pair(gw)
            handle = await submitted(gw, prefill)
            rid = handle.request_id
            prefill.send(FirstToken(rid, 0, 5, None))
            assert await next_event(handle) == Event(5, None)
            assert gw.registry.workers["p1"].active == set()  # prefill is done with it
            decode.send(TokenBatch([TokenEvent(rid, 0, 6, None), TokenEvent(rid, 0, 7, None)]))
            decode.send(TokenBatch([TokenEvent(rid, 0, 8, "length")]))
            decode.send(TokenBatch([TokenEvent(rid, 0, 9, None)]))  # late: after the end
            decode.send(RequestFailed(rid, 0, "late failure"))
            got = [await next_event(handle) for _ in range(3)]
            assert got == [Event(6, None), Event(7, None), Event(8, "length")]
            assert handle.done and rid not in gw.dispatcher.requests
            await no_more_events(handle)
            assert gw.registry.workers["d1"].active == set()
            gw.dispatcher.abort(handle)  # after the end: nothing to stop
            assert await prefill.quiet() == [] and await decode.quiet() == []
            assert gw.dispatcher.aborts_sent == 0

    asyncio.run(body())


def test_a_first_token_that_finishes_ends_the_request(tmp_path: Path) -> None:
    async def body() -> None:
        async with gateway(tmp_path) as gw:
            prefill, decode = await pair(gw)
            handle = await submitted(gw, prefill)
            prefill.send(FirstToken(handle.request_id, 0, 2, "stop"))
            assert await next_event(handle) == Event(2, "stop")
            assert handle.done and gw.registry.workers["d1"].active == set()
            await no_more_events(handle)
            assert await decode.quiet() == []

    asyncio.run(body())


def test_events_for_unknown_or_old_requests_are_ignored(tmp_path: Path) -> None:
    async def body() -> None:
        async with gateway(tmp_path) as gw:
            prefill, decode = await pair(gw)
            handle = await submitted(gw, prefill)
            rid = handle.request_id
            prefill.send(FirstToken("unknown", 0, 1, None))
            prefill.send(FirstToken(rid, 1, 1, None))  # a later epoch than this request's
            decode.send(TokenBatch([TokenEvent("unknown", 0, 2, "stop"),
                                    TokenEvent(rid, 3, 2, "stop"),
                                    TokenEvent(rid, 0, 3, None)]))
            decode.send(RequestFailed("unknown", 0, "x"))
            decode.send(RequestFailed(rid, 2, "x"))
            decode.send(TokenBatch([TokenEvent(rid, 0, 4, None)]))
            assert await next_event(handle) == Event(3, None)
            assert await next_event(handle) == Event(4, None)
            await no_more_events(handle)
            assert not handle.done and rid in gw.dispatcher.requests

    asyncio.run(body())


def test_request_failed_ends_the_handle_with_an_error(tmp_path: Path) -> None:
    async def body() -> None:
        async with gateway(tmp_path) as gw:
            prefill, decode = await pair(gw)
            handle = await submitted(gw, prefill)
            decode.send(RequestFailed(handle.request_id, 0, "KV never arrived"))
            assert await next_event(handle) == Event(None, "error", "KV never arrived")
            assert handle.done and not gw.dispatcher.requests
            await no_more_events(handle)

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
            decode.send(TokenBatch([TokenEvent(handle.request_id, 0, 1, None)]))
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
            stuck = await submitted(gw, prefill)
            del gw.beating["p1"]
            gw.tasks.append(asyncio.create_task(gw.dispatcher.watch_liveness(0.05)))
            assert await next_event(stuck) == Event(None, "error", "p1 died")
            assert stuck.done and "p1" not in gw.registry.workers
            assert await decode.expect(1) == [Abort(stuck.request_id, 0)]
            assert not past_prefill.done  # it no longer needs the prefill worker
            assert gw.registry.workers["d1"].active == {past_prefill.request_id}
            await no_more_events(stuck)
            with pytest.raises(APIError):
                gw.dispatcher.submit(TASK)  # no prefill worker left

    asyncio.run(body())


def test_a_restarted_worker_fails_the_requests_of_its_old_instance(tmp_path: Path) -> None:
    async def body() -> None:
        async with gateway(tmp_path) as gw:
            prefill, _ = await pair(gw)
            handle = await submitted(gw, prefill)
            prefill.client.close()
            await gw.worker("p1", "prefill", instance_id="i1")
            assert await next_event(handle) == Event(None, "error", "p1 restarted")
            assert handle.done and gw.registry.workers["p1"].instance_id == "i1"

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
            assert gw.registry.workers["p1"].active == set()

    asyncio.run(body())
