"""Continuous batching for decode: admit, grow, preempt (by recompute), finish. Pure bookkeeping.

A sequence's KV covers `tokens[:num_cached]`; each step feeds the next `num_scheduled` of the
rest: one token in steady state (and after it the sequence's `draft`, guesses at the tokens that
follow, where the worker speculates), a chunk of them for a prompt prefilled here or for a
preempted sequence's recompute. A step's chunks share one budget, costed as the prefill worker's
are (engine/model/chunk_cost.py: deep into a long prompt a chunk has fewer tokens), so a long
prompt never holds the running sequences' next tokens back by more than one chunk's time; they
go earliest deadline first (see prefill/scheduler.py), so a short prompt does not wait for a
long one to finish.

With prefix caching, a sequence that leaves (finished, aborted or preempted) leaves the full
blocks of its computed KV, prompt and generated tokens alike, in the worker's `PrefixCache`;
a sequence computed here (a prompt prefilled here, a preempted one's recompute) starts from the
longest cached prefix of its tokens. Idle cached blocks are evicted when live sequences need
room, before any of them is preempted.

Under a sliding window (Mistral), a sequence's blocks whose every key lies before the window of
its next query are released as it grows: its table keeps `DROPPED` in their place, so a long
generation holds about a window of blocks. A sequence that dropped blocks leaves none in the
prefix cache (its chain of blocks no longer starts at its first token).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from core.messages import DecodeRequest, PromptLogprob, RequestKey
from core.timeline import Timeline
from decode.guessing import Tally
from engine.kv.allocator import BlockAllocator, blocks_needed
from engine.kv.block_hash import block_hashes
from engine.kv.prefix_cache import PrefixCache
from engine.model.chunk_cost import TOKENS_ONLY, ChunkCost

if TYPE_CHECKING:
    import torch

    from decode.incoming import ReceivedKV
    from engine.sampling.grammar import Constraint


DROPPED = -1  # a block table entry whose block was released: before the sliding window


@dataclass(eq=False)
class DecodeSequence:
    request: DecodeRequest
    tokens: list[int]  # prompt + generated
    num_generated: int
    generator: torch.Generator | None = None  # its draws (reseeded per token if seeded)
    received_kv: list[ReceivedKV] | None = None  # as received, written in at admission
    num_cached: int = 0
    num_reused: int = 0  # of its prompt's tokens, those found in the prefix cache
    num_scheduled: int = 0  # tokens this step feeds, from num_cached on
    blocks: list[int] = field(default_factory=list)
    constraint: Constraint | None = None  # its grammar's state, when it asked for one
    deadline: float = 0.0  # when its prompt should be prefilled by, if prefilled here
    timeline: Timeline = field(default_factory=Timeline)  # its stages' stamps here
    # Its prompt tokens' logprobs so far, while computed here for a request that asked.
    prompt_scores: list[PromptLogprob] = field(default_factory=list)
    # Guesses at its next tokens (decode/drafts.py), fed this step after its last token.
    draft: list[int] = field(default_factory=list)
    guesses: Tally = field(default_factory=Tally)  # its guesses tried and kept, lately

    @property
    def key(self) -> RequestKey:
        return self.request.key

    @property
    def step_tokens(self) -> list[int]:
        """What this step feeds it: its next `num_scheduled` tokens, its draft after them."""
        return (self.tokens[self.num_cached:] + self.draft)[:self.num_scheduled]

    @property
    def block_table(self) -> list[int]:
        """Its blocks for a forward pass: a dropped one stands in as its own last block, which
        the window masks wherever it is read."""
        if not self.blocks or self.blocks[0] != DROPPED:  # dropped ones come first
            return self.blocks  # every step reads it: no copy where nothing was dropped
        last = self.blocks[-1]
        return [last if block == DROPPED else block for block in self.blocks]

    @property
    def live_blocks(self) -> list[int]:
        return [block for block in self.blocks if block != DROPPED]


class DecodeScheduler:
    def __init__(self, allocator: BlockAllocator, block_size: int, max_running: int,
                 chunk_tokens: int = 512, cost: ChunkCost = TOKENS_ONLY,
                 prefix_caching: bool = False, cache_share: float = 1.0,
                 window: int | None = None) -> None:
        """`window`: the model's sliding window (engine.weights.spec), if it has one."""
        assert chunk_tokens > 0
        self.allocator = allocator
        self.cache = PrefixCache(allocator, cache_share)
        self.prefix_caching = prefix_caching
        self.block_size = block_size
        self.max_running = max_running
        self.chunk_tokens = chunk_tokens
        self.cost = cost
        self.waiting: deque[DecodeSequence] = deque()
        self.running: list[DecodeSequence] = []
        # Every sequence here by key: thousands may wait, and each abort looks one up.
        self.sequences: dict[RequestKey, DecodeSequence] = {}
        self.preemptions = 0
        self.window = window

    def add(self, sequence: DecodeSequence) -> None:
        assert sequence.key not in self.sequences, "a request is added once per epoch"
        self.waiting.append(sequence)
        self.sequences[sequence.key] = sequence

    def fits_at_all(self, sequence: DecodeSequence) -> bool:
        """Whether the pool could hold the sequence at its longest (prompt + max_tokens)."""
        task = sequence.request.task
        longest = len(task.prompt_ids) + task.max_tokens
        return blocks_needed(longest, self.block_size) <= self.allocator.num_total

    def find(self, key: RequestKey) -> DecodeSequence | None:
        return self.sequences.get(key)

    def schedule(self) -> tuple[list[DecodeSequence], list[DecodeSequence]]:
        """(sequences admitted now, the batch to run this step)."""
        self._grow_running()
        admitted: list[DecodeSequence] = []
        while self.waiting and len(self.running) < self.max_running:
            sequence = self.waiting[0]
            if not self._can_allocate(self._need(sequence)):
                break
            self.waiting.popleft()
            self._allocate(sequence)
            self.running.append(sequence)
            admitted.append(sequence)
        return admitted, list(self.running)

    def chunk(self, batch: list[DecodeSequence]) -> list[DecodeSequence]:
        """Set each sequence's `num_scheduled` for this step, once admitted KV is written:
        every decoding sequence its one token; sequences with more to compute, earliest
        deadline first, what is left of the chunk budget (the first at least one token).
        Returns those with something to compute, in batch order."""
        budget = float(self.chunk_tokens)
        first = True
        for sequence in sorted(batch, key=lambda s: (s.request.task.priority, s.deadline)):
            pending = len(sequence.tokens) - sequence.num_cached
            assert pending > 0, "a running sequence always has its last token to feed"
            if pending == 1:
                sequence.num_scheduled = 1 + len(sequence.draft)
                continue
            fits = self.cost.tokens_within(budget, sequence.num_cached, pending)
            sequence.num_scheduled = max(fits, 1) if first else fits
            budget -= self.cost.cost(sequence.num_cached, sequence.num_scheduled)
            first = False
        return [sequence for sequence in batch if sequence.num_scheduled > 0]

    @property
    def prompt_tokens_pending(self) -> int:
        """Tokens still to prefill here, before their sequences' first draw."""
        return sum(len(s.tokens) - s.num_cached
                   for s in [*self.running, *self.waiting] if s.num_generated == 0)

    def fork(self, parent: DecodeSequence, child: DecodeSequence) -> tuple[int, int] | None:
        """Start `child` on `parent`'s KV of its first `child.num_cached` tokens, copy on
        write: the full blocks shared (ref counted; nobody writes a full block again), a
        partial last one to be copied. Returns (source, target) of that copy, if any. A child
        that does not fit now waits, to be computed from scratch."""
        assert parent in self.running and child.num_cached <= parent.num_cached
        assert child.key not in self.sequences, "a choice is forked once per epoch"
        self.sequences[child.key] = child
        shared = child.num_cached // self.block_size
        fresh = self._need(child) - shared
        if len(self.running) >= self.max_running or not self._can_allocate(fresh):
            child.num_cached = 0
            self.waiting.append(child)
            return None
        self.allocator.incref([b for b in parent.blocks[:shared] if b != DROPPED])
        child.blocks = parent.blocks[:shared] + self.cache.allocate(fresh)
        self.running.append(child)
        if child.num_cached % self.block_size == 0:
            return None
        return parent.blocks[shared], child.blocks[shared]

    def remove(self, sequence: DecodeSequence) -> None:
        """Take a sequence out (finished or aborted) and free its blocks."""
        if sequence in self.running:
            self.running.remove(sequence)
        else:
            self.waiting.remove(sequence)
        del self.sequences[sequence.key]
        self._release(sequence)

    def _need(self, sequence: DecodeSequence) -> int:
        return blocks_needed(len(sequence.tokens) + len(sequence.draft), self.block_size)

    def _grow_running(self) -> None:
        """Give each running sequence room for this step's tokens; preempt the newest if full."""
        for sequence in list(self.running):
            if sequence not in self.running:
                continue  # preempted earlier in this loop: it must not preempt others
            self._drop_before_window(sequence)
            extra = self._need(sequence) - len(sequence.blocks)
            if extra > 0 and sequence.draft and not self._can_allocate(extra):
                sequence.draft = []  # a guess takes no room a sequence needs
                extra = self._need(sequence) - len(sequence.blocks)
            while extra > 0 and not self._can_allocate(extra):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is sequence:
                    break
            if extra > 0 and sequence in self.running:
                sequence.blocks += self.cache.allocate(extra)

    def _drop_before_window(self, sequence: DecodeSequence) -> None:
        """Release its blocks that only keys before its next query's window fill."""
        if self.window is None:
            return
        first_key = sequence.num_cached - self.window + 1  # the earliest its next query sees
        before = sequence.blocks[:max(first_key, 0) // self.block_size]
        dropping = [block for block in before if block != DROPPED]
        if dropping:
            self.cache.release(dropping)
            sequence.blocks[:len(before)] = [DROPPED] * len(before)

    def _preempt(self, sequence: DecodeSequence) -> None:
        self.running.remove(sequence)
        self._release(sequence)
        sequence.num_cached = 0
        sequence.draft = []
        self.waiting.appendleft(sequence)
        self.preemptions += 1

    def _can_allocate(self, n: int) -> bool:
        """Whether `n` blocks are free, or can be once idle cached blocks are evicted."""
        return self.allocator.can_allocate(n) or 0 <= n <= self.cache.num_available

    def _allocate(self, sequence: DecodeSequence) -> None:
        """Its blocks: for one to be computed here, its longest cached prefix (short of its
        last token, which a step must feed) first."""
        computed_here = sequence.received_kv is None and sequence.num_cached == 0
        scored = sequence.request.task.prompt_logprobs is not None  # needs every row's logits
        chain = (self._chain(sequence, len(sequence.tokens) - 1)
                 if self.prefix_caching and computed_here and not scored else [])
        sequence.blocks, reused = self.cache.table(chain, self._need(sequence))
        if reused:
            sequence.num_cached = reused * self.block_size
            if sequence.num_generated == 0:
                sequence.num_reused = sequence.num_cached

    def _chain(self, sequence: DecodeSequence, num_tokens: int) -> list[bytes]:
        """The block hashes of the full blocks of its first `num_tokens` tokens."""
        salt = sequence.request.task.cache_salt
        return block_hashes(sequence.tokens[:num_tokens], self.block_size, salt)

    def _release(self, sequence: DecodeSequence) -> None:
        """Free its blocks, leaving those of its computed KV in the prefix cache."""
        live = sequence.live_blocks
        if live:
            whole = len(live) == len(sequence.blocks)
            if self.prefix_caching and sequence.received_kv is None and whole:
                self.cache.insert(self._chain(sequence, sequence.num_cached), sequence.blocks)
            self.cache.release(live)
        sequence.blocks = []
        sequence.received_kv = None
