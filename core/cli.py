"""Command lines derived from the config: named flags become dotted overrides."""

from __future__ import annotations

import argparse
import logging
import sys

from core.config import KV_BACKENDS, Config, load_config


def base_parser(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", default=None, help="YAML config file (configs/default.yaml)")
    parser.add_argument("--model", help="packaged model name or local Hugging Face folder")
    parser.add_argument("--control-address", help="the gateway's control address (tcp://...)")
    parser.add_argument("--kv-backend", choices=KV_BACKENDS,
                        help="how prefill hands KV to decode (kv_transfer.backend)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override any config value")
    return parser


def config_from_args(args: argparse.Namespace, flag_keys: dict[str, str]) -> Config:
    """Load the config file, then apply named flags (`flag_keys`: dest -> section.key) and --set."""
    overrides: dict[str, str] = {}
    keys = {"model": "model.name", "control_address": "gateway.control_address",
            "kv_backend": "kv_transfer.backend", **flag_keys}
    for dest, dotted in keys.items():
        value = getattr(args, dest, None)
        if value is not None:
            overrides[dotted] = str(value)
    for item in args.set:
        dotted, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--set {item!r}: expected SECTION.KEY=VALUE")
        overrides[dotted] = value
    try:
        return load_config(args.config, overrides)
    except ValueError as exc:
        raise SystemExit(f"config error: {exc}") from None


def setup_logging(name: str) -> None:
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr,
        format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s",
    )
