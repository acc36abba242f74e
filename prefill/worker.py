"""The prefill worker: batch prompts (long ones a chunk per step), compute their KV, send the
first token and hand off the KV, chunk by chunk and layer by layer."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from core.config import Config
from core.logs import about
from core.messages import (
    Abort,
    FinishReason,
    FirstToken,
    Heartbeat,
    Held,
    Message,
    PrefillRequest,
    RequestFailed,
    RequestKey,
    SharePrefix,
    TransferTotals,
    choice_keys,
)
from core.timeline import Timeline
from core.worker import Worker, WorkerIdentity, retry_elsewhere
from engine.kv.allocator import blocks_needed
from engine.kv.block_hash import block_hashes
from engine.kv.prefix_cache import PrefixCache, capacity
from engine.model.batch import ForwardBatch
from engine.pooling import embedding_bytes
from engine.runner import Runner
from engine.sampling.grammar import Grammars, history_of
from engine.sampling.sampler import Draw, draw, make_generator, seed_at
from engine.sampling.stopping import finish_reason
from kvtransfer import make_sender
from kvtransfer.share import share_prefix
from prefill.handoff import LayerStream
from prefill.scheduler import Chunk, PrefillScheduler

log = logging.getLogger(__name__)


@dataclass
class _Job:
    """One prompt in progress: its prompt's block hashes, its block table (for the whole
    prompt, held across its chunks), how many of its prompt tokens were cached already, and
    when it arrived and started."""

    request: PrefillRequest
    chain: list[bytes]
    table: list[int]
    cached: int
    timeline: Timeline = field(default_factory=Timeline)


class _StepAborted(Exception):
    """Every request of the step in the forward pass was aborted: stop it."""


class PrefillWorker(Worker):
    def __init__(self, worker_id: str, config: Config, runner: Runner) -> None:
        identity = WorkerIdentity(worker_id, "prefill", runner.kv_fingerprint,
                                  runner.block_size, runner.allocator.num_total,
                                  torch.get_num_threads(), isa=runner.kernel_isa,
                                  prefix_caching=config.prefill.prefix_caching,
                                  kv_bytes_per_token=runner.cache.bytes_per_token,
                                  cache_blocks=capacity(runner.allocator.num_total,
                                                        config.prefill.prefix_cache_share))
        super().__init__(identity, config)
        self.runner = runner
        self.scheduler = PrefillScheduler(config.prefill.max_batch_tokens, runner.block_size,
                                          config.prefill.chunk_tokens,
                                          config.prefill.ttft_ms_per_token / 1000,
                                          runner.chunk_cost)
        self.sender = make_sender(self.context, config.kv_transfer, self.keys, runner.device)
        self.sender.while_waiting = self.maybe_heartbeat  # a dead receiver's connect wait
        self.chunk_bytes = int(config.kv_transfer.chunk_mb * 2**20)
        self.stream = LayerStream(self.sender, runner.cache, identity.fingerprint,
                                  self.chunk_bytes, self.host)
        self.cache = PrefixCache(runner.allocator, config.prefill.prefix_cache_share)
        self.prefix_caching = config.prefill.prefix_caching
        self.jobs: dict[RequestKey, _Job] = {}  # the prompts in progress
        self.arrivals: dict[RequestKey, float] = {}  # when each queued prompt arrived
        self.in_step: set[RequestKey] = set()  # the prompts in the forward pass now
        self.aborted_in_step: set[RequestKey] = set()
        self.grammars = Grammars(runner.model_dir, runner.spec.vocab_size)
        self.grammar_tables_at_start = config.engine.grammar_tables_at_start
        self.compiling: dict[RequestKey, PrefillRequest] = {}  # until their grammar compiles

    def after_registering(self) -> None:
        if self.grammar_tables_at_start:
            self.grammars.warm_up()

    def handle(self, message: Message) -> None:
        if isinstance(message, PrefillRequest):
            self._add(message)
        elif isinstance(message, Abort):
            if self.compiling.pop(message.key, None) is not None:
                return
            if message.key in self.in_step:
                self.aborted_in_step.add(message.key)  # it stops streaming at the next layer
            elif self.scheduler.abort(message.key):
                self._drop(message.key)
        elif isinstance(message, SharePrefix):
            share_prefix(message, self.cache, self.runner.cache, self.sender,
                         self.identity.fingerprint, self.chunk_bytes, self.host)
        else:
            log.warning("prefill worker ignored %s", type(message).__name__)

    def _add(self, request: PrefillRequest) -> None:
        """Queue the request (unless it is here already) once its grammar, if any, has
        compiled: until then it waits in `compiling`, off the scheduler."""
        if self.scheduler.holds(request.key) or request.key in self.compiling:
            return  # a repeat
        log.info("request %s: %d prompt tokens", request.request_id,
                 len(request.task.prompt_ids), extra=about(request.key))
        if request.task.grammar and not self.grammars.ready(request.task.grammar):
            self.compiling[request.key] = request
            return
        self._schedule(request)

    def _schedule(self, request: PrefillRequest) -> None:
        problem = self.grammars.problem(request.task.grammar) if request.task.grammar else None
        if problem is not None:
            log.warning("request %s: %s", request.request_id, problem, extra=about(request.key))
            self.control.send(RequestFailed(request.request_id, request.epoch, problem))
            return
        arrived = time.monotonic()
        self.scheduler.add(request, arrived)
        self.arrivals[request.key] = arrived

    def _schedule_compiled(self) -> None:
        """Queue the requests whose grammar has compiled since."""
        for request in self.grammars.take_ready(self.compiling, lambda r: r.task.grammar):
            self._schedule(request)

    def step(self) -> bool:
        self._schedule_compiled()
        chunks = self.scheduler.schedule(self.cache.num_available, self._start)
        stopped = self._stop_broken_handoffs()  # announced to nobody: compute nothing for them
        chunks = [c for c in chunks if c.prompt.key not in stopped]
        if not chunks:
            return bool(stopped)
        self.in_step = {c.prompt.key for c in chunks}
        try:
            self._prefill(chunks)
        except _StepAborted:
            log.info("every request of a step was aborted mid-prefill")
        finally:
            for key in self.aborted_in_step:
                self.scheduler.abort(key)
                self._drop(key)
            self.in_step, self.aborted_in_step = set(), set()
        self._stop_broken_handoffs()
        return True

    def _stop_broken_handoffs(self) -> set[RequestKey]:
        """A prompt whose KV could not reach its decode worker computes no more chunks here:
        the gateway serves it again on another pair. The prompts stopped."""
        broken = self.stream.broken()
        for key, failure in broken.items():
            request = self.jobs[key].request
            queued = self.scheduler.abort(key)
            assert queued, "a prompt still streaming is still scheduled"
            self._drop(key)
            self._report_failure(request, failure)
        return set(broken)

    def _start(self, request: PrefillRequest) -> int:
        """Admit a prompt: reserve its blocks, announce it to its decode worker; how many of
        its tokens are cached."""
        job = self._plan(request)
        now = time.monotonic()  # its first chunk's forward pass comes next
        job.timeline = Timeline(arrived=self.arrivals.pop(request.key, now), started=now)
        self.jobs[request.key] = job
        # With one token to make and no other choice (n > 1) to fork, decode never sees it.
        if request.task.max_tokens > 1 or request.siblings:
            self.stream.start(request, job.table)
        return job.cached

    def _plan(self, request: PrefillRequest) -> _Job:
        """Reuse the cached blocks of the prompt's longest cached prefix (short of its last
        token, which the forward pass must compute for the logits); allocate the rest."""
        prompt, size = request.task.prompt_ids, self.runner.block_size
        chain = block_hashes(prompt, size, request.task.cache_salt) if self.prefix_caching else []
        table, reused = self.cache.table(chain[:(len(prompt) - 1) // size],
                                         blocks_needed(len(prompt), size))
        return _Job(request, chain, table, reused * size)

    def _drop(self, key: RequestKey) -> None:
        """Forget a prompt in progress (aborted): free its blocks, stop its stream."""
        job = self.jobs.pop(key, None)
        self.arrivals.pop(key, None)
        if job is not None:
            self.cache.release(job.table)
        self.stream.forget(key)

    def _prefill(self, chunks: list[Chunk]) -> None:
        """One forward pass over the chunks, streaming their KV; the first token of each
        prompt whose last chunk this was."""
        self.stream.begin_step({c.prompt.key: c.end for c in chunks})
        jobs = [self.jobs[c.prompt.key] for c in chunks]
        embedding = any(c.is_last and c.prompt.request.task.embedding for c in chunks)

        def after_layer(layer: int) -> None:
            self.take_control()  # aborts land here, between layers
            for key in self.aborted_in_step:
                self.stream.abort(key)
            if self.aborted_in_step == self.in_step:
                raise _StepAborted
            self.stream.send_layer(layer)
            self.between_layers(layer)

        with self.turns:
            logits = self.runner.forward(ForwardBatch(
                token_ids=[c.prompt.request.task.prompt_ids[c.start:c.end] for c in chunks],
                start_positions=[c.start for c in chunks],
                block_tables=[j.table for j in jobs],
                hidden=embedding,
            ), layer_hook=after_layer)
        live = [i for i, c in enumerate(chunks) if c.prompt.key not in self.aborted_in_step]
        for i in live:
            self.scheduler.advance(chunks[i])
        done = [i for i in live if chunks[i].is_last]
        self._complete([jobs[i] for i in done], logits[done],
                       self.runner.hidden[done] if embedding else None)

    def _complete(self, jobs: list[_Job], logits: torch.Tensor,
                  hidden: torch.Tensor | None) -> None:
        """The prompts' KV is complete: cache their full blocks, draw and hand off their first
        tokens (with their embeddings, from `hidden`, where asked for), free their blocks."""
        if not jobs:
            return
        tokens = self._first_tokens([j.request for j in jobs], logits)
        rows = embedding_bytes(hidden) if hidden is not None else [b""] * len(jobs)
        for job, token, row in zip(jobs, tokens, rows, strict=True):
            request = job.request
            del self.jobs[request.key]
            self.cache.insert(job.chain, job.table)
            self.cache.release(job.table)
            self._hand_off(job, token, row if request.task.embedding else b"")

    def _first_tokens(self, batch: list[PrefillRequest], logits: torch.Tensor) -> list[Draw]:
        params = [r.task.sampling for r in batch]
        generators = [make_generator(seed_at(r.task.sampling.seed, r.task.output_before),
                                     self.runner.device) for r in batch]
        eos = self.runner.spec.eos_token_ids
        histories = [history_of(r.task, r.task.prompt_ids, 0, eos,
                                self.grammars.constraint(r.task, eos)) for r in batch]
        return draw(logits, params, generators, histories)

    def _hand_off(self, job: _Job, token: Draw, embedding: bytes) -> None:
        """First token to the gateway, then to decode after the KV (unless it ends the request),
        with the prompt's stages here."""
        request, eos = job.request, self.runner.spec.eos_token_ids
        reason = finish_reason(request.task, token.token_id, 1, eos)
        job.timeline.computed = time.monotonic()
        first = FirstToken(request.request_id, request.epoch, token.token_id, reason,
                           job.cached, token.logprob, token.top, job.timeline.prefill_stages(),
                           embedding)
        self.control.send(first)
        log.info("request %s: first token, %d prompt tokens cached", request.request_id,
                 job.cached, extra=about(request.key))
        failure = self.stream.finish(first)
        if failure is not None:
            self._report_failure(request, failure, reason)
        if self.tracer is not None:
            self.tracer.stages(request.traceparent, job.timeline, {
                "raging.request_id": request.request_id, "raging.epoch": request.epoch,
                "raging.prompt_tokens": len(request.task.prompt_ids),
                "raging.cached_tokens": job.cached, "raging.decode_worker": request.decode_worker})

    def _report_failure(self, request: PrefillRequest, failure: str,
                        first_finish: FinishReason | None = None) -> None:
        """The request's KV could not be handed off: each of its choices may be served again,
        but its own when its first token finished it (`first_finish`)."""
        retry_elsewhere(self.control, request, failure,
                        request.key if first_finish is not None else None)

    def heartbeat(self) -> Heartbeat:
        return Heartbeat(
            worker_id=self.worker_id, instance_id=self.instance_id,
            queued_tokens=self.scheduler.queued_tokens,
            free_blocks=self.cache.num_available, running=0,  # cached idle blocks count as free
            waiting=len(self.scheduler.waiting),
            transfers=[TransferTotals(backend, "send", **vars(counters))
                       for backend, counters in self.sender.totals()],
            in_transfer=self.sender.staged, leases_expired=self.sender.leases_expired,
            progress=self.progress, holding=self.holding(),
        )

    def holding(self) -> list[Held]:
        """Queued and in-progress prompts, with their other choices (n > 1), but not those
        aborted mid-step."""
        requests = [p.request for p in [*self.scheduler.waiting, *self.scheduler.running]]
        requests += self.compiling.values()
        return [Held(*key) for r in requests if r.key not in self.aborted_in_step
                for key in choice_keys(r)]

    def drained(self) -> bool:
        """No prompt held, and every chunk staged for a decode worker taken by it."""
        return super().drained() and self.sender.staged == 0

    def close(self) -> None:
        self.grammars.close()
        self.sender.close()
        super().close()

