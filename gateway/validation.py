"""What every request model shares: the strict pydantic base (`RequestModel`), small validator
helpers (features missing here, `n` of one, content parts read as text, tools of one type), and a
JSON body's parsing into a model (`parse_body`), any malformed body a 400 `APIError` naming the
first invalid field, never quoting its value.

Duplicate keys are refused; fields outside the schema are kept aside for
gateway/ignored_fields.py (ignored, or refused in strict mode). Another API's request, made over
into a chat or completion request, gets the 400 naming its own field (`request_of`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError, ValidationInfo
from pydantic_core import PydanticCustomError

from gateway.errors import APIError, bad_request

MAX_NAME_CHARS = 64  # of a client-chosen field name quoted back in an error
# Content parts this text-only model cannot read, by type: what the 400 calls them.
UNREADABLE_PARTS = {"image_url": "image", "input_image": "image", "image": "image",
                    "input_audio": "audio", "audio_url": "audio", "audio": "audio",
                    "video_url": "video", "video": "video", "file": "file", "input_file": "file"}


class RequestModel(BaseModel):
    # strict: no "1" -> 1 or true -> 1 coercions. allow: a field outside the schema is kept in
    # model_extra, for gateway/ignored_fields.py to ignore (logged, counted) or refuse (strict
    # mode); OpenAI client fields that do not apply are declared and ignored.
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False, frozen=True)


def invalid_value(message: str) -> PydanticCustomError:
    # PydanticCustomError formats its template with str.format-style fields: no braces in messages.
    return PydanticCustomError("invalid_value", message)


def unsupported(what: str) -> PydanticCustomError:
    return PydanticCustomError("unsupported", f"{what} is not supported yet")


def none_only(value: object, info: ValidationInfo) -> object:
    """For a feature that is missing: only null (asking for nothing) is accepted."""
    if value is not None:
        raise unsupported(str(info.field_name))
    return value


def one_choice(value: int | None) -> int | None:
    """For an API whose reply has one output: `n` may only be 1."""
    if value not in (None, 1):
        raise invalid_value("n must be 1: this API's reply has one output")
    return value


CHAT_TEXT_PARTS = {"text": "text"}  # a content part's type -> the field holding its text


def joined_text(value: object, kinds: Mapping[str, str] = CHAT_TEXT_PARTS) -> object:
    """Content parts (`part_text`) as one string, joined by \\n; anything else as it is, for
    pydantic to judge."""
    if isinstance(value, list):
        return "\n".join(part_text(index, part, kinds) for index, part in enumerate(value))
    return value


def only_tools_of_type(allowed: str, what: str) -> Callable[[object], object]:
    """A `tools` entry's before-validator refusing other types of tool (hosted ones), `what`
    naming the ones served."""
    def check(value: object) -> object:
        kind = value.get("type") if isinstance(value, dict) else None
        if isinstance(kind, str) and kind != allowed:
            raise PydanticCustomError("unsupported", "tools of type '{kind}' are not supported "
                                      "here: only {what}", {"kind": kind[:64], "what": what})
        return value

    return check


def part_text(index: int, part: object, kinds: Mapping[str, str] = CHAT_TEXT_PARTS) -> str:
    """A text part's text, `kinds` naming the part types read and the field each keeps its
    text in; image, audio, video and file parts are refused as unreadable."""
    if not isinstance(part, dict):
        raise invalid_value("each content part must be an object")
    kind = part.get("type")
    if isinstance(kind, str) and kind in UNREADABLE_PARTS:
        raise PydanticCustomError(
            "unreadable_part", "{what} input is not supported: this model reads text only",
            {"what": UNREADABLE_PARTS[kind], "part": index})
    if not isinstance(kind, str) or kind not in kinds:
        names = ", ".join(f"'{name}'" for name in kinds)
        raise invalid_value(f"only content parts of type {names} are supported")
    text = part.get(kinds[kind])
    if not isinstance(text, str):
        raise invalid_value(f"a {kind} content part needs a string '{kinds[kind]}' field")
    return text


_Model = TypeVar("_Model", bound=BaseModel)


def request_of(model: type[_Model], fields: dict[str, Any], params: Mapping[str, str],
               check: Callable[[_Model], None] | None = None) -> _Model:
    """`fields` (another API's request, made over) validated as `model`, then `check`ed; a 400
    as `model` would give it, naming that request's own field (`params`: the top-level field ->
    its own)."""
    try:
        request = model.model_validate(fields)
        if check is not None:
            check(request)
    except ValidationError as exc:
        raise _with_param_renamed(validation_error(exc), params) from None
    except APIError as exc:
        raise _with_param_renamed(exc, params) from None
    return request


def _with_param_renamed(error: APIError, params: Mapping[str, str]) -> APIError:
    """An error of the chat or completion request another API's request became, naming the
    field of that request it came from (`params`: the top-level field -> its own). Indices
    are dropped: a message's index in chat is not one in the request (system text, merged
    turns shift it)."""
    chat_field = re.split(r"[.\[]", error.param or "")[0]
    param = params.get(chat_field)
    if param is None or error.param is None:
        return error
    return bad_request(error.message.replace(f"'{error.param}'", f"'{param}'"), param=param)


def parse_body(model: type[_Model], body: bytes) -> _Model:
    """The `model` request of a JSON `body`; any invalid body raises a 400 `APIError`."""
    try:
        request = model.model_validate_json(body)
    except ValidationError as exc:
        repaired = replace_lone_surrogates(body)  # only where the parser refused the body
        if repaired == body:
            raise validation_error(exc) from None
        return parse_body(model, repaired)
    _reject_duplicate_keys(body)
    return request


# One escape of a JSON string: a surrogate pair, a lone surrogate, or any other (an escaped
# backslash among them, so that the text after it is never read as an escape)
_ESCAPE = re.compile(rb"\\(u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2}"
                     rb"|(u[dD][89a-fA-F][0-9a-fA-F]{2})|.)", re.DOTALL)
_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")


def replace_lone_surrogates(body: bytes) -> bytes:
    """`body` with each escaped surrogate that is not half of a pair (a browser's script that
    cut a string inside an emoji sends one) as U+FFFD, as a text decoder reads a broken
    character; pairs, and everything else, untouched."""
    if not _SURROGATE.search(body):
        return body
    return _ESCAPE.sub(lambda m: b"\\ufffd" if m.group(2) else m.group(0), body)


def _reject_duplicate_keys(body: bytes) -> None:
    """400 when an object repeats a key: pydantic keeps the last one, a proxy in front may have
    checked the first. Only run on a body pydantic accepted, so its nesting depth is small."""
    try:
        json.loads(body, object_pairs_hook=_unique_keys)
    except ValueError:  # what pydantic's parser accepts and Python's does not
        raise bad_request("The request body is not valid JSON.") from None


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result = dict(pairs)
    if len(result) == len(pairs):
        return result
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            name = key[:MAX_NAME_CHARS]
            raise bad_request(f"Duplicate key '{name}' in the request body", param=name)
        seen.add(key)
    raise AssertionError("a shorter dict means a repeated key")


def validation_error(exc: ValidationError) -> APIError:
    """A 400 naming the first invalid field; the offending input value is never included."""
    first = exc.errors(include_url=False, include_input=False)[0]
    loc = first["loc"]
    if first["type"] == "unreadable_part":  # name the part, not only its message's content
        loc = (*loc, first.get("ctx", {})["part"])
    param = format_loc(loc)
    message = first["msg"]
    if param is not None:
        return bad_request(f"Invalid '{param}': {message}", param=param)
    if first["type"] == "json_invalid":
        return bad_request(message)
    return bad_request(f"Invalid request body: {message}")


def format_loc(loc: tuple[int | str, ...]) -> str | None:
    """Pydantic's error location as `messages[0].content`; None for the body itself."""
    text = ""
    for item in loc:
        if isinstance(item, int):
            text += f"[{item}]"
        else:
            name = item[:MAX_NAME_CHARS]  # a map key or unknown field: chosen by the client
            text += f".{name}" if text else name
    return text or None

