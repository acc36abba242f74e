"""Prefill scheduling: earliest deadline first, under a token budget, long prompts in chunks.
Pure bookkeeping.

A prompt's deadline is its arrival plus `ttft_s_per_token` for each of its tokens, the way
users budget a first token: a long prompt may take longer. Each step's batch takes the next
chunk (at most `chunk_tokens` tokens) of prompts in deadline order, in progress or waiting,
while the step's tokens stay within `max_batch_tokens`; a step whose first chunk alone is over
the budget runs it alone. A short prompt that arrives behind a long one therefore waits for
the step in progress, not for the long prompt; the long one's deadline comes in its turn, so
it is never starved.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from core.messages import PrefillRequest
from engine.block_allocator import blocks_needed

Key = tuple[str, int]  # (request id, epoch)


@dataclass(eq=False)
class Prefilling:
    """A prompt to prefill. Once admitted (blocks held) its KV covers its tokens 0..done-1
    (computed, or found in the prefix cache)."""

    request: PrefillRequest
    deadline: float
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
    def __init__(self, max_batch_tokens: int, block_size: int, chunk_tokens: int = 512,
                 ttft_s_per_token: float = 0.005) -> None:
        assert max_batch_tokens > 0 and chunk_tokens > 0 and ttft_s_per_token >= 0
        self.max_batch_tokens = max_batch_tokens
        self.block_size = block_size
        self.chunk_tokens = chunk_tokens
        self.ttft_s_per_token = ttft_s_per_token
        self.waiting: list[Prefilling] = []  # no blocks yet, in arrival order
        self.running: list[Prefilling] = []  # in progress (blocks held), in admission order

    def add(self, request: PrefillRequest, now: float = 0.0) -> bool:
        """Queue a request that arrived at `now` (seconds); False (and nothing queued) when
        the same one is here already."""
        key = (request.request_id, request.epoch)
        if key in self.held():
            return False
        deadline = now + self.ttft_s_per_token * len(request.task.prompt_ids)
        self.waiting.append(Prefilling(request, deadline))
        return True

    def abort(self, request_id: str, epoch: int) -> bool:
        """Drop a queued or in-progress request; False when it is not here."""
        found = [p for p in [*self.waiting, *self.running] if p.key == (request_id, epoch)]
        for prompt in found:
            (self.waiting if prompt in self.waiting else self.running).remove(prompt)
        return bool(found)

    def held(self) -> list[Key]:
        """Every request here, waiting or in progress."""
        return [p.key for p in [*self.waiting, *self.running]]

    @property
    def queued_tokens(self) -> int:
        """Prompt tokens still to compute (a cached prefix, once found, does not count)."""
        return sum(p.remaining for p in [*self.waiting, *self.running])

    def schedule(self, free_blocks: int,
                 start: Callable[[PrefillRequest], int] = lambda request: 0) -> list[Chunk]:
        """The next step's chunks: the next chunk of prompts in deadline order, in progress
        or waiting, within the token budget and the free KV blocks.

        A waiting prompt admitted here (its blocks counted against `free_blocks`) is handed to
        `start`, which reserves its blocks and returns how many of its tokens are cached.
        Once one waiting prompt does not fit the free blocks, no later one is admitted.
        """
        chunks: list[Chunk] = []
        tokens = blocks = 0
        admitting = True
        for prompt in sorted([*self.running, *self.waiting], key=lambda p: p.deadline):
            size = min(self.chunk_tokens, prompt.remaining)
            if chunks and tokens + size > self.max_batch_tokens:
                continue
            if prompt in self.running:
                chunk = Chunk(prompt, prompt.done, prompt.done + size)
            else:
                need = blocks_needed(prompt.prompt_len, self.block_size)
                admitting = admitting and blocks + need <= free_blocks
                if not admitting:
                    continue
                blocks += need
                chunk = self._admit(prompt, start)
            chunks.append(chunk)
            tokens += size
        return chunks

    def _admit(self, prompt: Prefilling, start: Callable[[PrefillRequest], int]) -> Chunk:
        self.waiting.remove(prompt)
        self.running.append(prompt)  # before `start`, which may heartbeat: held all along
        prompt.done = start(prompt.request)
        assert 0 <= prompt.done < prompt.prompt_len, "the last token is always computed"
        return Chunk(prompt, prompt.done, prompt.done + min(self.chunk_tokens, prompt.remaining))

    def advance(self, chunk: Chunk) -> None:
        """The chunk's KV is computed; a prompt whose KV is complete leaves."""
        prompt = chunk.prompt
        assert prompt.done == chunk.start, "chunks are computed in order"
        prompt.done = chunk.end
        if prompt.remaining == 0:
            self.running.remove(prompt)
