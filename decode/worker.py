"""The decode worker: receive KV into the paged pool, run continuous batching, stream tokens."""

from __future__ import annotations

import logging
import time

import zmq

from core.codec import MalformedMessage
from core.config import Config
from core.curve import keys_for
from core.messages import (
    Abort,
    DecodeRequest,
    DropCount,
    FirstToken,
    GenerationTask,
    Heartbeat,
    Held,
    Message,
    RequestFailed,
    TokenBatch,
    TokenEvent,
    TransferTotals,
    decode,
)
from core.worker import Worker, WorkerIdentity
from decode.incoming import IncomingKV, IncomingTable, Key
from decode.scheduler import DecodeScheduler, DecodeSequence
from engine.batch import ForwardBatch
from engine.grammar import Constraint, GrammarError, Grammars
from engine.runner import ModelRunner
from engine.sampler import Draw, History, draw, make_generator
from engine.stopping import banned_tokens, finish_reason
from kvtransfer import KVItem, KVNotice, KVRejected, make_receiver
from kvtransfer.wire import dtype_name

log = logging.getLogger(__name__)
_TOMBSTONE_TTL_S = 120.0


class DecodeWorker(Worker):
    def __init__(self, worker_id: str, config: Config, runner: ModelRunner, fingerprint: str):
        identity = WorkerIdentity(worker_id, "decode", fingerprint, runner.block_size,
                                  runner.allocator.num_total)
        super().__init__(identity, config.gateway.control_address,
                         config.decode.heartbeat_interval_s, keys_for(config.internal))
        self.runner = runner
        self.scheduler = DecodeScheduler(runner.allocator, runner.block_size,
                                         config.decode.max_running)
        self.receiver = make_receiver(self.context, config.decode.kv_bind, self.keys)
        self.kv_address = self.receiver.address
        self.poller.register(self.receiver.fileno_socket(), zmq.POLLIN)
        spec = runner.spec
        self.incoming = IncomingTable(spec.num_layers, (spec.num_kv_heads, spec.head_dim),
                                      dtype_name(runner.cache.dtype), fingerprint,
                                      config.kv_transfer.lease_s)
        self.aborted: dict[Key, float] = {}  # aborts that may beat their KV here
        self.rejected_requests = 0
        self.grammars = Grammars(runner.model_dir, spec.vocab_size)

    def handle(self, message: Message) -> None:
        if isinstance(message, Abort):
            self._abort((message.request_id, message.epoch))
        else:
            log.warning("decode worker ignored %s", type(message).__name__)

    def on_poll(self, ready: dict[zmq.Socket, int]) -> None:
        if self.receiver.fileno_socket() in ready:
            self.receiver.drain(self._on_kv)

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
        draws = draw(logits, params, [s.generator for s in batch],
                     [self._history(s) for s in batch])
        events = [self._advance(s, d) for s, d in zip(batch, draws, strict=True)]
        self.control.send(TokenBatch(events))
        return True

    def _history(self, sequence: DecodeSequence) -> History:
        """Its tokens, for the penalties; EOS and stop tokens banned under min_tokens; the
        tokens its grammar allows."""
        task = sequence.request.task
        banned = banned_tokens(task, sequence.num_generated, self.runner.spec.eos_token_ids)
        constraint = sequence.constraint
        allowed = None if constraint is None else constraint.allowed()
        return History(sequence.tokens, task.prompt_len, banned, allowed)

    def _advance(self, sequence: DecodeSequence, token: Draw) -> TokenEvent:
        sequence.num_cached = len(sequence.tokens)
        sequence.tokens.append(token.token_id)
        sequence.num_generated += 1
        if sequence.constraint is not None:
            sequence.constraint.advance(token.token_id)
        task = sequence.request.task
        eos = self.runner.spec.eos_token_ids
        reason = finish_reason(task, token.token_id, sequence.num_generated, eos)
        if reason is not None:
            self.scheduler.remove(sequence)
        return TokenEvent(*sequence.key, sequence.num_generated - 1, token.token_id, reason,
                          token.logprob, token.top)

    def _on_kv(self, item: KVItem) -> None:
        key = item.key
        if isinstance(item, KVNotice):
            self._on_notice(key, item.meta)
        elif isinstance(item, KVRejected):
            if self.incoming.take(key) is not None:
                self._fail(key, item.reason)
        else:
            failure = self.incoming.add(item)
            if failure is not None:
                self._fail(key, failure)

    def _on_notice(self, key: Key, meta: bytes) -> None:
        try:
            message = decode(meta)
        except MalformedMessage:
            message = None
        if not isinstance(message, DecodeRequest | FirstToken) or (
                (message.request_id, message.epoch) != key):
            self.incoming.dropped["malformed notice"] += 1
            return
        if isinstance(message, DecodeRequest):
            if self.scheduler.find(key) is not None:
                self.incoming.dropped["duplicate request"] += 1  # a repeated hand-off
            elif key not in self.aborted:
                problem = self.incoming.expect(message, time.monotonic())
                if problem is not None:
                    self._fail(key, problem)
            return
        entry = self.incoming.take(key)
        if entry is not None and message.finish_reason is None:
            self._admit(entry, message.token_id)

    def _admit(self, entry: IncomingKV, first_token: int) -> None:
        """All layers and the first token are here: queue the sequence for a decode slot."""
        request = entry.request
        key = (request.request_id, request.epoch)
        if not self.incoming.is_complete(entry):
            self._fail(key, f"KV ended at layer {entry.next_layer}, before the last one")
            return
        try:
            constraint = self._constraint(request.task, first_token)
        except GrammarError as exc:
            self._fail(key, f"invalid grammar: {exc}")
            return
        sequence = DecodeSequence(
            request=request, tokens=[*request.task.prompt_ids, first_token],
            num_generated=1, received_kv=entry.layers,
            generator=make_generator(_decode_seed(request.task.sampling.seed)),
            constraint=constraint,
        )
        if not self.scheduler.fits_at_all(sequence):
            self._fail(key, "the request does not fit the decode KV pool")
            return
        self.scheduler.add(sequence)

    def _constraint(self, task: GenerationTask, first_token: int) -> Constraint | None:
        """The task's grammar state after its first token; None without a grammar."""
        constraint = self.grammars.constraint(task, self.runner.spec.eos_token_ids)
        if constraint is not None:
            constraint.advance(first_token)
        return constraint

    def _fail(self, key: Key, reason: str) -> None:
        self.rejected_requests += 1
        self.control.send(RequestFailed(*key, reason))

    def _write_received_kv(self, sequence: DecodeSequence) -> None:
        if sequence.received_kv is None:
            return  # resumed after preemption: recomputed in the step
        for layer_start, k, v in sequence.received_kv:
            self.runner.cache.write(sequence.blocks, 0, k, v, layer_start)
        sequence.num_cached = len(sequence.request.task.prompt_ids)
        sequence.received_kv = None

    def _abort(self, key: Key) -> None:
        sequence = self.scheduler.find(key)
        if sequence is not None:
            self.scheduler.remove(sequence)
        elif self.incoming.take(key) is None:
            self.aborted[key] = time.monotonic() + _TOMBSTONE_TTL_S

    def heartbeat(self) -> Heartbeat:
        now = time.monotonic()
        self.aborted = {k: t for k, t in self.aborted.items() if t > now}
        for key in self.incoming.expire(now):
            self._fail(key, "the KV did not arrive in time")
        dropped = self.receiver.dropped + self.incoming.dropped
        return Heartbeat(
            worker_id=self.worker_id, instance_id=self.instance_id, queued_tokens=0,
            free_blocks=self.runner.allocator.num_free, running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting), preemptions=self.scheduler.preemptions,
            transfers=[TransferTotals("any", "receive", **vars(self.receiver.counters))],
            dropped_chunks=[DropCount(reason, n) for reason, n in sorted(dropped.items())],
            in_transfer=len(self.incoming.pending), leases_expired=self.incoming.expired,
            progress=self.progress, holding=self.holding(),
            rejected_peers=self.receiver.rejected_peers,
        )

    def holding(self) -> list[Held]:
        sequences = [*self.scheduler.running, *self.scheduler.waiting]
        return [Held(*key) for key in [*self.incoming.pending, *(s.key for s in sequences)]]

    def close(self) -> None:
        self.receiver.close()
        super().close()


def _decode_seed(seed: int | None) -> int | None:
    """Decode's draws must not replay the draw prefill used for the first token."""
    return None if seed is None else (seed + 1) % 2**63
