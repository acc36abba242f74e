"""The decode worker: receive KV into the paged pool, run continuous batching, stream tokens."""

from __future__ import annotations

import logging
import time

import torch
import zmq

from core.config import Config
from core.messages import (
    Abort,
    DropCount,
    Heartbeat,
    Held,
    Message,
    PrefillRequest,
    RequestKey,
    SharedPrefix,
    SharePrefix,
    TokenBatch,
    TransferTotals,
)
from core.worker import Worker, WorkerIdentity
from decode.admission import Admission
from decode.batch import decode_rows, forward_batch, is_scored, score_prompts
from decode.incoming import IncomingTable
from decode.intake import Intake
from decode.phases import Phases
from decode.pulls import Pulls
from decode.sampler import Sampler
from decode.scheduler import DecodeScheduler, DecodeSequence
from engine.kv.prefix_cache import capacity
from engine.runner import Runner
from engine.sampling.grammar import Grammars
from kvtransfer import make_receiver, make_sender
from kvtransfer.share import share_prefix
from kvtransfer.wire import dtype_name

log = logging.getLogger(__name__)


class DecodeWorker(Worker):
    """Requests come in through `intake` (decode/intake.py) and wait for a slot in `admission`
    (decode/admission.py); each step runs the scheduler's batch in one forward pass
    (decode/batch.py), whose logits `sampler` (decode/sampler.py) draws the next tokens from."""

    def __init__(self, worker_id: str, config: Config, runner: Runner) -> None:
        identity = WorkerIdentity(worker_id, "decode", runner.kv_fingerprint,
                                  runner.block_size, runner.allocator.num_total,
                                  torch.get_num_threads(), config.decode.max_running,
                                  isa=runner.kernel_isa,
                                  prefix_caching=config.decode.prefix_caching,
                                  kv_bytes_per_token=runner.cache.bytes_per_token,
                                  cache_blocks=capacity(runner.allocator.num_total,
                                                        config.decode.prefix_cache_share))
        super().__init__(identity, config)
        self.runner = runner
        self.scheduler = DecodeScheduler(runner.allocator, runner.block_size,
                                         config.decode.max_running, config.decode.chunk_tokens,
                                         runner.chunk_cost, config.decode.prefix_caching,
                                         config.decode.prefix_cache_share,
                                         runner.spec.sliding_window)
        self.receiver = make_receiver(self.context, config.decode.kv_bind, self.keys)
        self.kv_address = self.receiver.address
        self.poller.register(self.receiver.fileno_socket(), zmq.POLLIN)
        spec = runner.spec
        self.incoming = IncomingTable(spec.num_layers, (spec.num_kv_heads, spec.head_dim),
                                      dtype_name(runner.cache.dtype), identity.fingerprint,
                                      config.kv_transfer.lease_s)
        self.phases = Phases(self.incoming, self.scheduler)
        self.sender = make_sender(self.context, config.kv_transfer, self.keys, runner.device)
        self.sender.while_waiting = self.maybe_heartbeat  # a dead receiver's connect wait
        self.chunk_bytes = int(config.kv_transfer.chunk_mb * 2**20)
        self.pulls = Pulls()
        self.grammars = Grammars(runner.model_dir, spec.vocab_size)
        self.grammar_tables_at_start = config.engine.grammar_tables_at_start
        self.admission = Admission(self.scheduler, self.phases, self.grammars,
                                   spec.eos_token_ids, self.control)
        self.intake = Intake(self.incoming, self.pulls, self.phases, self.admission,
                             self.control, identity, self.kv_address, self.host, runner.device,
                             config)
        self.sampler = Sampler(self.scheduler, self.phases, runner, self.control, self.tracer,
                               config.decode)

    def after_registering(self) -> None:
        if self.grammar_tables_at_start:
            self.grammars.warm_up()

    def handle(self, message: Message) -> None:
        if isinstance(message, Abort):
            self._abort(message.key)
        elif isinstance(message, PrefillRequest):
            self.intake.prefill_here(message)
        elif isinstance(message, SharePrefix):
            self._share(message)
        elif isinstance(message, SharedPrefix):
            self.intake.on_shared(message)  # from the gateway: the holder is gone
        else:
            log.warning("decode worker ignored %s", type(message).__name__)

    def on_poll(self, ready: dict[zmq.Socket, int]) -> None:
        if self.receiver.fileno_socket() in ready:
            self.receiver.drain(self.intake.on_kv)

    def step(self) -> bool:
        self.admission.queue_compiled()
        self.sampler.guess_next_tokens()
        admitted, running = self.scheduler.schedule()
        for sequence in admitted:
            if sequence.received_kv is not None:  # else resumed after preemption: recomputed
                self._take_received_kv(sequence)
        batch = self.scheduler.chunk(running)
        if not batch:
            return False
        now = time.monotonic()
        prompt_tokens = _start_prompts(batch, now)
        scored = [is_scored(s) for s in batch]
        decoding_rows = decode_rows(batch, scored)  # before the step clears the drafts
        with self.turns:
            started = time.monotonic()
            logits = self.runner.forward(forward_batch(batch, scored),
                                         layer_hook=self.between_layers)
        self.pulls.pace.observe(prompt_tokens, time.monotonic() - now)
        events = self.sampler.draw_next(batch, logits, score_prompts(batch, scored, logits))
        if decoding_rows:  # what the step cost, but its wait for its turn
            self.sampler.guessing.costs.observe(decoding_rows, time.monotonic() - started)
        if events:
            self.control.send(TokenBatch(events))
        return True

    def _share(self, asked: SharePrefix) -> None:
        share_prefix(asked, self.scheduler.cache, self.runner.cache, self.sender,
                     self.identity.fingerprint, self.chunk_bytes, self.host)

    def _take_received_kv(self, sequence: DecodeSequence) -> None:
        """Write the KV it received into its blocks; fork its other choices once it has its
        first token."""
        assert sequence.received_kv is not None
        for part in sequence.received_kv:
            self.runner.cache.write(sequence.blocks, part.token_start, part.k, part.v,
                                    part.layer_start)
        sequence.num_cached = max(p.token_start + p.k.shape[1] for p in sequence.received_kv)
        if sequence.num_generated == 0:  # a pulled prefix: the rest is computed here
            sequence.num_reused = sequence.num_cached
        sequence.received_kv = None
        # a choice with no first token yet draws it from its prompt's last token
        sequence.num_cached = min(sequence.num_cached, len(sequence.tokens) - 1)
        if sequence.num_generated:  # else (a pulled prefix) the rest is computed first
            self.sampler.fork(sequence, drawing=False)

    def _abort(self, key: RequestKey) -> None:
        sequence = self.scheduler.find(key)
        if sequence is not None:
            self.scheduler.remove(sequence)
            self.sampler.trace_end(sequence, "abort")
        elif key in self.phases.compiling:
            self.admission.abort_compiling(key)
        else:
            self.incoming.take(key)
            self.pulls.take(key)
        for fork in self.phases.forks.pop(key, []):  # the others go on, computing the prompt
            fork.num_cached = 0
            self.scheduler.add(fork)
        self.phases.end(key, time.monotonic())

    def heartbeat(self) -> Heartbeat:
        now = time.monotonic()
        self.phases.forget_ended(now)
        self.intake.expire(now)
        dropped = self.receiver.dropped + self.incoming.dropped
        return Heartbeat(
            worker_id=self.worker_id, instance_id=self.instance_id,
            queued_tokens=self.scheduler.prompt_tokens_pending,
            free_blocks=self.scheduler.cache.num_available, running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting), preemptions=self.scheduler.preemptions,
            guessed_tokens=self.sampler.guessed_tokens, kept_guesses=self.sampler.kept_guesses,
            transfers=[TransferTotals("any", "receive", **vars(self.receiver.counters)),
                       *(TransferTotals(backend, "send", **vars(counters))
                         for backend, counters in self.sender.totals())],
            dropped_chunks=[DropCount(reason, n) for reason, n in sorted(dropped.items())],
            in_transfer=len(self.incoming.pending), leases_expired=self.incoming.expired,
            progress=self.progress, holding=self.holding(),
            rejected_peers=self.receiver.rejected_peers,
            pulls=self.pulls.totals, prefill_s_per_token=self.pulls.pace.s_per_token,
        )

    def holding(self) -> list[Held]:
        return [Held(*key) for key in self.phases.held()]

    def drained(self) -> bool:
        return super().drained() and self.sender.staged == 0

    def close(self) -> None:
        self.grammars.close()
        self.receiver.close()
        self.sender.close()
        super().close()


def _start_prompts(batch: list[DecodeSequence], now: float) -> int:
    """Start the timeline of each sequence whose prompt this step computes; how many of its
    tokens the step computes."""
    prompt_tokens = 0
    for sequence in batch:
        if sequence.num_generated == 0:
            sequence.timeline.start(now)
            prompt_tokens += sequence.num_scheduled
    return prompt_tokens
