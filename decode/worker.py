"""The decode worker: receive KV into the paged pool, run continuous batching, stream tokens."""

from __future__ import annotations

import logging
import time

import torch
import zmq

from core.codec import MalformedMessage
from core.config import Config
from core.curve import keys_for
from core.messages import (
    Abort,
    DecodeRequest,
    DropCount,
    FirstToken,
    Heartbeat,
    Held,
    Message,
    PrefillRequest,
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
                                         config.decode.max_running, config.decode.chunk_tokens)
        self.receiver = make_receiver(self.context, config.decode.kv_bind, self.keys)
        self.kv_address = self.receiver.address
        self.poller.register(self.receiver.fileno_socket(), zmq.POLLIN)
        spec = runner.spec
        self.incoming = IncomingTable(spec.num_layers, (spec.num_kv_heads, spec.head_dim),
                                      dtype_name(runner.cache.dtype), fingerprint,
                                      config.kv_transfer.lease_s)
        # Requests ended here (aborted, finished): a late or repeated request for one is dropped
        self.ended: dict[Key, float] = {}
        self.rejected_requests = 0
        self.grammars = Grammars(runner.model_dir, spec.vocab_size)

    def handle(self, message: Message) -> None:
        if isinstance(message, Abort):
            self._abort((message.request_id, message.epoch))
        elif isinstance(message, PrefillRequest):
            self._prefill_here(message)
        else:
            log.warning("decode worker ignored %s", type(message).__name__)

    def on_poll(self, ready: dict[zmq.Socket, int]) -> None:
        if self.receiver.fileno_socket() in ready:
            self.receiver.drain(self._on_kv)

    def step(self) -> bool:
        admitted, running = self.scheduler.schedule()
        for sequence in admitted:
            self._write_received_kv(sequence)
        batch = self.scheduler.chunk(running)
        if not batch:
            return False
        logits = self.runner.forward(ForwardBatch(
            token_ids=[s.tokens[s.num_cached:s.num_cached + s.num_scheduled] for s in batch],
            start_positions=[s.num_cached for s in batch],
            block_tables=[s.blocks for s in batch],
        ), layer_hook=self.between_layers)
        for sequence in batch:
            sequence.num_cached += sequence.num_scheduled
        rows = [i for i, s in enumerate(batch) if s.num_cached == len(s.tokens)]
        self._sample([batch[i] for i in rows], logits[rows])
        return True

    def _sample(self, ready: list[DecodeSequence], logits: torch.Tensor) -> None:
        """Draw the next token of each sequence whose KV is complete; stream them."""
        if not ready:
            return  # only prompt chunks this step
        draws = draw(logits, [s.request.task.sampling for s in ready],
                     [s.generator for s in ready], [self._history(s) for s in ready])
        self.control.send(TokenBatch([self._advance(s, d) for s, d in zip(ready, draws,
                                                                          strict=True)]))

    def _history(self, sequence: DecodeSequence) -> History:
        """Its tokens, for the penalties; EOS and stop tokens banned under min_tokens; the
        tokens its grammar allows."""
        task = sequence.request.task
        banned = banned_tokens(task, sequence.num_generated, self.runner.spec.eos_token_ids)
        constraint = sequence.constraint
        allowed = None if constraint is None else constraint.allowed()
        return History(sequence.tokens, task.prompt_len, banned, allowed)

    def _advance(self, sequence: DecodeSequence, token: Draw) -> TokenEvent:
        sequence.tokens.append(token.token_id)
        sequence.num_generated += 1
        task = sequence.request.task
        if sequence.num_generated == 1:  # prefilled here: the rest draws as decode would
            sequence.generator = make_generator(_decode_seed(task.sampling.seed))
        if sequence.constraint is not None:
            sequence.constraint.advance(token.token_id)
        eos = self.runner.spec.eos_token_ids
        reason = finish_reason(task, token.token_id, sequence.num_generated, eos)
        if reason is not None:
            self.scheduler.remove(sequence)
            self.ended[sequence.key] = time.monotonic() + _TOMBSTONE_TTL_S
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
            elif key not in self.ended:
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
        self._queue(DecodeSequence(
            request=request, tokens=[*request.task.prompt_ids, first_token],
            num_generated=1, received_kv=entry.layers,
            generator=make_generator(_decode_seed(request.task.sampling.seed))))

    def _prefill_here(self, message: PrefillRequest) -> None:
        """Conditional disaggregation: the gateway sent the prompt to this worker, which
        prefills it in chunks inside its decode batches and draws its first token itself."""
        key = (message.request_id, message.epoch)
        if self.scheduler.find(key) is not None or key in self.ended:
            return  # a repeat, or already aborted
        task = message.task
        request = DecodeRequest(*key, task, self.identity.fingerprint)
        self._queue(DecodeSequence(request=request, tokens=list(task.prompt_ids),
                                   num_generated=0,
                                   generator=make_generator(task.sampling.seed)))

    def _queue(self, sequence: DecodeSequence) -> None:
        """Queue the sequence for a decode slot, once its grammar compiles and it fits."""
        key = sequence.key
        try:
            sequence.constraint = self._constraint(sequence)
        except GrammarError as exc:
            self._fail(key, f"invalid grammar: {exc}")
            return
        if not self.scheduler.fits_at_all(sequence):
            self._fail(key, "the request does not fit the decode KV pool")
            return
        self.scheduler.add(sequence)

    def _constraint(self, sequence: DecodeSequence) -> Constraint | None:
        """The task's grammar state after the tokens generated so far; None without one."""
        task = sequence.request.task
        constraint = self.grammars.constraint(task, self.runner.spec.eos_token_ids)
        if constraint is not None:
            for token in sequence.tokens[len(task.prompt_ids):]:
                constraint.advance(token)
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
        else:
            self.incoming.take(key)
        self.ended[key] = time.monotonic() + _TOMBSTONE_TTL_S

    def heartbeat(self) -> Heartbeat:
        now = time.monotonic()
        self.ended = {k: t for k, t in self.ended.items() if t > now}
        for key in self.incoming.expire(now):
            self._fail(key, "the KV did not arrive in time")
        dropped = self.receiver.dropped + self.incoming.dropped
        return Heartbeat(
            worker_id=self.worker_id, instance_id=self.instance_id,
            queued_tokens=self.scheduler.prompt_tokens_pending,
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
