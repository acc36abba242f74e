"""The prefill worker: batch prompts, compute their KV, send the first token and hand off the KV."""

from __future__ import annotations

import logging

import torch

from core.config import Config
from core.messages import (
    Abort,
    DecodeRequest,
    FirstToken,
    Heartbeat,
    Message,
    PrefillRequest,
    RequestFailed,
    encode,
)
from core.worker import Worker, WorkerIdentity
from engine.batch import ForwardBatch
from engine.block_allocator import blocks_needed
from engine.runner import ModelRunner
from engine.sampler import make_generator, sample
from engine.stopping import finish_reason
from kvtransfer import TransferError, make_sender
from prefill.scheduler import PrefillScheduler

log = logging.getLogger(__name__)


class PrefillWorker(Worker):
    def __init__(self, worker_id: str, config: Config, runner: ModelRunner, fingerprint: str):
        identity = WorkerIdentity(worker_id, "prefill", fingerprint, runner.block_size,
                                  runner.allocator.num_total)
        super().__init__(identity, config.gateway.control_address,
                         config.prefill.heartbeat_interval_s)
        self.runner = runner
        self.scheduler = PrefillScheduler(config.prefill.max_batch_tokens, runner.block_size)
        self.sender = make_sender(self.context)

    def handle(self, message: Message) -> None:
        if isinstance(message, PrefillRequest):
            self.scheduler.add(message)
        elif isinstance(message, Abort):
            self.scheduler.abort(message.request_id, message.epoch)
        else:
            log.warning("prefill worker ignored %s", type(message).__name__)

    def step(self) -> bool:
        batch = self.scheduler.schedule(self.runner.allocator.num_free)
        if not batch:
            return False
        tables = [self.runner.allocator.allocate(self._blocks_for(r)) for r in batch]
        logits = self.runner.forward(ForwardBatch(
            token_ids=[r.task.prompt_ids for r in batch],
            start_positions=[0] * len(batch),
            block_tables=tables,
        ), layer_hook=self.between_layers)
        tokens = self._first_tokens(batch, logits)
        for request, table, token in zip(batch, tables, tokens, strict=True):
            self._hand_off(request, table, token)
            self.runner.allocator.free(table)
        return True

    def _blocks_for(self, request: PrefillRequest) -> int:
        return blocks_needed(len(request.task.prompt_ids), self.runner.block_size)

    def _first_tokens(self, batch: list[PrefillRequest], logits: torch.Tensor) -> list[int]:
        params = [r.task.sampling for r in batch]
        generators = [make_generator(r.task.sampling.seed) for r in batch]
        return sample(logits, params, generators)

    def _hand_off(self, request: PrefillRequest, table: list[int], token: int) -> None:
        """First token to the gateway; unless that already ends it, KV + request to decode."""
        reason = finish_reason(request.task, token, 1, self.runner.spec.eos_token_ids)
        rid, epoch = request.request_id, request.epoch
        self.control.send(FirstToken(rid, epoch, token, reason))
        if reason is not None:
            return
        k, v = self.runner.cache.read(table, len(request.task.prompt_ids))
        meta = encode(DecodeRequest(rid, epoch, request.task, token))
        try:
            self.sender.send(request.decode_address, rid, epoch, meta, k, v)
        except TransferError as exc:
            self.control.send(RequestFailed(rid, epoch, str(exc)))

    def heartbeat(self) -> Heartbeat:
        return Heartbeat(
            worker_id=self.worker_id, instance_id=self.instance_id,
            queued_tokens=self.scheduler.queued_tokens,
            free_blocks=self.runner.allocator.num_free, running=0,
            waiting=len(self.scheduler.waiting),
        )

    def close(self) -> None:
        self.sender.close()
        super().close()
