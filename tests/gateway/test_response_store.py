"""The kept responses: bounded, least recently used first out, each its tenant's."""

from __future__ import annotations

from gateway.response_store import ResponseStore, StoredResponse


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
