"""The kept responses: bounded, least recently used first out, each its tenant's."""

from __future__ import annotations

import pytest

from gateway.errors import APIError
from gateway.response_store import ResponseStore, StoredResponse, input_items_page


def kept(response_id: str, owner: str = "") -> StoredResponse:
    return StoredResponse(owner, {"id": response_id}, [{"role": "user", "content": "Hi"}])


def test_the_least_recently_used_goes_first() -> None:
    store = ResponseStore(2)
    store.keep(kept("a"))
    store.keep(kept("b"))
    assert store.get("a", "") is not None  # now b is the oldest in use
    store.keep(kept("c"))
    assert len(store) == 2
    assert store.get("b", "") is None
    assert store.get("a", "") is not None and store.get("c", "") is not None


def test_another_tenant_finds_nothing_and_deletes_nothing() -> None:
    store = ResponseStore(4)
    store.keep(kept("a", owner="salt-1"))
    assert store.get("a", "salt-2") is None and store.get("a", "") is None
    assert not store.delete("a", "salt-2")
    assert store.delete("a", "salt-1")
    assert store.get("a", "salt-1") is None and not store.delete("a", "salt-1")


def test_each_tenant_keeps_its_own_count() -> None:
    store = ResponseStore(1)
    store.keep(kept("a", owner="salt-1"))
    store.keep(kept("b", owner="salt-2"))  # another tenant's pushes out nothing
    assert store.get("a", "salt-1") is not None and store.get("b", "salt-2") is not None
    store.keep(kept("c", owner="salt-1"))
    assert store.get("a", "salt-1") is None and len(store) == 2


def test_a_tenants_responses_are_bounded_in_bytes_too() -> None:
    big = "x" * 1000
    store = ResponseStore(100, tenant_bytes=2500)
    for name in "abc":
        store.keep(StoredResponse("", {"id": name, "text": big}, []))
    assert [store.get(name, "") is not None for name in "abc"] == [False, True, True]
    store.keep(StoredResponse("", {"id": "huge", "text": big * 3}, []))  # over the whole budget
    assert store.get("huge", "") is None and store.get("c", "") is not None
    assert store.delete("b", "") and store.delete("c", "")
    store.keep(StoredResponse("", {"id": "d", "text": big * 2}, []))  # room again
    assert store.get("d", "") is not None


def test_capacity_zero_keeps_nothing() -> None:
    store = ResponseStore(0)
    store.keep(kept("a"))
    assert len(store) == 0 and store.get("a", "") is None


ITEMS = [{"id": f"msg_{i}"} for i in range(5)]


@pytest.mark.parametrize(("query", "ids", "has_more"), [
    ({}, [4, 3, 2, 1, 0], False),
    ({"order": "asc", "limit": "2"}, [0, 1], True),
    ({"order": "asc", "after": "msg_1", "limit": "3"}, [2, 3, 4], False),
    ({"after": "msg_3", "limit": "2"}, [2, 1], True),
    ({"after": "msg_0"}, [], False),
])
def test_input_items_come_a_page_at_a_time(query: dict[str, str], ids: list[int],
                                          has_more: bool) -> None:
    page = input_items_page(ITEMS, query)
    assert [item["id"] for item in page["data"]] == [f"msg_{i}" for i in ids]
    assert page["object"] == "list" and page["has_more"] is has_more
    assert (page["first_id"], page["last_id"]) == (
        (f"msg_{ids[0]}", f"msg_{ids[-1]}") if ids else (None, None))


@pytest.mark.parametrize(("query", "param"), [
    ({"order": "up"}, "order"), ({"limit": "0"}, "limit"), ({"limit": "101"}, "limit"),
    ({"limit": "x"}, "limit"), ({"limit": "²"}, "limit"), ({"after": "msg_9"}, "after")])
def test_a_bad_page_query_is_a_400_naming_it(query: dict[str, str], param: str) -> None:
    with pytest.raises(APIError) as caught:
        input_items_page(ITEMS, query)
    assert (caught.value.status, caught.value.param) == (400, param)
