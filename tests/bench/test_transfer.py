"""The KV transfer benchmark, run for real with a small KV between two processes."""

from __future__ import annotations

from bench.transfer import cuda_ready, markdown, measure


def test_transfer_measures_each_backend_against_memcpy() -> None:
    figures = measure((16, 64), repeats=2, min_mb=1)
    names = ["zmq tcp", "zmq ipc", "shm"] + (["cuda_ipc"] if cuda_ready() else [])
    assert [(f.backend, f.tokens) for f in figures] == [
        (name, tokens) for tokens in (16, 64) for name in names]
    for figure in figures:
        assert figure.gb_per_s > 0 and figure.memcpy_gb_per_s > 0
        assert figure.megabytes == figure.tokens * 2 * 30 * 3 * 64 * 4 / 2**20
    table = markdown(figures)
    assert table.count("\n") == len(figures) + 1 and "| shm | 64 |" in table


def test_transfer_runs_over_curve_sockets() -> None:
    figures = measure((16,), repeats=1, min_mb=1, curve=True)
    assert [f.backend for f in figures][:3] == ["zmq tcp +curve", "zmq ipc +curve", "shm +curve"]
    assert all(figure.gb_per_s > 0 for figure in figures)
