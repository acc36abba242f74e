"""The prefill worker: batch prompts, compute their KV, send the first token and hand off the KV."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from core.config import Config
from core.curve import keys_for
from core.messages import (
    Abort,
    FirstToken,
    GenerationTask,
    Heartbeat,
    Held,
    Message,
    PrefillRequest,
    RequestFailed,
    TransferTotals,
)
from core.worker import Worker, WorkerIdentity
from engine.batch import ForwardBatch
from engine.block_allocator import blocks_needed
from engine.block_hash import block_hashes
from engine.grammar import GrammarError, Grammars
from engine.prefix_cache import PrefixCache
from engine.runner import ModelRunner
from engine.sampler import Draw, History, draw, make_generator
from engine.stopping import banned_tokens, finish_reason
from kvtransfer import make_sender
from prefill.handoff import LayerStream
from prefill.scheduler import PrefillScheduler

log = logging.getLogger(__name__)


@dataclass
class _Job:
    """One request of a batch: its prompt's block hashes, its block table, and how many of
    its prompt tokens were cached already."""

    request: PrefillRequest
    chain: list[bytes]
    table: list[int]
    cached: int


class _BatchAborted(Exception):
    """Every request of the batch in the forward pass was aborted: stop it."""


class PrefillWorker(Worker):
    def __init__(self, worker_id: str, config: Config, runner: ModelRunner, fingerprint: str):
        identity = WorkerIdentity(worker_id, "prefill", fingerprint, runner.block_size,
                                  runner.allocator.num_total)
        super().__init__(identity, config.gateway.control_address,
                         config.prefill.heartbeat_interval_s, keys_for(config.internal))
        self.runner = runner
        self.scheduler = PrefillScheduler(config.prefill.max_batch_tokens, runner.block_size)
        self.sender = make_sender(self.context, config.kv_transfer, self.keys)
        self.chunk_bytes = int(config.kv_transfer.chunk_mb * 2**20)
        self.cache = PrefixCache(runner.allocator)
        self.prefix_caching = config.prefill.prefix_caching
        self.in_batch: set[tuple[str, int]] = set()  # the batch being prefilled
        self.aborted_in_batch: set[tuple[str, int]] = set()
        self.grammars = Grammars(runner.model_dir, runner.spec.vocab_size)

    def handle(self, message: Message) -> None:
        if isinstance(message, PrefillRequest):
            if (message.request_id, message.epoch) not in self.in_batch:  # not a repeat
                self._add(message)
        elif isinstance(message, Abort):
            key = (message.request_id, message.epoch)
            if not self.scheduler.abort(*key) and key in self.in_batch:
                self.aborted_in_batch.add(key)  # it stops streaming at the next layer
        else:
            log.warning("prefill worker ignored %s", type(message).__name__)

    def _add(self, request: PrefillRequest) -> None:
        """Queue the request, once its grammar (if any) compiles; compiled now, it is cached
        for the draw and for later requests."""
        if request.task.grammar:
            try:
                self.grammars.compiled(request.task.grammar)
            except GrammarError as exc:
                self.control.send(RequestFailed(request.request_id, request.epoch,
                                                f"invalid grammar: {exc}"))
                return
        self.scheduler.add(request)

    def step(self) -> bool:
        batch = self.scheduler.schedule(self.cache.num_available)
        if not batch:
            return False
        jobs = [self._plan(request) for request in batch]
        self.in_batch = {(r.request_id, r.epoch) for r in batch}
        try:
            self._prefill(jobs)
            for job in jobs:
                self.cache.insert(job.chain, job.table)  # their KV is all written now
        except _BatchAborted:
            log.info("every request of a batch was aborted mid-prefill")
        finally:
            for job in jobs:
                self.cache.release(job.table)
            self.in_batch, self.aborted_in_batch = set(), set()
        return True

    def _plan(self, request: PrefillRequest) -> _Job:
        """Reuse the cached blocks of the prompt's longest cached prefix (short of its last
        token, which the forward pass must compute for the logits); allocate the rest."""
        prompt, size = request.task.prompt_ids, self.runner.block_size
        chain = block_hashes(prompt, size, request.task.cache_salt) if self.prefix_caching else []
        reused = self.cache.match(chain[:(len(prompt) - 1) // size])
        table = reused + self.cache.allocate(blocks_needed(len(prompt), size) - len(reused))
        return _Job(request, chain, table, len(reused) * size)

    def _prefill(self, jobs: list[_Job]) -> None:
        batch = [job.request for job in jobs]
        streamed = [(j.request, j.table) for j in jobs if j.request.task.max_tokens > 1]
        stream = LayerStream(self.sender, self.runner.cache, self.identity.fingerprint, streamed,
                             self.chunk_bytes)

        def after_layer(layer: int) -> None:
            self.take_control()  # aborts land here, between layers
            for key in self.aborted_in_batch:
                stream.abort(key)
            if self.aborted_in_batch == self.in_batch:
                raise _BatchAborted
            stream.send_layer(layer)
            self.between_layers(layer)

        logits = self.runner.forward(ForwardBatch(
            token_ids=[j.request.task.prompt_ids[j.cached:] for j in jobs],
            start_positions=[j.cached for j in jobs],
            block_tables=[j.table for j in jobs],
        ), layer_hook=after_layer)
        for job, token in zip(jobs, self._first_tokens(batch, logits), strict=True):
            if (job.request.request_id, job.request.epoch) not in self.aborted_in_batch:
                self._hand_off(job.request, token, stream, job.cached)

    def _first_tokens(self, batch: list[PrefillRequest], logits: torch.Tensor) -> list[Draw]:
        params = [r.task.sampling for r in batch]
        generators = [make_generator(r.task.sampling.seed) for r in batch]
        return draw(logits, params, generators, [self._history(r.task) for r in batch])

    def _history(self, task: GenerationTask) -> History:
        """The prompt, for the penalties; EOS and stop tokens banned under min_tokens; the
        tokens its grammar allows."""
        eos = self.runner.spec.eos_token_ids
        constraint = self.grammars.constraint(task, eos)
        allowed = None if constraint is None else constraint.allowed()
        return History(task.prompt_ids, task.prompt_len, banned_tokens(task, 0, eos), allowed)

    def _hand_off(self, request: PrefillRequest, token: Draw, stream: LayerStream,
                  cached_tokens: int) -> None:
        """First token to the gateway, then to decode after the KV (unless it ends the request)."""
        eos = self.runner.spec.eos_token_ids
        reason = finish_reason(request.task, token.token_id, 1, eos)
        first = FirstToken(request.request_id, request.epoch, token.token_id, reason,
                           cached_tokens, token.logprob, token.top)
        self.control.send(first)
        failure = stream.finish(first)
        if failure is not None and reason is None:
            self.control.send(RequestFailed(request.request_id, request.epoch, failure))

    def heartbeat(self) -> Heartbeat:
        return Heartbeat(
            worker_id=self.worker_id, instance_id=self.instance_id,
            queued_tokens=self.scheduler.queued_tokens,
            free_blocks=self.cache.num_available, running=0,  # cached idle blocks count as free
            waiting=len(self.scheduler.waiting),
            transfers=[TransferTotals(self.sender.backend, "send", **vars(self.sender.counters))],
            in_transfer=self.sender.staged, leases_expired=self.sender.leases_expired,
            progress=self.progress, holding=self.holding(),
        )

    def holding(self) -> list[Held]:
        queued = [Held(r.request_id, r.epoch) for r in self.scheduler.waiting]
        return queued + [Held(*key) for key in self.in_batch - self.aborted_in_batch]

    def close(self) -> None:
        self.sender.close()
        super().close()
