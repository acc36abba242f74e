"""The built-in web page's files: served at fixed paths with a strict CSP, open without a key
(they hold no data), and nothing else becomes open with them."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.auth import OPEN_PATHS
from gateway.page import PAGE_FILES, PAGE_PATHS, WEB_DIR
from tests.gateway.served_app import error_of
from tests.gateway.test_cluster import KEY, served


@pytest.mark.parametrize("keys", [(), (KEY,)], ids=["no keys", "keys set"])
def test_every_page_file_loads_without_a_key(real_model_dir: Path, keys: tuple[str, ...]) -> None:
    with served(real_model_dir, keys) as (client, _):
        for path, (name, media_type) in PAGE_FILES.items():
            response = client.get(path)
            assert response.status_code == 200, path
            assert response.headers["content-type"] == media_type
            assert response.content == (WEB_DIR / name).read_bytes()
            csp = response.headers["content-security-policy"]
            assert "script-src 'self'" in csp and "default-src 'none'" in csp
            assert response.headers["x-content-type-options"] == "nosniff"


def test_the_page_refers_only_to_its_own_files() -> None:
    html = (WEB_DIR / "index.html").read_text()
    assert 'src="/web/app.js"' in html and 'href="/web/style.css"' in html
    for text in (html, (WEB_DIR / "app.js").read_text(), (WEB_DIR / "style.css").read_text()):
        assert "http://" not in text and "https://" not in text  # no CDN, nothing external


def test_model_output_is_never_inserted_as_html() -> None:
    script = (WEB_DIR / "app.js").read_text()
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval("):
        assert sink not in script


def test_the_page_files_are_open_and_no_data_route_is() -> None:
    assert {"/", "/web/app.js", "/web/style.css"} == PAGE_PATHS
    assert PAGE_PATHS <= OPEN_PATHS
    assert not any(path.startswith("/v1") for path in OPEN_PATHS)


def test_other_files_of_the_folder_are_not_served(real_model_dir: Path) -> None:
    with served(real_model_dir, (KEY,)) as (client, _):
        unknown = client.get("/web/index.html")  # only the listed paths exist
        escape = client.get("/web/../v1/cluster")
    assert unknown.status_code == 401 and error_of(unknown)["code"] == "invalid_api_key"
    assert escape.status_code in (401, 404)
