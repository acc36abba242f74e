"""Prefill scheduling: first come, first served, under a token budget, long prompts in chunks.
Pure bookkeeping.

Each step's batch takes, oldest first, the next chunk (at most `chunk_tokens` tokens) of every
prompt in progress, then the first chunks of waiting prompts, while the step's tokens stay
within `max_batch_tokens`; a step whose first chunk alone is over the budget runs it alone. A
prompt in progress contributes one chunk per step, so a long prompt holds back a short one
that arrives meanwhile by at most one chunk.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from core.messages import PrefillRequest
from engine.block_allocator import blocks_needed

Key = tuple[str, int]  # (request id, epoch)


@dataclass
class Prefilling:
    """A prompt admitted for prefill: its KV covers its tokens 0..done-1 (computed, or found
    in the prefix cache)."""

    request: PrefillRequest
    done: int = 0

    @property
    def key(self) -> Key:
        return self.request.request_id, self.request.epoch

    @property
    def prompt_len(self) -> int:
        return len(self.request.task.prompt_ids)

    @property
    def remaining(self) -> int:
        return self.prompt_len - self.done


@dataclass(frozen=True)
class Chunk:
    """Tokens start..end-1 of a prompt, to compute in this step."""

    prompt: Prefilling
    start: int
    end: int

    @property
    def is_last(self) -> bool:
        """Whether the prompt's KV is complete after this chunk (its first token is due)."""
        return self.end == self.prompt.prompt_len


class PrefillScheduler:
    def __init__(self, max_batch_tokens: int, block_size: int, chunk_tokens: int = 512) -> None:
        assert max_batch_tokens > 0 and chunk_tokens > 0
        self.max_batch_tokens = max_batch_tokens
        self.block_size = block_size
        self.chunk_tokens = chunk_tokens
        self.waiting: deque[PrefillRequest] = deque()
        self.running: list[Prefilling] = []  # in progress (blocks held), oldest first

    def add(self, request: PrefillRequest) -> bool:
        """Queue a request; False (and nothing queued) when the same one is here already."""
        key = (request.request_id, request.epoch)
        if key in self.held():
            return False
        self.waiting.append(request)
        return True

    def abort(self, request_id: str, epoch: int) -> bool:
        """Drop a queued or in-progress request; False when it is not here."""
        key = (request_id, epoch)
        for request in self.waiting:
            if (request.request_id, request.epoch) == key:
                self.waiting.remove(request)
                return True
        found = [p for p in self.running if p.key == key]
        for prompt in found:
            self.running.remove(prompt)
        return bool(found)

    def held(self) -> list[Key]:
        """Every request here, waiting or in progress."""
        return [(r.request_id, r.epoch) for r in self.waiting] + [p.key for p in self.running]

    @property
    def queued_tokens(self) -> int:
        """Prompt tokens still to compute (a cached prefix, once found, does not count)."""
        waiting = sum(len(r.task.prompt_ids) for r in self.waiting)
        return waiting + sum(p.remaining for p in self.running)

    def schedule(self, free_blocks: int,
                 start: Callable[[PrefillRequest], int] = lambda request: 0) -> list[Chunk]:
        """The next step's chunks: one of each prompt in progress, oldest first, then the
        first chunks of waiting prompts, within the token budget and the free KV blocks.

        A waiting prompt admitted here (its blocks counted against `free_blocks`) is handed to
        `start`, which reserves its blocks and returns how many of its tokens are cached.
        """
        chunks: list[Chunk] = []
        tokens = 0
        for prompt in self.running:
            size = min(self.chunk_tokens, prompt.remaining)
            if chunks and tokens + size > self.max_batch_tokens:
                return chunks  # an older prompt waits: nothing newer may pass it
            chunks.append(Chunk(prompt, prompt.done, prompt.done + size))
            tokens += size
        blocks = 0
        while self.waiting:
            prompt_len = len(self.waiting[0].task.prompt_ids)
            size = min(self.chunk_tokens, prompt_len)
            need = blocks_needed(prompt_len, self.block_size)
            if (chunks and tokens + size > self.max_batch_tokens) or blocks + need > free_blocks:
                break
            chunks.append(self._admit(self.waiting.popleft(), start))
            tokens += size
            blocks += need
        return chunks

    def _admit(self, request: PrefillRequest, start: Callable[[PrefillRequest], int]) -> Chunk:
        prompt = Prefilling(request)
        prompt.done = start(request)
        assert 0 <= prompt.done < prompt.prompt_len, "the last token is always computed"
        self.running.append(prompt)
        return Chunk(prompt, prompt.done, prompt.done + min(self.chunk_tokens, prompt.remaining))

    def advance(self, chunk: Chunk) -> None:
        """The chunk's KV is computed; a prompt whose KV is complete leaves."""
        prompt = chunk.prompt
        assert prompt.done == chunk.start, "chunks are computed in order"
        prompt.done = chunk.end
        if prompt.remaining == 0:
            self.running.remove(prompt)
