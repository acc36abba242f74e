"""The decode worker: receive KV into the paged pool, run continuous batching, stream tokens."""

from __future__ import annotations

import logging
import time

import zmq

from core.codec import MalformedMessage
from core.config import Config
from core.messages import (
    Abort,
    DecodeRequest,
    Heartbeat,
    Message,
    RequestFailed,
    TokenBatch,
    TokenEvent,
    decode,
)
from core.worker import Worker, WorkerIdentity
from decode.scheduler import DecodeScheduler, DecodeSequence
from engine.batch import ForwardBatch
from engine.runner import ModelRunner
from engine.sampler import make_generator, sample
from engine.stopping import finish_reason
from kvtransfer import KVPayload, make_receiver

log = logging.getLogger(__name__)
_TOMBSTONE_TTL_S = 120.0


class DecodeWorker(Worker):
    def __init__(self, worker_id: str, config: Config, runner: ModelRunner, fingerprint: str):
        identity = WorkerIdentity(worker_id, "decode", fingerprint, runner.block_size,
                                  runner.allocator.num_total)
        super().__init__(identity, config.gateway.control_address,
                         config.decode.heartbeat_interval_s)
        self.runner = runner
        self.scheduler = DecodeScheduler(runner.allocator, runner.block_size,
                                         config.decode.max_running)
        self.receiver = make_receiver(self.context, config.decode.kv_bind)
        self.kv_address = self.receiver.address
        self.poller.register(self.receiver.fileno_socket(), zmq.POLLIN)
        self.aborted: dict[tuple[str, int], float] = {}  # aborts that may beat their KV here
        self.rejected_requests = 0

    def handle(self, message: Message) -> None:
        if isinstance(message, Abort):
            self._abort((message.request_id, message.epoch))
        else:
            log.warning("decode worker ignored %s", type(message).__name__)

    def on_poll(self, ready: dict[zmq.Socket, int]) -> None:
        if self.receiver.fileno_socket() in ready:
            for payload in self.receiver.drain():
                self._accept(payload)
            for rejected in self.receiver.take_rejections():
                self._fail((rejected.request_id, rejected.epoch), rejected.reason)

    def step(self) -> bool:
        admitted, batch = self.scheduler.schedule()
        for sequence in admitted:
            self._write_received_kv(sequence)
        if not batch:
            return False
        logits = self.runner.forward(ForwardBatch(
            token_ids=[s.tokens[s.num_cached:] for s in batch],
            start_positions=[s.num_cached for s in batch],
            block_tables=[s.blocks for s in batch],
        ), layer_hook=self.between_layers)
        params = [s.request.task.sampling for s in batch]
        tokens = sample(logits, params, [s.generator for s in batch])
        events = [self._advance(s, t) for s, t in zip(batch, tokens, strict=True)]
        self.control.send(TokenBatch(events))
        return True

    def _advance(self, sequence: DecodeSequence, token: int) -> TokenEvent:
        sequence.num_cached = len(sequence.tokens)
        sequence.tokens.append(token)
        sequence.num_generated += 1
        task = sequence.request.task
        reason = finish_reason(task, token, sequence.num_generated, self.runner.spec.eos_token_ids)
        if reason is not None:
            self.scheduler.remove(sequence)
        return TokenEvent(*sequence.key, sequence.num_generated - 1, token, reason)

    def _accept(self, payload: KVPayload) -> None:
        """A request arrived with its KV: queue it for admission, unless it is stale or bad."""
        try:
            request = decode(payload.header.meta)
        except MalformedMessage:
            request = None
        key = (payload.header.request_id, payload.header.epoch)
        if not isinstance(request, DecodeRequest) or not self._kv_matches(request, payload):
            self.receiver.rejected += 1
            self._fail(key, "the KV did not match its request")
            return
        if key in self.aborted or self.scheduler.find(key) is not None:
            return
        sequence = DecodeSequence(
            request=request, tokens=[*request.task.prompt_ids, request.first_token],
            num_generated=1, received_kv=(payload.k, payload.v),
            generator=make_generator(_decode_seed(request.task.sampling.seed)),
        )
        if not self.scheduler.fits_at_all(sequence):
            self._fail(key, "the request does not fit the decode KV pool")
            return
        self.scheduler.add(sequence)

    def _fail(self, key: tuple[str, int], reason: str) -> None:
        self.rejected_requests += 1
        self.control.send(RequestFailed(*key, reason))

    def _kv_matches(self, request: DecodeRequest, payload: KVPayload) -> bool:
        header, spec = payload.header, self.runner.spec
        expected = [spec.num_layers, len(request.task.prompt_ids), spec.num_kv_heads, spec.head_dim]
        return ((header.request_id, header.epoch) == (request.request_id, request.epoch)
                and header.layer_start == 0 and header.shape == expected)

    def _write_received_kv(self, sequence: DecodeSequence) -> None:
        if sequence.received_kv is None:
            return  # resumed after preemption: recomputed in the step
        k, v = sequence.received_kv
        self.runner.cache.write(sequence.blocks, 0, k, v)
        sequence.num_cached = k.shape[1]
        sequence.received_kv = None

    def _abort(self, key: tuple[str, int]) -> None:
        sequence = self.scheduler.find(key)
        if sequence is not None:
            self.scheduler.remove(sequence)
        else:
            self.aborted[key] = time.monotonic() + _TOMBSTONE_TTL_S

    def heartbeat(self) -> Heartbeat:
        now = time.monotonic()
        self.aborted = {k: t for k, t in self.aborted.items() if t > now}
        return Heartbeat(
            worker_id=self.worker_id, instance_id=self.instance_id, queued_tokens=0,
            free_blocks=self.runner.allocator.num_free, running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting), preemptions=self.scheduler.preemptions,
        )

    def close(self) -> None:
        self.receiver.close()
        super().close()


def _decode_seed(seed: int | None) -> int | None:
    """Decode's draws must not replay the draw prefill used for the first token."""
    return None if seed is None else (seed + 1) % 2**63
