"""A worker's command line: what it refuses before it loads a model or meets a gateway."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_worker(role: str, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", role, *flags], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize(("role", "key"), [("prefill", "decode.prefix_caching"),
                                           ("decode", "prefill.kv_bind")])
def test_a_key_its_pool_lacks_is_a_config_error(role: str, key: str) -> None:
    done = run_worker(role, "--set", f"{key}=1")
    assert done.returncode != 0 and "config error" in done.stderr
    assert key.split(".")[1] in done.stderr and "Traceback" not in done.stderr


def test_cpus_this_machine_lacks_are_refused_by_name() -> None:
    done = run_worker("decode", "--worker-id", "decode-7", "--cpus", "4096")
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert "decode-7: CPUs [4096] are not available here" in done.stderr


def test_flags_are_the_config_keys_they_set() -> None:
    done = run_worker("prefill", "--help")
    assert done.returncode == 0
    assert "usage: python -m prefill" in done.stdout and "torch intra-op threads" in done.stdout
