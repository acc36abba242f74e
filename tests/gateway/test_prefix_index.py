"""The gateway's guess of a prefill worker's cache: leading blocks matched, the least recently
sent dropped beyond the worker's block count."""

from __future__ import annotations

from gateway.prefix_index import PrefixIndex


def hashes(*names: str) -> list[bytes]:
    return [name.encode() for name in names]


def test_only_leading_blocks_sent_before_match() -> None:
    index = PrefixIndex(capacity_blocks=8)
    index.add(hashes("a", "b", "c"))
    assert index.matched(hashes("a", "b", "c", "d")) == 3
    assert index.matched(hashes("a", "x", "c")) == 1
    assert index.matched(hashes("b", "c")) == 2  # any run of known blocks from the start
    assert index.matched(hashes("x", "a")) == 0
    assert b"c" in index and b"d" not in index


def test_the_least_recently_sent_go_first() -> None:
    index = PrefixIndex(capacity_blocks=3)
    index.add(hashes("a", "b", "c"))
    index.add(hashes("a"))  # sent again: now the most recent
    index.add(hashes("d"))
    assert b"b" not in index and all(h in index for h in hashes("a", "c", "d"))
    assert len(index.hashes) == 3
