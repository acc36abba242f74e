"""Command lines derived from the config: each named flag sets one config key, and takes its
type, choices and help from that key's field (core/config.py); `--set SECTION.KEY=VALUE` sets
any other."""

from __future__ import annotations

import argparse
import typing
from typing import Any

from core.codec import literal_values
from core.config import Config, config_field, load_config


class ConfigParser(argparse.ArgumentParser):
    """`--config FILE`, `--set` and the flags every process shares (`--model`,
    `--control-address`, `--kv-backend`, `--otlp-endpoint`, `--log-format`); `config_flag` adds
    more."""

    def __init__(self, prog: str, description: str) -> None:
        super().__init__(prog=prog, description=description)
        self._keys: dict[str, str] = {}  # argparse dest -> the config key its flag sets
        self.add_argument("--config", default=None, help="YAML config file (configs/default.yaml)")
        self.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                          help="override any config value")
        self.config_flag("model.name", "--model")
        self.config_flag("gateway.control_address")
        self.config_flag("kv_transfer.backend", "--kv-backend")
        self.config_flag("tracing.otlp_endpoint")
        self.config_flag("logging.format", "--log-format")

    def config_flag(self, dotted: str, flag: str | None = None) -> None:
        """A flag for the config key `section.key` (default name: `--key`, dashed)."""
        config, hint = config_field(dotted)
        flag = flag or "--" + dotted.partition(".")[2].replace("_", "-")
        dest = flag.removeprefix("--").replace("-", "_")
        options: dict[str, Any] = {"dest": dest, "help": config.metadata.get("help")}
        choices = literal_values(hint)
        if choices is not None:
            options["choices"] = choices
        elif hint in (int, float):
            options["type"] = hint
        elif hint is bool:
            options["type"] = _boolean
        elif typing.get_origin(hint) is tuple:
            options["nargs"] = "+"  # a list of values
        self.add_argument(flag, **options)
        self._keys[dest] = dotted

    def config(self, args: argparse.Namespace) -> Config:
        """The config file with the flags given and every --set applied; exits with the
        reason when it is invalid."""
        overrides: dict[str, object] = {}
        for dest, dotted in self._keys.items():
            value = getattr(args, dest)
            if value is not None:
                overrides[dotted] = value
        for item in args.set:
            dotted, sep, value = item.partition("=")
            if not sep:
                raise SystemExit(f"--set {item!r}: expected SECTION.KEY=VALUE")
            overrides[dotted] = value
        try:
            return load_config(args.config, overrides)
        except ValueError as exc:
            raise SystemExit(f"config error: {exc}") from None


def _boolean(text: str) -> bool:
    if text.lower() in ("true", "yes", "1"):
        return True
    if text.lower() in ("false", "no", "0"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, not {text!r}")
