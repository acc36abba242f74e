"""The background responses' tasks: started, found while they run, cancelled and waited for;
the event logs of background streams, followed from any event and kept for a while."""

from __future__ import annotations

import asyncio

from gateway.background import KEPT_LOGS, BackgroundResponses, EventLog


async def _until(event: asyncio.Event, ended: list[str], name: str) -> None:
    try:
        await event.wait()
        ended.append(f"{name} done")
    except asyncio.CancelledError:
        ended.append(f"{name} cancelled")
        raise


def test_a_task_runs_until_it_ends_and_is_then_forgotten() -> None:
    async def scenario() -> None:
        background, go = BackgroundResponses(), asyncio.Event()
        ended: list[str] = []
        background.start("alpha", "resp_1", _until(go, ended, "resp_1"))
        await asyncio.sleep(0)
        assert background.running("alpha", "resp_1") and len(background) == 1
        assert not background.running("beta", "resp_1")  # another tenant's is not found
        go.set()
        await asyncio.sleep(0.01)
        assert ended == ["resp_1 done"] and len(background) == 0
        assert not await background.cancel("alpha", "resp_1")  # ended: nothing to cancel
    asyncio.run(scenario())


def test_cancel_ends_the_task_before_it_returns() -> None:
    async def scenario() -> None:
        background = BackgroundResponses()
        ended: list[str] = []
        background.start("alpha", "resp_1", _until(asyncio.Event(), ended, "resp_1"))
        await asyncio.sleep(0)
        assert not await background.cancel("beta", "resp_1")
        assert await background.cancel("alpha", "resp_1")
        assert ended == ["resp_1 cancelled"] and len(background) == 0
    asyncio.run(scenario())


def test_settle_sees_every_end_even_of_a_task_cancelled_before_it_began() -> None:
    """A task cancelled before its first step never runs a line of its work (no `finally`
    either): only `settle` can end what it left."""
    async def scenario() -> None:
        background = BackgroundResponses()
        settled: list[asyncio.Task[None]] = []
        ended: list[str] = []
        background.start("alpha", "resp_1", _until(asyncio.Event(), ended, "resp_1"),
                         settle=settled.append)
        assert await background.cancel("alpha", "resp_1")  # at once: it never began
        assert ended == [] and len(settled) == 1 and settled[0].cancelled()

        async def broken() -> None:
            raise RuntimeError("a bug of ours")
        background.start("alpha", "resp_2", broken(), settle=settled.append)
        await asyncio.sleep(0.01)
        assert len(settled) == 2 and isinstance(settled[1].exception(), RuntimeError)
    asyncio.run(scenario())


def test_shutdown_cancels_every_task() -> None:
    async def scenario() -> None:
        background = BackgroundResponses()
        ended: list[str] = []
        for name in ("resp_1", "resp_2"):
            background.start("alpha", name, _until(asyncio.Event(), ended, name))
        await asyncio.sleep(0)
        await background.cancel_all()
        assert sorted(ended) == ["resp_1 cancelled", "resp_2 cancelled"]
        assert len(background) == 0
    asyncio.run(scenario())


async def _followed(log: EventLog, after: int, quiet_s: float = 5.0) -> list[str | None]:
    return [event async for event in log.follow(after, quiet_s)]


def test_a_log_is_followed_from_after_any_event_until_it_ends() -> None:
    async def scenario() -> None:
        log = EventLog()
        log.append("e0")
        early, late = (asyncio.create_task(_followed(log, after)) for after in (-1, 1))
        await asyncio.sleep(0.01)
        for event in ("e1", "e2", "e3"):
            log.append(event)
            await asyncio.sleep(0)
        log.end()
        assert await early == ["e0", "e1", "e2", "e3"] and await late == ["e2", "e3"]
        assert await _followed(log, 2) == ["e3"] and await _followed(log, 3) == []  # ended
    asyncio.run(scenario())


def test_a_quiet_log_says_so_while_it_waits() -> None:
    async def scenario() -> None:
        log, seen = EventLog(), []
        async for event in log.follow(-1, quiet_s=0.01):
            seen.append(event)
            if len(seen) == 3:  # three quiet spells, then an event and the end
                log.append("e0")
                log.end()
        assert seen == [None, None, None, "e0"]
    asyncio.run(scenario())


def test_logs_are_found_by_tenant_and_the_oldest_ended_ones_forgotten() -> None:
    async def scenario() -> None:
        background = BackgroundResponses()
        logs = [EventLog() for _ in range(KEPT_LOGS + 2)]
        for index, log in enumerate(logs[:-1]):
            background.start("alpha", f"resp_{index}", asyncio.sleep(0), log)
            log.end()
        assert background.log("alpha", "resp_0") is logs[0]
        assert background.log("beta", "resp_0") is None  # another tenant's is not found
        running = logs[-1]  # not ended: never forgotten
        background.start("alpha", "resp_last", asyncio.sleep(0), running)
        assert background.log("alpha", "resp_0") is None  # one too many ended: the oldest
        assert background.log("alpha", "resp_1") is logs[1]
        assert background.log("alpha", "resp_last") is running
        background.forget("alpha", "resp_1")  # deleted
        assert background.log("alpha", "resp_1") is None
        for name in ("resp_b1", "resp_b2"):  # another tenant's, ended: push none out
            others = EventLog()
            others.end()
            background.add_log("beta", name, others)
        assert background.log("alpha", "resp_2") is logs[2]
        await asyncio.sleep(0)
    asyncio.run(scenario())
