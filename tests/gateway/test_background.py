"""The background responses' tasks: started, found while they run, cancelled and waited for."""

from __future__ import annotations

import asyncio

from gateway.background import BackgroundResponses


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
