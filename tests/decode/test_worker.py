"""The decode worker's step, in process on a tiny model: continuous batching at step granularity."""

from __future__ import annotations

import json
import math
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import zmq
from transformers import AutoModelForCausalLM, AutoTokenizer

from core.config import Config, load_config
from core.messages import (
    Abort,
    DecodeRequest,
    DropCount,
    FinishReason,
    FirstToken,
    GenerationTask,
    Grammar,
    Message,
    PrefillRequest,
    PromptLogprobs,
    RequestFailed,
    RequestKey,
    Sampling,
    TokenBatch,
    TokenEvent,
    decode,
    encode,
)
from decode.phases import Phase
from decode.worker import DecodeWorker
from engine.model.batch import ForwardBatch
from engine.model.chunk_cost import TOKENS_ONLY, ChunkCost
from engine.runner import ModelRunner
from engine.weights.tokenizer import decode_text
from kvtransfer import make_sender
from kvtransfer.wire import FORWARD_CODEC, KVHeader, KVNotice, KVPayload, KVRejected
from tests.control import sent_to_gateway
from tests.reference import is_hidden_state, last_hidden_state

PROMPT_LEN = 8
GREEDY = Sampling(temperature=0.0)
WAIT_S = 5.0
Served = tuple[DecodeWorker, zmq.Socket]  # the worker, and the ROUTER standing in for the gateway

pytestmark = pytest.mark.usefixtures("shared_grammar_tables")


@contextmanager
def serving(model_dir: Path, folder: Path, chunk_tokens: int = 512,
            prefix_caching: bool = True, speculative_tokens: int = 0) -> Iterator[Served]:
    """A decode worker on the tiny model, and the ROUTER standing in for its gateway."""
    control = f"ipc://{folder}/control.sock"
    config: Config = load_config(None, {"gateway.control_address": control,
                                        "decode.kv_bind": f"ipc://{folder}/kv.sock",
                                        "decode.chunk_tokens": str(chunk_tokens),
                                        "decode.prefix_caching": str(prefix_caching).lower(),
                                        "decode.speculative_tokens": str(speculative_tokens),
                                        "decode.speculative_max_running": "8"})
    gateway: zmq.Socket = zmq.Context.instance().socket(zmq.ROUTER)
    gateway.bind(control)
    runner = ModelRunner(model_dir, num_blocks=256, block_size=16)
    decode_worker = DecodeWorker("decode-0", config, runner)
    assert decode_worker.scheduler.cost == ChunkCost.of(runner.spec)
    decode_worker.scheduler.cost = TOKENS_ONLY  # chunks of chunk_tokens: the tiny keys are dear
    try:
        yield decode_worker, gateway
    finally:
        decode_worker.close()
        gateway.close(linger=0)


@pytest.fixture
def worker(tiny_model_dir: Path, tmp_path: Path) -> Iterator[Served]:
    with serving(tiny_model_dir, tmp_path) as served:
        yield served


def task(max_tokens: int = 100) -> GenerationTask:
    return GenerationTask(list(range(10, 10 + PROMPT_LEN)), Sampling(temperature=0.0), max_tokens,
                          [], True)


def announce(worker: DecodeWorker, request_id: str, max_tokens: int = 100,
             fingerprint: str | None = None, job: GenerationTask | None = None) -> None:
    """The request's notice, computed in `fingerprint`'s KV layout (default: the worker's)."""
    expect = DecodeRequest(request_id, 0, job or task(max_tokens),
                           fingerprint or worker.identity.fingerprint)
    worker.intake.on_kv(KVNotice(request_id, 0, encode(expect)))


def layer_kv(worker: DecodeWorker) -> tuple[torch.Tensor, torch.Tensor]:
    """Random K and V of the whole prompt, [layers, PROMPT_LEN, kv_heads, head_dim] each."""
    spec = worker.runner.spec
    shape = (spec.num_layers, PROMPT_LEN, spec.num_kv_heads, spec.head_dim)
    return torch.randn(shape), torch.randn(shape)


def send_layer(worker: DecodeWorker, request_id: str, layer: int, k: torch.Tensor,
               v: torch.Tensor, borrowed: bool = False) -> None:
    """Layer `layer` of [layers, T, H, D] K and V, as one chunk."""
    shape = [1, *k.shape[1:]]
    header = KVHeader(request_id, 0, layer, layer + 1, PROMPT_LEN, "float32", shape, 0, None)
    worker.intake.on_kv(KVPayload(header, k[layer:layer + 1], v[layer:layer + 1], borrowed))


def first_token(worker: DecodeWorker, request_id: str, finish_reason: FinishReason | None = None,
                token_id: int = 5) -> None:
    first = FirstToken(request_id, 0, token_id, finish_reason)
    worker.intake.on_kv(KVNotice(request_id, 0, encode(first)))


def arrive(worker: DecodeWorker, request_id: str, max_tokens: int,
           job: GenerationTask | None = None, token_id: int = 5) -> None:
    """A request lands as the receiver would hand it over: its notice, its (random but
    well-formed) KV layer by layer, then its first token."""
    announce(worker, request_id, max_tokens, job=job)
    k, v = layer_kv(worker)
    for layer in range(worker.runner.spec.num_layers):
        send_layer(worker, request_id, layer, k, v)
    first_token(worker, request_id, token_id=token_id)


def failures(messages: list[Message]) -> list[RequestFailed]:
    return [m for m in messages if isinstance(m, RequestFailed)]


def admitted(worker: DecodeWorker) -> list[str]:
    return [s.key[0] for s in [*worker.scheduler.waiting, *worker.scheduler.running]]


def cache_untouched(worker: DecodeWorker) -> bool:
    cache = worker.runner.cache
    return not cache.k.any() and not cache.v.any()


def events_of_next_step(worker: DecodeWorker, gateway: zmq.Socket) -> dict[str, str | None]:
    assert worker.step()
    while True:
        _, data = gateway.recv_multipart()
        message = decode(data)
        if isinstance(message, TokenBatch):
            return {e.request_id: e.finish_reason for e in message.events}


def test_a_request_joins_the_running_batch_at_the_next_step(worker) -> None:
    decode_worker, gateway = worker
    for i in range(32):
        arrive(decode_worker, f"r{i}", max_tokens=100)
    assert len(events_of_next_step(decode_worker, gateway)) == 32
    arrive(decode_worker, "late", max_tokens=100)
    events = events_of_next_step(decode_worker, gateway)
    assert len(events) == 33 and "late" in events


def test_a_finished_sequence_leaves_the_batch_in_the_same_step(worker) -> None:
    decode_worker, gateway = worker
    free = decode_worker.scheduler.cache.num_available
    arrive(decode_worker, "long", max_tokens=100)
    arrive(decode_worker, "short", max_tokens=2)  # the first token came from prefill
    assert events_of_next_step(decode_worker, gateway) == {"long": None, "short": "length"}
    assert [s.key[0] for s in decode_worker.scheduler.running] == ["long"]
    assert events_of_next_step(decode_worker, gateway) == {"long": None}
    held = len(decode_worker.scheduler.running[0].blocks)
    assert decode_worker.scheduler.cache.num_available == free - held


def test_the_kv_written_into_the_cache_is_the_kv_received(worker: Served) -> None:
    decode_worker, gateway = worker
    k, v = layer_kv(decode_worker)
    k_sent, v_sent = k.clone(), v.clone()
    announce(decode_worker, "r")
    for layer in range(decode_worker.runner.spec.num_layers):
        send_layer(decode_worker, "r", layer, k, v, borrowed=True)
        k[layer].fill_(-1.0)  # a borrowed chunk's buffer is reused once the drain returns
        v[layer].fill_(-1.0)
    first_token(decode_worker, "r")
    assert admitted(decode_worker) == ["r"]
    assert cache_untouched(decode_worker)  # nothing is written before a slot is given
    assert events_of_next_step(decode_worker, gateway) == {"r": None}
    (sequence,) = decode_worker.scheduler.running
    k_cached, v_cached = decode_worker.runner.cache.read(sequence.blocks, PROMPT_LEN)
    assert torch.equal(k_cached, k_sent) and torch.equal(v_cached, v_sent)
    assert sequence.tokens[:PROMPT_LEN + 1] == [*task().prompt_ids, 5]


def test_a_fingerprint_mismatch_fails_the_request_and_admits_nothing(worker: Served) -> None:
    decode_worker, gateway = worker
    announce(decode_worker, "r", fingerprint="another layout")
    k, v = layer_kv(decode_worker)
    for layer in range(decode_worker.runner.spec.num_layers):
        send_layer(decode_worker, "r", layer, k, v)
    first_token(decode_worker, "r")
    (failed,) = failures(sent_to_gateway(decode_worker, gateway))
    assert (failed.request_id, failed.epoch) == ("r", 0)
    assert "another layout" in failed.reason  # the sender's layout
    assert decode_worker.identity.fingerprint in failed.reason  # and this worker's
    assert admitted(decode_worker) == [] and not decode_worker.step()
    assert cache_untouched(decode_worker)
    assert decode_worker.incoming.dropped["unknown request"] == decode_worker.runner.spec.num_layers


def test_a_rejected_chunk_fails_its_request(worker: Served) -> None:
    decode_worker, gateway = worker
    k, v = layer_kv(decode_worker)
    announce(decode_worker, "r")
    send_layer(decode_worker, "r", 0, k, v)
    decode_worker.intake.on_kv(KVRejected("r", 0, "checksum mismatch"))
    decode_worker.intake.on_kv(KVRejected("never announced", 0, "checksum mismatch"))
    for layer in range(1, decode_worker.runner.spec.num_layers):
        send_layer(decode_worker, "r", layer, k, v)
    first_token(decode_worker, "r")
    assert failures(sent_to_gateway(decode_worker, gateway)) == [
        RequestFailed("r", 0, "checksum mismatch", retry=True)]
    assert admitted(decode_worker) == [] and decode_worker.incoming.pending == {}


def test_an_abort_while_kv_is_incoming_drops_the_rest(worker: Served) -> None:
    decode_worker, gateway = worker
    k, v = layer_kv(decode_worker)
    announce(decode_worker, "r")
    send_layer(decode_worker, "r", 0, k, v)
    decode_worker.handle(Abort("r", 0))
    assert decode_worker.incoming.pending == {}
    for layer in range(1, decode_worker.runner.spec.num_layers):
        send_layer(decode_worker, "r", layer, k, v)
    first_token(decode_worker, "r")
    assert admitted(decode_worker) == [] and not decode_worker.step()
    assert cache_untouched(decode_worker)
    later = decode_worker.runner.spec.num_layers - 1
    assert decode_worker.incoming.dropped == {"unknown request": later}
    assert failures(sent_to_gateway(decode_worker, gateway)) == []  # the gateway asked for it
    heartbeat = decode_worker.heartbeat()
    assert DropCount("unknown request", later) in heartbeat.dropped_chunks


def test_an_abort_that_beats_the_notice_keeps_the_request_out(worker: Served) -> None:
    decode_worker, gateway = worker
    decode_worker.handle(Abort("r", 0))
    arrive(decode_worker, "r", max_tokens=100)
    assert admitted(decode_worker) == [] and decode_worker.incoming.pending == {}
    assert cache_untouched(decode_worker)
    assert failures(sent_to_gateway(decode_worker, gateway)) == []


def test_a_first_token_that_finishes_the_request_drops_its_kv(worker: Served) -> None:
    decode_worker, gateway = worker
    k, v = layer_kv(decode_worker)
    announce(decode_worker, "r")
    for layer in range(decode_worker.runner.spec.num_layers):
        send_layer(decode_worker, "r", layer, k, v)
    first_token(decode_worker, "r", finish_reason="stop")
    assert decode_worker.incoming.pending == {} and admitted(decode_worker) == []
    assert failures(sent_to_gateway(decode_worker, gateway)) == []
    assert not decode_worker.step()


def test_kv_that_stops_arriving_fails_every_choice_for_another_pair(worker: Served) -> None:
    """Its lease runs out: the hand-off failed, not the request, so each choice (n > 1) may be
    served again elsewhere."""
    decode_worker, gateway = worker
    expect = DecodeRequest("r", 0, task(100), decode_worker.identity.fingerprint,
                           siblings=["r-1", "r-2"])
    decode_worker.intake.on_kv(KVNotice("r", 0, encode(expect)))
    decode_worker.incoming.pending[RequestKey("r", 0)].deadline = 0.0  # its lease ran out
    decode_worker.heartbeat()
    failed = failures(sent_to_gateway(decode_worker, gateway))
    assert [(f.request_id, f.retry) for f in failed] == [("r", True), ("r-1", True), ("r-2", True)]
    assert decode_worker.incoming.pending == {} and admitted(decode_worker) == []


def test_a_first_token_before_the_last_layer_fails_the_request(worker: Served) -> None:
    decode_worker, gateway = worker
    k, v = layer_kv(decode_worker)
    announce(decode_worker, "r")
    send_layer(decode_worker, "r", 0, k, v)
    first_token(decode_worker, "r")
    (failed,) = failures(sent_to_gateway(decode_worker, gateway))
    assert (failed.request_id, failed.epoch) == ("r", 0)
    assert "before the last one" in failed.reason and failed.retry  # another pair may serve it
    assert admitted(decode_worker) == [] and decode_worker.incoming.pending == {}
    send_layer(decode_worker, "r", 1, k, v)  # a straggler
    assert decode_worker.incoming.dropped == {"unknown request": 1}


def test_a_chunk_of_the_wrong_dtype_fails_its_request(worker: Served) -> None:
    decode_worker, gateway = worker
    k, v = layer_kv(decode_worker)
    k, v = k.half(), v.half()
    announce(decode_worker, "r")
    for layer in range(decode_worker.runner.spec.num_layers):
        shape = [1, *k.shape[1:]]
        header = KVHeader("r", 0, layer, layer + 1, PROMPT_LEN, "float16", shape, 0, None)
        decode_worker.intake.on_kv(KVPayload(header, k[layer:layer + 1], v[layer:layer + 1]))
    first_token(decode_worker, "r")
    decode_worker.step()  # must not raise: the request fails, the worker carries on
    (failed,) = failures(sent_to_gateway(decode_worker, gateway))
    assert failed.request_id == "r"
    assert admitted(decode_worker) == []


def test_kv_that_outlives_its_lease_fails_at_the_heartbeat(worker: Served) -> None:
    decode_worker, gateway = worker
    announce(decode_worker, "late")
    announce(decode_worker, "on time")
    decode_worker.incoming.pending[RequestKey("late", 0)].deadline = time.monotonic() - 1.0
    decode_worker.heartbeat()
    (failed,) = failures(sent_to_gateway(decode_worker, gateway))
    assert failed.request_id == "late" and "in time" in failed.reason
    assert set(decode_worker.incoming.pending) == {("on time", 0)}


def test_the_heartbeat_reports_receive_totals_and_drops(worker: Served) -> None:
    decode_worker, gateway = worker
    spec = decode_worker.runner.spec
    k, v = layer_kv(decode_worker)
    announce(decode_worker, "r")
    sender = make_sender(decode_worker.context)
    raw = decode_worker.context.socket(zmq.DEALER)
    raw.connect(decode_worker.kv_address)
    try:
        for layer in range(spec.num_layers):
            sender.send_layers(decode_worker.kv_address, "r", 0, layer, k[layer:layer + 1],
                               v[layer:layer + 1])
        sender.send_layers(decode_worker.kv_address, "stranger", 0, 0, k[:1], v[:1])
        receive_into(decode_worker, spec.num_layers + 1)
        # Then a chunk whose data does not match its checksum: the receiver rejects it.
        header = KVHeader("r", 0, 0, 1, PROMPT_LEN, "float32", list(k[:1].shape), 1, None)
        raw.send_multipart([FORWARD_CODEC.encode(header), k[:1].numpy().tobytes(),
                            v[:1].numpy().tobytes()])
        receive_into(decode_worker, 1)
    finally:
        sender.close()
        raw.close(linger=0)
    heartbeat = decode_worker.heartbeat()
    totals, sent = heartbeat.transfers  # what it received; what it sent of its cache (nothing)
    assert sent.direction == "send" and sent.chunks == 0
    chunk_bytes = k[:1].nbytes + v[:1].nbytes
    assert (totals.direction, totals.chunks, totals.bytes, totals.failures) == (
        "receive", spec.num_layers + 1, (spec.num_layers + 1) * chunk_bytes, 0)
    assert totals.seconds > 0
    assert heartbeat.dropped_chunks == [DropCount("checksum", 1), DropCount("unknown request", 1)]
    # The rejected chunk failed its request, which had all its layers but not its first token.
    assert failures(sent_to_gateway(decode_worker, gateway)) == [
        RequestFailed("r", 0, "checksum mismatch", retry=True)]


def receive_into(worker: DecodeWorker, count: int) -> None:
    """Poll and drain the worker's receiver until `count` more items were handed to it."""
    handed = 0
    deadline = time.monotonic() + WAIT_S
    while handed < count:
        assert time.monotonic() < deadline, f"only {handed} of {count} KV items arrived"
        worker.receiver.fileno_socket().poll(100)
        handed += worker.receiver.drain(worker.intake.on_kv)


def test_a_repeated_hand_off_of_a_running_request_is_dropped_and_counted(worker) -> None:
    decode_worker, gateway = worker
    arrive(decode_worker, "r", max_tokens=100)
    assert events_of_next_step(decode_worker, gateway) == {"r": None}
    free = decode_worker.scheduler.cache.num_available
    arrive(decode_worker, "r", max_tokens=100)  # the same request and epoch, handed off again
    assert events_of_next_step(decode_worker, gateway) == {"r": None}
    assert len(decode_worker.scheduler.running) == 1 and not decode_worker.scheduler.waiting
    assert decode_worker.scheduler.cache.num_available == free
    assert decode_worker.incoming.dropped["duplicate request"] == 1


def compiled(worker: DecodeWorker, schema: str) -> None:
    """Wait for the worker's grammar thread to be done with the JSON `schema`."""
    worker.grammars.prepare(Grammar("json_schema", schema)).exception(timeout=120)


def test_an_abort_while_its_grammar_compiles_ends_it_there(worker: Served) -> None:
    decode_worker, gateway = worker
    grammar = json.dumps({"type": "object", "properties": {"z": {"type": "integer"}}})
    blocker = threading.Event()
    decode_worker.grammars._thread.submit(blocker.wait, 120)  # the grammar thread held up
    arrive(decode_worker, "gone", 100, grammar_task(grammar))
    key = RequestKey("gone", 0)
    assert decode_worker.phases.of(key) is Phase.COMPILING and not decode_worker.step()
    decode_worker.handle(Abort(*key))
    blocker.set()
    compiled(decode_worker, grammar)
    assert not decode_worker.step() and admitted(decode_worker) == []
    assert decode_worker.phases.of(key) is Phase.ENDED and key not in decode_worker.phases.held()
    assert failures(sent_to_gateway(decode_worker, gateway)) == []


def grammar_task(schema: str) -> GenerationTask:
    return GenerationTask(list(range(10, 10 + PROMPT_LEN)), Sampling(temperature=1.0, seed=4),
                          100, [], False, grammar=Grammar("json_schema", schema))


def test_decode_follows_the_grammar_from_the_first_token_to_eos(worker: Served) -> None:
    decode_worker, gateway = worker
    tokenizer = AutoTokenizer.from_pretrained(decode_worker.runner.model_dir)
    schema = {"type": "object", "properties": {"k": {"enum": ["v", "w"]}}, "required": ["k"]}
    (brace,) = tokenizer.encode("{")
    blocker = threading.Event()  # the grammar thread held up: a fast compile cannot finish
    decode_worker.grammars._thread.submit(blocker.wait, 120)  # before the first token lands
    arrive(decode_worker, "json", 100, grammar_task(json.dumps(schema)), token_id=brace)
    assert decode_worker.phases.of(RequestKey("json", 0)) is Phase.COMPILING
    assert RequestKey("json", 0) in decode_worker.phases.held()
    blocker.set()
    compiled(decode_worker, json.dumps(schema))
    output, finish = [brace], None
    while finish is None:
        assert decode_worker.step()
        (event,) = [e for m in sent_to_gateway(decode_worker, gateway)
                    if isinstance(m, TokenBatch) for e in m.events]
        output.append(event.token_id)
        finish = event.finish_reason
    assert (finish, output[-1]) == ("stop", 2)
    assert json.loads(decode_text(tokenizer, output[:-1]))["k"] in ("v", "w")


def test_a_grammar_that_does_not_compile_fails_at_admission(worker: Served) -> None:
    decode_worker, gateway = worker
    arrive(decode_worker, "bad", 100, grammar_task(json.dumps({"type": "bogus"})))
    compiled(decode_worker, json.dumps({"type": "bogus"}))
    assert not decode_worker.step()
    (failed,) = failures(sent_to_gateway(decode_worker, gateway))
    assert "invalid grammar" in failed.reason and admitted(decode_worker) == []


def prefill_here(worker: DecodeWorker, request_id: str, prompt: list[int], max_tokens: int,
                 sampling: Sampling = GREEDY, siblings: tuple[str, ...] = ()) -> None:
    """The gateway sends the prompt itself: conditional disaggregation's local path."""
    job = GenerationTask(prompt, sampling, max_tokens, [], True)
    worker.handle(PrefillRequest(request_id, 0, job, worker.worker_id, worker.kv_address,
                                 list(siblings)))


def output_of(worker: DecodeWorker, gateway: zmq.Socket, request_id: str) -> list[int]:
    """Step until idle; the request's tokens in order, checked to be indexed 0, 1, ..."""
    return outputs_of(worker, gateway, [request_id])[0]


def outputs_of(worker: DecodeWorker, gateway: zmq.Socket,
               request_ids: list[str]) -> list[list[int]]:
    while worker.step():
        pass
    events = [e for m in sent_to_gateway(worker, gateway) if isinstance(m, TokenBatch)
              for e in m.events]
    outputs = []
    for request_id in request_ids:
        mine = [e for e in events if e.request_id == request_id]
        assert [e.index for e in mine] == list(range(len(mine)))
        assert mine[-1].finish_reason is not None
        outputs.append([e.token_id for e in mine])
    return outputs


def test_a_prompt_prefilled_here_in_chunks_matches_one_pass(tiny_model_dir, tmp_path) -> None:
    prompt = list(range(3, 73))  # 70 tokens: chunks of 16, 16, 16, 16 and 6
    outputs = []
    for chunk_tokens in (16, 512):
        (tmp_path / str(chunk_tokens)).mkdir()
        with serving(tiny_model_dir, tmp_path / str(chunk_tokens), chunk_tokens) as (w, g):
            prefill_here(w, "r", prompt, max_tokens=12)
            outputs.append(output_of(w, g, "r"))
            assert w.scheduler.cache.num_available == 256 and not admitted(w)
    assert len(outputs[0]) == 12 and outputs[0] == outputs[1]


def test_a_long_prompt_here_holds_a_running_sequence_back_by_one_chunk(
        tiny_model_dir, tmp_path) -> None:
    with serving(tiny_model_dir, tmp_path, chunk_tokens=16) as (w, gateway):
        arrive(w, "running", max_tokens=100)
        assert events_of_next_step(w, gateway) == {"running": None}
        prefill_here(w, "long", list(range(5, 69)), max_tokens=4)  # 64 tokens: 4 chunks
        assert w.heartbeat().queued_tokens == 64
        steps = [events_of_next_step(w, gateway) for _ in range(4)]
        assert steps[:3] == [{"running": None}] * 3  # a token every step, a chunk beside it
        assert steps[3] == {"running": None, "long": None}  # the last chunk: its first token
        assert w.heartbeat().queued_tokens == 0


def test_an_abort_between_chunks_frees_the_prompt_blocks(tiny_model_dir, tmp_path) -> None:
    with serving(tiny_model_dir, tmp_path, chunk_tokens=16) as (w, gateway):
        prefill_here(w, "long", list(range(5, 69)), max_tokens=4)
        assert w.step() and w.scheduler.running[0].num_cached == 16
        w.handle(Abort("long", 0))
        assert not admitted(w) and w.scheduler.cache.num_available == 256
        assert not w.step()
        prefill_here(w, "long", list(range(5, 69)), max_tokens=4)  # a late repeat: stays dead
        w.handle(Abort("early", 0))  # an abort that beats its request
        prefill_here(w, "early", [1, 2, 3], max_tokens=4)
        assert not admitted(w) and not w.step()
        assert not [m for m in sent_to_gateway(w, gateway)
                    if isinstance(m, TokenBatch | RequestFailed)]


@pytest.mark.parametrize("chunk_tokens", [16, 512])
def test_a_prompt_scored_here_sends_its_tokens_logprobs_before_each_choice_s_first_token(
        tiny_model_dir: Path, tmp_path: Path, chunk_tokens: int) -> None:
    """Echo with logprobs: every prompt position's logits, chunk by chunk, as transformers'
    log-softmax; computed whole even where the prefix cache holds the prompt; sent once per
    choice, ahead of its first token."""
    prompt = list(range(3, 43))  # 40 tokens
    with torch.inference_mode():
        hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
        steps = torch.log_softmax(hf(torch.tensor([prompt])).logits[0, :-1].float(), dim=-1)
    with serving(tiny_model_dir, tmp_path, chunk_tokens) as (w, gateway):
        prefill_here(w, "warm", prompt, 2)
        output_of(w, gateway, "warm")  # its blocks now in the prefix cache
        job = GenerationTask(prompt, GREEDY, 3, [], True, prompt_logprobs=2)
        w.handle(PrefillRequest("r", 0, job, w.worker_id, w.kv_address, ["r.1"]))
        while w.step():
            pass
        messages = sent_to_gateway(w, gateway)
        scores = [m for m in messages if isinstance(m, PromptLogprobs)]
        assert [m.request_id for m in scores] == ["r", "r.1"]
        first = next(i for i, m in enumerate(messages) if isinstance(m, TokenBatch))
        assert max(messages.index(m) for m in scores) < first
        entries = scores[0].entries
        assert scores[1].entries == entries and len(entries) == len(prompt) - 1
        expected = steps[torch.arange(len(prompt) - 1), prompt[1:]]
        assert [e.logprob for e in entries] == pytest.approx(expected.tolist(), abs=1e-4)
        assert [[t.token_id for t in e.top] for e in entries] == steps.topk(2).indices.tolist()
        events = [e for m in messages if isinstance(m, TokenBatch) for e in m.events]
        assert next(e for e in events if e.request_id == "r").cached_tokens == 0
        assert w.scheduler.cache.num_available == 256


def test_n_choices_prefilled_here_fork_the_prompt_and_sample_apart(tiny_model_dir,
                                                                  tmp_path) -> None:
    """Choice i of a seeded request draws what a lone request seeded seed + i would."""
    prompt, seeded = list(range(3, 43)), Sampling(temperature=1.0, seed=7)  # 40 tokens
    with serving(tiny_model_dir, tmp_path) as (w, gateway):
        prefill_here(w, "r", prompt, 10, seeded, siblings=("r.1", "r.2"))
        assert w.step()  # the prompt, and the three first draws from its logits
        blocks = [s.blocks for s in w.scheduler.running]
        assert len(blocks) == 3 and blocks[0][:2] == blocks[1][:2] == blocks[2][:2]
        assert len({b[2] for b in blocks}) == 3  # the partial block: copied
        assert [w.runner.allocator.ref_count(b) for b in blocks[0][:3]] == [3, 3, 1]
        choices = outputs_of(w, gateway, ["r", "r.1", "r.2"])
        assert w.scheduler.cache.num_available == 256 and not w.phases.forks
        alone = []
        for i in range(3):
            prefill_here(w, f"alone{i}", prompt, 10, seeded.for_choice(i))
            alone.append(output_of(w, gateway, f"alone{i}"))
    assert choices == alone and len({tuple(c) for c in choices}) == 3


def test_n_choices_arriving_with_kv_fork_it_once_written(worker: Served) -> None:
    """The prompt's KV comes once; the other choices fork it and draw their first token
    from its last prompt token; the request's own first token ended it already."""
    decode_worker, gateway = worker
    expect = DecodeRequest("r", 0, task(max_tokens=6), decode_worker.identity.fingerprint,
                           ["r.1", "r.2"])
    decode_worker.intake.on_kv(KVNotice("r", 0, encode(expect)))
    assert {h.request_id for h in decode_worker.holding()} == {"r", "r.1", "r.2"}
    k, v = layer_kv(decode_worker)
    for layer in range(decode_worker.runner.spec.num_layers):
        send_layer(decode_worker, "r", layer, k, v)
    first_token(decode_worker, "r", finish_reason="stop")
    assert decode_worker.step()  # writes the KV into r.1's blocks, forks r.2, draws both
    owner, fork = decode_worker.scheduler.running
    assert (owner.key[0], fork.key[0]) == ("r.1", "r.2") and owner.blocks != fork.blocks
    for sequence in (owner, fork):  # 8 of 16 tokens: the partial block was copied
        cached_k, cached_v = decode_worker.runner.cache.read(sequence.blocks, PROMPT_LEN - 1)
        assert torch.equal(cached_k, k[:, :PROMPT_LEN - 1])
        assert torch.equal(cached_v, v[:, :PROMPT_LEN - 1])
    outputs = outputs_of(decode_worker, gateway, ["r.1", "r.2"])
    assert [len(o) for o in outputs] == [6, 6]
    assert decode_worker.scheduler.cache.num_available == 256


def events_of_steps(worker: DecodeWorker, gateway: zmq.Socket, steps: int) -> list[TokenEvent]:
    """The token events of the worker's next `steps` steps, in order."""
    for _ in range(steps):
        assert worker.step()
    return [e for m in sent_to_gateway(worker, gateway) if isinstance(m, TokenBatch)
            for e in m.events]


def test_kv_from_a_prefill_worker_reports_its_transfer_and_first_step_once(worker) -> None:
    decode_worker, gateway = worker
    announce(decode_worker, "r")
    k, v = layer_kv(decode_worker)
    for layer in range(decode_worker.runner.spec.num_layers):
        send_layer(decode_worker, "r", layer, k, v)
        time.sleep(0.02)  # the layers arrive as they are computed
    began = time.monotonic()  # before the KV is whole: first_decode can only be shorter
    first_token(decode_worker, "r")
    time.sleep(0.03)  # waiting for the next step
    first, second = events_of_steps(decode_worker, gateway, 2)
    stages = {s.stage: s.seconds for s in first.stages}
    assert first.index == 1 and list(stages) == ["kv_transfer", "first_decode"]
    assert stages["kv_transfer"] >= 0.02 * decode_worker.runner.spec.num_layers
    assert 0.03 <= stages["first_decode"] <= time.monotonic() - began
    assert second.stages == []


def test_a_prompt_prefilled_here_reports_its_prefill_then_its_first_decode_step(worker) -> None:
    decode_worker, gateway = worker
    job = task(100)
    decode_worker.handle(PrefillRequest("p", 0, job, decode_worker.worker_id, ""))
    time.sleep(0.05)  # queued here
    events = events_of_steps(decode_worker, gateway, 3)
    assert [e.index for e in events] == [0, 1, 2]
    prefill = {s.stage: s.seconds for s in events[0].stages}
    assert list(prefill) == ["prefill_wait", "prefill_compute"]
    assert prefill["prefill_wait"] >= 0.05 and prefill["prefill_compute"] > 0
    assert [s.stage for s in events[1].stages] == ["first_decode"]  # no transfer: KV is here
    assert events[2].stages == []


def test_it_registers_its_cpus_threads_and_batch_bound(worker: Served) -> None:
    decode_worker, _ = worker
    register = decode_worker.registration()
    assert register.role == "decode" and register.cpus == sorted(os.sched_getaffinity(0))
    assert register.threads == torch.get_num_threads()
    assert register.max_running == decode_worker.scheduler.max_running == 64


def first_events(worker: DecodeWorker, gateway: zmq.Socket) -> dict[str, TokenEvent]:
    """Step until idle; each request's first token event."""
    while worker.step():
        pass
    return {e.request_id: e for m in sent_to_gateway(worker, gateway)
            if isinstance(m, TokenBatch) for e in m.events if e.index == 0}


def test_prompts_prefilled_here_reuse_the_blocks_of_earlier_prompts_and_answers(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    prompt = list(range(3, 73))  # 70 tokens: 4 full blocks before its last token
    (tmp_path / "cold").mkdir()
    with serving(tiny_model_dir, tmp_path / "cold", prefix_caching=False) as (w, g):
        prefill_here(w, "a", prompt, 12)
        first = output_of(w, g, "a")
        follow_up = [*prompt, *first, 5, 6]  # the answer's KV, and two tokens more
        prefill_here(w, "c", follow_up, 12)
        cold = output_of(w, g, "c")
    (tmp_path / "warm").mkdir()
    with serving(tiny_model_dir, tmp_path / "warm") as (w, g):
        prefill_here(w, "a", prompt, 12)
        assert output_of(w, g, "a") == first
        prefill_here(w, "b", prompt, 12)
        prefill_here(w, "c", follow_up, 12)
        events = first_events(w, g)
        assert events["b"].cached_tokens == 64  # the last token's block is computed again
        assert events["c"].cached_tokens == 80  # prompt + 10 answer tokens: 5 full blocks
        prefill_here(w, "c2", follow_up, 12)
        assert output_of(w, g, "c2") == cold
        assert w.scheduler.cache.num_available == 256 and not admitted(w)


def fed_tokens(worker: DecodeWorker) -> list[int]:
    """The tokens each forward pass of the worker feeds, from now on (a list it appends to)."""
    fed: list[int] = []
    forward = worker.runner.forward

    def counting(batch: ForwardBatch, layer_hook: Callable[[int], None] | None = None
                 ) -> torch.Tensor:
        fed.append(batch.num_tokens)
        return forward(batch, layer_hook)

    worker.runner.forward = counting  # type: ignore[method-assign]
    return fed


def rows_cost(monkeypatch: pytest.MonkeyPatch, fixed: float, per_row: float) -> None:
    """Every worker's steps cost `fixed + rows * per_row` as its guessing policy sees them
    (per_row 0: a guess costs nothing, so every sequence guesses all it may, every step)."""
    monkeypatch.setattr("decode.guessing.StepCosts.line", lambda self: (fixed, per_row))


def oracle(outputs: dict[tuple[int, ...], list[int]], wrong_after: int | None = None
           ) -> Callable[..., list[int]]:
    """A guesser that knows each prompt's output: it guesses the next k tokens right (only the
    first `wrong_after` of them, the rest off by one)."""
    def guess(tokens: list[int], k: int, min_n: int = 1) -> list[int]:
        prompt = next(p for p in outputs if tuple(tokens[:len(p)]) == p)
        done = len(tokens) - len(prompt)
        right = outputs[prompt][done:done + k]
        cut = len(right) if wrong_after is None else wrong_after
        return right[:cut] + [(token + 1) % 64 for token in right[cut:]]
    return guess


def decoded(worker: Served, prompts: list[list[int]], sampling: Sampling
            ) -> tuple[dict[str, list[tuple[Any, ...]]], list[int]]:
    """Each prompt's events (index, token, logprob, top, finish) when prefilled and decoded
    here, and the tokens each forward pass fed."""
    w, gateway = worker
    fed = fed_tokens(w)
    for i, prompt in enumerate(prompts):
        prefill_here(w, f"r{i}", prompt, 40, sampling)
    while w.step():
        pass
    events = [e for m in sent_to_gateway(w, gateway) if isinstance(m, TokenBatch)
              for e in m.events]
    assert w.scheduler.cache.num_available == 256 and not admitted(w)
    mine = {f"r{i}": [(e.index, e.token_id, e.logprob, e.top, e.finish_reason)
                      for e in events if e.request_id == f"r{i}"] for i in range(len(prompts))}
    assert all([e[0] for e in tokens] == list(range(40)) for tokens in mine.values())
    return mine, fed


@pytest.mark.parametrize("sampling", [
    GREEDY,
    Sampling(temperature=1.0, seed=11, logprobs=2),
    Sampling(temperature=0.8, top_p=0.9, seed=3, repetition_penalty=1.3,
             frequency_penalty=0.5),
], ids=["greedy", "seeded-logprobs", "penalties"])
@pytest.mark.parametrize("wrong_after", [None, 1], ids=["right", "first-right"])
def test_guessed_tokens_change_no_output(tiny_model_dir: Path, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch, sampling: Sampling,
                                          wrong_after: int | None) -> None:
    """Each request draws the tokens (and logprobs) it draws without guesses, right guesses
    or wrong, in fewer forward passes where guesses are right; every block comes back."""
    prompts = [list(range(3 + i, 30 + i)) for i in range(3)]
    (tmp_path / "plain").mkdir()
    with serving(tiny_model_dir, tmp_path / "plain") as served:
        plain, plain_fed = decoded(served, prompts, sampling)
    outputs = {tuple(p): [e[1] for e in plain[f"r{i}"]] for i, p in enumerate(prompts)}
    monkeypatch.setattr("decode.sampler.propose", oracle(outputs, wrong_after))
    rows_cost(monkeypatch, 1.0, 0.0)
    (tmp_path / "guessed").mkdir()
    with serving(tiny_model_dir, tmp_path / "guessed", speculative_tokens=4) as served:
        guessed, guessed_fed = decoded(served, prompts, sampling)
        beat = served[0].heartbeat()
    # The same tokens; logprobs to rounding (rows of a longer pass: other reduction orders).
    assert _tokens(guessed) == _tokens(plain)
    assert _numbers(guessed) == pytest.approx(_numbers(plain), abs=1e-4)
    # Right guesses: up to 5 tokens a step; the first right: 2 (the guess and the draw after).
    per_step = 5 if wrong_after is None else 2
    assert len(guessed_fed) == 1 + math.ceil(39 / per_step)
    assert len(plain_fed) == 40
    guesses = sum(fed - 3 for fed in guessed_fed[1:])  # each step's tokens beyond the 3 last
    guessing_steps = sum(fed > 3 for fed in guessed_fed[1:])
    kept = guesses if wrong_after is None else 3 * guessing_steps  # one a step each
    assert (beat.guessed_tokens, beat.kept_guesses) == (guesses, kept)


def _tokens(events: dict[str, list[tuple[Any, ...]]]) -> dict[str, list[tuple[Any, ...]]]:
    """Each event's index, token, top token ids and finish reason."""
    return {key: [(index, token, [t.token_id for t in top], finish)
                  for index, token, _, top, finish in tokens] for key, tokens in events.items()}


def _numbers(events: dict[str, list[tuple[Any, ...]]]) -> list[float]:
    """Every logprob of the events, the tops' included, in order."""
    return [number for tokens in events.values() for _, _, logprob, top, _ in tokens
            for number in ([] if logprob is None else [logprob, *(t.logprob for t in top)])]


@pytest.mark.parametrize("wrong_after", [None, 1], ids=["right", "first-right"])
def test_guesses_under_a_grammar_change_no_output(tiny_model_dir: Path, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch,
                                                  wrong_after: int | None) -> None:
    """A structured-output request's guesses are drawn under its grammar's state after the
    tokens before them: the same valid JSON, token for token."""
    values = ["alpha beta gamma delta epsilon", "zeta eta theta iota kappa"]
    grammar = json.dumps({"type": "object", "properties": {"k": {"enum": values}},
                          "required": ["k"]})
    job = replace(grammar_task(grammar), max_tokens=60)
    outputs = []
    rows_cost(monkeypatch, 1.0, 0.0)
    for k in (0, 4):
        (tmp_path / str(k)).mkdir()
        with serving(tiny_model_dir, tmp_path / str(k), speculative_tokens=k) as (w, gateway):
            w.handle(PrefillRequest("json", 0, job, w.worker_id, w.kv_address, []))
            compiled(w, grammar)
            while w.step():
                pass
            outputs.append([e.token_id for m in sent_to_gateway(w, gateway)
                            if isinstance(m, TokenBatch) for e in m.events])
            assert w.scheduler.cache.num_available == 256
        if k == 0:
            right = {tuple(job.prompt_ids): outputs[0]}
            monkeypatch.setattr("decode.sampler.propose", oracle(right, wrong_after))
    assert outputs[1] == outputs[0]
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert json.loads(decode_text(tokenizer, outputs[0][:-1]))["k"] in values
    assert len(outputs[0]) > 10


def test_guesses_that_miss_thin_out(tiny_model_dir: Path, tmp_path: Path,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Always wrong, where a guess's row costs a seventh of a lone sequence's step: the
    sequence guesses both tokens it may at first (the worker's hopeful start), then ever
    more seldom as its rate and the worker's fall; the output is as without guesses."""
    prompts = [list(range(3, 30))]
    (tmp_path / "plain").mkdir()
    with serving(tiny_model_dir, tmp_path / "plain") as served:
        plain, _ = decoded(served, prompts, GREEDY)
    monkeypatch.setattr("decode.sampler.propose", lambda tokens, k: [0] * k)
    rows_cost(monkeypatch, 6.0, 1.0)
    (tmp_path / "guessed").mkdir()
    with serving(tiny_model_dir, tmp_path / "guessed", speculative_tokens=2) as served:
        guessed, fed = decoded(served, prompts, GREEDY)
        beat = served[0].heartbeat()
    assert _tokens(guessed) == _tokens(plain)
    guesses = [tokens - 1 for tokens in fed[1:]]  # each decoding step's, after the prompt
    assert guesses[0] == 2
    assert 0 < sum(map(bool, guesses[20:])) <= 4 < sum(map(bool, guesses[:20]))
    assert (beat.guessed_tokens, beat.kept_guesses) == (sum(guesses), 0)


def test_an_embedding_prefilled_here_comes_with_its_first_token_and_frees_its_blocks(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    prompt = list(range(3, 73))  # 70 tokens: chunks of 16, and 4 full blocks to cache
    expected = last_hidden_state(tiny_model_dir, prompt)
    task = GenerationTask(prompt, GREEDY, 1, [], True, embedding=True)
    with serving(tiny_model_dir, tmp_path, chunk_tokens=16) as (w, gateway):
        arrive(w, "running", max_tokens=40)  # decoding beside the prompts' chunks
        firsts: list[TokenEvent] = []
        for request_id in ("cold", "warm"):
            w.handle(PrefillRequest(request_id, 0, task, w.worker_id, w.kv_address))
            while w.step():
                pass
            events = [e for m in sent_to_gateway(w, gateway) if isinstance(m, TokenBatch)
                      for e in m.events]
            (first,) = [e for e in events if e.request_id == request_id]
            assert first.finish_reason == "length"
            assert is_hidden_state(first.embedding, expected)
            assert all(not e.embedding for e in events if e.request_id != request_id)
            firsts.append(first)
        assert [first.cached_tokens for first in firsts] == [0, 64]
        assert w.scheduler.cache.num_available == 256 and not admitted(w)
