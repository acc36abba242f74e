"""`python -m bench chats` against real servers (tiny model) started with launch.sh: the turns of
each chat on a decode worker other than the one holding its history, pulling it or not."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from bench.__main__ import main
from tests.e2e.cluster import TEST_CONFIG, with_decode_cache

pytestmark = pytest.mark.e2e


def test_chats_measure_pulls_against_recompute(tiny_model_dir: Path, tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(with_decode_cache(TEST_CONFIG)))
    out = tmp_path / "chats.json"
    # Pulls always: on the tiny model computing a prefix takes about as long as pulling it.
    launch = (f"c2=--colocated 2 --model {tiny_model_dir} --config {config} "
              "--set gateway.pull_prefixes=always")
    status = main(["chats", "--launch", launch, "--against", "no-pulls", "--chats", "2",
                   "--turns", "3", "--document-len", "80", "--question-len", "8",
                   "--output-len", "8", "--out", str(out)])
    assert status == 0
    report = json.loads(out.read_text())
    assert [(r["layout"], r["on"]) for r in report["runs"]] == [("c2", True), ("c2", False)]
    rows = {row["turns"]: row for row in report["summary"]}
    assert list(rows) == ["1", "2", "3", "2-3"]
    assert all(row["same_answers"] == row["of"] == (2 if t != "2-3" else 4)
               for t, row in rows.items())
    assert rows["1"]["cached_tokens_on"] == 0
    # Turn 2 goes to the worker that holds none of turn 1: it pulls the history, or computes it
    # (turn 3 then finds some of its history on either worker).
    # Computing it, the worker finds cached only what every chat starts with (the template's
    # system prompt, cached by the benchmark's warm-up request).
    assert rows["2"]["cached_tokens_on"] - rows["2"]["cached_tokens_off"] >= 80
