"""The responses /v1/responses keeps (`store`), in the gateway's memory: what GET
/v1/responses/{id} returns and what `previous_response_id` continues.

Bounded by count: past `capacity`, the least recently used goes first (`gateway.stored_responses`).
Each belongs to its tenant (the API key's; "" with authentication off): another tenant's id is
not found, as an unknown one is. A restarted gateway has none.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StoredResponse:
    owner: str  # the tenant's cache salt
    body: dict[str, Any]  # the response object, as the client got it
    conversation: list[dict[str, Any]]  # its chat messages, input and output, no instructions


class ResponseStore:
    def __init__(self, capacity: int) -> None:
        assert capacity >= 0
        self.capacity = capacity
        self._kept: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._kept)

    def keep(self, response: StoredResponse) -> None:
        if self.capacity == 0:
            return
        response_id = response.body["id"]
        self._kept[response_id] = response
        self._kept.move_to_end(response_id)
        while len(self._kept) > self.capacity:
            self._kept.popitem(last=False)

    def get(self, response_id: str, owner: str) -> StoredResponse | None:
        """The response, if kept and `owner`'s."""
        response = self._kept.get(response_id)
        if response is None or response.owner != owner:
            return None
        self._kept.move_to_end(response_id)
        return response

    def delete(self, response_id: str, owner: str) -> bool:
        """Forget the response; False if it was not kept (or not `owner`'s)."""
        if self.get(response_id, owner) is None:
            return False
        del self._kept[response_id]
        return True
