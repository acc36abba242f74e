"""`python -m bench overload` against a real server (tiny model) it launches itself."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from bench.__main__ import main
from bench.overload import capped_config
from core.config import load_config


def test_the_capped_config_is_the_default_with_the_cap(tmp_path: Path) -> None:
    path = capped_config(3, tmp_path / "sub" / "config.yaml")
    config = load_config(path)
    assert config.gateway.max_inflight_requests == 3
    default = yaml.safe_load(Path("configs/default.yaml").read_text())
    assert config.decode.num_kv_blocks == default["decode"]["num_kv_blocks"]


@pytest.mark.e2e
def test_overload_sheds_the_flood_and_serves_the_admitted(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "overload.json"
    status = main(["overload", "--launch", f"--prefill 1 --decode 1 --model {tiny_model_dir}",
                   "--cap", "2", "--input-len", "16", "--output-len", "6",
                   "--idle-requests", "2", "--rated-requests", "8", "--factor", "10",
                   "--flood-seconds", "3", "--out", str(out)])
    assert status == 0
    phases = {p["name"]: p["summary"] for p in json.loads(out.read_text())["phases"]}
    assert set(phases) == {"idle", "rated", "flood 10x"}
    assert phases["idle"]["completed"] == 2 and phases["rated"]["completed"] == 8
    flood = phases["flood 10x"]
    assert flood["completed"] >= 1 and flood["errors"].get("HTTP 429", 0) >= 1
    assert set(flood["errors"]) <= {"HTTP 429"}  # shed, never failed
    table = capsys.readouterr().out
    assert "| flood 10x |" in table and "e2e p99 / rated" in table
