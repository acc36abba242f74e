"""Prefill scheduling: earliest deadline first, under a cost budget and the free KV blocks,
long prompts one chunk per step. Costs count tokens alone unless a test gives a ChunkCost.
Most tests give no time per token, so that the deadline is the arrival and the order first
come, first served; the last ones test deadlines."""

from __future__ import annotations

import time

from core.messages import GenerationTask, PrefillRequest, RequestKey, Sampling
from engine.model.chunk_cost import ChunkCost
from prefill.scheduler import Chunk, Prefilling, PrefillScheduler

BLOCK = 4


def request(request_id: str, prompt_len: int, epoch: int = 0) -> PrefillRequest:
    task = GenerationTask(list(range(prompt_len)), Sampling(), 8, [], False)
    return PrefillRequest(request_id, epoch, task, "d1", "tcp://127.0.0.1:1")


def scheduler_with(*lengths: int, budget: int = 100, chunk: int = 512,
                   per_token: float = 0.0) -> PrefillScheduler:
    """Prompts r0, r1, ... of `lengths`, arriving one second apart."""
    scheduler = PrefillScheduler(max_batch_tokens=budget, block_size=BLOCK, chunk_tokens=chunk,
                                 ttft_s_per_token=per_token)
    for i, length in enumerate(lengths):
        scheduler.add(request(f"r{i}", length), now=float(i))
    return scheduler


def ids(batch: list[Chunk] | list[Prefilling]) -> list[str]:
    return [(c.prompt if isinstance(c, Chunk) else c).request.request_id for c in batch]


def step(scheduler: PrefillScheduler, free_blocks: int = 100, **kwargs: object) -> list[Chunk]:
    """One step, as the worker runs it: schedule, then every chunk's KV is computed."""
    chunks = scheduler.schedule(free_blocks, **kwargs)  # type: ignore[arg-type]
    for chunk in chunks:
        scheduler.advance(chunk)
    return chunks


def spans(chunks: list[Chunk]) -> list[tuple[str, int, int, bool]]:
    return [(c.prompt.request.request_id, c.start, c.end, c.is_last) for c in chunks]


def test_empty_queue_schedules_nothing() -> None:
    assert scheduler_with().schedule(free_blocks=100) == []


def test_fifo_order() -> None:
    scheduler = scheduler_with(3, 1, 2, 5)
    assert ids(step(scheduler, free_blocks=100)) == ["r0", "r1", "r2", "r3"]
    assert not scheduler.waiting


def test_token_budget_splits_batches_in_order() -> None:
    scheduler = scheduler_with(4, 4, 4, 4, 3, budget=10)
    assert ids(step(scheduler, free_blocks=100)) == ["r0", "r1"]
    assert ids(step(scheduler, free_blocks=100)) == ["r2", "r3"]
    assert ids(step(scheduler, free_blocks=100)) == ["r4"]


def test_a_batch_may_fill_the_budget_exactly() -> None:
    scheduler = scheduler_with(6, 4, 1, budget=10)
    assert ids(step(scheduler, free_blocks=100)) == ["r0", "r1"]


def test_a_later_short_prompt_fills_what_an_older_one_leaves_of_the_budget() -> None:
    scheduler = scheduler_with(4, 8, 1, budget=10)
    assert ids(step(scheduler, free_blocks=100)) == ["r0", "r2"]  # r1 does not fit: next step
    assert ids(step(scheduler, free_blocks=100)) == ["r1"]


def test_block_limit() -> None:
    scheduler = scheduler_with(8, 8, 1)  # 2, 2 and 1 blocks
    assert ids(step(scheduler, free_blocks=3)) == ["r0"]
    assert ids(step(scheduler, free_blocks=1)) == []  # r1 needs 2 blocks: it waits
    assert ids(step(scheduler, free_blocks=3)) == ["r1", "r2"]


def test_blocks_round_up_per_prompt() -> None:
    scheduler = scheduler_with(5, 5)  # 2 blocks each, although 10 tokens fit in 3
    assert ids(step(scheduler, free_blocks=3)) == ["r0"]


def test_no_free_blocks_schedules_nothing() -> None:
    scheduler = scheduler_with(1)
    assert step(scheduler, free_blocks=0) == []
    assert ids(step(scheduler, free_blocks=1)) == ["r0"]


def test_a_prompt_over_the_budget_goes_in_chunks_of_the_budget() -> None:
    scheduler = scheduler_with(25, 1, budget=10)
    assert spans(step(scheduler)) == [("r0", 0, 10, False)]
    assert spans(step(scheduler)) == [("r0", 10, 20, False)]
    assert spans(step(scheduler)) == [("r0", 20, 25, True), ("r1", 0, 1, True)]


def test_a_long_prompt_does_not_ride_in_a_step_that_finishes_an_earlier_one() -> None:
    """The step's end is r0's first token: a chunk of r1, due later, would only delay it (r2,
    whole, still fills what is left)."""
    scheduler = scheduler_with(1, 25, 1, budget=10)
    assert spans(step(scheduler)) == [("r0", 0, 1, True), ("r2", 0, 1, True)]
    assert spans(step(scheduler)) == [("r1", 0, 10, False)]
    assert spans(step(scheduler)) == [("r1", 10, 20, False)]
    assert spans(step(scheduler)) == [("r1", 20, 25, True)]


def test_an_unfinished_earlier_chunk_leaves_the_budget_to_a_later_long_prompt() -> None:
    scheduler = scheduler_with(30, 25, budget=10, chunk=6)
    assert spans(step(scheduler)) == [("r0", 0, 6, False), ("r1", 0, 4, False)]


def test_a_prompt_over_the_budget_still_needs_its_blocks() -> None:
    scheduler = scheduler_with(25, budget=10)  # 7 blocks
    assert step(scheduler, free_blocks=6) == []
    assert ids(step(scheduler, free_blocks=7)) == ["r0"]


def test_abort_of_a_queued_request() -> None:
    scheduler = scheduler_with(3, 4, 5)
    assert scheduler.abort(RequestKey("r1", 0))
    assert ids(list(scheduler.waiting)) == ["r0", "r2"]
    assert not scheduler.abort(RequestKey("r1", 0))  # already gone
    assert ids(step(scheduler, free_blocks=100)) == ["r0", "r2"]


def test_abort_matches_the_epoch() -> None:
    scheduler = PrefillScheduler(max_batch_tokens=100, block_size=BLOCK)
    scheduler.add(request("r", 3, epoch=0))
    scheduler.add(request("r", 5, epoch=1))
    assert not scheduler.abort(RequestKey("r", 2))
    assert scheduler.abort(RequestKey("r", 1))
    assert [p.key for p in scheduler.waiting] == [("r", 0)]


def test_abort_of_unknown_or_finished_request_is_false() -> None:
    scheduler = scheduler_with(3)
    assert not scheduler.abort(RequestKey("nope", 0))
    step(scheduler, free_blocks=100)
    assert not scheduler.abort(RequestKey("r0", 0))


def test_queued_tokens() -> None:
    scheduler = scheduler_with(3, 4, 5, budget=7)
    assert scheduler.queued_tokens == 12
    scheduler.abort(RequestKey("r2", 0))
    assert scheduler.queued_tokens == 7
    step(scheduler, free_blocks=100)
    assert scheduler.queued_tokens == 0
    assert scheduler_with().queued_tokens == 0


def test_a_repeated_request_is_queued_once_but_a_new_epoch_is_its_own() -> None:
    scheduler = PrefillScheduler(max_batch_tokens=100, block_size=BLOCK)
    assert scheduler.add(request("r", 3))
    assert not scheduler.add(request("r", 3))
    assert scheduler.add(request("r", 3, epoch=1))
    assert [c.prompt.key for c in step(scheduler, free_blocks=100)] == [
        ("r", 0), ("r", 1)]


def test_a_long_prompt_goes_one_chunk_per_step_and_only_the_last_is_last() -> None:
    scheduler = scheduler_with(20, budget=10, chunk=8)
    assert spans(step(scheduler)) == [("r0", 0, 8, False)]
    assert scheduler.held() == [("r0", 0)] and scheduler.queued_tokens == 12
    assert spans(step(scheduler)) == [("r0", 8, 16, False)]
    assert spans(step(scheduler)) == [("r0", 16, 20, True)]
    assert scheduler.held() == [] and step(scheduler) == []


def test_a_prompt_that_fits_the_budget_goes_whole_however_long_the_chunks() -> None:
    scheduler = scheduler_with(20, budget=20, chunk=8)
    assert spans(step(scheduler)) == [("r0", 0, 20, True)]


def test_a_short_prompt_arriving_behind_a_long_one_waits_at_most_one_chunk() -> None:
    scheduler = scheduler_with(4000, budget=2048, chunk=512)
    assert spans(step(scheduler, free_blocks=2000)) == [("r0", 0, 512, False)]
    scheduler.add(request("short", 50), now=1.0)
    assert spans(step(scheduler, free_blocks=2000)) == [("r0", 512, 1024, False),
                                                         ("short", 0, 50, True)]


def test_prompts_in_progress_go_first_each_one_chunk_within_the_budget() -> None:
    scheduler = scheduler_with(30, 30, 5, budget=20, chunk=8)
    assert spans(step(scheduler)) == [("r0", 0, 8, False), ("r1", 0, 8, False)]
    # Both in progress fill 16 of 20: r2 (5 tokens) waits, nothing newer passes an older one.
    assert spans(step(scheduler)) == [("r0", 8, 16, False), ("r1", 8, 16, False)]
    # r0's rest fits: it goes whole; r1's 14 would not fit the 6 left, r2's 5 do.
    assert spans(step(scheduler)) == [("r0", 16, 30, True), ("r2", 0, 5, True)]
    assert spans(step(scheduler)) == [("r1", 16, 30, True)]


def test_an_older_prompt_in_progress_is_not_passed_when_the_budget_is_full() -> None:
    scheduler = scheduler_with(30, 30, budget=10, chunk=8)
    assert spans(step(scheduler)) == [("r0", 0, 8, False), ("r1", 0, 2, False)]
    assert spans(step(scheduler)) == [("r0", 8, 16, False), ("r1", 2, 4, False)]
    assert spans(step(scheduler)) == [("r0", 16, 24, False), ("r1", 4, 6, False)]
    assert spans(step(scheduler)) == [("r0", 24, 30, True)]  # r0's first token is due
    assert spans(step(scheduler)) == [("r1", 6, 14, False)]


def test_a_chunk_is_cut_to_the_budget() -> None:
    scheduler = scheduler_with(30, 2, budget=10, chunk=16)
    assert spans(step(scheduler)) == [("r0", 0, 10, False)]
    assert spans(step(scheduler)) == [("r0", 10, 20, False)]
    assert spans(step(scheduler)) == [("r0", 20, 30, True)]
    assert ids(step(scheduler)) == ["r1"]


def test_blocks_are_counted_for_the_whole_prompt_at_admission_only() -> None:
    scheduler = scheduler_with(32, 4, budget=12, chunk=8)  # 8 blocks, then 1
    assert step(scheduler, free_blocks=7) == []
    assert ids(step(scheduler, free_blocks=8)) == ["r0"]
    assert ids(step(scheduler, free_blocks=0)) == ["r0"]  # it holds its blocks already
    assert ids(step(scheduler, free_blocks=1)) == ["r0", "r1"]


def test_a_cached_prefix_is_skipped() -> None:
    scheduler = scheduler_with(20, chunk=8)
    started: list[str] = []

    def start(request: PrefillRequest) -> int:
        started.append(request.request_id)
        return 12  # tokens 0..11 are in the prefix cache
    assert spans(step(scheduler, start=start)) == [("r0", 12, 20, True)]
    assert started == ["r0"] and scheduler.held() == []


def test_start_is_called_once_per_prompt_when_it_is_admitted() -> None:
    scheduler = scheduler_with(20, 3, budget=8, chunk=8)
    started: list[str] = []

    def start(request: PrefillRequest) -> int:
        started.append(request.request_id)
        return 0
    for _ in range(4):
        step(scheduler, start=start)
    assert started == ["r0", "r1"]


def test_abort_of_a_prompt_in_progress() -> None:
    scheduler = scheduler_with(20, 20, budget=16, chunk=8)
    step(scheduler)
    assert scheduler.held() == [("r0", 0), ("r1", 0)] and scheduler.queued_tokens == 24
    assert scheduler.abort(RequestKey("r0", 0))
    assert not scheduler.abort(RequestKey("r0", 0))
    assert scheduler.held() == [("r1", 0)] and scheduler.queued_tokens == 12
    assert ids(step(scheduler)) == ["r1"]


def test_a_repeat_of_a_prompt_in_progress_is_not_queued() -> None:
    scheduler = scheduler_with(20, budget=10, chunk=8)
    step(scheduler)
    assert not scheduler.add(request("r0", 20))
    assert scheduler.add(request("r0", 20, epoch=1))


def test_a_short_prompt_goes_whole_before_a_long_one_in_progress() -> None:
    """Deadlines: the long prompt's is 0 + 4000 x 5 ms = 20 s, the short one's 1 + 1.5 s."""
    scheduler = scheduler_with(4000, budget=512, chunk=256, per_token=0.005)
    assert spans(step(scheduler, free_blocks=2000)) == [("r0", 0, 256, False)]
    scheduler.add(request("short", 300), now=1.0)
    assert spans(step(scheduler, free_blocks=2000)) == [("short", 0, 300, True)]
    assert spans(step(scheduler, free_blocks=2000)) == [("r0", 256, 512, False)]


def test_a_long_prompt_is_not_starved_by_later_short_ones() -> None:
    scheduler = scheduler_with(1000, budget=100, chunk=100, per_token=0.005)  # due at 5 s
    for arrival in range(9):  # shorts due at 0.5 .. 8.5 s: those due before 5 s go first
        scheduler.add(request(f"s{arrival}", 100), now=float(arrival))
    order = [ids(step(scheduler, free_blocks=1000)) for _ in range(19)]
    assert order[:5] == [["s0"], ["s1"], ["s2"], ["s3"], ["s4"]]
    assert order[5:15] == [["r0"]] * 10 and order[15:] == [["s5"], ["s6"], ["s7"], ["s8"]]


def test_deadlines_order_waiting_prompts_by_arrival_and_length() -> None:
    scheduler = PrefillScheduler(max_batch_tokens=1000, block_size=BLOCK, ttft_s_per_token=0.01)
    scheduler.add(request("long", 300), now=0.0)  # due at 3 s
    scheduler.add(request("short", 50), now=2.0)  # due at 2.5 s
    scheduler.add(request("later", 10), now=2.9)  # due at 3.0 s, after "long" (stable)
    assert ids(scheduler.schedule(free_blocks=1000)) == ["short", "long", "later"]


def test_a_prompt_being_started_is_held() -> None:
    """`start` may heartbeat (a KV receiver's connect wait): the heartbeat must list the prompt,
    or the gateway would think no worker holds it."""
    scheduler = scheduler_with(3, 5)
    seen: list[set[tuple[str, int]]] = []

    def start(request: PrefillRequest) -> int:
        seen.append(set(scheduler.held()))
        return 0

    scheduler.schedule(free_blocks=100, start=start)
    assert seen == [{("r0", 0), ("r1", 0)}] * 2


def test_costed_chunks_shrink_deep_into_a_long_prompt_to_half_a_chunk() -> None:
    """With keys costed, a long prompt alone gets a chunk's worth per step, but never fewer
    than half a chunk's tokens."""
    cost = ChunkCost(keys_per_token=1536)
    scheduler = PrefillScheduler(max_batch_tokens=512, block_size=BLOCK, chunk_tokens=256,
                                 cost=cost)
    scheduler.add(request("long", 4000))
    chunks = []
    while scheduler.held():
        (chunk,) = step(scheduler, free_blocks=2000)
        chunks.append((chunk.start, chunk.end - chunk.start))
    sizes = [n for _, n in chunks[:-1]]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] > 200 and sizes[-1] == 128
    assert all(cost.cost(s, n) <= 256 for s, n in chunks[:-1] if n > 128)
    assert cost.cost(*chunks[-2]) > 256  # deep in, half a chunk costs more than a chunk's worth
    assert sum(n for _, n in chunks) == 4000


def test_a_short_prompt_behind_a_deep_chunk_goes_whole_in_a_step_of_its_own() -> None:
    cost = ChunkCost(keys_per_token=1536)
    scheduler = PrefillScheduler(max_batch_tokens=512, block_size=BLOCK, chunk_tokens=256,
                                 ttft_s_per_token=0.005, cost=cost)
    scheduler.add(request("long", 4000), now=0.0)
    while scheduler.running == [] or scheduler.running[0].done < 3000:
        step(scheduler, free_blocks=2000)
    scheduler.add(request("short", 277), now=10.0)
    (short,) = step(scheduler, free_blocks=2000)
    assert (short.prompt.request.request_id, short.start, short.end) == ("short", 0, 277)
    (deep,) = step(scheduler, free_blocks=2000)
    assert deep.prompt.request.request_id == "long" and deep.end - deep.start == 128


def test_priority_comes_before_the_deadline_lower_first() -> None:
    scheduler = PrefillScheduler(max_batch_tokens=10, block_size=BLOCK)
    for name, priority in (("normal", 0), ("urgent", -5), ("later", 3), ("also", 0)):
        task = GenerationTask(list(range(5)), Sampling(), 8, [], False, priority=priority)
        scheduler.add(PrefillRequest(name, 0, task, "d1", "tcp://127.0.0.1:1"))
    assert ids(step(scheduler)) == ["urgent", "normal"]
    assert ids(step(scheduler)) == ["also", "later"]


def test_thousands_queued_are_added_and_aborted_each_in_constant_time() -> None:
    """Each arrival and abort looks its prompt up by key (a list scan each made 5,000 queued
    requests take longer to take in than the stall timeout)."""
    scheduler = scheduler_with()
    began = time.monotonic()
    for i in range(20_000):
        assert scheduler.add(request(f"r{i}", 8))
    assert not scheduler.add(request("r7", 8)) and scheduler.holds(RequestKey("r7", 0))
    for i in range(20_000):
        assert scheduler.abort(RequestKey(f"r{i}", 0))
    # Linear: about 0.1 s here; quadratic was minutes.
    assert time.monotonic() - began < 5.0
    assert not scheduler.waiting and not scheduler.held() and not scheduler.abort(
        RequestKey("r7", 0))
