"""Prefill scheduling: earliest deadline first, under a compute budget, long prompts in chunks.
Pure bookkeeping.

A prompt's deadline is its arrival plus `ttft_s_per_token` for each of its tokens, the way users
budget a first token: a long prompt may take longer. Each step takes prompts in deadline order,
in progress or waiting, while the step's cost stays within `max_batch_tokens` (costs count the
keys each token attends to, engine/model/chunk_cost.py, so a chunk deep into a long prompt has
fewer tokens). A prompt whose rest fits what is left goes whole. One that would fit a step of
its own waits for the next step; a longer one gets a chunk of what is left, at most
`chunk_tokens` worth (if it comes first, at least half of `chunk_tokens` in tokens, so that
steps' fixed costs stay a small share), unless a prompt due earlier finishes in the step: the
step's end is that prompt's first token, and a chunk of a prompt due later would only delay it.
A short prompt that arrives behind a long one therefore waits for the step in progress, not for
the long one, goes whole in a step no longer than it needs, and is not cut in pieces that each
ride with the long one's chunks; the long one's deadline comes in its turn, so it is never
starved.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from core.messages import PrefillRequest, RequestKey
from engine.kv.allocator import blocks_needed
from engine.model.chunk_cost import TOKENS_ONLY, ChunkCost


@dataclass(eq=False)
class Prefilling:
    """A prompt to prefill. Once admitted (blocks held) its KV covers its tokens 0..done-1
    (computed, or found in the prefix cache)."""

    request: PrefillRequest
    deadline: float
    done: int = 0
    admitted: bool = False  # blocks held: running

    @property
    def key(self) -> RequestKey:
        return self.request.key

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
                 ttft_s_per_token: float = 0.005, cost: ChunkCost = TOKENS_ONLY) -> None:
        assert max_batch_tokens > 0 and chunk_tokens > 0 and ttft_s_per_token >= 0
        self.max_batch_tokens = max_batch_tokens
        self.block_size = block_size
        self.chunk_tokens = chunk_tokens
        self.ttft_s_per_token = ttft_s_per_token
        self.cost = cost
        self.waiting: list[Prefilling] = []  # no blocks yet, in arrival order
        self.running: list[Prefilling] = []  # in progress (blocks held), in admission order
        # Every prompt here by key: thousands may wait, and each arrival or abort looks one up.
        self.prompts: dict[RequestKey, Prefilling] = {}

    @property
    def min_first_chunk(self) -> int:
        """The fewest tokens of a step's first chunk. A step also pays fixed costs, whatever its
        size (the weights streamed, the cached context gathered): chunks costed down to a few
        dozen tokens deep into a long prompt would multiply them (a 5,200-token prompt took
        1.9x its unchunked time)."""
        return max(1, min(self.chunk_tokens, self.max_batch_tokens) // 2)

    def add(self, request: PrefillRequest, now: float = 0.0) -> bool:
        """Queue a request that arrived at `now` (seconds); False (and nothing queued) when
        the same one is here already."""
        if request.key in self.prompts:
            return False
        deadline = now + self.ttft_s_per_token * len(request.task.prompt_ids)
        prompt = Prefilling(request, deadline)
        self.waiting.append(prompt)
        self.prompts[request.key] = prompt
        return True

    def abort(self, key: RequestKey) -> bool:
        """Drop a queued or in-progress request; False when it is not here."""
        prompt = self.prompts.pop(key, None)
        if prompt is None:
            return False
        (self.running if prompt.admitted else self.waiting).remove(prompt)
        return True

    def holds(self, key: RequestKey) -> bool:
        return key in self.prompts

    def held(self) -> list[RequestKey]:
        """Every request here, waiting or in progress."""
        return list(self.prompts)

    @property
    def queued_tokens(self) -> int:
        """Prompt tokens still to compute (a cached prefix, once found, does not count)."""
        return sum(p.remaining for p in self.prompts.values())

    def schedule(self, free_blocks: int,
                 start: Callable[[PrefillRequest], int] = lambda request: 0) -> list[Chunk]:
        """The next step's chunks: prompts in deadline order, in progress or waiting, within
        the cost budget and the free KV blocks.

        A waiting prompt admitted here (its blocks counted against `free_blocks`) is handed to
        `start`, which reserves its blocks and returns how many of its tokens are cached.
        Once one waiting prompt does not fit the free blocks, no later one is admitted.
        """
        chunks: list[Chunk] = []
        budget = float(self.max_batch_tokens)
        blocks = 0
        admitting = True
        for prompt in sorted([*self.running, *self.waiting],
                             key=lambda p: (p.request.task.priority, p.deadline)):
            finishing = any(chunk.is_last for chunk in chunks)
            if chunks and self._size(prompt, budget, False, finishing) == 0:
                continue
            if not prompt.admitted:
                need = blocks_needed(prompt.prompt_len, self.block_size)
                admitting = admitting and blocks + need <= free_blocks
                if not admitting:
                    continue
                blocks += need
                self._admit(prompt, start)
            size = self._size(prompt, budget, not chunks, finishing)
            if size == 0:
                continue  # admitted, its cached prefix made the rest dearer: next step
            chunks.append(Chunk(prompt, prompt.done, prompt.done + size))
            budget -= self.cost.cost(prompt.done, size)
        return chunks

    def _size(self, prompt: Prefilling, budget: float, first: bool, finishing: bool) -> int:
        """Tokens of `prompt` for this step. The rest, if it fits `budget`; else nothing for a
        prompt that fits a step of its own (it goes whole later) or when the step already
        finishes a prompt due earlier (`finishing`); else a chunk of at most `chunk_tokens`
        worth, and for a step's first prompt at least `min_first_chunk` tokens."""
        rest = self.cost.cost(prompt.done, prompt.remaining)
        if rest <= budget:
            return prompt.remaining
        if rest <= self.max_batch_tokens or finishing:
            return 0
        size = self.cost.tokens_within(min(budget, self.chunk_tokens), prompt.done,
                                       prompt.remaining)
        return max(size, min(self.min_first_chunk, prompt.remaining)) if first else size

    def _admit(self, prompt: Prefilling, start: Callable[[PrefillRequest], int]) -> None:
        self.waiting.remove(prompt)
        self.running.append(prompt)  # before `start`, which may heartbeat: held all along
        prompt.admitted = True
        prompt.done = start(prompt.request)
        assert 0 <= prompt.done < prompt.prompt_len, "the last token is always computed"

    def advance(self, chunk: Chunk) -> None:
        """The chunk's KV is computed; a prompt whose KV is complete leaves."""
        prompt = chunk.prompt
        assert prompt.done == chunk.start, "chunks are computed in order"
        prompt.done = chunk.end
        if prompt.remaining == 0:
            self.running.remove(prompt)
            del self.prompts[prompt.key]
