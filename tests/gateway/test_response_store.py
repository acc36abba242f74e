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


def test_capacity_zero_keeps_nothing() -> None:
    store = ResponseStore(0)
    store.keep(kept("a"))
    assert len(store) == 0 and store.get("a", "") is None
