"""Responses made with `background: true`: each runs as a task of its own after the reply
that announced it, keeping itself in the response store as it goes (queued, in_progress, then
completed, incomplete, failed or cancelled: gateway/responses_reply.py), where GET
/v1/responses/{id} finds it. POST /v1/responses/{id}/cancel, a DELETE or the gateway's
shutdown cancels a task; its request is then aborted on the workers, as a client's disconnect
aborts a foreground one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

Key = tuple[str, str]  # (owner, response id)


class BackgroundResponses:
    def __init__(self) -> None:
        self._running: dict[Key, asyncio.Task[None]] = {}

    def __len__(self) -> int:
        return len(self._running)

    def start(self, owner: str, response_id: str, work: Coroutine[Any, Any, None]) -> None:
        key = (owner, response_id)
        assert key not in self._running, "a response id is made once"
        task = asyncio.create_task(work, name=f"background {response_id}")
        self._running[key] = task
        task.add_done_callback(lambda _: self._running.pop(key, None))

    def running(self, owner: str, response_id: str) -> bool:
        return (owner, response_id) in self._running

    async def cancel(self, owner: str, response_id: str) -> bool:
        """Cancel the response's task and wait for it to end; False if none runs."""
        task = self._running.get((owner, response_id))
        if task is None:
            return False
        task.cancel()
        await asyncio.wait({task})
        return True

    async def cancel_all(self) -> None:
        """At shutdown: every task cancelled, and ended."""
        tasks = list(self._running.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
