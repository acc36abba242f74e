"""Workers' OpenMP threads spin between parallel regions unless the environment says otherwise,
set before anything loads torch."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
READ_POLICY = "import core.threads, os; print(os.environ['OMP_WAIT_POLICY'])"


@pytest.mark.parametrize(("given", "expected"), [(None, "ACTIVE"), ("PASSIVE", "PASSIVE")])
def test_the_wait_policy_is_active_unless_given(given: str | None, expected: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if given is not None:
        env["OMP_WAIT_POLICY"] = given
    out = subprocess.run([sys.executable, "-c", READ_POLICY], env=env, cwd=ROOT, check=True,
                         capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == expected


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_each_worker_sets_it_before_any_other_import(role: str) -> None:
    tree = ast.parse((ROOT / role / "__main__.py").read_text())
    imports = [node for node in tree.body if isinstance(node, ast.Import | ast.ImportFrom)]
    first = imports[0]
    assert isinstance(first, ast.Import) and first.names[0].name == "core.threads"
