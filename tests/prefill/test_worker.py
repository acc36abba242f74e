"""The prefill worker's step in process on a tiny model: aborts stop a batch between layers."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import zmq
from transformers import AutoTokenizer

import kvtransfer.sender
from core.config import load_config
from core.messages import (
    JSON_OBJECT,
    Abort,
    DecodeRequest,
    FirstToken,
    GenerationTask,
    Grammar,
    Heartbeat,
    Held,
    Message,
    PrefillRequest,
    RequestFailed,
    Sampling,
    decode,
    encode,
)
from engine.model.batch import ForwardBatch
from engine.model.chunk_cost import TOKENS_ONLY, ChunkCost
from engine.runner import ModelRunner
from engine.weights.tokenizer import decode_text
from kvtransfer import KVItem, KVNotice, KVPayload, KVReceiver, make_receiver
from prefill.worker import PrefillWorker
from tests.control import sent_to_gateway
from tests.reference import is_hidden_state, last_hidden_state

LAYERS = 6
WAIT_S = 5.0
GRAMMAR_WAIT_S = 120.0  # the vocabulary tables, on a loaded machine

pytestmark = pytest.mark.usefixtures("shared_grammar_tables")


@pytest.fixture
def setup(make_tiny_model: Callable[..., Path], tmp_path: Path,
          ) -> Iterator[tuple[PrefillWorker, zmq.Socket, KVReceiver]]:
    control = f"ipc://{tmp_path}/control.sock"
    config = load_config(None, {"gateway.control_address": control,
                                "kv_transfer.backend": "zmq", "kv_transfer.chunk_mb": "0.0001"})
    gateway: zmq.Socket = zmq.Context.instance().socket(zmq.ROUTER)
    gateway.bind(control)
    runner = ModelRunner(make_tiny_model(num_hidden_layers=LAYERS), num_blocks=64, block_size=16)
    worker = PrefillWorker("prefill-0", config, runner)
    worker.control.send(Abort("hello", 0))  # so the gateway's ROUTER knows the worker
    gateway.recv_multipart()
    receiver = make_receiver(worker.context, "tcp://127.0.0.1:*")
    yield worker, gateway, receiver
    receiver.close()
    worker.close()
    gateway.close(linger=0)


def request(request_id: str, address: str) -> PrefillRequest:
    task = GenerationTask(list(range(10, 40)), Sampling(temperature=0.0), 16, [], True)
    return PrefillRequest(request_id, 0, task, "decode-0", address)


def to_worker(gateway: zmq.Socket, message: Message) -> None:
    gateway.send_multipart([b"prefill-0", encode(message)])


def received(receiver: KVReceiver) -> dict[str, list[str]]:
    """What reached decode, per request: notices by type, chunks by first layer."""
    got: dict[str, list[str]] = {}

    def keep(item: KVItem) -> None:
        if isinstance(item, KVNotice):
            entry = type(decode(item.meta)).__name__
        else:
            assert isinstance(item, KVPayload)
            entry = f"layer {item.header.layer_start}"
        got.setdefault(item.key[0], []).append(entry)
    deadline = time.monotonic() + 0.5
    while time.monotonic() < deadline:
        receiver.fileno_socket().poll(50)
        receiver.drain(keep)
    return got


def abort_at_layer(worker: PrefillWorker, gateway: zmq.Socket, layer: int,
                   aborts: list[Abort]) -> None:
    """Have the gateway's aborts arrive while the model computes layer `layer`."""
    forward = worker.runner.forward

    def hooked(batch, layer_hook=None):
        def hook(index: int) -> None:
            if index == layer:
                for abort in aborts:
                    to_worker(gateway, abort)
                time.sleep(0.05)  # let them land
            assert layer_hook is not None
            layer_hook(index)
        return forward(batch, layer_hook=hook)
    worker.runner.forward = hooked  # type: ignore[method-assign]


def queue(worker: PrefillWorker, gateway: zmq.Socket, receiver: KVReceiver,
          *request_ids: str) -> None:
    """The gateway sends the requests; the worker takes them into its queue."""
    for request_id in request_ids:
        to_worker(gateway, request(request_id, receiver.address))
    time.sleep(0.1)
    worker.take_control()


def test_aborting_the_whole_batch_stops_the_forward_and_frees_its_blocks(setup) -> None:
    worker, gateway, receiver = setup
    free = worker.cache.num_available
    queue(worker, gateway, receiver, "a", "b")
    abort_at_layer(worker, gateway, 2, [Abort("a", 0), Abort("b", 0)])
    assert worker.step()
    assert worker.cache.num_available == free
    assert not [m for m in sent_to_gateway(worker, gateway) if isinstance(m, FirstToken)]
    sent = received(receiver)
    # Layers 0 and 1 went out; the aborts arrived after layer 2 was computed: nothing more.
    assert sent == {r: ["DecodeRequest", "layer 0", "layer 1"] for r in ("a", "b")}


def test_aborting_one_request_stops_only_its_stream(setup) -> None:
    worker, gateway, receiver = setup
    free = worker.cache.num_available
    queue(worker, gateway, receiver, "a", "b")
    abort_at_layer(worker, gateway, 3, [Abort("a", 0)])
    assert worker.step()
    assert worker.cache.num_available == free
    firsts = [m.request_id for m in sent_to_gateway(worker, gateway) if isinstance(m, FirstToken)]
    assert firsts == ["b"]
    sent = received(receiver)
    assert sent["a"] == ["DecodeRequest", "layer 0", "layer 1", "layer 2"]
    assert sent["b"] == ["DecodeRequest", *[f"layer {i}" for i in range(LAYERS)], "FirstToken"]


def test_an_abort_for_a_queued_request_removes_it_and_a_repeat_is_a_no_op(setup) -> None:
    worker, gateway, receiver = setup
    to_worker(gateway, request("a", receiver.address))
    to_worker(gateway, Abort("a", 0))
    to_worker(gateway, Abort("a", 0))
    to_worker(gateway, Abort("never-sent", 0))
    time.sleep(0.1)
    worker.take_control()
    assert not worker.step()
    assert worker.scheduler.waiting == type(worker.scheduler.waiting)()
    assert sent_to_gateway(worker, gateway) == [] and received(receiver) == {}


def kv_of(receiver: KVReceiver) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The K and V each request's chunks carried, all layers stacked."""
    parts: dict[str, list[tuple[int, torch.Tensor, torch.Tensor]]] = {}

    def keep(item: KVItem) -> None:
        if isinstance(item, KVPayload):
            parts.setdefault(item.key[0], []).append((item.header.layer_start, item.k.clone(),
                                                       item.v.clone()))
    deadline = time.monotonic() + 0.5
    while time.monotonic() < deadline:
        receiver.fileno_socket().poll(50)
        receiver.drain(keep)
    return {rid: (torch.cat([k for _, k, _ in sorted(chunks, key=lambda c: c[0])]),
                  torch.cat([v for _, _, v in sorted(chunks, key=lambda c: c[0])]))
            for rid, chunks in parts.items()}


def prefill_one(worker: PrefillWorker, gateway: zmq.Socket, receiver: KVReceiver,
                request_id: str, prompt: list[int] | None = None, salt: str = "",
                grammar: Grammar | None = None, task: GenerationTask | None = None) -> FirstToken:
    task = task or GenerationTask(prompt or [], Sampling(temperature=0.0), 16, [], True,
                                  cache_salt=salt, grammar=grammar)
    to_worker(gateway, PrefillRequest(request_id, 0, task, "decode-0", receiver.address))
    time.sleep(0.1)
    worker.take_control()
    compiled(worker, task.grammar)
    assert worker.step()
    (first,) = [m for m in sent_to_gateway(worker, gateway) if isinstance(m, FirstToken)]
    return first


def compiled(worker: PrefillWorker, grammar: Grammar | None) -> None:
    """Wait for the worker's grammar thread to be done with `grammar` (if any)."""
    if grammar:
        worker.grammars.prepare(grammar).exception(timeout=GRAMMAR_WAIT_S)


def test_a_cached_prefix_is_reused_and_gives_the_same_kv_and_token(setup) -> None:
    worker, gateway, receiver = setup
    shared = list(range(100, 148))  # 3 blocks of 16
    cold_other = prefill_one(worker, gateway, receiver, "cold", [*shared, 7, 8, 9])
    cold = kv_of(receiver)["cold"]
    forward = worker.runner.forward
    computed: list[int] = []

    def counting(batch, layer_hook=None):
        computed.extend(len(tokens) for tokens in batch.token_ids)
        return forward(batch, layer_hook=layer_hook)
    worker.runner.forward = counting
    warm = prefill_one(worker, gateway, receiver, "warm", [*shared, 7, 8, 9])
    assert warm.cached_tokens == 48 and computed == [3]
    assert warm.token_id == cold_other.token_id and cold_other.cached_tokens == 0
    warm_kv = kv_of(receiver)["warm"]
    for got, expected in zip(warm_kv, cold, strict=True):
        assert torch.allclose(got, expected, atol=1e-5)
    other_tenant = prefill_one(worker, gateway, receiver, "other", [*shared, 7, 8, 9], "beta")
    exact_blocks = prefill_one(worker, gateway, receiver, "exact", shared)
    assert other_tenant.cached_tokens == 0
    assert exact_blocks.cached_tokens == 32  # the last token is always computed
    assert computed == [3, 51, 16]


def grammar_task(schema: str, prompt: list[int]) -> GenerationTask:
    return GenerationTask(prompt, Sampling(temperature=0.0), 16, [], False,
                          grammar=Grammar("json_schema", schema))


def test_a_grammar_that_does_not_compile_fails_the_request(setup) -> None:
    worker, gateway, receiver = setup
    bad = grammar_task(json.dumps({"type": "bogus"}), list(range(10, 20)))
    to_worker(gateway, PrefillRequest("bad", 0, bad, "decode-0", receiver.address))
    time.sleep(0.1)
    worker.take_control()
    compiled(worker, bad.grammar)
    assert not worker.step()
    (failed,) = sent_to_gateway(worker, gateway)
    assert isinstance(failed, RequestFailed) and "invalid grammar" in failed.reason
    assert worker.holding() == []


def test_a_request_waits_for_its_grammar_held_and_abortable_off_the_loop(setup) -> None:
    """Its grammar compiles on the grammar thread: the loop's steps go on meanwhile (nothing to
    compute), the request is held all along, and it is prefilled once the grammar is ready."""
    worker, gateway, receiver = setup
    schemas = [json.dumps({"type": "object", "properties": {f"k{i}": {"enum": ["v"]}},
                           "required": [f"k{i}"]}) for i in range(2)]
    for request_id, schema in zip(("waits", "aborted"), schemas, strict=True):
        task = grammar_task(schema, list(range(30, 40)))
        to_worker(gateway, PrefillRequest(request_id, 0, task, "decode-0", receiver.address))
    blocker = threading.Event()
    worker.grammars._thread.submit(blocker.wait, GRAMMAR_WAIT_S)  # the grammar thread held up
    time.sleep(0.1)
    worker.take_control()
    assert not worker.step() and not worker.step()  # nothing ready: nothing computed, no wait
    assert {h.request_id for h in worker.holding()} == {"waits", "aborted"}
    worker.handle(Abort("aborted", 0))
    blocker.set()
    for schema in schemas:
        compiled(worker, Grammar("json_schema", schema))
    assert worker.step()
    assert [f.request_id for f in firsts(worker, gateway)] == ["waits"]
    assert worker.holding() == []


def test_the_first_token_follows_the_grammar_after_resumed_output(setup) -> None:
    worker, gateway, receiver = setup
    tokenizer = AutoTokenizer.from_pretrained(worker.runner.model_dir)
    prompt = list(range(10, 20))
    first = prefill_one(worker, gateway, receiver, "object", prompt, grammar=JSON_OBJECT)
    assert decode_text(tokenizer, [first.token_id]).startswith("{")
    # Resumed with the whole value streamed already: only EOS may follow, and it ends it.
    schema = json.dumps({"type": "object", "properties": {"k": {"enum": ["v"]}}})
    output = tokenizer.encode('{"k": "v"}')
    task = replace(grammar_task(schema, [*prompt, *output]), output_start=len(prompt))
    first = prefill_one(worker, gateway, receiver, "resumed", task=task)
    assert (first.token_id, first.finish_reason) == (2, "stop")


# --- chunked prefill -------------------------------------------------------------------------

CHUNK = 16


def chunk_by_tokens(worker: PrefillWorker, budget: int = CHUNK) -> None:
    """Chunks of CHUNK tokens, steps of `budget`, keys not costed (the tiny model's are dear)."""
    worker.scheduler.chunk_tokens = CHUNK
    worker.scheduler.max_batch_tokens = budget
    worker.scheduler.cost = TOKENS_ONLY


def kv_pieces(receiver: KVReceiver) -> dict[str, list[tuple[int, int, torch.Tensor, torch.Tensor]]]:
    """Each request's chunks in arrival order: (token start, layer start, K, V)."""
    got: dict[str, list[tuple[int, int, torch.Tensor, torch.Tensor]]] = {}

    def keep(item: KVItem) -> None:
        if isinstance(item, KVPayload):
            header = item.header
            got.setdefault(item.key[0], []).append(
                (header.token_start, header.layer_start, item.k.clone(), item.v.clone()))
    deadline = time.monotonic() + 0.5
    while time.monotonic() < deadline:
        receiver.fileno_socket().poll(50)
        receiver.drain(keep)
    return got


def assembled(pieces: list[tuple[int, int, torch.Tensor, torch.Tensor]], tokens: int,
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of every layer and token, put together from the pieces at their offsets."""
    _, _, k0, _ = pieces[0]
    k = torch.full((LAYERS, tokens, *k0.shape[2:]), float("nan"))
    v = k.clone()
    for token_start, layer_start, piece_k, piece_v in pieces:
        layers, count = piece_k.shape[:2]
        k[layer_start:layer_start + layers, token_start:token_start + count] = piece_k
        v[layer_start:layer_start + layers, token_start:token_start + count] = piece_v
    return k, v


def send(worker: PrefillWorker, gateway: zmq.Socket, receiver: KVReceiver, request_id: str,
         prompt: list[int], salt: str = "") -> None:
    task = GenerationTask(prompt, Sampling(temperature=0.0), 16, [], True, cache_salt=salt)
    to_worker(gateway, PrefillRequest(request_id, 0, task, "decode-0", receiver.address))
    time.sleep(0.1)
    worker.take_control()


def firsts(worker: PrefillWorker, gateway: zmq.Socket) -> list[FirstToken]:
    return [m for m in sent_to_gateway(worker, gateway) if isinstance(m, FirstToken)]


def test_a_prompt_prefilled_in_chunks_gives_the_kv_and_token_of_one_pass(setup) -> None:
    worker, gateway, receiver = setup
    prompt = list(range(200, 270))  # 70 tokens: chunks of 16, 16, 16, 16 and 6
    whole = prefill_one(worker, gateway, receiver, "whole", prompt, salt="a")
    whole_kv = assembled(kv_pieces(receiver)["whole"], len(prompt))
    chunk_by_tokens(worker)
    send(worker, gateway, receiver, "chunked", prompt, salt="b")  # no prefix reuse
    for _ in range(4):
        assert worker.step()
        assert firsts(worker, gateway) == []  # not before the last chunk
        assert worker.holding() == [Held("chunked", 0)]
    assert worker.heartbeat().queued_tokens == 6
    assert worker.step()
    (first,) = firsts(worker, gateway)
    assert first.token_id == whole.token_id and not worker.step()
    pieces = kv_pieces(receiver)["chunked"]
    # Chunk after chunk, each chunk's layers in order before the next chunk's.
    assert [(t, layer) for t, layer, _, _ in pieces] == [
        (t, layer) for t in range(0, 70, CHUNK) for layer in range(LAYERS)]
    for got, expected in zip(assembled(pieces, len(prompt)), whole_kv, strict=True):
        assert torch.allclose(got, expected, atol=1e-5)
    assert worker.jobs == {} and worker.holding() == []


def test_a_short_prompt_behind_a_long_one_waits_at_most_one_chunk(setup) -> None:
    worker, gateway, receiver = setup
    chunk_by_tokens(worker, budget=2 * CHUNK)
    send(worker, gateway, receiver, "long", list(range(300, 400)))
    assert worker.step()  # the long prompt's first chunk
    send(worker, gateway, receiver, "short", list(range(10, 15)))
    assert worker.step()  # its second chunk, and the short prompt whole
    assert [f.request_id for f in firsts(worker, gateway)] == ["short"]
    while worker.step():
        pass
    assert [f.request_id for f in firsts(worker, gateway)] == ["long"]


def test_an_abort_between_chunks_frees_the_blocks_and_stops_the_stream(setup) -> None:
    worker, gateway, receiver = setup
    free = worker.cache.num_available
    chunk_by_tokens(worker)
    send(worker, gateway, receiver, "a", list(range(300, 350)))
    assert worker.step() and worker.step()
    assert worker.cache.num_available < free
    to_worker(gateway, Abort("a", 0))
    time.sleep(0.1)
    worker.take_control()
    assert worker.cache.num_available == free and worker.holding() == []
    assert not worker.step()
    assert firsts(worker, gateway) == []
    assert received(receiver)["a"] == ["DecodeRequest", *[f"layer {i}" for i in range(LAYERS)] * 2]


def test_an_abort_inside_a_later_chunk_stops_it_between_layers(setup) -> None:
    worker, gateway, receiver = setup
    free = worker.cache.num_available
    chunk_by_tokens(worker)
    send(worker, gateway, receiver, "a", list(range(300, 350)))
    assert worker.step()
    abort_at_layer(worker, gateway, 2, [Abort("a", 0)])
    assert worker.step()
    assert worker.cache.num_available == free and worker.holding() == [] and worker.jobs == {}
    assert not worker.step() and firsts(worker, gateway) == []
    layers = [f"layer {i}" for i in range(LAYERS)]
    assert received(receiver)["a"] == ["DecodeRequest", *layers, *layers[:2]]


def test_a_prompt_whose_decode_worker_is_gone_stops_at_the_failed_chunk(
        setup, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its KV has nowhere to go: no later chunk is computed, its blocks are freed, and the
    gateway hears that another pair may serve it."""
    monkeypatch.setattr(kvtransfer.sender, "_CONNECT_WAIT_MS", 200)
    worker, gateway, _ = setup
    free = worker.cache.num_available
    chunk_by_tokens(worker)
    doomed = make_receiver(worker.context, "tcp://127.0.0.1:*")
    send(worker, gateway, doomed, "a", list(range(300, 350)))  # four chunks
    assert worker.step()
    doomed.close()
    gone_by = time.monotonic() + WAIT_S
    while worker.sender.sockets[doomed.address].poll(0, zmq.POLLOUT):
        assert time.monotonic() < gone_by, "the sender did not notice the receiver leave"
        time.sleep(0.01)
    assert worker.step()  # the second chunk: its first send fails
    assert worker.holding() == [] and worker.jobs == {}
    assert worker.cache.num_available == free and worker.scheduler.held() == []
    assert not worker.step()
    (failed,) = [m for m in sent_to_gateway(worker, gateway) if not isinstance(m, Heartbeat)]
    assert isinstance(failed, RequestFailed) and (failed.request_id, failed.retry) == ("a", True)
    assert doomed.address in failed.reason


def test_a_prompt_announced_to_nobody_is_not_computed(
        setup, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its decode worker was unreachable from the start: no chunk of it runs, and the others
    of the step do."""
    monkeypatch.setattr(kvtransfer.sender, "_CONNECT_WAIT_MS", 200)
    worker, gateway, receiver = setup
    free = worker.cache.num_available
    doomed = make_receiver(worker.context, "tcp://127.0.0.1:*")
    doomed.close()
    send(worker, gateway, doomed, "lost", list(range(300, 340)))
    send(worker, gateway, receiver, "kept", list(range(10, 30)))
    computed: list[int] = []
    forward = worker.runner.forward

    def counting(batch, layer_hook=None):
        computed.append(batch.num_seqs)
        return forward(batch, layer_hook=layer_hook)
    worker.runner.forward = counting
    assert worker.step()
    assert computed == [1] and not worker.step()
    messages = [m for m in sent_to_gateway(worker, gateway) if not isinstance(m, Heartbeat)]
    assert [(type(m).__name__, m.request_id) for m in messages
            if isinstance(m, RequestFailed | FirstToken)] == [
        ("RequestFailed", "lost"), ("FirstToken", "kept")]
    assert len(messages) == 2
    assert worker.cache.num_available == free and worker.jobs == {}


def test_a_cached_prefix_is_skipped_and_the_chunks_cover_the_rest(setup) -> None:
    worker, gateway, receiver = setup
    prompt = [*range(100, 148), *range(500, 540)]  # 3 cached blocks of 16, then 40 tokens
    prefill_one(worker, gateway, receiver, "cold", prompt[:49])
    cold = prefill_one(worker, gateway, receiver, "other", prompt, salt="x")  # not shared
    cold_kv = assembled(kv_pieces(receiver)["other"], len(prompt))
    chunk_by_tokens(worker)
    forward = worker.runner.forward
    computed: list[list[int]] = []

    def counting(batch, layer_hook=None):
        computed.append([len(tokens) for tokens in batch.token_ids])
        return forward(batch, layer_hook=layer_hook)
    worker.runner.forward = counting
    firsts(worker, gateway)
    send(worker, gateway, receiver, "warm", prompt)
    while worker.step():
        pass
    (warm,) = firsts(worker, gateway)
    assert computed == [[16], [16], [8]] and warm.cached_tokens == 48
    assert warm.token_id == cold.token_id
    pieces = kv_pieces(receiver)["warm"]
    assert sorted({t for t, _, _, _ in pieces}) == [0, 64, 80]  # the prefix goes with chunk 1
    for got, expected in zip(assembled(pieces, len(prompt)), cold_kv, strict=True):
        assert torch.allclose(got, expected, atol=1e-5)


def test_steps_are_costed_by_the_model_shape(setup) -> None:
    worker = setup[0]
    assert worker.scheduler.cost == ChunkCost.of(worker.runner.spec)
    assert worker.scheduler.cost.keys_per_token < float("inf")


def test_the_first_token_reports_the_prompts_wait_and_compute_here(setup) -> None:
    """To the gateway and on to decode, after the KV; the notice ahead of the KV passes the
    gateway's trace context on."""
    worker, gateway, receiver = setup
    traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    to_worker(gateway, replace(request("r", receiver.address), traceparent=traceparent))
    time.sleep(0.1)
    before = time.monotonic()
    worker.take_control()
    time.sleep(0.05)  # queued here
    began = time.monotonic()
    assert worker.step()
    after = time.monotonic()
    (first,) = firsts(worker, gateway)
    stages = {s.stage: s.seconds for s in first.stages}
    assert list(stages) == ["prefill_wait", "prefill_compute"]
    assert stages["prefill_wait"] >= 0.05 and 0 < stages["prefill_compute"] <= after - began
    assert stages["prefill_wait"] + stages["prefill_compute"] <= after - before
    notices: list[Message] = []
    deadline = time.monotonic() + 0.5
    while time.monotonic() < deadline:
        receiver.fileno_socket().poll(50)
        receiver.drain(lambda item: notices.append(decode(item.meta))
                       if isinstance(item, KVNotice) else None)
    announced, handed = notices
    assert isinstance(announced, DecodeRequest) and announced.traceparent == traceparent
    assert handed == first


def test_it_registers_the_cpus_and_threads_it_computes_with(setup) -> None:
    worker, _, _ = setup
    register = worker.registration()
    assert register.role == "prefill" and register.cpus == sorted(os.sched_getaffinity(0))
    assert register.threads == torch.get_num_threads() and register.max_running == 0


def embedding_task(prompt: list[int]) -> GenerationTask:
    return GenerationTask(prompt, Sampling(temperature=0.0), 1, [], True, embedding=True)


def test_an_embedding_comes_with_the_first_token_computed_cached_or_in_chunks(setup) -> None:
    worker, gateway, receiver = setup
    prompt = list(range(100, 150))  # 50 tokens: 3 full blocks before the last one
    expected = last_hidden_state(worker.runner.model_dir, prompt)
    cold = prefill_one(worker, gateway, receiver, "cold", task=embedding_task(prompt))
    warm = prefill_one(worker, gateway, receiver, "warm", task=embedding_task(prompt))
    chunk_by_tokens(worker)
    to_worker(gateway, PrefillRequest("chunked", 0, replace(embedding_task(prompt),
                                                               cache_salt="b"),
                                      "decode-0", receiver.address))
    time.sleep(0.1)
    worker.take_control()
    while worker.step():
        pass
    (chunked,) = firsts(worker, gateway)
    assert (cold.cached_tokens, warm.cached_tokens, chunked.cached_tokens) == (0, 48, 0)
    for first in (cold, warm, chunked):
        assert first.finish_reason == "length"
        assert is_hidden_state(first.embedding, expected)
    assert received(receiver) == {}  # nothing for decode: the request ends here
    assert worker.jobs == {} and worker.cache.num_available == 64


def test_in_a_batch_only_the_request_that_asks_gets_an_embedding(setup) -> None:
    worker, gateway, receiver = setup
    asked = list(range(10, 50))  # longer than the other: due later, so its row comes second
    to_worker(gateway, request("other", receiver.address))
    to_worker(gateway, PrefillRequest("asked", 0, embedding_task(asked), "decode-0",
                                      receiver.address))
    time.sleep(0.1)
    worker.take_control()
    forward = worker.runner.forward
    batches: list[ForwardBatch] = []

    def recording(batch: ForwardBatch, layer_hook: Callable[[int], None] | None = None
                  ) -> torch.Tensor:
        batches.append(batch)
        return forward(batch, layer_hook)

    worker.runner.forward = recording
    assert worker.step() and not worker.step()
    (batch,) = batches  # one pass for both, the embedding's row second
    assert batch.hidden and batch.token_ids == [list(range(10, 40)), asked]
    sent = {first.request_id: first for first in firsts(worker, gateway)}
    assert sent["other"].embedding == b"" and sent["asked"].embedding
    expected = last_hidden_state(worker.runner.model_dir, asked)
    assert is_hidden_state(sent["asked"].embedding, expected)
    assert list(received(receiver)) == ["other"]
