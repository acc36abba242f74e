"""A msgpack codec for frozen dataclasses: `[tag, field, ...]`, nested dataclasses as arrays.

`Codec.decode` is where untrusted bytes become typed values: anything malformed or mistyped
raises `MalformedMessage`. No pickle, ever.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from functools import cache
from typing import Any, Generic, TypeVar

import msgpack

T = TypeVar("T")


class MalformedMessage(ValueError):
    """Bytes that do not decode to a known, well-typed message."""


class Codec(Generic[T]):
    """Encodes and decodes the dataclasses in `types_`; the tag is the index in that tuple."""

    def __init__(self, types_: tuple[type, ...]) -> None:
        self.types = types_
        self.tag_of = {cls: tag for tag, cls in enumerate(types_)}

    def encode(self, message: T) -> bytes:
        return msgpack.packb([self.tag_of[type(message)], *_fields_of(message)], use_bin_type=True)

    def decode(self, data: bytes) -> T:
        """Bytes to a message; raises MalformedMessage for anything else."""
        try:
            raw = msgpack.unpackb(data, raw=False, strict_map_key=True)
        except (ValueError, msgpack.UnpackException) as exc:
            raise MalformedMessage(f"not msgpack: {exc}") from None
        if not isinstance(raw, list) or not raw or not _is_int(raw[0]):
            raise MalformedMessage("missing type tag")
        if not 0 <= raw[0] < len(self.types):
            raise MalformedMessage(f"unknown type tag {raw[0]}")
        return _build(self.types[raw[0]], raw[1:])


def _fields_of(obj: Any) -> list[Any]:
    return [_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)]


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return _fields_of(value)
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


@cache
def _hints(cls: type) -> list[Any]:
    hints = typing.get_type_hints(cls)
    return [hints[f.name] for f in dataclasses.fields(cls)]


def _build(cls: type, values: Any) -> Any:
    hints = _hints(cls)
    if not isinstance(values, list) or len(values) != len(hints):
        raise MalformedMessage(f"{cls.__name__}: expected {len(hints)} fields")
    fields = [_typed(h, v, cls.__name__) for h, v in zip(hints, values, strict=True)]
    try:
        return cls(*fields)
    except ValueError as exc:  # the message type's own validation (__post_init__)
        raise MalformedMessage(f"{cls.__name__}: {exc}") from None


def _typed(hint: Any, value: Any, where: str) -> Any:
    if isinstance(hint, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        hint = next(o for o in options if o is not type(None))
    if dataclasses.is_dataclass(hint):
        return _build(hint, value)
    if typing.get_origin(hint) is list:
        if not isinstance(value, list):
            raise MalformedMessage(f"{where}: expected a list")
        (item,) = typing.get_args(hint)
        return [_typed(item, v, where) for v in value]
    if _matches(hint, value):
        return float(value) if hint is float else value
    raise MalformedMessage(f"{where}: expected {getattr(hint, '__name__', hint)}")


def _matches(hint: Any, value: Any) -> bool:
    if hint is int:
        return _is_int(value)
    if hint is float:
        return isinstance(value, float) or _is_int(value)
    return isinstance(value, hint)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
