"""Request fields outside the schema: found, then ignored (logged once, counted) or refused.

Chat UIs and vLLM's tooling send fields the schema does not know (`stream_options.
continuous_usage_stats`, a part's `cache_control`, ...). The request models keep such fields
aside (pydantic's extra="allow"); `unknown_fields` says where each sits, and `IgnoredFields`
either refuses the first (strict mode, OpenAI's 400) or lets the request through, logging each
field name once per process and counting it in `raging_ignored_fields_total{field}`.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator

from prometheus_client import Counter
from pydantic import BaseModel

from gateway.errors import bad_request
from gateway.validation import MAX_NAME_CHARS

log = logging.getLogger(__name__)

MAX_FIELD_LABELS = 64  # distinct `field` labels, then "other": clients choose the names
_INDEX = re.compile(r"\[\d+\]")


def unknown_fields(request: BaseModel) -> list[str]:
    """Where each field outside the schema sits in `request`, as `messages[0].content[1].x`."""
    return list(_extras(request, ""))


def _extras(value: object, where: str) -> Iterator[str]:
    if isinstance(value, BaseModel):
        for name in value.model_extra or {}:
            yield _join(where, name[:MAX_NAME_CHARS])
        for name in getattr(value, "_unknown_parts", ()):  # content parts are plain dicts
            yield _join(where, name)
        for name in type(value).model_fields:
            yield from _extras(getattr(value, name), _join(where, name))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _extras(item, f"{where}[{index}]")


def _join(where: str, name: str) -> str:
    return f"{where}.{name}" if where and not name.startswith("[") else where + name


def field_label(path: str) -> str:
    """A field's name without list indices: `messages.content.cache_control`."""
    return _INDEX.sub("", path)


class IgnoredFields:
    """What the routes do with unknown fields: refuse them (`strict`) or log and count them."""

    def __init__(self, counter: Counter, strict: bool) -> None:
        self.counter = counter
        self.strict = strict
        self.logged: set[str] = set()

    def check(self, request: BaseModel) -> None:
        """Raise OpenAI's 400 for the first unknown field in strict mode; else note each."""
        paths = unknown_fields(request)
        if paths and self.strict:
            raise bad_request(f"Unrecognized request argument supplied: {paths[0]}",
                              param=paths[0])
        for path in paths:
            self._note(field_label(path))

    def _note(self, label: str) -> None:
        if label not in self.logged and len(self.logged) < MAX_FIELD_LABELS:
            self.logged.add(label)
            log.info("ignoring request field %r (not part of the API here); logged once", label)
        self.counter.labels(label if label in self.logged else "other").inc()
