"""Traces: the JSONL format round trip, bad lines refused by line, traces of workloads."""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path

import pytest

from bench.__main__ import main
from bench.load import arrival_offsets
from bench.trace import (
    ByteLengths,
    Grouping,
    TraceError,
    TraceRequest,
    describe,
    format_trace,
    parse_trace,
    read_trace,
    workload_trace,
    write_trace,
)
from bench.workloads import Workload, build

REQUESTS = (
    TraceRequest(0.0, 1200, 64, "g0", 1000),
    TraceRequest(0.25, 30, 8, None),
    TraceRequest(0.25, 500, 1, "tenant-b"),  # a group without a shared prefix: a label
    TraceRequest(1.5, 1001, 200, "g0", 1000),
)


def test_a_written_trace_reads_back_the_same(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "trace.jsonl"
    write_trace(REQUESTS, path)
    assert read_trace(path) == REQUESTS
    lines = path.read_text().splitlines()
    assert len(lines) == len(REQUESTS)
    assert json.loads(lines[1]) == {"arrival_s": 0.25, "prompt_tokens": 30, "output_tokens": 8,
                                    "prefix_group": None}  # prefix_tokens 0 is left out
    assert json.loads(lines[0])["prefix_tokens"] == 1000


GOOD = '{"arrival_s": 1, "prompt_tokens": 10, "output_tokens": 5, "prefix_group": null}'


@pytest.mark.parametrize(("line", "why"), [
    ("not json", "not JSON"),
    ("[1, 2]", "not a JSON object"),
    ('{"arrival_s": 2, "prompt_tokens": 10, "output_tokens": 5}', "missing keys"),
    (GOOD[:-1] + ', "extra": 1}', "unknown keys"),
    (GOOD.replace('"arrival_s": 1', '"arrival_s": "1"'), "arrival_s must be a number"),
    (GOOD.replace('"arrival_s": 1', '"arrival_s": 0.5'), "before the line before"),
    (GOOD.replace('"arrival_s": 1', '"arrival_s": -1'), "arrival_s must be"),
    (GOOD.replace("10", "10.5"), "prompt_tokens must be an integer"),
    (GOOD.replace("10", "true"), "prompt_tokens must be an integer"),
    (GOOD.replace(": 5", ": 0"), "must be >= 1"),
    (GOOD.replace("null", "3"), "prefix_group must be a string or null"),
    (GOOD.replace("null", '""'), "non-empty"),
    (GOOD[:-1] + ', "prefix_tokens": 4}', "needs a prefix_group"),
    (GOOD.replace("null", '"g"')[:-1] + ', "prefix_tokens": 11}', "prefix_tokens must be in"),
    ("", "blank line"),
])
def test_a_bad_line_is_refused_naming_it(line: str, why: str) -> None:
    text = f"{GOOD}\n{line}\n{GOOD.replace('1,', '3,', 1)}\n"
    with pytest.raises(TraceError, match=f"^t.jsonl:2: .*{why}"):
        parse_trace(text, "t.jsonl")


def test_an_empty_trace_is_refused(tmp_path: Path) -> None:
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(TraceError, match="no requests"):
        read_trace(tmp_path / "empty.jsonl")


def test_a_workload_trace_has_its_lengths_and_poisson_arrivals() -> None:
    workload = Workload("chat", seed=5, max_output_len=100)
    trace = workload_trace(workload, 300, rate=4.0)
    specs = build(workload, ByteLengths(), 300)
    assert [(r.prompt_tokens, r.output_tokens) for r in trace] == [
        (s.input_len, s.output_len) for s in specs]
    assert [r.arrival_s for r in trace] == pytest.approx(
        arrival_offsets(300, 4.0, random.Random(5)), abs=1e-6)
    assert all(r.prefix_group is None and r.prefix_tokens == 0 for r in trace)
    assert describe(trace)["rate"] == pytest.approx(4.0, rel=0.2)
    assert workload_trace(workload, 300, rate=4.0) == trace  # seeded


def test_grouped_requests_add_the_shared_prefix_to_their_prompts() -> None:
    workload = Workload("fixed", input_len=50, output_len=7, seed=1)
    trace = workload_trace(workload, 400, 10.0, Grouping(groups=4, prefix_tokens=1000))
    assert all(r.prompt_tokens == 1050 and r.prefix_tokens == 1000 for r in trace)
    groups = Counter(r.prefix_group for r in trace)
    assert set(groups) == {"g0", "g1", "g2", "g3"}
    assert min(groups.values()) > 60  # uniform: about 100 each
    assert describe(trace)["groups"] == 4 and describe(trace)["grouped"] == 400


def test_a_grouped_share_leaves_the_others_as_the_workload_made_them() -> None:
    workload = Workload("fixed", input_len=50, output_len=7)
    trace = workload_trace(workload, 1000, 10.0, Grouping(3, 200, share=0.3))
    grouped = [r for r in trace if r.prefix_group is not None]
    assert 200 < len(grouped) < 400
    assert all(r.prompt_tokens == 250 and r.prefix_tokens == 200 for r in grouped)
    assert all(r.prompt_tokens == 50 and r.prefix_tokens == 0
               for r in trace if r.prefix_group is None)
    with pytest.raises(ValueError, match="share"):
        Grouping(3, 200, share=1.5)


def test_text_workloads_count_utf8_bytes_as_tokens() -> None:
    assert ByteLengths().count("héllo") == 6
    trace = workload_trace(Workload("messages", input_len=100), 3, 1.0)
    assert all(80 < r.prompt_tokens < 800 for r in trace)


def test_grouping_needs_groups_for_a_prefix() -> None:
    with pytest.raises(ValueError, match="needs groups"):
        Grouping(groups=0, prefix_tokens=10)


def test_trace_write_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "t.jsonl"
    assert main(["trace", "write", "--workload", "fixed", "--input-len", "20", "--rate", "5",
                 "--count", "12", "--groups", "2", "--prefix-len", "100", "--out",
                 str(out)]) == 0
    trace = read_trace(out)
    assert len(trace) == 12 and {r.prompt_tokens for r in trace} == {120}
    assert json.loads(capsys.readouterr().out)["requests"] == 12
    assert format_trace(trace) == out.read_text()
