"""The gateway's start-up: its app from config, with the model's files read without torch."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_SERVE_AND_LIST_MODULES = textwrap.dedent("""
    import sys
    from starlette.testclient import TestClient
    from core.config import load_config
    from gateway.__main__ import gateway_app

    config = load_config(overrides={{"model.name": {model!r},
                                     "gateway.control_address": "inproc://startup-test"}})
    with TestClient(gateway_app(config)) as client:
        assert client.get("/health").status_code == 503  # no worker yet
        chat = {{"model": "{name}", "messages": [{{"role": "user", "content": "Hi"}}]}}
        assert client.post("/v1/chat/completions", json=chat).status_code == 503
        text = {{"model": "{name}", "prompt": "Once upon a time"}}
        assert client.post("/v1/completions", json=text).status_code == 503
    print(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")))
""")


def test_a_started_gateway_has_not_loaded_torch(tiny_model_dir: Path) -> None:
    """Up to a request's dispatch (its chat template applied, its prompt tokenized), nothing
    in the gateway imports torch."""
    script = _SERVE_AND_LIST_MODULES.format(model=str(tiny_model_dir), name=tiny_model_dir.name)
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"
