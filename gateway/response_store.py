"""The responses /v1/responses keeps (`store`), in the gateway's memory: what GET
/v1/responses/{id} returns (and .../input_items lists), and what `previous_response_id`
continues.

Each tenant (the API key's; "" with authentication off) has its own: another tenant's id is not
found, as an unknown one is, and one tenant's traffic never pushes out another's responses.
Each is bounded by count (`gateway.stored_responses`) and by size (`TENANT_BYTES` of JSON):
past either, the tenant's least recently used go first. A restarted gateway has none.
"""

from __future__ import annotations

import json
from collections import OrderedDict, defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gateway.errors import bad_request, whole_number

TENANT_BYTES = 64 * 2**20  # what one tenant's kept responses may weigh, as JSON


@dataclass(frozen=True)
class StoredResponse:
    owner: str  # the tenant's cache salt
    body: dict[str, Any]  # the response object, as the client got it
    conversation: list[dict[str, Any]]  # its chat messages, input and output, no instructions
    input_items: list[dict[str, Any]] = field(default_factory=list)  # its own input, listed
    size: int = field(init=False)  # bytes, as JSON

    def __post_init__(self) -> None:
        size = len(json.dumps([self.body, self.conversation, self.input_items]))
        object.__setattr__(self, "size", size)


class ResponseStore:
    def __init__(self, capacity: int, tenant_bytes: int = TENANT_BYTES) -> None:
        assert capacity >= 0
        self.capacity = capacity  # per tenant
        self.tenant_bytes = tenant_bytes
        self._kept: defaultdict[str, OrderedDict[str, StoredResponse]] = defaultdict(OrderedDict)
        self._bytes: defaultdict[str, int] = defaultdict(int)  # per tenant

    def __len__(self) -> int:
        return sum(len(kept) for kept in self._kept.values())

    def keep(self, response: StoredResponse) -> None:
        if self.capacity == 0 or response.size > self.tenant_bytes:
            return
        self.delete(response.body["id"], response.owner)
        kept = self._kept[response.owner]
        kept[response.body["id"]] = response
        self._bytes[response.owner] += response.size
        while len(kept) > self.capacity or self._bytes[response.owner] > self.tenant_bytes:
            _, oldest = kept.popitem(last=False)
            self._bytes[response.owner] -= oldest.size

    def get(self, response_id: str, owner: str) -> StoredResponse | None:
        """The response, if kept and `owner`'s."""
        kept = self._kept.get(owner)
        if kept is None or response_id not in kept:
            return None
        kept.move_to_end(response_id)
        return kept[response_id]

    def delete(self, response_id: str, owner: str) -> bool:
        """Forget the response; False if it was not kept (or not `owner`'s)."""
        kept = self._kept.get(owner)
        response = None if kept is None else kept.pop(response_id, None)
        if response is None:
            return False
        self._bytes[owner] -= response.size
        return True


def input_items_page(items: list[dict[str, Any]], query: Mapping[str, str]) -> dict[str, Any]:
    """One page of a response's input items, as OpenAI lists them: `order` "desc" (the
    default: the last item first) or "asc", the items after the one whose id is `after`, at
    most `limit` (1-100, default 20)."""
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise bad_request("order must be 'asc' or 'desc'", param="order")
    limit = whole_number(query.get("limit", "20"))
    if limit is None or not 1 <= limit <= 100:
        raise bad_request("limit must be an integer from 1 to 100", param="limit")
    ordered = items if order == "asc" else items[::-1]
    after = query.get("after")
    if after is not None:
        ids = [item["id"] for item in ordered]
        if after not in ids:
            raise bad_request(f"no input item has the id '{after}'", param="after")
        ordered = ordered[ids.index(after) + 1:]
    page = ordered[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(ordered) > len(page)}
