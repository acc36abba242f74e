"""The built-in web page: plain HTML, CSS and JavaScript files from gateway/web/, no build step.

The page's files hold no data, so they load without an API key (`PAGE_PATHS` are open in
gateway/auth.py); everything the page shows comes from /v1 routes, which it calls with the key
the user typed (kept in sessionStorage) when keys are set. A strict Content-Security-Policy
allows only this origin's scripts, styles and connections.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

from starlette.requests import Request
from starlette.responses import FileResponse, Response
from starlette.routing import Route

WEB_DIR = Path(__file__).with_name("web")
# URL path -> file in WEB_DIR, with its media type.
PAGE_FILES = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/web/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/web/style.css": ("style.css", "text/css; charset=utf-8"),
}
PAGE_PATHS = frozenset(PAGE_FILES)
_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
                               "connect-src 'self'; img-src 'self' data:; base-uri 'none'; "
                               "form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def page_routes() -> list[Route]:
    """GET (and HEAD) routes for the page's files."""
    return [Route(path, _serve(name, media_type), methods=["GET"])
            for path, (name, media_type) in PAGE_FILES.items()]


def _serve(name: str, media_type: str) -> Callable[[Request], Awaitable[Response]]:
    path = WEB_DIR / name
    assert path.is_file(), f"the web page's {name} is missing from {WEB_DIR}"

    async def serve(request: Request) -> Response:
        return FileResponse(path, media_type=media_type, headers=_HEADERS)

    return serve
