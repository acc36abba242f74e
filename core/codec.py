"""A msgpack codec for frozen dataclasses: `[tag, field, ...]`, nested dataclasses as arrays.

`Codec.decode` is where untrusted bytes become typed values: anything malformed or mistyped
raises `MalformedMessage`. No pickle, ever.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable
from functools import cache
from typing import Any, Generic, Literal, TypeVar, Union

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
        if not isinstance(raw, list) or not raw or not is_int(raw[0]):
            raise MalformedMessage("missing type tag")
        if not 0 <= raw[0] < len(self.types):
            raise MalformedMessage(f"unknown type tag {raw[0]}")
        return _build(self.types[raw[0]], raw[1:])


def _fields_of(obj: object) -> list[Any]:
    cls: type = type(obj)
    return [plain(getattr(obj, name)) for name, plain in _encoders(cls)]


@cache
def _encoders(cls: type) -> tuple[tuple[str, Callable[[Any], Any]], ...]:
    """Each field's name and how to turn its value into msgpack-ready data."""
    hints = typing.get_type_hints(cls)
    return tuple((f.name, _encoder(hints[f.name])) for f in dataclasses.fields(cls))


@cache
def _encoder(hint: Any) -> Callable[[Any], Any]:
    hint = _without_none(hint)
    if dataclasses.is_dataclass(hint):
        return lambda value: None if value is None else _fields_of(value)
    if typing.get_origin(hint) is list:
        (item,) = typing.get_args(hint)
        inner = _encoder(item)
        return lambda value: None if value is None else [inner(v) for v in value]
    return _identity


def _identity(value: Any) -> Any:
    return value


def _build(cls: type, values: Any) -> Any:
    return _builder(cls)(values)


_SCALAR_CHECKS = {int: "type({v}) is int", str: "type({v}) is str", bool: "type({v}) is bool",
                  bytes: "type({v}) is bytes", float: "type({v}) is float"}


@cache
def _builder(cls: type) -> Callable[[Any], Any]:
    """`cls` from its decoded fields, checked as `_decoder` checks them, compiled once per
    class into one function: a token's message is decoded thousands of times a second, and
    a call per field plus a frozen dataclass's `__init__` took half the gateway's time."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    assert all(f.init for f in dataclasses.fields(cls)), "every field travels"
    env: dict[str, Any] = {"cls": cls, "new": object.__new__, "Malformed": MalformedMessage,
                           "post": getattr(cls, "__post_init__", None)}
    lines = [f"if type(values) is not list or len(values) != {len(names)}:",
             f"    raise Malformed('{cls.__name__}: expected {len(names)} fields')"]
    for i, name in enumerate(names):
        lines += _field_lines(hints[name], f"v{i}", f"values[{i}]", f"{cls.__name__}", env)
    lines += ["obj = new(cls)",
              "obj.__dict__.update({" + ", ".join(f"{n!r}: v{i}" for i, n in enumerate(names))
              + "})",
              "if post is not None:",
              "    try:",
              "        post(obj)",
              "    except ValueError as exc:",  # the message type's own validation
              f"        raise Malformed(f'{cls.__name__}: {{exc}}') from None",
              "return obj"]
    source = "def build(values):\n" + "".join(f"    {line}\n" for line in lines)
    exec(source, env)  # source built above from field types, never from input
    built: Callable[[Any], Any] = env["build"]
    return built


def _field_lines(hint: Any, name: str, value: str, where: str, env: dict[str, Any]) -> list[str]:
    """Lines binding `name` to the field `value`, checked (inline for plain scalars)."""
    optional = _is_union(hint) and type(None) in typing.get_args(hint)
    required = _without_none(hint)
    check = _SCALAR_CHECKS.get(required)
    if check is None:
        env[f"decode_{name}"] = _decoder(hint)
        return [f"{name} = decode_{name}({value}, {where!r})"]
    if required is float:  # an int is a float too, as msgpack may carry 1.0 as 1
        check = f"({check} or type({{v}}) is int and not isinstance({{v}}, bool))"
    lines = [f"{name} = {value}"]
    test = check.format(v=name)
    if optional:
        test = f"{name} is None or {test}"
    lines += [f"if not ({test}):",
              f"    raise Malformed('{where}: expected {getattr(required, '__name__', required)}')"]
    if required is float:
        convert = f"{name} = float({name})"
        lines += [f"if {name} is not None:", f"    {convert}"] if optional else [convert]
    return lines


@cache
def _decoder(hint: Any) -> Callable[[Any, str], Any]:
    optional = _is_union(hint) and type(None) in typing.get_args(hint)
    convert = _required(_without_none(hint))
    if not optional:
        return convert
    return lambda value, where: None if value is None else convert(value, where)


def _required(hint: Any) -> Callable[[Any, str], Any]:
    allowed = literal_values(hint)
    if allowed is not None:
        def choice(value: Any, where: str) -> Any:
            if any(type(value) is type(a) and value == a for a in allowed):
                return value
            raise MalformedMessage(f"{where}: expected one of {list(allowed)}")
        return choice
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return lambda value, where: _build(hint, value)
    if typing.get_origin(hint) is list:
        (item,) = typing.get_args(hint)
        inner = _decoder(item)

        def items(value: Any, where: str) -> list[Any]:
            if not isinstance(value, list):
                raise MalformedMessage(f"{where}: expected a list")
            return [inner(v, where) for v in value]
        return items

    def scalar(value: Any, where: str) -> Any:
        if _matches(hint, value):
            return float(value) if hint is float else value
        raise MalformedMessage(f"{where}: expected {getattr(hint, '__name__', hint)}")
    return scalar


def _is_union(hint: Any) -> bool:
    return isinstance(hint, types.UnionType) or typing.get_origin(hint) is Union


def _without_none(hint: Any) -> Any:
    """`hint` without its `None` option (`X | None` is X; a union of several others stays one)."""
    if not _is_union(hint):
        return hint
    rest = tuple(o for o in typing.get_args(hint) if o is not type(None))
    return rest[0] if len(rest) == 1 else Union[rest]  # noqa: UP007 (a union built at run time)


def literal_values(hint: Any) -> tuple[Any, ...] | None:
    """The values a `Literal[...]` (or a union of them) allows; None for any other type."""
    if typing.get_origin(hint) is Literal:
        return typing.get_args(hint)
    if _is_union(hint):
        parts = [literal_values(o) for o in typing.get_args(hint)]
        if all(part is not None for part in parts):
            return tuple(value for part in parts for value in part or ())
    return None


def _matches(hint: Any, value: Any) -> bool:
    if hint is int:
        return is_int(value)
    if hint is float:
        return isinstance(value, float) or is_int(value)
    return isinstance(value, hint)


def is_int(value: Any) -> bool:
    """An int, not a bool (which JSON and msgpack tell apart, and Python does not)."""
    return isinstance(value, int) and not isinstance(value, bool)
