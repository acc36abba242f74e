"""Continuous batching over a real BlockAllocator: admit, grow, preempt the newest, resume."""

from __future__ import annotations

import random
import time

import pytest
import torch

from core.messages import DecodeRequest, GenerationTask, RequestKey, Sampling
from decode.incoming import ReceivedKV
from decode.scheduler import DROPPED, DecodeScheduler, DecodeSequence
from engine.kv.allocator import BlockAllocator, blocks_needed
from engine.model.chunk_cost import ChunkCost

BLOCK = 4


RECEIVED = [ReceivedKV(0, 0, torch.empty(0), torch.empty(0))]  # stands for KV that arrived


def sequence(request_id: str, num_tokens: int, epoch: int = 0,
             max_tokens: int = 64) -> DecodeSequence:
    """As decode receives it: `num_tokens - 1` prompt tokens plus the first sampled token."""
    task = GenerationTask(list(range(num_tokens - 1)), Sampling(), max_tokens, [], False)
    request = DecodeRequest(request_id, epoch, task, "fp")
    return DecodeSequence(request, tokens=[*task.prompt_ids, 7], num_generated=1,
                          received_kv=RECEIVED,
                          num_cached=num_tokens - 1)


def make(num_blocks: int, max_running: int = 8) -> tuple[DecodeScheduler, BlockAllocator]:
    allocator = BlockAllocator(num_blocks)
    return DecodeScheduler(allocator, BLOCK, max_running), allocator


def step(batch: list[DecodeSequence], token: int = 1) -> None:
    """What the decode loop does after a forward: everything is cached, one token appended."""
    for seq in batch:
        seq.num_cached = len(seq.tokens)
        seq.tokens.append(token)
        seq.num_generated += 1


def full_pool() -> tuple[DecodeScheduler, BlockAllocator, DecodeSequence, DecodeSequence]:
    """A pool of 4 blocks that two admitted sequences of 8 tokens (2 blocks each) fill."""
    scheduler, allocator = make(4)
    old, new = sequence("old", 8), sequence("new", 8)
    scheduler.add(old)
    scheduler.add(new)
    scheduler.schedule()
    return scheduler, allocator, old, new


def held(scheduler: DecodeScheduler) -> list[int]:
    return [b for s in [*scheduler.running, *scheduler.waiting] for b in s.blocks]


def assert_accounted(scheduler: DecodeScheduler, allocator: BlockAllocator) -> None:
    blocks = held(scheduler)
    assert len(blocks) == len(set(blocks)), "a block is held twice"
    assert allocator.num_free + len(blocks) == allocator.num_total
    assert all(allocator.ref_count(b) == 1 for b in blocks)


def test_admission_allocates_blocks_for_all_tokens() -> None:
    scheduler, allocator = make(10)
    seq = sequence("a", 5)
    scheduler.add(seq)
    admitted, batch = scheduler.schedule()
    assert admitted == [seq] and batch == [seq]
    assert len(seq.blocks) == 2 and allocator.num_free == 8
    assert seq.received_kv is RECEIVED  # kept for the loop to write at admission
    assert_accounted(scheduler, allocator)


def test_admission_waits_for_blocks_in_fifo_order() -> None:
    scheduler, allocator = make(3)
    a, b, c = sequence("a", 8), sequence("b", 8), sequence("c", 1)
    for seq in (a, b, c):
        scheduler.add(seq)
    assert scheduler.schedule() == ([a], [a])
    assert list(scheduler.waiting) == [b, c]  # c would fit, but b is older
    assert b.blocks == [] and c.blocks == []
    scheduler.remove(a)
    assert scheduler.schedule() == ([b, c], [b, c])
    assert_accounted(scheduler, allocator)


def test_exact_fit_is_admitted() -> None:
    scheduler, allocator = make(2)
    seq = sequence("a", 8)
    scheduler.add(seq)
    assert scheduler.schedule()[0] == [seq]
    assert allocator.num_free == 0


def test_growth_allocates_a_block_at_each_boundary() -> None:
    scheduler, allocator = make(10)
    seq = sequence("a", 4)
    scheduler.add(seq)
    counts = []
    for _ in range(9):
        _, batch = scheduler.schedule()
        assert len(seq.blocks) >= blocks_needed(len(seq.tokens), BLOCK)
        counts.append((len(seq.tokens), len(seq.blocks)))
        step(batch)
    assert counts == [(4, 1), (5, 2), (6, 2), (7, 2), (8, 2), (9, 3), (10, 3), (11, 3), (12, 3)]
    assert allocator.num_free == 7
    assert_accounted(scheduler, allocator)


def test_growth_keeps_existing_blocks() -> None:
    scheduler, _ = make(10)
    seq = sequence("a", 4)
    scheduler.add(seq)
    scheduler.schedule()
    first = list(seq.blocks)
    step([seq])
    scheduler.schedule()
    assert seq.blocks[: len(first)] == first and len(seq.blocks) == 2


def test_full_pool_preempts_the_newest_sequence() -> None:
    scheduler, allocator = make(4)
    old, new = sequence("old", 8), sequence("new", 8)
    scheduler.add(old)
    scheduler.add(new)
    assert scheduler.schedule()[0] == [old, new]
    assert allocator.num_free == 0
    old.tokens.append(1)  # needs a third block; the pool is full
    old.num_cached = 8
    admitted, batch = scheduler.schedule()
    assert admitted == [] and batch == [old]
    assert len(old.blocks) == 3
    assert new.blocks == [] and new.num_cached == 0 and new.received_kv is None
    assert list(scheduler.waiting) == [new] and scheduler.preemptions == 1
    assert_accounted(scheduler, allocator)


def test_preempted_sequence_goes_to_the_front_and_resumes() -> None:
    scheduler, allocator = make(4)
    old, new, later = sequence("old", 8), sequence("new", 8), sequence("later", 5)
    scheduler.add(old)
    scheduler.add(new)
    scheduler.schedule()
    scheduler.add(later)
    step([old, new])  # both need a third block
    _, batch = scheduler.schedule()
    assert batch == [old]
    assert list(scheduler.waiting) == [new, later]
    scheduler.remove(old)
    admitted, batch = scheduler.schedule()
    assert admitted == [new] and batch == [new]  # before `later`, and with blocks for all tokens
    assert len(new.blocks) == blocks_needed(len(new.tokens), BLOCK) == 3
    assert new.num_cached == 0  # the loop recomputes its whole KV
    assert list(scheduler.waiting) == [later]  # needs 2 blocks, 1 is free
    assert_accounted(scheduler, allocator)


def test_preemption_takes_newest_first_until_the_grower_fits() -> None:
    scheduler, allocator = make(6)
    a, b, c = sequence("a", 8), sequence("b", 4), sequence("c", 4)
    for seq in (a, b, c):
        scheduler.add(seq)
    scheduler.schedule()  # a: 2 blocks, b: 1, c: 1; 2 free
    a.tokens += [1] * 13  # 21 tokens: 6 blocks, 4 more
    _, batch = scheduler.schedule()
    assert batch == [a] and list(scheduler.waiting) == [b, c]
    assert scheduler.preemptions == 2 and len(a.blocks) == 6
    assert_accounted(scheduler, allocator)


def test_a_sequence_that_cannot_grow_preempts_itself_last() -> None:
    """The scheduler itself does not refuse a sequence that outgrows the pool (the worker
    checks `fits_at_all` on arrival): it preempts the others, then itself."""
    scheduler, allocator = make(3)
    a, b = sequence("a", 4, max_tokens=8), sequence("b", 8, max_tokens=64)
    assert scheduler.fits_at_all(a) and not scheduler.fits_at_all(b)
    scheduler.add(a)
    scheduler.add(b)
    assert scheduler.schedule()[0] == [a, b]  # both fit now: 1 + 2 of 3 blocks
    b.tokens += [1] * 5  # 13 tokens: 4 blocks, more than the pool
    _, batch = scheduler.schedule()
    assert batch == [a] and list(scheduler.waiting) == [b] and b.blocks == []
    assert scheduler.preemptions == 1
    assert_accounted(scheduler, allocator)


def test_a_preempted_sequence_does_not_preempt_others() -> None:
    """Once the newest is preempted for the oldest, the loop must not preempt again for it."""
    scheduler, allocator, old, new = full_pool()
    step([old, new])
    _, batch = scheduler.schedule()
    assert batch == [old] and scheduler.preemptions == 1
    assert_accounted(scheduler, allocator)


def test_remove_frees_blocks_of_running_and_waiting_sequences() -> None:
    scheduler, allocator = make(4)
    a, b = sequence("a", 8), sequence("b", 12)
    scheduler.add(a)
    scheduler.add(b)
    scheduler.schedule()
    assert list(scheduler.waiting) == [b]
    scheduler.remove(a)
    assert allocator.num_free == 4 and a.blocks == [] and a.received_kv is None
    scheduler.remove(b)
    assert not scheduler.running and not scheduler.waiting and allocator.num_free == 4
    with pytest.raises(ValueError):
        scheduler.remove(b)


def test_max_running_is_respected() -> None:
    scheduler, allocator = make(100, max_running=2)
    seqs = [sequence(f"s{i}", 3) for i in range(5)]
    for seq in seqs:
        scheduler.add(seq)
    admitted, batch = scheduler.schedule()
    assert admitted == seqs[:2] and batch == seqs[:2] and len(scheduler.waiting) == 3
    assert scheduler.schedule() == ([], seqs[:2])
    scheduler.remove(seqs[0])
    assert scheduler.schedule() == ([seqs[2]], [seqs[1], seqs[2]])
    assert_accounted(scheduler, allocator)


def test_find_by_request_id_and_epoch() -> None:
    scheduler, _ = make(2)
    a, b, a1 = sequence("a", 8), sequence("b", 4), sequence("a", 4, epoch=1)
    for seq in (a, b, a1):
        scheduler.add(seq)
    scheduler.schedule()
    assert scheduler.find(RequestKey("a", 0)) is a and scheduler.find(RequestKey("b", 0)) is b
    assert scheduler.find(RequestKey("a", 1)) is a1 and scheduler.find(RequestKey("a", 2)) is None


@pytest.mark.parametrize(("prompt", "max_tokens", "fits"), [
    (4, 8, True),  # 12 tokens at the longest: exactly the 3 blocks
    (4, 9, False),  # 13: a fourth block
    (11, 1, True),
    (12, 1, False),
    (1, 11, True),
    (1, 12, False),
    (0, 12, True),
])
def test_fits_at_all_counts_the_longest_the_sequence_can_get(
    prompt: int, max_tokens: int, fits: bool
) -> None:
    scheduler, allocator = make(3)  # 12 tokens
    seq = sequence("a", prompt + 1, max_tokens=max_tokens)
    assert len(seq.request.task.prompt_ids) == prompt
    assert scheduler.fits_at_all(seq) is fits
    assert allocator.num_free == 3 and not scheduler.waiting  # a question, not an admission


def test_fits_at_all_ignores_how_far_the_sequence_has_got() -> None:
    scheduler, _ = make(3)
    short_now = sequence("a", 2, max_tokens=64)  # 2 tokens now, up to 65
    assert not scheduler.fits_at_all(short_now)
    grown = sequence("b", 5, max_tokens=8)
    grown.tokens += [1] * 7  # 12 tokens, its longest
    assert scheduler.fits_at_all(grown)


@pytest.mark.parametrize("seed", range(20))
def test_random_operations_keep_every_block_accounted_for(seed: int) -> None:
    rng = random.Random(seed)
    scheduler, allocator = make(rng.randint(4, 24), max_running=rng.randint(1, 6))
    capacity = allocator.num_total * BLOCK
    live: list[DecodeSequence] = []
    for op in range(300):
        choice = rng.random()
        if choice < 0.25:
            seq = sequence(f"s{op}", rng.randint(1, capacity // 2 + 1))
            scheduler.add(seq)
            live.append(seq)
        elif choice < 0.4 and live:
            seq = live.pop(rng.randrange(len(live)))
            scheduler.remove(seq)
        else:
            _, batch = scheduler.schedule()
            assert len(batch) <= scheduler.max_running
            for seq in batch:
                assert len(seq.blocks) >= blocks_needed(len(seq.tokens), BLOCK)
            assert all(s.blocks == [] for s in scheduler.waiting)
            step(batch)
            for seq in [s for s in batch if len(s.tokens) >= capacity]:  # finished
                scheduler.remove(seq)
                live.remove(seq)
        assert_accounted(scheduler, allocator)
        assert set(scheduler.running) | set(scheduler.waiting) == set(live)
        assert len(scheduler.running) + len(scheduler.waiting) == len(live)
    for seq in live:
        scheduler.remove(seq)
    assert allocator.num_free == allocator.num_total


def forked(parent: DecodeSequence, request_id: str, num_cached: int) -> DecodeSequence:
    """Another choice of `parent`'s request: the same prompt, its own first token."""
    task = parent.request.task
    return DecodeSequence(DecodeRequest(request_id, 0, task, "fp"),
                          tokens=[*task.prompt_ids, 9], num_generated=1, num_cached=num_cached)


def test_fork_shares_full_blocks_and_copies_the_partial_one() -> None:
    scheduler, allocator = make(20)
    parent = sequence("a", 11)  # 10 prompt tokens: blocks of 4, 4 and 2 (+ the first token)
    scheduler.add(parent)
    scheduler.schedule()
    child = forked(parent, "b", num_cached=10)
    assert scheduler.fork(parent, child) == (parent.blocks[2], child.blocks[2])
    assert child.blocks[:2] == parent.blocks[:2] and child.blocks[2] != parent.blocks[2]
    assert [allocator.ref_count(b) for b in child.blocks] == [2, 2, 1]
    assert scheduler.running == [parent, child] and allocator.num_free == 20 - 4
    scheduler.remove(parent)  # the shared blocks stay with the child
    assert [allocator.ref_count(b) for b in child.blocks] == [1, 1, 1]
    scheduler.remove(child)
    assert allocator.num_free == 20


def test_fork_at_a_block_boundary_copies_nothing() -> None:
    scheduler, _ = make(20)
    parent = sequence("a", 9)  # 8 prompt tokens: two full blocks
    scheduler.add(parent)
    scheduler.schedule()
    child = forked(parent, "b", num_cached=8)
    assert scheduler.fork(parent, child) is None
    assert child.blocks[:2] == parent.blocks[:2] and len(child.blocks) == 3


def test_a_fork_that_does_not_fit_waits_to_be_computed_from_scratch() -> None:
    scheduler, allocator = make(3)
    parent = sequence("a", 11)
    scheduler.add(parent)
    scheduler.schedule()
    child = forked(parent, "b", num_cached=10)
    assert scheduler.fork(parent, child) is None
    assert child.blocks == [] and child.num_cached == 0 and list(scheduler.waiting) == [child]
    assert allocator.num_free == 0 and allocator.ref_count(parent.blocks[0]) == 1


def prompt_to_prefill(request_id: str, prompt_len: int, deadline: float) -> DecodeSequence:
    """A prompt sent to this worker to prefill itself (conditional disaggregation)."""
    task = GenerationTask(list(range(prompt_len)), Sampling(), 8, [], False)
    return DecodeSequence(DecodeRequest(request_id, 0, task, "fp"), tokens=list(task.prompt_ids),
                          num_generated=0, deadline=deadline)


def test_chunk_gives_the_budget_to_prompts_earliest_deadline_first() -> None:
    scheduler = DecodeScheduler(BlockAllocator(64), BLOCK, max_running=8, chunk_tokens=8)
    running, long, short = (sequence("d", 5), prompt_to_prefill("long", 30, deadline=10.0),
                            prompt_to_prefill("short", 6, deadline=1.0))
    for each in (running, long, short):
        scheduler.add(each)
    _, batch = scheduler.schedule()
    assert scheduler.chunk(batch) == [running, long, short]  # in batch order
    assert [s.num_scheduled for s in batch] == [1, 2, 6]  # the short prompt's 6 came first
    long.num_cached, short.num_cached = 2, 6  # the forward wrote their chunks
    short.tokens.append(9)  # and the short prompt drew its first token
    assert scheduler.chunk(batch) == [running, long, short]
    assert [s.num_scheduled for s in batch] == [1, 8, 1]


def test_chunk_costs_the_keys_so_a_deep_chunk_has_fewer_tokens() -> None:
    cost = ChunkCost(keys_per_token=1536)
    scheduler = DecodeScheduler(BlockAllocator(400), 16, max_running=8, chunk_tokens=256,
                                cost=cost)
    long = prompt_to_prefill("long", 4000, deadline=20.0)
    scheduler.add(long)
    _, batch = scheduler.schedule()
    scheduler.chunk(batch)
    first = long.num_scheduled
    long.num_cached = 3072  # deep into the prompt now
    scheduler.chunk(batch)
    assert first > 2.5 * long.num_scheduled > 0
    assert cost.cost(3072, long.num_scheduled) <= 256 < cost.cost(3072, long.num_scheduled + 1)


def test_a_chunk_deeper_than_the_whole_budget_still_gets_one_token() -> None:
    scheduler = DecodeScheduler(BlockAllocator(400), 16, max_running=8, chunk_tokens=2,
                                cost=ChunkCost(keys_per_token=10))
    long = prompt_to_prefill("long", 1000, deadline=1.0)
    later = prompt_to_prefill("later", 50, deadline=2.0)
    for each in (long, later):
        scheduler.add(each)
    _, batch = scheduler.schedule()
    long.num_cached = 900  # one token here costs 91
    assert scheduler.chunk(batch) == [long] and long.num_scheduled == 1


def prompt_here(request_id: str, prompt: list[int], salt: str = "") -> DecodeSequence:
    """A prompt this worker prefills itself: nothing computed, no first token yet."""
    task = GenerationTask(prompt, Sampling(), 8, [], False, cache_salt=salt)
    return DecodeSequence(DecodeRequest(request_id, 0, task, "fp"), tokens=list(prompt),
                          num_generated=0)


def caching(num_blocks: int) -> tuple[DecodeScheduler, BlockAllocator]:
    allocator = BlockAllocator(num_blocks)
    return DecodeScheduler(allocator, BLOCK, 8, prefix_caching=True), allocator


def computed_and_gone(scheduler: DecodeScheduler, seq: DecodeSequence) -> None:
    """Admit it, compute every token, and let it finish."""
    scheduler.add(seq)
    scheduler.schedule()
    seq.num_cached = len(seq.tokens)
    scheduler.remove(seq)


def test_a_prompt_computed_here_starts_from_the_full_blocks_one_that_left_computed() -> None:
    scheduler, allocator = caching(10)
    first = prompt_here("a", list(range(10)))
    computed_and_gone(scheduler, first)
    assert allocator.num_free == 8 and scheduler.cache.num_available == 10  # 2 full blocks kept
    second = prompt_here("b", [*range(9), 99, 98, 97])
    scheduler.add(second)
    admitted, _ = scheduler.schedule()
    assert admitted == [second]
    assert second.num_cached == second.num_reused == 8  # the two full blocks 0-7
    assert len(second.blocks) == 3
    assert [allocator.ref_count(b) for b in second.blocks] == [2, 2, 1]
    scheduler.chunk([second])
    assert second.num_scheduled == 4  # only the rest is computed


def test_a_cached_prompt_still_computes_its_last_token() -> None:
    scheduler, _ = caching(10)
    computed_and_gone(scheduler, prompt_here("a", list(range(8))))
    again = prompt_here("b", list(range(8)))
    scheduler.add(again)
    scheduler.schedule()
    assert again.num_cached == 4  # block 1 holds the last token, which the step must feed


def test_tenants_never_reuse_each_others_blocks() -> None:
    scheduler, _ = caching(10)
    computed_and_gone(scheduler, prompt_here("a", list(range(10)), salt="alice"))
    other = prompt_here("b", list(range(10)), salt="bob")
    scheduler.add(other)
    scheduler.schedule()
    assert other.num_cached == other.num_reused == 0


def test_idle_cached_blocks_give_way_to_a_sequence_that_needs_room() -> None:
    scheduler, allocator = caching(4)
    computed_and_gone(scheduler, prompt_here("a", list(range(8))))
    assert allocator.num_free == 2
    big = prompt_here("b", list(range(100, 116)))  # four blocks, none cached
    scheduler.add(big)
    admitted, _ = scheduler.schedule()
    assert admitted == [big] and len(big.blocks) == 4 and big.num_cached == 0
    assert scheduler.cache.evictions == 2 and allocator.num_free == 0


def test_a_received_sequence_leaves_its_prompt_and_generated_blocks() -> None:
    scheduler, allocator = caching(10)
    seq = sequence("a", 9)  # 8 prompt tokens + the first token, KV of the 8 received
    scheduler.add(seq)
    scheduler.schedule()
    seq.received_kv = None  # written, as the loop does at admission
    step([seq], token=5)  # 10 tokens, 9 computed
    scheduler.remove(seq)
    assert allocator.num_free == 8  # blocks 0-1 (tokens 0-7) cached; the partial one freed
    follow_up = prompt_here("b", [*seq.tokens, 11, 12])
    scheduler.add(follow_up)
    scheduler.schedule()
    assert follow_up.num_cached == 8


def test_a_sliding_window_holds_about_a_window_of_blocks_and_frees_the_rest() -> None:
    allocator = BlockAllocator(8)
    scheduler = DecodeScheduler(allocator, BLOCK, 8, window=6)
    seq = sequence("a", 9)  # 8 prompt tokens cached, the first sampled one to feed
    scheduler.add(seq)
    for _ in range(40):  # far past what 8 blocks of 4 would hold without the window
        _, batch = scheduler.schedule()
        assert batch == [seq]
        first_key = seq.num_cached - 6 + 1
        live = seq.live_blocks
        assert len(live) <= -(-6 // BLOCK) + 2
        assert seq.blocks[:len(seq.blocks) - len(live)] == [DROPPED] * (len(seq.blocks)
                                                                        - len(live))
        assert (len(seq.blocks) - len(live)) * BLOCK <= max(first_key, 0)  # none it still sees
        assert allocator.num_free + len(live) == allocator.num_total
        if seq.blocks[0] == DROPPED:  # a dropped entry reads the sequence's own last block
            assert seq.block_table[0] == live[-1]
        step(batch)
    assert seq.num_cached == 48 and scheduler.preemptions == 0
    scheduler.remove(seq)
    assert allocator.num_free == allocator.num_total


def test_a_fork_past_the_window_shares_only_live_blocks() -> None:
    allocator = BlockAllocator(16)
    scheduler = DecodeScheduler(allocator, BLOCK, 8, window=4)
    parent = sequence("a", 14)
    scheduler.add(parent)
    scheduler.schedule()  # admitted
    scheduler.schedule()  # grown: keys 0-7 are before its next query's window (10-13)
    assert parent.blocks[:2] == [DROPPED, DROPPED]
    child = sequence("b", 14)
    child.num_cached = 13
    copy = scheduler.fork(parent, child)
    assert child.blocks[:2] == [DROPPED, DROPPED] and copy == (parent.blocks[3], child.blocks[3])
    assert allocator.ref_count(parent.blocks[2]) == 2
    for finished in (parent, child):
        scheduler.remove(finished)
    assert allocator.num_free == allocator.num_total


def test_without_a_window_no_block_is_dropped() -> None:
    scheduler, _ = make(16)
    seq = sequence("a", 30)
    scheduler.add(seq)
    for _ in range(10):
        _, batch = scheduler.schedule()
        step(batch)
    assert DROPPED not in seq.blocks and len(seq.blocks) == blocks_needed(40, BLOCK)


def test_thousands_waiting_are_found_and_removed_each_in_constant_time() -> None:
    """An abort finds its sequence by key, however many wait (a scan each made an abort storm
    over thousands of queued requests quadratic)."""
    scheduler, allocator = make(num_blocks=8)
    sequences = [sequence(f"r{i}", 5) for i in range(20_000)]
    began = time.monotonic()
    for each in sequences:
        scheduler.add(each)
    for each in sequences:
        found = scheduler.find(each.key)
        assert found is each
        scheduler.remove(found)
    assert time.monotonic() - began < 5.0  # linear: well under a second here
    assert not scheduler.waiting and scheduler.find(RequestKey("r0", 0)) is None
    assert_accounted(scheduler, allocator)


def test_a_draft_is_fed_after_the_last_token_in_blocks_of_its_own() -> None:
    scheduler, allocator = make(10)
    seq = sequence("a", 4)
    scheduler.add(seq)
    scheduler.schedule()
    step([seq])  # 5 tokens, 4 cached: one block held
    seq.draft = [9, 9, 9, 9]
    _, batch = scheduler.schedule()
    assert scheduler.chunk(batch) == [seq]
    assert seq.num_scheduled == 5 and seq.step_tokens == [1, 9, 9, 9, 9]
    assert len(seq.blocks) == blocks_needed(9, BLOCK)  # room for every guess's KV
    assert_accounted(scheduler, allocator)


def test_a_draft_takes_no_room_a_sequence_needs() -> None:
    scheduler, allocator, old, new = full_pool()
    old.draft = [5, 6, 7]  # would need a third block
    _, batch = scheduler.schedule()
    assert batch == [old, new] and scheduler.preemptions == 0
    assert old.draft == [] and len(old.blocks) == 2
    assert scheduler.chunk(batch) == [old, new] and old.num_scheduled == 1
    assert_accounted(scheduler, allocator)


def test_a_preempted_sequence_drops_its_draft() -> None:
    scheduler, _, old, new = full_pool()
    new.draft = [5]
    old.tokens.append(1)  # needs a third block: the newest goes
    old.num_cached = 8
    scheduler.schedule()
    assert list(scheduler.waiting) == [new] and new.draft == []
