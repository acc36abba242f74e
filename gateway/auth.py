"""API keys: which callers may use the gateway, and which tenant each one is.

Keys come from `auth.api_keys` (the `--api-key KEY[:TENANT]` flags end up there) and from
`auth.keys_file`; none at all turns authentication off. An ASGI middleware checks every request
outside `OPEN_PATHS` before the app runs, so no unauthenticated body is ever read. The tenant is
derived from the key alone, never from the request, and reaches the workers only as a salt.

Keys are kept as SHA-256 digests and compared in constant time; no message or log line quotes
one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import logging
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from starlette.datastructures import Headers
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from core.config import AuthConfig, Config
from core.netaddr import is_loopback
from gateway.errors import APIError, Dialect, dialect_of, error_response, unauthorized
from gateway.page import PAGE_PATHS

log = logging.getLogger(__name__)

DEFAULT_TENANT = "default"
# /health, /ping: load balancers and launch.sh probe them without a key; the web page's files
# hold no data.
OPEN_PATHS = frozenset({"/health", "/ping"}) | PAGE_PATHS
_STATE_KEY = "tenant"
_SALT_DOMAIN = b"raging-tenant-cache-salt-v1\0"
_KEY_PATTERN = re.compile(r"[!-9;-~]+")  # printable ASCII, no space, no ':' (KEY:TENANT)
_TENANT_PATTERN = re.compile(r"[A-Za-z0-9._-]{1,64}")


class KeysError(ValueError):
    """An unusable key, tenant or keys file; the message names where, never the key."""


@dataclass(frozen=True)
class Tenant:
    """Who a caller is: a name from the key table, and the cache salt derived from it."""

    name: str
    cache_salt: str

    @classmethod
    def named(cls, name: str) -> Tenant:
        """The tenant `name`; its salt is a hash, so the name itself never leaves the gateway."""
        return cls(name, hashlib.sha256(_SALT_DOMAIN + name.encode()).hexdigest())


@dataclass(frozen=True)
class KeyTable:
    """The accepted keys (as SHA-256 digests) and their tenants; empty: authentication is off."""

    entries: tuple[tuple[bytes, Tenant], ...] = ()

    @property
    def enabled(self) -> bool:
        return bool(self.entries)

    def lookup(self, presented: str) -> Tenant | None:
        """The tenant of `presented`, or None. Every entry is compared, in constant time, so the
        time taken tells neither whether nor which key matched."""
        digest = _digest(presented)
        found = None
        for known, tenant in self.entries:
            if hmac.compare_digest(digest, known):
                found = tenant
        return found

    def describe(self) -> str:
        """A log-safe summary: how many keys and tenants, no key material."""
        tenants = sorted({tenant.name for _, tenant in self.entries})
        return f"{len(self.entries)} API keys for tenants {', '.join(tenants)}"


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def with_keys(config: Config, specs: Sequence[str]) -> Config:
    """`config` with the command line's `KEY[:TENANT]` specs added to `auth.api_keys`."""
    auth = dataclasses.replace(config.auth, api_keys=(*config.auth.api_keys, *specs))
    return dataclasses.replace(config, auth=auth)


def load_keys(auth: AuthConfig) -> KeyTable:
    """The key table of `auth`: its `api_keys`, then every line of its `keys_file`."""
    pairs = [parse_key_spec(spec, f"auth.api_keys[{index}]")
             for index, spec in enumerate(auth.api_keys)]
    if auth.keys_file:
        pairs += read_keys_file(Path(auth.keys_file).expanduser())
    return _table(pairs)


def _table(pairs: Sequence[tuple[str, str, str]]) -> KeyTable:
    """From (key, tenant, where) triples; a key given twice is refused, even for one tenant."""
    seen: dict[bytes, str] = {}
    entries = []
    for key, tenant, where in pairs:
        digest = _digest(key)
        if digest in seen:
            raise KeysError(f"{where}: the same key is already given at {seen[digest]}")
        seen[digest] = where
        entries.append((digest, Tenant.named(tenant)))
    return KeyTable(tuple(entries))


def parse_key_spec(spec: str, where: str) -> tuple[str, str, str]:
    """`KEY` or `KEY:TENANT` as (key, tenant, where); the tenant defaults to "default"."""
    key, _, tenant = spec.partition(":")
    return _checked(key, tenant or DEFAULT_TENANT, where)


def read_keys_file(path: Path) -> list[tuple[str, str, str]]:
    """(key, tenant, where) of each `KEY [TENANT]` line; blank and `#` lines are skipped."""
    try:
        text = path.read_text()
        mode = path.stat().st_mode
    except OSError as exc:
        raise KeysError(f"{path}: cannot read the keys file ({exc.strerror})") from None
    if mode & 0o077:
        log.warning("keys file %s is accessible to other users; chmod 600 it", path)
    return list(_key_lines(text, str(path)))


def _key_lines(text: str, name: str) -> Iterator[tuple[str, str, str]]:
    for number, line in enumerate(text.splitlines(), start=1):
        fields = line.split()
        if not fields or fields[0].startswith("#"):
            continue
        if len(fields) > 2:
            raise KeysError(f"{name}:{number}: expected KEY [TENANT]")
        tenant = fields[1] if len(fields) == 2 else DEFAULT_TENANT
        yield _checked(fields[0], tenant, f"{name}:{number}")


def _checked(key: str, tenant: str, where: str) -> tuple[str, str, str]:
    if not _KEY_PATTERN.fullmatch(key):
        raise KeysError(f"{where}: a key must be printable ASCII without spaces or ':'")
    if not _TENANT_PATTERN.fullmatch(tenant):
        raise KeysError(f"{where}: a tenant name must be 1-64 of A-Z a-z 0-9 . _ -")
    return key, tenant, where


def presented_key(headers: Headers) -> str | None:
    """The key a request carries: `Authorization: Bearer KEY`, else an `x-api-key` header."""
    scheme, _, token = headers.get("authorization", "").strip().partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return headers.get("x-api-key", "").strip() or None


def authenticate(keys: KeyTable, headers: Headers) -> Tenant:
    """The caller's tenant; a 401 APIError when the key is missing or unknown."""
    presented = presented_key(headers)
    if presented is None:
        raise unauthorized("You didn't provide an API key. Send it as 'Authorization: Bearer "
                           "KEY' (or in an 'x-api-key' header).")
    tenant = keys.lookup(presented)
    if tenant is None:
        raise unauthorized("Incorrect API key provided.")
    return tenant


class ApiKeyMiddleware:
    """Answers 401 to any request outside `open_paths` without a known key, before the app
    (and so before anything reads the body); otherwise records the caller's tenant."""

    def __init__(self, app: ASGIApp, keys: KeyTable,
                 open_paths: frozenset[str] = OPEN_PATHS) -> None:
        self.app = app
        self.keys = keys
        self.open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        try:
            tenant = authenticate(self.keys, Headers(scope=scope))
        except APIError as err:
            log.debug("refused %s: %s", scope["path"][:200], err.message)
            await _refusal(err, dialect_of(scope["path"]))(scope, receive, send)
            return
        scope.setdefault("state", {})[_STATE_KEY] = tenant
        await self.app(scope, receive, send)


def _refusal(err: APIError, dialect: Dialect) -> ASGIApp:
    response = error_response(err, dialect)
    response.headers["WWW-Authenticate"] = "Bearer"
    return response


def middleware(keys: KeyTable) -> list[Middleware]:
    """The app's middleware for `keys`: none when authentication is off."""
    return [Middleware(ApiKeyMiddleware, keys=keys)] if keys.enabled else []


def tenant_of(request: Request) -> Tenant | None:
    """The authenticated caller's tenant; None when authentication is off."""
    tenant = request.scope.get("state", {}).get(_STATE_KEY)
    return tenant if isinstance(tenant, Tenant) else None


def cache_salt(request: Request) -> str:
    """The prefix-cache salt of the request's tenant; "" when authentication is off."""
    tenant = tenant_of(request)
    return "" if tenant is None else tenant.cache_salt


def log_auth_state(host: str, keys: KeyTable) -> None:
    """At start: whether keys are required, and a warning when an exposed host needs none."""
    if keys.enabled:
        log.info("authentication on: %s", keys.describe())
    elif not is_loopback(host):
        log.warning("listening on %s without API keys: anyone who can reach it can use it "
                    "(give --api-key KEY[:TENANT] or auth.keys_file)", host)
