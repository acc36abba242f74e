"""The gateway's start-up: its app from config, with the model's files read without torch, and
its router routing as the config says."""

from __future__ import annotations

import resource
import subprocess
import sys
import textwrap
from pathlib import Path

from core.config import load_config
from gateway.__main__ import make_registry, make_router
from gateway.packing import Packing

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


def test_the_router_routes_as_the_config_says() -> None:
    shipped = load_config().gateway
    packed = make_router(shipped, make_registry(shipped, "fp"))
    assert packed.packing == Packing("pack", "pack", 0.9) and packed.registry.fingerprint == "fp"
    config = load_config(overrides={"gateway.decode_routing": "spread",
                                    "gateway.prefill_routing": "spread",
                                    "gateway.pack_kv_fraction": "0.5"}).gateway
    spread = make_router(config, make_registry(config, "fp"))
    assert spread.packing == Packing("spread", "spread", 0.5)


def test_the_gateway_takes_the_hard_open_files_limit() -> None:
    """A soft limit of 1,024 (common) would refuse client connections past about a thousand."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    unlimited = hard == resource.RLIM_INFINITY
    wanted = 1 << 20 if unlimited else hard
    script = ("import resource; from gateway.__main__ import raise_open_files_limit; "
              "print(raise_open_files_limit(), resource.getrlimit(resource.RLIMIT_NOFILE)[0])")
    limit = f"--nofile=256:{'unlimited' if unlimited else hard}"
    run = subprocess.run(["prlimit", limit, sys.executable, "-c", script], cwd=ROOT,
                         capture_output=True, text=True, timeout=60, check=True)
    assert run.stdout.split() == [str(wanted), str(wanted)]
