"""Prefill scheduling: oldest first, under a token budget and the free KV blocks."""

from __future__ import annotations

from core.messages import GenerationTask, PrefillRequest, Sampling
from prefill.scheduler import PrefillScheduler

BLOCK = 4


def request(request_id: str, prompt_len: int, epoch: int = 0) -> PrefillRequest:
    task = GenerationTask(list(range(prompt_len)), Sampling(), 8, [], False)
    return PrefillRequest(request_id, epoch, task, "d1", "tcp://127.0.0.1:1")


def scheduler_with(*lengths: int, budget: int = 100) -> PrefillScheduler:
    scheduler = PrefillScheduler(max_batch_tokens=budget, block_size=BLOCK)
    for i, length in enumerate(lengths):
        scheduler.add(request(f"r{i}", length))
    return scheduler


def ids(batch: list[PrefillRequest]) -> list[str]:
    return [r.request_id for r in batch]


def test_empty_queue_schedules_nothing() -> None:
    assert scheduler_with().schedule(free_blocks=100) == []


def test_fifo_order() -> None:
    scheduler = scheduler_with(3, 1, 2, 5)
    assert ids(scheduler.schedule(free_blocks=100)) == ["r0", "r1", "r2", "r3"]
    assert not scheduler.waiting


def test_token_budget_splits_batches_in_order() -> None:
    scheduler = scheduler_with(4, 4, 4, 4, 3, budget=10)
    assert ids(scheduler.schedule(free_blocks=100)) == ["r0", "r1"]
    assert ids(scheduler.schedule(free_blocks=100)) == ["r2", "r3"]
    assert ids(scheduler.schedule(free_blocks=100)) == ["r4"]


def test_a_batch_may_fill_the_budget_exactly() -> None:
    scheduler = scheduler_with(6, 4, 1, budget=10)
    assert ids(scheduler.schedule(free_blocks=100)) == ["r0", "r1"]


def test_a_later_short_prompt_does_not_jump_the_queue() -> None:
    scheduler = scheduler_with(4, 8, 1, budget=10)
    assert ids(scheduler.schedule(free_blocks=100)) == ["r0"]  # r2 would fit, but r1 is older
    assert ids(scheduler.schedule(free_blocks=100)) == ["r1", "r2"]


def test_block_limit() -> None:
    scheduler = scheduler_with(8, 8, 1)  # 2, 2 and 1 blocks
    assert ids(scheduler.schedule(free_blocks=3)) == ["r0"]
    assert ids(scheduler.schedule(free_blocks=1)) == []  # r1 needs 2 blocks: it waits
    assert ids(scheduler.schedule(free_blocks=3)) == ["r1", "r2"]


def test_blocks_round_up_per_prompt() -> None:
    scheduler = scheduler_with(5, 5)  # 2 blocks each, although 10 tokens fit in 3
    assert ids(scheduler.schedule(free_blocks=3)) == ["r0"]


def test_no_free_blocks_schedules_nothing() -> None:
    scheduler = scheduler_with(1)
    assert scheduler.schedule(free_blocks=0) == []
    assert ids(scheduler.schedule(free_blocks=1)) == ["r0"]


def test_a_prompt_over_the_budget_runs_alone() -> None:
    scheduler = scheduler_with(25, 1, budget=10)
    assert ids(scheduler.schedule(free_blocks=100)) == ["r0"]
    assert ids(scheduler.schedule(free_blocks=100)) == ["r1"]


def test_a_prompt_over_the_budget_waits_for_a_batch_of_its_own() -> None:
    scheduler = scheduler_with(1, 25, 1, budget=10)
    assert ids(scheduler.schedule(free_blocks=100)) == ["r0"]
    assert ids(scheduler.schedule(free_blocks=100)) == ["r1"]
    assert ids(scheduler.schedule(free_blocks=100)) == ["r2"]


def test_a_prompt_over_the_budget_still_needs_its_blocks() -> None:
    scheduler = scheduler_with(25, budget=10)  # 7 blocks
    assert scheduler.schedule(free_blocks=6) == []
    assert ids(scheduler.schedule(free_blocks=7)) == ["r0"]


def test_abort_of_a_queued_request() -> None:
    scheduler = scheduler_with(3, 4, 5)
    assert scheduler.abort("r1", 0)
    assert ids(list(scheduler.waiting)) == ["r0", "r2"]
    assert not scheduler.abort("r1", 0)  # already gone
    assert ids(scheduler.schedule(free_blocks=100)) == ["r0", "r2"]


def test_abort_matches_the_epoch() -> None:
    scheduler = PrefillScheduler(max_batch_tokens=100, block_size=BLOCK)
    scheduler.add(request("r", 3, epoch=0))
    scheduler.add(request("r", 5, epoch=1))
    assert not scheduler.abort("r", 2)
    assert scheduler.abort("r", 1)
    assert [(r.request_id, r.epoch) for r in scheduler.waiting] == [("r", 0)]


def test_abort_of_unknown_or_scheduled_request_is_false() -> None:
    scheduler = scheduler_with(3)
    assert not scheduler.abort("nope", 0)
    scheduler.schedule(free_blocks=100)
    assert not scheduler.abort("r0", 0)


def test_queued_tokens() -> None:
    scheduler = scheduler_with(3, 4, 5, budget=7)
    assert scheduler.queued_tokens == 12
    scheduler.abort("r2", 0)
    assert scheduler.queued_tokens == 7
    scheduler.schedule(free_blocks=100)
    assert scheduler.queued_tokens == 0
    assert scheduler_with().queued_tokens == 0


def test_a_repeated_request_is_queued_once_but_a_new_epoch_is_its_own() -> None:
    scheduler = PrefillScheduler(max_batch_tokens=100, block_size=BLOCK)
    assert scheduler.add(request("r", 3))
    assert not scheduler.add(request("r", 3))
    assert scheduler.add(request("r", 3, epoch=1))
    assert [(r.request_id, r.epoch) for r in scheduler.schedule(free_blocks=100)] == [
        ("r", 0), ("r", 1)]
