"""Control channels over ipc: ROUTER (asyncio) <-> DEALER (blocking), malformed frames dropped."""

from __future__ import annotations

import asyncio
import contextlib
import pickle
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest
import zmq
import zmq.asyncio

from core.channels import ControlClient, ControlServer
from core.curve import CurveKeys, generate, load
from core.messages import Abort, Heartbeat, Message, RegisterReply, encode

WAIT_S = 5.0


@pytest.fixture
def sync_context() -> Iterator[zmq.Context]:
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def address(tmp_path: Path) -> str:
    return f"ipc://{tmp_path}/ctl"


async def recv(server: ControlServer) -> tuple[str, Message]:
    return await asyncio.wait_for(server.recv(), WAIT_S)


async def taken_until(client: ControlClient, count: int) -> list[Message]:
    """Poll the blocking client from the event loop until `count` messages arrived."""
    messages: list[Message] = []
    deadline = time.monotonic() + WAIT_S
    while len(messages) < count:
        assert time.monotonic() < deadline, f"only {messages} arrived"
        messages += client.take_waiting()
        await asyncio.sleep(0.005)
    return messages


async def settle(client: ControlClient) -> list[Message]:
    """Whatever else arrives within a short while (expected: nothing)."""
    await asyncio.sleep(0.1)
    return client.take_waiting()


def run_with_server(
    tmp_path: Path, body: Callable[[ControlServer], Awaitable[None]],
    keys: CurveKeys | None = None,
) -> None:
    async def main() -> None:
        context = zmq.asyncio.Context()
        server = ControlServer(context, address(tmp_path), keys)
        watching = asyncio.create_task(server.watch_rejections())
        try:
            await body(server)
        finally:
            watching.cancel()
            server.close()
            context.destroy(linger=0)

    asyncio.run(main())


def heartbeat(worker_id: str, queued: int = 0) -> Heartbeat:
    return Heartbeat(worker_id, "inst", queued, 10, 0, 0)


def test_messages_flow_both_ways_by_worker_id(
    tmp_path: Path, sync_context: zmq.Context
) -> None:
    async def body(server: ControlServer) -> None:
        clients = {w: ControlClient(sync_context, address(tmp_path), w) for w in ("w1", "w2")}
        for worker_id, client in clients.items():
            client.send(heartbeat(worker_id))
        received = dict([await recv(server), await recv(server)])
        assert received == {w: heartbeat(w) for w in clients}
        server.send("w2", Abort("for-w2", 1))
        server.send("w1", Abort("for-w1", 0))
        server.send("w1", RegisterReply(True, ""))
        assert await taken_until(clients["w1"], 2) == [Abort("for-w1", 0), RegisterReply(True, "")]
        assert await taken_until(clients["w2"], 1) == [Abort("for-w2", 1)]
        assert await settle(clients["w1"]) == [] and await settle(clients["w2"]) == []
        assert server.dropped == 0 and all(c.dropped == 0 for c in clients.values())

    run_with_server(tmp_path, body)


def test_many_messages_keep_their_order(tmp_path: Path, sync_context: zmq.Context) -> None:
    async def body(server: ControlServer) -> None:
        client = ControlClient(sync_context, address(tmp_path), "w1")
        for i in range(200):
            client.send(heartbeat("w1", i))
        got = [await recv(server) for _ in range(200)]
        assert [m.queued_tokens for _, m in got] == list(range(200))  # type: ignore[union-attr]
        for i in range(200):
            server.send("w1", Abort("r", i))
        assert [m.epoch for m in await taken_until(client, 200)] == list(range(200))  # type: ignore[union-attr]

    run_with_server(tmp_path, body)


def test_sending_to_an_unknown_worker_is_dropped_quietly(
    tmp_path: Path, sync_context: zmq.Context
) -> None:
    async def body(server: ControlServer) -> None:
        client = ControlClient(sync_context, address(tmp_path), "w1")
        client.send(heartbeat("w1"))
        assert (await recv(server))[0] == "w1"
        server.send("nobody", Abort("r", 0))  # neither raises nor reaches anyone
        server.send("w1", Abort("r", 1))
        assert [m.epoch for m in await taken_until(client, 1)] == [1]  # type: ignore[union-attr]
        assert server.dropped == 0
        client.close()

    run_with_server(tmp_path, body)


def test_server_drops_and_counts_malformed_frames(
    tmp_path: Path, sync_context: zmq.Context
) -> None:
    async def body(server: ControlServer) -> None:
        raw = sync_context.socket(zmq.DEALER)
        raw.setsockopt(zmq.IDENTITY, b"w1")
        raw.connect(address(tmp_path))
        raw.send(b"garbage")
        raw.send(b"")
        raw.send(pickle.dumps(Abort("r", 0)))
        raw.send_multipart([encode(Abort("r", 0)), encode(Abort("r", 1))])  # 3 frames at ROUTER
        raw.send(encode(Abort("r", 0))[:-1])
        raw.send(encode(heartbeat("w1")))
        assert await recv(server) == ("w1", heartbeat("w1"))
        assert server.dropped == 5
        raw.close(linger=0)

    run_with_server(tmp_path, body)


def test_server_drops_a_non_utf8_identity(tmp_path: Path, sync_context: zmq.Context) -> None:
    async def body(server: ControlServer) -> None:
        bad = sync_context.socket(zmq.DEALER)
        bad.setsockopt(zmq.IDENTITY, b"\xff\xfe")
        bad.connect(address(tmp_path))
        bad.send(encode(heartbeat("w1")))
        await asyncio.sleep(0.1)
        good = ControlClient(sync_context, address(tmp_path), "w2")
        good.send(heartbeat("w2"))
        assert await recv(server) == ("w2", heartbeat("w2"))
        assert server.dropped == 1
        bad.close(linger=0)

    run_with_server(tmp_path, body)


def test_client_drops_and_counts_malformed_frames(
    tmp_path: Path, sync_context: zmq.Context
) -> None:
    async def body(server: ControlServer) -> None:
        client = ControlClient(sync_context, address(tmp_path), "w1")
        client.send(heartbeat("w1"))
        await recv(server)  # the ROUTER now knows w1
        raw = server.socket
        await raw.send_multipart([b"w1", b"garbage"])
        await raw.send_multipart([b"w1", b""])
        await raw.send_multipart([b"w1", pickle.dumps(Abort("r", 0))])
        await raw.send_multipart([b"w1", encode(Abort("r", 0)), encode(Abort("r", 1))])
        await raw.send_multipart([b"w1", b"\x93\x07\xa1r"])  # a field short
        server.send("w1", Abort("good", 3))
        assert await taken_until(client, 1) == [Abort("good", 3)]
        assert client.dropped == 5
        assert await settle(client) == []

    run_with_server(tmp_path, body)


def test_a_restarted_worker_takes_over_its_id(tmp_path: Path, sync_context: zmq.Context) -> None:
    async def body(server: ControlServer) -> None:
        old = ControlClient(sync_context, address(tmp_path), "w1")
        old.send(heartbeat("w1", 1))
        await recv(server)
        old.close()
        new = ControlClient(sync_context, address(tmp_path), "w1")
        new.send(heartbeat("w1", 2))
        assert await recv(server) == ("w1", heartbeat("w1", 2))
        server.send("w1", Abort("r", 0))
        assert await taken_until(new, 1) == [Abort("r", 0)]

    run_with_server(tmp_path, body)


# --- CURVE -----------------------------------------------------------------------------------


@pytest.fixture
def keys(tmp_path: Path) -> CurveKeys:
    generate(tmp_path / "keys")
    return load(tmp_path / "keys")


def test_with_curve_the_clusters_workers_talk_both_ways(
    tmp_path: Path, sync_context: zmq.Context, keys: CurveKeys
) -> None:
    async def body(server: ControlServer) -> None:
        client = ControlClient(sync_context, address(tmp_path), "w1", keys)
        client.send(heartbeat("w1"))
        assert await recv(server) == ("w1", heartbeat("w1"))
        server.send("w1", Abort("r", 0))
        assert await taken_until(client, 1) == [Abort("r", 0)]
        await asyncio.sleep(0.1)
        assert server.rejected_peers == 0

    run_with_server(tmp_path, body, keys)


def test_with_curve_peers_without_the_keys_get_nothing_processed_and_are_counted(
    tmp_path: Path, sync_context: zmq.Context, keys: CurveKeys
) -> None:
    stranger_keys = CurveKeys(keys.server_public, b"", *zmq.curve_keypair(), frozenset())

    async def body(server: ControlServer) -> None:
        plain = ControlClient(sync_context, address(tmp_path), "plain")
        stranger = ControlClient(sync_context, address(tmp_path), "stranger", stranger_keys)
        for client in (plain, stranger):
            # Not blocking: after a refused handshake a DEALER may have no pipe to queue on.
            for frame in (encode(heartbeat(client.socket.getsockopt(zmq.IDENTITY).decode())),
                          pickle.dumps(Abort("r", 0))):
                with contextlib.suppress(zmq.Again):
                    client.socket.send(frame, flags=zmq.NOBLOCK)
        deadline = time.monotonic() + WAIT_S
        while server.rejected_peers < 2:
            assert time.monotonic() < deadline, f"{server.rejected_peers} rejected"
            await asyncio.sleep(0.02)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(server.recv(), 0.3)
        assert server.dropped == 0  # nothing reached the socket to be dropped
        good = ControlClient(sync_context, address(tmp_path), "w1", keys)
        good.send(heartbeat("w1"))
        assert await recv(server) == ("w1", heartbeat("w1"))
        for client in (plain, stranger, good):
            client.close()

    run_with_server(tmp_path, body, keys)


def test_without_curve_nothing_is_counted(tmp_path: Path, sync_context: zmq.Context) -> None:
    async def body(server: ControlServer) -> None:
        client = ControlClient(sync_context, address(tmp_path), "w1")
        client.send(heartbeat("w1"))
        assert await recv(server) == ("w1", heartbeat("w1"))
        assert server.curve is None and server.rejected_peers == 0

    run_with_server(tmp_path, body)
