"""Where a decode worker's requests are: one phase each, found in one place."""

from __future__ import annotations

from core.messages import DecodeRequest, GenerationTask, RequestKey, Sampling
from decode.incoming import IncomingTable
from decode.phases import TOMBSTONE_TTL_S, Phase, Phases
from decode.scheduler import DecodeScheduler, DecodeSequence
from engine.kv.allocator import BlockAllocator

TASK = GenerationTask([1, 2, 3], Sampling(), 8, [], False)


def request(request_id: str, siblings: tuple[str, ...] = ()) -> DecodeRequest:
    return DecodeRequest(request_id, 0, TASK, "fp", list(siblings))


def sequence(request_id: str) -> DecodeSequence:
    return DecodeSequence(request(request_id), tokens=[1, 2, 3, 7], num_generated=1,
                          num_cached=3)


def phases(num_blocks: int = 8) -> Phases:
    incoming = IncomingTable(2, (2, 4), "float32", "fp", lease_s=30.0)
    return Phases(incoming, DecodeScheduler(BlockAllocator(num_blocks), 16, max_running=1))


def test_each_table_is_a_phase() -> None:
    table = phases()
    table.incoming.expect(request("arriving", siblings=("arriving.1",)), now=0.0)
    table.scheduler.add(sequence("running"))
    table.scheduler.add(sequence("waiting"))
    table.scheduler.schedule()  # one slot: the first admitted, the second waits
    table.forks[RequestKey("running", 0)] = [sequence("forking")]
    table.end(RequestKey("ended", 0), now=0.0)
    found = {name: table.of(RequestKey(name, 0)) for name in
             ("arriving", "arriving.1", "running", "waiting", "forking", "ended", "unknown")}
    assert found == {"arriving": Phase.RECEIVING, "arriving.1": Phase.RECEIVING,
                     "running": Phase.RUNNING, "waiting": Phase.WAITING,
                     "forking": Phase.FORKING, "ended": Phase.ENDED, "unknown": None}
    assert sorted(key.request_id for key in table.held()) == [
        "arriving", "arriving.1", "forking", "running", "waiting"]


def test_an_ended_request_is_remembered_for_a_while_then_forgotten() -> None:
    table = phases()
    key = RequestKey("done", 0)
    table.end(key, now=100.0)
    table.forget_ended(now=100.0 + TOMBSTONE_TTL_S - 1)
    assert table.of(key) is Phase.ENDED
    table.forget_ended(now=100.0 + TOMBSTONE_TTL_S)
    assert table.of(key) is None


def test_ended_wins_over_any_table_still_holding_it() -> None:
    table = phases()
    table.scheduler.add(sequence("r"))
    table.end(RequestKey("r", 0), now=0.0)
    assert table.of(RequestKey("r", 0)) is Phase.ENDED
