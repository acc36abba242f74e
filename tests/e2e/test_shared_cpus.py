"""As many workers as CPUs or more, as launch.sh starts them: pinned where asked (a warning says
how many share a CPU, and the gateway packs every sequence onto one of them), else every worker
on every CPU; workers on the same CPUs compute in turn (core/turns.py)."""

from __future__ import annotations

import contextlib
import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from core.turns import turns_file
from tests.e2e.cluster import TEST_CONFIG, launch

pytestmark = pytest.mark.e2e


def test_three_decode_workers_on_one_cpu_fill_one_batch(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    cpu = max(os.sched_getaffinity(0))
    flags = ["--prefill-cpus", str(min(os.sched_getaffinity(0))), "--decode-cpus", str(cpu)]
    with launch(tmp_path / "run", tiny_model_dir, prefill=1, decode=3, flags=flags) as cluster:
        workers = cluster.client.get("/v1/cluster").json()["workers"]
        decode = {w["id"]: (w["cpus"], w["threads"]) for w in workers if w["role"] == "decode"}
        assert decode == {f"decode-{i}": ([cpu], 1) for i in range(3)}

        def complete(prompt: str) -> int:
            body = {"model": cluster.model, "prompt": prompt, "max_tokens": 8,
                    "ignore_eos": True}
            return cluster.client.post("/v1/completions", json=body).status_code

        with ThreadPoolExecutor(6) as pool:
            statuses = list(pool.map(complete, [f"Count to {n}:" for n in range(6)]))
        assert statuses == [200] * 6
        routed = re.findall(r"decode on (decode-\d)", cluster.log("gateway"))
    assert routed == ["decode-0"] * 6
    launched = (tmp_path / "run" / "launch.log").read_text()
    assert launched.count("[launch] warning: 3 decode workers") == 1
    assert "gateway.decode_routing" in launched and "prefill workers" not in launched


@pytest.mark.parametrize(("more", "threads"), [(0, 1), (1, 0)],
                         ids=["as-many-as-the-cpus-one-thread-each", "one-more-filling-them"])
def test_workers_as_many_as_the_cpus_share_them_all(
        tiny_model_dir: Path, tmp_path: Path, more: int, threads: int) -> None:
    """Every worker on every CPU; they take turns where each one's threads (by default one per
    CPU) fill the CPUs, and compute at once where they leave room for each other."""
    cpus = sorted(os.sched_getaffinity(0))[:2]
    decode = len(cpus) - 1 + more  # with the prefill worker, `more` workers more than the CPUs
    config = {**TEST_CONFIG, "prefill": {**TEST_CONFIG["prefill"], "threads": threads},
              "decode": {**TEST_CONFIG["decode"], "threads": threads}}
    with launch(tmp_path / "run", tiny_model_dir, prefill=1, decode=decode, config=config,
                cpus=cpus) as cluster:
        workers = cluster.client.get("/v1/cluster").json()["workers"]
        assert sorted(w["id"] for w in workers) == sorted(
            ["prefill-0", *(f"decode-{i}" for i in range(decode))])
        assert all(w["cpus"] == cpus and w["threads"] == (threads or len(cpus))
                   for w in workers)
        turns = tmp_path / "run" / "turns" / turns_file(Path(), cpus)
        assert len(cluster.pids()) == decode + 2
        for name, pid in cluster.pids().items():
            held = set()
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                with contextlib.suppress(FileNotFoundError):  # closed meanwhile
                    held.add(os.readlink(fd))
            assert (str(turns) in held) == (name != "gateway" and threads == 0), name
        body = {"model": cluster.model, "prompt": "Count to 5:", "max_tokens": 8,
                "ignore_eos": True}
        replies = [cluster.client.post("/v1/completions", json=body) for _ in range(3)]
        assert [r.status_code for r in replies] == [200] * 3
        assert all(r.json()["usage"]["completion_tokens"] == 8 for r in replies)
    launched = (tmp_path / "run" / "launch.log").read_text()
    shared = f"[launch] {decode + 1} workers on {len(cpus)} CPUs: each runs on all of them"
    assert shared in launched
    assert "[launch] warning" not in launched


def test_pin_keeps_each_pool_on_cpus_of_its_own(tiny_model_dir: Path, tmp_path: Path) -> None:
    cpus = sorted(os.sched_getaffinity(0))[:2]
    with launch(tmp_path / "run", tiny_model_dir, flags=["--pin"], cpus=cpus) as cluster:
        workers = cluster.client.get("/v1/cluster").json()["workers"]
        placed = {w["id"]: (w["cpus"], w["threads"]) for w in workers}
        assert placed == {"prefill-0": ([cpus[0]], 1), "decode-0": ([cpus[1]], 1)}
    assert "each runs on all of them" not in (tmp_path / "run" / "launch.log").read_text()
