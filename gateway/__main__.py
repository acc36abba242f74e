"""`python -m gateway --config configs/default.yaml --port 8000`"""

from __future__ import annotations

import uvicorn
from transformers import AutoTokenizer

from core.cli import base_parser, config_from_args, setup_logging
from engine.loading import kv_fingerprint, model_dtype
from engine.prepare import resolve_model
from engine.spec import load_spec
from gateway.app import build_app
from gateway.auth import KeysError, with_keys
from gateway.metrics import Metrics
from gateway.registry import LocalPrefill, Registry
from gateway.state import GatewayState


def main() -> None:
    parser = base_parser("raging gateway (OpenAI-compatible HTTP server)")
    for flag in ("host", "port", "expect-prefill", "expect-decode"):
        parser.add_argument(f"--{flag}")
    parser.add_argument("--api-key", action="append", default=[], metavar="KEY[:TENANT]",
                        help="accept this key (repeatable; tenant default: 'default'); "
                             "prefer --api-key-file: argv is visible to other users in ps")
    parser.add_argument("--api-key-file", metavar="FILE",
                        help="keys file, one 'KEY TENANT' per line (auth.keys_file)")
    args = parser.parse_args()
    config = config_from_args(args, {
        "host": "gateway.host", "port": "gateway.port",
        "expect_prefill": "gateway.expect_prefill", "expect_decode": "gateway.expect_decode",
        "api_key_file": "auth.keys_file",
    })
    config = with_keys(config, args.api_key)
    setup_logging("gateway")
    folder = resolve_model(config.model.name, config.model.cache_dir)
    spec = load_spec(folder)
    gateway = config.gateway
    fingerprint = kv_fingerprint(spec, model_dtype(config.model.dtype))
    registry = Registry(fingerprint, gateway.heartbeat_timeout_s,
                        gateway.expect_prefill, gateway.expect_decode, gateway.stall_timeout_s,
                        LocalPrefill(gateway.local_prefill_max_tokens,
                                     gateway.prefill_saturated_tokens,
                                     gateway.saturated_local_max_tokens))
    max_len = min(config.model.max_model_len or spec.max_position_embeddings,
                  spec.max_position_embeddings)
    state = GatewayState(config=config, model_name=spec.name, max_model_len=max_len,
                         tokenizer=AutoTokenizer.from_pretrained(folder), registry=registry,
                         metrics=Metrics())
    try:
        app = build_app(state)
    except KeysError as exc:
        raise SystemExit(f"auth error: {exc}") from None
    uvicorn.run(app, host=gateway.host, port=gateway.port, loop="uvloop",
                http="httptools", log_level="warning", timeout_graceful_shutdown=5,
                timeout_keep_alive=gateway.http_keep_alive_s)


if __name__ == "__main__":
    main()
