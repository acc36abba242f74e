"""The KV transfer benchmark, run for real with a small KV between two processes."""

from __future__ import annotations

from bench.transfer import markdown, measure


def test_transfer_measures_each_backend_against_memcpy() -> None:
    figures = measure((16, 64), repeats=2)
    assert [(f.backend, f.tokens) for f in figures] == [
        ("zmq tcp", 16), ("zmq ipc", 16), ("zmq tcp", 64), ("zmq ipc", 64)]
    for figure in figures:
        assert figure.gb_per_s > 0 and figure.memcpy_gb_per_s > 0
        assert figure.megabytes == figure.tokens * 2 * 30 * 3 * 64 * 4 / 2**20
    table = markdown(figures)
    assert table.count("\n") == len(figures) + 1 and "zmq ipc | 64" in table
