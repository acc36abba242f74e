"""Layer-by-layer KV hand-off, in process: a real forward pass on a tiny model streams each
layer through a real sender (ZeroMQ or shared memory) to a real receiver while it runs."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
import zmq

import kvtransfer.sender
from core.config import KVTransferConfig
from core.messages import (
    DecodeRequest,
    FirstToken,
    GenerationTask,
    Message,
    PrefillRequest,
    RequestKey,
    Sampling,
    decode,
)
from engine.kv.allocator import blocks_needed
from engine.model.batch import ForwardBatch
from engine.runner import ModelRunner
from kvtransfer import (
    KVItem,
    KVNotice,
    KVPayload,
    KVReceiver,
    KVSender,
    make_receiver,
    make_sender,
)
from prefill.handoff import LayerStream

WAIT_S = 5.0
BLOCK_SIZE = 4  # small, so prompts span several (scattered) blocks
FINGERPRINT = "tiny|float32"
PROMPTS = {"a": list(range(20, 31)), "b": list(range(40, 45))}  # 11 and 5 tokens
ONE_LAYER = 1  # chunk bytes: every layer goes in a chunk of its own



@dataclass(frozen=True)
class Layer:
    index: int
    k: torch.Tensor
    v: torch.Tensor


Received = Message | Layer  # a notice's message, or a layer's K and V


@pytest.fixture(scope="module")
def runner(tiny_model_dir: Path) -> ModelRunner:
    return ModelRunner(tiny_model_dir, num_blocks=32, block_size=BLOCK_SIZE)


@pytest.fixture
def receiver(context: zmq.Context) -> Iterator[KVReceiver]:
    receiver = make_receiver(context, "tcp://127.0.0.1:*")
    yield receiver
    receiver.close()


@pytest.fixture(params=["zmq", "shm"])
def sender(request: pytest.FixtureRequest, context: zmq.Context) -> Iterator[KVSender]:
    sender = make_sender(context, KVTransferConfig(backend=request.param, buffer_mb=1))
    assert sender.backend == request.param
    yield sender
    sender.close()


class Inbox:
    """What the receiver handed over, per request, in order; borrowed chunks are copied."""

    def __init__(self, receiver: KVReceiver) -> None:
        self.receiver = receiver
        self.items: dict[str, list[Received]] = {}

    def _keep(self, item: KVItem) -> None:
        entry: Received
        if isinstance(item, KVNotice):
            entry = decode(item.meta)
        else:
            assert isinstance(item, KVPayload), f"unexpected {item!r}"
            header = item.header
            assert header.layer_end == header.layer_start + 1
            entry = Layer(header.layer_start, item.k.clone(), item.v.clone())
        request_id, epoch = item.key
        assert epoch == 0
        self.items.setdefault(request_id, []).append(entry)

    def drain_until(self, done: Callable[[], bool]) -> None:
        deadline = time.monotonic() + WAIT_S
        self.receiver.drain(self._keep)
        while not done():
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            assert remaining_ms > 0, f"timed out; got {self.summary()}"
            self.receiver.fileno_socket().poll(min(remaining_ms, 50))
            self.receiver.drain(self._keep)

    def layers_of(self, request_id: str) -> list[int]:
        return [e.index for e in self.items.get(request_id, []) if isinstance(e, Layer)]

    def summary(self) -> dict[str, list[str]]:
        """Per request, the kind of each arrival in order."""
        return {r: [type(e).__name__ for e in items] for r, items in self.items.items()}


def prefill_request(request_id: str, address: str) -> PrefillRequest:
    task = GenerationTask(PROMPTS[request_id], Sampling(temperature=0.0), 16, [], True)
    return PrefillRequest(request_id, 0, task, "decode-0", address)


def allocate(runner: ModelRunner, requests: list[PrefillRequest]) -> list[list[int]]:
    """Block tables whose blocks interleave, so a table read in the wrong order shows."""
    counts = [blocks_needed(len(r.task.prompt_ids), BLOCK_SIZE) for r in requests]
    blocks = runner.allocator.allocate(sum(counts))
    tables: list[list[int]] = [[] for _ in requests]
    index = 0
    while any(len(t) < c for t, c in zip(tables, counts, strict=True)):
        for table, count in zip(tables, counts, strict=True):
            if len(table) < count:
                table.append(blocks[index])
                index += 1
    return tables


def open_stream(sender: KVSender, runner: ModelRunner, requests: list[PrefillRequest],
                tables: list[list[int]], chunk_bytes: int) -> LayerStream:
    """A stream that announced the requests and expects their whole prompts in one step."""
    stream = LayerStream(sender, runner.cache, FINGERPRINT, chunk_bytes)
    for request, table in zip(requests, tables, strict=True):
        stream.start(request, table)
    stream.begin_step({r.key: len(r.task.prompt_ids) for r in requests})
    return stream


def run_prefill(runner: ModelRunner, stream: LayerStream, requests: list[PrefillRequest],
                tables: list[list[int]], hook: Callable[[int], None]) -> list[FirstToken]:
    logits = runner.forward(ForwardBatch(
        token_ids=[r.task.prompt_ids for r in requests],
        start_positions=[0] * len(requests),
        block_tables=tables,
    ), layer_hook=hook)
    tokens = logits.argmax(dim=-1).tolist()
    return [FirstToken(r.request_id, 0, t, None) for r, t in zip(requests, tokens, strict=True)]


def test_each_layer_streams_during_the_forward_then_the_first_token(
        runner: ModelRunner, sender: KVSender, receiver: KVReceiver) -> None:
    num_layers = runner.spec.num_layers
    requests = [prefill_request(r, receiver.address) for r in PROMPTS]
    tables = allocate(runner, requests)
    inbox = Inbox(receiver)
    stream = open_stream(sender, runner, requests, tables, ONE_LAYER)
    seen_at_hook: list[dict[str, list[int]]] = []

    def hook(layer: int) -> None:
        # Before this layer goes out, the previous ones have already arrived: mid-forward.
        inbox.drain_until(lambda: all(inbox.layers_of(r) == list(range(layer))
                                      for r in PROMPTS))
        seen_at_hook.append({r: inbox.layers_of(r) for r in PROMPTS})
        stream.send_layer(layer)

    try:
        firsts = run_prefill(runner, stream, requests, tables, hook)
        assert len(seen_at_hook) == num_layers
        assert seen_at_hook[-1] == {r: list(range(num_layers - 1)) for r in PROMPTS}
        for first in firsts:
            assert stream.finish(first) is None
        inbox.drain_until(lambda: all(len(inbox.items.get(r, [])) == num_layers + 2
                                      for r in PROMPTS))

        for request, table, first in zip(requests, tables, firsts, strict=True):
            items = inbox.items[request.request_id]
            assert inbox.summary()[request.request_id] == [
                "DecodeRequest", *["Layer"] * num_layers, "FirstToken"]
            assert items[0] == DecodeRequest(request.request_id, 0, request.task, FINGERPRINT)
            assert items[-1] == first
            tokens = len(request.task.prompt_ids)
            k_cache, v_cache = runner.cache.read(table, tokens)
            for layer, chunk in enumerate(items[1:-1]):
                assert isinstance(chunk, Layer) and chunk.index == layer
                shape = (1, tokens, runner.spec.num_kv_heads, runner.spec.head_dim)
                assert chunk.k.shape == chunk.v.shape == shape
                assert torch.equal(chunk.k[0], k_cache[layer])
                assert torch.equal(chunk.v[0], v_cache[layer])
        assert sender.counters.chunks == num_layers * len(requests)
        assert sender.counters.failures == 0
        assert getattr(sender, "inline_fallbacks", 0) == 0  # shm placed every chunk
    finally:
        for table in tables:
            runner.allocator.free(table)


def test_kv_for_a_decode_worker_on_another_host_goes_inline(
        runner: ModelRunner, context: zmq.Context, receiver: KVReceiver) -> None:
    """Shared memory reaches a decode worker on this host only: the KV for one on another
    goes in the messages, over the same socket, and counts as zmq."""
    num_layers = runner.spec.num_layers
    sender = make_sender(context, KVTransferConfig(backend="shm", buffer_mb=1))
    near = replace(prefill_request("a", receiver.address), decode_host="host-a")
    far = replace(prefill_request("b", receiver.address), decode_host="host-b")
    tables = allocate(runner, [near, far])
    placed: dict[str, list[bool]] = {"a": [], "b": []}

    def keep(item: KVItem) -> None:
        if isinstance(item, KVPayload):
            placed[item.header.request_id].append(item.header.placement is not None)

    try:
        stream = LayerStream(sender, runner.cache, FINGERPRINT, ONE_LAYER, "host-a")
        for request, table in zip([near, far], tables, strict=True):
            stream.start(request, table)
        stream.begin_step({r.key: len(r.task.prompt_ids) for r in (near, far)})
        for first in run_prefill(runner, stream, [near, far], tables, stream.send_layer):
            assert stream.finish(first) is None
        deadline = time.monotonic() + WAIT_S
        while sum(map(len, placed.values())) < 2 * num_layers:
            assert time.monotonic() < deadline, placed
            receiver.fileno_socket().poll(50)
            receiver.drain(keep)
        assert placed == {"a": [True] * num_layers, "b": [False] * num_layers}
        assert {backend: c.chunks for backend, c in sender.totals()} == {
            "shm": num_layers, "zmq": num_layers}
    finally:
        sender.close()
        for table in tables:
            runner.allocator.free(table)


def test_an_unreachable_decode_worker_fails_only_its_request(
        runner: ModelRunner, sender: KVSender, receiver: KVReceiver,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kvtransfer.sender, "_CONNECT_WAIT_MS", 200)
    num_layers = runner.spec.num_layers
    nowhere = f"tcp://127.0.0.1:{free_port()}"
    requests = [prefill_request("a", nowhere), prefill_request("b", receiver.address)]
    tables = allocate(runner, requests)
    inbox = Inbox(receiver)
    try:
        stream = open_stream(sender, runner, requests, tables, ONE_LAYER)
        assert list(stream.broken()) == [("a", 0)]  # its notice found no receiver
        stream.abort(RequestKey("a", 0))
        assert stream.broken() == {}  # an aborted request is not one to serve again
        firsts = run_prefill(runner, stream, requests, tables, stream.send_layer)
        failure = stream.finish(firsts[0])
        assert failure is not None and nowhere in failure
        assert stream.finish(firsts[1]) is None
        assert stream.finish(FirstToken("not in this batch", 0, 1, None)) is None
        inbox.drain_until(lambda: len(inbox.items.get("b", [])) == num_layers + 2)
        assert inbox.summary() == {"b": ["DecodeRequest", *["Layer"] * num_layers, "FirstToken"]}
        assert sender.counters.failures == 1  # it gave up on the request at once
        assert sender.counters.chunks == num_layers
    finally:
        for table in tables:
            runner.allocator.free(table)


def test_a_decode_worker_lost_mid_stream_costs_one_failed_send(
        runner: ModelRunner, sender: KVSender, receiver: KVReceiver, context: zmq.Context,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kvtransfer.sender, "_CONNECT_WAIT_MS", 200)
    num_layers = runner.spec.num_layers
    doomed = make_receiver(context, "tcp://127.0.0.1:*")
    requests = [prefill_request("a", doomed.address), prefill_request("b", receiver.address)]
    tables = allocate(runner, requests)
    inbox = Inbox(receiver)
    try:
        stream = open_stream(sender, runner, requests, tables, ONE_LAYER)
        doomed.close()  # after its notice: the first layer finds it gone
        gone_by = time.monotonic() + WAIT_S
        while sender.sockets[doomed.address].poll(0, zmq.POLLOUT):
            assert time.monotonic() < gone_by, "the sender did not notice the receiver leave"
            time.sleep(0.01)
        firsts = run_prefill(runner, stream, requests, tables, stream.send_layer)
        failure = stream.finish(firsts[0])
        assert failure is not None and doomed.address in failure
        assert stream.finish(firsts[1]) is None
        inbox.drain_until(lambda: len(inbox.items.get("b", [])) == num_layers + 2)
        assert inbox.summary() == {"b": ["DecodeRequest", *["Layer"] * num_layers, "FirstToken"]}
        # Its first failed send marked the request: no later layer, nor its first token, waited.
        assert sender.counters.failures == 1
        assert sender.counters.chunks == num_layers
    finally:
        for table in tables:
            runner.allocator.free(table)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_short_prompts_group_layers_into_chunks_of_about_chunk_bytes(
        make_tiny_model: Callable[..., Path], sender: KVSender, receiver: KVReceiver) -> None:
    runner = ModelRunner(make_tiny_model(num_hidden_layers=5), num_blocks=32,
                         block_size=BLOCK_SIZE)
    requests = [prefill_request(r, receiver.address) for r in PROMPTS]
    tables = allocate(runner, requests)
    bytes_per_layer_a = len(PROMPTS["a"]) * runner.cache.bytes_per_token // 5
    stream = open_stream(sender, runner, requests, tables, 2 * bytes_per_layer_a)
    chunks: dict[str, list[tuple[int, int]]] = {}

    def keep(item: KVItem) -> None:
        if isinstance(item, KVPayload):
            header = item.header
            chunks.setdefault(header.request_id, []).append((header.layer_start,
                                                             header.layer_end))
            k, v = runner.cache.read_layers(header.layer_start, header.layer_end,
                                            tables[0 if header.request_id == "a" else 1],
                                            header.num_tokens)
            assert torch.equal(item.k, k) and torch.equal(item.v, v)

    firsts = run_prefill(runner, stream, requests, tables, stream.send_layer)
    assert all(stream.finish(first) is None for first in firsts)
    deadline = time.monotonic() + WAIT_S
    while sum(map(len, chunks.values())) < 5 and time.monotonic() < deadline:
        receiver.fileno_socket().poll(50)
        receiver.drain(keep)
    # 11 tokens: two layers a chunk, the last layer alone; 5 tokens: four layers, then one.
    assert chunks == {"a": [(0, 2), (2, 4), (4, 5)], "b": [(0, 4), (4, 5)]}


def test_a_prompt_in_two_chunks_streams_each_chunk_during_its_own_forward(
        runner: ModelRunner, sender: KVSender, receiver: KVReceiver) -> None:
    num_layers = runner.spec.num_layers
    (request,) = requests = [prefill_request("a", receiver.address)]  # 11 tokens: 6, then 5
    tables = allocate(runner, requests)
    key = request.key
    got: list[tuple[str, int, int, int]] = []  # (kind, token start, tokens, first layer)

    def keep(item: KVItem) -> None:
        if isinstance(item, KVNotice):
            got.append((type(decode(item.meta)).__name__, 0, 0, 0))
        else:
            assert isinstance(item, KVPayload)
            h = item.header
            got.append(("KV", h.token_start, h.num_tokens, h.layer_start))
            k, v = runner.cache.read_layers(h.layer_start, h.layer_end, tables[0],
                                            h.token_start + h.num_tokens, h.token_start)
            assert torch.equal(item.k, k) and torch.equal(item.v, v)

    def drain() -> None:
        deadline = time.monotonic() + 0.3
        while time.monotonic() < deadline:
            receiver.fileno_socket().poll(50)
            receiver.drain(keep)

    try:
        stream = LayerStream(sender, runner.cache, FINGERPRINT, ONE_LAYER)
        stream.start(request, tables[0])
        for start, end in ((0, 6), (6, 11)):
            stream.begin_step({key: end})
            logits = runner.forward(ForwardBatch([request.task.prompt_ids[start:end]], [start],
                                                 tables), layer_hook=stream.send_layer)
            drain()
            assert got[-1] == ("KV", start, end - start, num_layers - 1)  # all in, mid-prompt
        first = FirstToken("a", 0, int(logits.argmax(dim=-1)[0]), None)
        assert stream.finish(first) is None and stream.outgoing == {}
        drain()
        layers = [("KV", s, n, layer) for s, n in ((0, 6), (6, 5)) for layer in range(num_layers)]
        assert got == [("DecodeRequest", 0, 0, 0), *layers, ("FirstToken", 0, 0, 0)]
    finally:
        runner.allocator.free(tables[0])
