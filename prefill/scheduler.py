"""Prefill scheduling: first come, first served, under a token budget. Pure bookkeeping."""

from __future__ import annotations

from collections import deque

from core.messages import PrefillRequest
from engine.block_allocator import blocks_needed


class PrefillScheduler:
    def __init__(self, max_batch_tokens: int, block_size: int) -> None:
        self.max_batch_tokens = max_batch_tokens
        self.block_size = block_size
        self.waiting: deque[PrefillRequest] = deque()

    def add(self, request: PrefillRequest) -> bool:
        """Queue a request; False (and nothing queued) when the same one is queued already."""
        key = (request.request_id, request.epoch)
        if any((r.request_id, r.epoch) == key for r in self.waiting):
            return False
        self.waiting.append(request)
        return True

    def abort(self, request_id: str, epoch: int) -> bool:
        """Drop a queued request; False when it is not queued here."""
        for request in self.waiting:
            if request.request_id == request_id and request.epoch == epoch:
                self.waiting.remove(request)
                return True
        return False

    @property
    def queued_tokens(self) -> int:
        return sum(len(r.task.prompt_ids) for r in self.waiting)

    def schedule(self, free_blocks: int) -> list[PrefillRequest]:
        """The next batch: oldest first, within the token budget and the free KV blocks.

        A prompt longer than the whole budget runs alone rather than never.
        """
        batch: list[PrefillRequest] = []
        tokens = blocks = 0
        while self.waiting:
            prompt_len = len(self.waiting[0].task.prompt_ids)
            need = blocks_needed(prompt_len, self.block_size)
            over_budget = batch and tokens + prompt_len > self.max_batch_tokens
            if over_budget or blocks + need > free_blocks:
                break
            batch.append(self.waiting.popleft())
            tokens += prompt_len
            blocks += need
        return batch
