"""Responses made with `background: true`: each runs as a task of its own after the reply
that announced it, keeping itself in the response store as it goes (queued, in_progress, then
completed, incomplete, failed or cancelled: gateway/responses_reply.py), where GET
/v1/responses/{id} finds it. POST /v1/responses/{id}/cancel, a DELETE or the gateway's
shutdown cancels a task; its request is then aborted on the workers, as a client's disconnect
aborts a foreground one.

One made with `stream: true` too logs its events (`EventLog`): the reply that created it
follows the log, and so may any later GET /v1/responses/{id}?stream=true&starting_after=N
of its tenant, from any event on, while it runs and after it has ended (the last
`KEPT_LOGS` ended ones of each tenant are kept).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

Key = tuple[str, str]  # (owner, response id)
KEPT_LOGS = 64  # the event logs of a tenant's ended background streams kept for a later GET


class EventLog:
    """A background stream's SSE events, each at the index of its sequence number."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.ended = False
        self._changed = asyncio.Event()

    def append(self, event: str) -> None:
        assert not self.ended, "a log ends once, after its last event"
        self.events.append(event)
        self._wake()

    def end(self) -> None:
        self.ended = True
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def follow(self, after: int, quiet_s: float) -> AsyncIterator[str | None]:
        """The events after sequence number `after`, as they come, until the log ends; None
        after each `quiet_s` with none (a stream's keep-alive)."""
        index = after + 1
        while True:
            changed = self._changed
            while index < len(self.events):
                yield self.events[index]
                index += 1
            if self.ended:
                return
            try:
                await asyncio.wait_for(changed.wait(), quiet_s)
            except TimeoutError:
                yield None


class BackgroundResponses:
    def __init__(self) -> None:
        self._running: dict[Key, asyncio.Task[None]] = {}
        self._logs: OrderedDict[Key, EventLog] = OrderedDict()

    def __len__(self) -> int:
        return len(self._running)

    def start(self, owner: str, response_id: str, work: Coroutine[Any, Any, None],
              log: EventLog | None = None,
              settle: Callable[[asyncio.Task[None]], None] | None = None) -> None:
        """Run `work`; `log`: the events it logs, found by `log` from now on; `settle`: called
        with the task as it ends, however it ends (even cancelled before it began, when no
        line of `work` ran)."""
        key = (owner, response_id)
        assert key not in self._running, "a response id is made once"
        task = asyncio.create_task(work, name=f"background {response_id}")
        self._running[key] = task
        task.add_done_callback(lambda _: self._running.pop(key, None))
        if settle is not None:
            task.add_done_callback(settle)
        if log is not None:
            self.add_log(owner, response_id, log)

    def add_log(self, owner: str, response_id: str, log: EventLog) -> None:
        """`log` found by `log` from now on (the tenant's oldest ended ones beyond `KEPT_LOGS`
        go: one tenant's streams never push out another's)."""
        self._logs[(owner, response_id)] = log
        ended = [key for key, kept in self._logs.items() if kept.ended and key[0] == owner]
        for key in ended[:max(0, len(ended) - KEPT_LOGS)]:
            del self._logs[key]

    def log(self, owner: str, response_id: str) -> EventLog | None:
        return self._logs.get((owner, response_id))

    def forget(self, owner: str, response_id: str) -> None:
        """The response is deleted: its log goes too."""
        self._logs.pop((owner, response_id), None)

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
