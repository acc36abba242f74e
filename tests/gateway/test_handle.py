"""A request's bookkeeping at the gateway: its workers, its output in order, across epochs."""

from __future__ import annotations

from core.messages import GenerationTask, RequestKey, Sampling
from gateway.handle import Assignment, Event, ReorderBuffer, RequestHandle


def token(token_id: int) -> Event:
    return Event(token_id, None)


def test_tokens_come_out_in_order_whatever_order_they_arrive_in() -> None:
    output = ReorderBuffer()
    assert output.accept(1, token(11)) and output.accept(2, token(12))
    assert list(output.in_order()) == [] and sorted(output.early) == [1, 2]
    assert output.accept(0, token(10))
    assert [e.token_id for e in output.in_order()] == [10, 11, 12]
    assert output.delivered == [10, 11, 12] and output.next_index == 3 and not output.early


def test_a_duplicate_is_refused_whether_delivered_or_waiting() -> None:
    output = ReorderBuffer()
    assert output.accept(0, token(10))
    list(output.in_order())
    assert output.accept(2, token(12))
    assert not output.accept(0, token(10))  # delivered already
    assert not output.accept(2, token(12))  # waiting already


def test_a_gap_is_timed_from_when_tokens_first_wait_behind_it() -> None:
    output = ReorderBuffer()
    output.accept(1, token(11))
    output.note_gap(5.0)
    output.note_gap(7.0)
    assert output.gap_since == 5.0
    output.accept(0, token(10))
    list(output.in_order())
    output.note_gap(9.0)
    assert output.gap_since is None


def test_a_new_epoch_counts_its_tokens_from_what_the_client_has() -> None:
    output = ReorderBuffer()
    for index, token_id in enumerate((10, 11)):
        output.accept(index, token(token_id))
    list(output.in_order())
    output.accept(5, token(99))  # of the old epoch: dropped with it
    output.note_gap(1.0)
    output.new_epoch()
    assert output.early == {} and output.gap_since is None and output.offset == 2
    assert output.accept(0, token(12))  # the new epoch's first token is the client's third
    assert [e.token_id for e in output.in_order()] == [12]
    assert output.delivered == [10, 11, 12]


def test_the_first_token_comes_from_the_prefilling_worker_unless_forked() -> None:
    handed_off = Assignment("p1", "d1")
    assert handed_off.handed_off and handed_off.workers == ["p1", "d1"]
    assert (handed_off.sender_of(0), handed_off.sender_of(1)) == ("p1", "d1")
    forked = Assignment("p1", "d1", forked=True)
    assert (forked.sender_of(0), forked.sender_of(1)) == ("d1", "d1")
    local = Assignment("d1", "d1")
    assert not local.handed_off and local.workers == ["d1"]


def test_a_handle_is_keyed_by_its_current_epoch() -> None:
    task = GenerationTask([1, 2], Sampling(), 4, [], False)
    handle = RequestHandle("r", 0, task, Assignment("p1", "d1"))
    assert handle.key == RequestKey("r", 0)
    handle.epoch += 1
    assert handle.key == ("r", 1)
