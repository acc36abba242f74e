"""`python -m gateway --config configs/default.yaml --port 8000`

The gateway never loads torch: it reads the model's spec, tokenizer and chat template, and
resolves `model.dtype` for the KV fingerprint from the CPU's flags (a structured-output request
brings torch in through xgrammar, the first time one comes).
"""

from __future__ import annotations

import logging
import resource

import uvicorn
from starlette.applications import Starlette

from core.cli import ConfigParser
from core.config import Config, GatewayConfig
from core.logs import setup_logging
from core.process import freeze_start_up
from core.tracing import make_tracer
from engine.device import device_type
from engine.locate import resolve_model
from engine.sim.folder import sim_fingerprint
from engine.weights.dtypes import resolve_dtype
from engine.weights.spec import kv_fingerprint, load_spec
from engine.weights.tokenizer import load_tokenizer
from gateway.app import build_app
from gateway.auth import KeysError, with_keys
from gateway.defaults import resolve_defaults
from gateway.metrics import Metrics
from gateway.model_facts import model_facts
from gateway.packing import Packing
from gateway.registry import Registry
from gateway.routing import LocalPrefill, Pulling, Router
from gateway.state import GatewayState

log = logging.getLogger("gateway")
_MOST_OPEN_FILES = 1 << 20  # where the hard limit is "unlimited": Linux's default nr_open


def make_registry(gateway: GatewayConfig, fingerprint: str) -> Registry:
    """The membership of workers serving KV layout `fingerprint`."""
    return Registry(fingerprint, gateway.heartbeat_timeout_s, gateway.expect_prefill,
                    gateway.expect_decode, gateway.stall_timeout_s)


def make_router(gateway: GatewayConfig, registry: Registry) -> Router:
    """The routing of requests over `registry`'s workers, by the config's policies."""
    return Router(registry,
                  LocalPrefill(gateway.local_prefill_max_tokens,
                               gateway.prefill_saturated_tokens,
                               gateway.saturated_local_max_tokens),
                  Packing(gateway.decode_routing, gateway.prefill_routing,
                          gateway.pack_kv_fraction),
                  Pulling(gateway.history_routing, gateway.pull_prefixes,
                          gateway.pull_min_tokens, gateway.pull_bandwidth_mb_s * 1e6))


def gateway_app(config: Config) -> Starlette:
    """The gateway's app for `config`, its model's files read; raises KeysError when the
    configured API keys are unusable."""
    folder = resolve_model(config.model.name, config.model.cache_dir)
    spec = load_spec(folder)
    dtype = resolve_dtype(config.model.dtype, device_type(config.model.device))
    fingerprint = (sim_fingerprint(folder, config.sim.kv_bytes) if config.model.sim_profile
                   else kv_fingerprint(spec, dtype))
    registry = make_registry(config.gateway, fingerprint)
    max_len = min(config.model.max_model_len or spec.max_position_embeddings,
                  spec.max_position_embeddings)
    metrics = Metrics(spec.name, max_len)  # vLLM's series are labelled with the served name
    state = GatewayState(config=config, model_name=spec.name, max_model_len=max_len,
                         tokenizer=load_tokenizer(folder), registry=registry,
                         router=make_router(config.gateway, registry), metrics=metrics,
                         tracer=make_tracer(config.tracing, "raging-gateway", "gateway"),
                         generation_defaults=resolve_defaults(config.generation_defaults,
                                                              folder),
                         facts=model_facts(folder, spec, dtype))
    return build_app(state)


def raise_open_files_limit() -> int:
    """Every client connection holds a socket: take the hard limit on open files, as vLLM
    does, rather than a soft one that is often 1,024. Returns the limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = _MOST_OPEN_FILES if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            soft = wanted
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open files limit from %d: %s", soft, exc)
    if soft != resource.RLIM_INFINITY and soft < 4096:
        log.warning("open files limit %d: at most about %d clients at once", soft, soft - 64)
    return soft


def main() -> None:
    parser = ConfigParser("python -m gateway", "raging gateway (OpenAI-compatible HTTP server)")
    for key in ("host", "port", "expect_prefill", "expect_decode", "tool_call_parser",
                "reasoning_parser",
                "strict_fields", "served_model_name", "allowed_origins", "decode_routing",
                "prefill_routing"):
        parser.config_flag(f"gateway.{key}")
    parser.config_flag("auth.keys_file", "--api-key-file")
    parser.add_argument("--api-key", action="append", default=[], metavar="KEY[:TENANT]",
                        help="accept this key (repeatable; tenant default: 'default'); "
                             "prefer --api-key-file: argv is visible to other users in ps")
    args = parser.parse_args()
    config = with_keys(parser.config(args), args.api_key)
    setup_logging("gateway", config.logging.format)
    raise_open_files_limit()
    try:
        app = gateway_app(config)
    except KeysError as exc:
        raise SystemExit(f"auth error: {exc}") from None
    freeze_start_up()
    gateway = config.gateway
    # log_config=None: uvicorn's lines go through this process's handler (JSON too).
    uvicorn.run(app, host=gateway.host, port=gateway.port, loop="uvloop",
                http="httptools", log_level="warning", log_config=None,
                timeout_graceful_shutdown=5, timeout_keep_alive=gateway.http_keep_alive_s)


if __name__ == "__main__":
    main()
