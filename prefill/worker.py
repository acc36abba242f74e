"""The prefill worker: batch prompts, compute their KV, send the first token and hand off the KV."""

from __future__ import annotations

import logging

import torch

from core.config import Config
from core.curve import keys_for
from core.messages import (
    Abort,
    FirstToken,
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
from engine.runner import ModelRunner
from engine.sampler import make_generator, sample
from engine.stopping import finish_reason
from kvtransfer import make_sender
from prefill.handoff import LayerStream
from prefill.scheduler import PrefillScheduler

log = logging.getLogger(__name__)


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
        self.in_batch: set[tuple[str, int]] = set()  # the batch being prefilled
        self.aborted_in_batch: set[tuple[str, int]] = set()

    def handle(self, message: Message) -> None:
        if isinstance(message, PrefillRequest):
            if (message.request_id, message.epoch) not in self.in_batch:  # not a repeat
                self.scheduler.add(message)
        elif isinstance(message, Abort):
            key = (message.request_id, message.epoch)
            if not self.scheduler.abort(*key) and key in self.in_batch:
                self.aborted_in_batch.add(key)  # it stops streaming at the next layer
        else:
            log.warning("prefill worker ignored %s", type(message).__name__)

    def step(self) -> bool:
        batch = self.scheduler.schedule(self.runner.allocator.num_free)
        if not batch:
            return False
        tables = [self.runner.allocator.allocate(self._blocks_for(r)) for r in batch]
        self.in_batch = {(r.request_id, r.epoch) for r in batch}
        try:
            self._prefill(batch, tables)
        except _BatchAborted:
            log.info("every request of a batch was aborted mid-prefill")
        finally:
            for table in tables:
                self.runner.allocator.free(table)
            self.in_batch, self.aborted_in_batch = set(), set()
        return True

    def _prefill(self, batch: list[PrefillRequest], tables: list[list[int]]) -> None:
        streamed = [(r, t) for r, t in zip(batch, tables, strict=True) if r.task.max_tokens > 1]
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
            token_ids=[r.task.prompt_ids for r in batch],
            start_positions=[0] * len(batch),
            block_tables=tables,
        ), layer_hook=after_layer)
        for request, token in zip(batch, self._first_tokens(batch, logits), strict=True):
            if (request.request_id, request.epoch) not in self.aborted_in_batch:
                self._hand_off(request, token, stream)

    def _blocks_for(self, request: PrefillRequest) -> int:
        return blocks_needed(len(request.task.prompt_ids), self.runner.block_size)

    def _first_tokens(self, batch: list[PrefillRequest], logits: torch.Tensor) -> list[int]:
        params = [r.task.sampling for r in batch]
        generators = [make_generator(r.task.sampling.seed) for r in batch]
        return sample(logits, params, generators)

    def _hand_off(self, request: PrefillRequest, token: int, stream: LayerStream) -> None:
        """First token to the gateway, then to decode after the KV (unless it ends the request)."""
        reason = finish_reason(request.task, token, 1, self.runner.spec.eos_token_ids)
        first = FirstToken(request.request_id, request.epoch, token, reason)
        self.control.send(first)
        failure = stream.finish(first)
        if failure is not None and reason is None:
            self.control.send(RequestFailed(request.request_id, request.epoch, failure))

    def heartbeat(self) -> Heartbeat:
        return Heartbeat(
            worker_id=self.worker_id, instance_id=self.instance_id,
            queued_tokens=self.scheduler.queued_tokens,
            free_blocks=self.runner.allocator.num_free, running=0,
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
