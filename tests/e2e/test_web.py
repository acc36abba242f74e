"""The built-in web page in headless Chromium, against a real cluster on the real model with an
API key set: without the key the page shows nothing; with it, the cluster view lists every
worker and a chat answer streams in, grows, and ends with its stats; Stop aborts it. And on a
tiny cluster without keys: the page needs none, and shows a worker leaving as it happens."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from playwright.sync_api import Browser, Page, sync_playwright

from tests.e2e.cluster import Cluster, alive, launch

pytestmark = [pytest.mark.e2e, pytest.mark.realmodel]

KEY = "sk-web-e2e-0123456789"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
QUESTION = "What is the capital of France?"
MAX_TOKENS = 48
TIMEOUT_MS = 120_000  # a loaded 2-core machine runs the model and the browser at once


@pytest.fixture(scope="module")
def cluster(real_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with launch(tmp_path_factory.mktemp("run"), real_model_dir, prefill=1, decode=2,
                flags=["--api-key", KEY], api_key=KEY) as running:
        yield running


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Browser]:
    """Debian's Chromium, driven by playwright, which must never download a browser."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PLAYWRIGHT_BROWSERS_PATH", str(tmp_path_factory.mktemp("no-browsers")))
        with sync_playwright() as playwright:  # launch() gives it a fresh, temporary profile
            launched = playwright.chromium.launch(executable_path=CHROMIUM, headless=True,
                                                  args=CHROMIUM_ARGS)
            yield launched
            launched.close()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    """A fresh tab (its own sessionStorage: no key until the test types one)."""
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    opened = context.new_page()
    opened.set_default_timeout(TIMEOUT_MS)
    yield opened
    context.close()


def open_page(page: Page, cluster: Cluster, key: str | None = KEY) -> list[tuple[str, int]]:
    """Load the page, typing `key` when given; returns the (path, status) of its /v1 calls as
    they happen."""
    calls: list[tuple[str, int]] = []
    page.on("response", lambda r: calls.append((r.url.removeprefix(cluster.url), r.status))
            if "/v1/" in r.url else None)
    page.goto(cluster.url + "/")
    if key is not None:
        page.fill("#api-key", key)
        page.click("#key-save")
        page.wait_for_function("() => document.querySelectorAll('#model option').length > 0")
    return calls


def next_poll(page: Page) -> None:
    """Until the page's next poll of the cluster view has been answered."""
    with page.expect_response(lambda response: response.url.endswith("/v1/cluster")):
        pass


def registry_workers(cluster: Cluster) -> dict[str, str]:
    """Worker id -> role, as the gateway's registry has them."""
    workers = cluster.client.get("/v1/cluster").json()["workers"]
    return {w["id"]: w["role"] for w in workers}


def shown_workers(page: Page) -> dict[str, list[str]]:
    """Worker id -> the cells of its row in the cluster view."""
    rows = page.eval_on_selector_all(
        "#workers tbody tr",
        "rows => rows.map(r => [r.dataset.workerId, [...r.cells].map(c => c.textContent)])")
    return {worker_id: cells for worker_id, cells in rows}


def test_without_a_key_the_page_loads_but_shows_no_data(page: Page, cluster: Cluster) -> None:
    calls = open_page(page, cluster, key=None)
    page.wait_for_function(
        "() => document.getElementById('health').textContent === 'needs a key'")
    page.wait_for_function("() => window.performance.getEntriesByType('resource').length >= 2")
    assert "needs an API key" in (page.text_content("#key-status") or "")
    assert page.eval_on_selector_all("#workers tbody tr", "rows => rows.length") == 0
    assert page.eval_on_selector_all("#model option", "options => options.length") == 0
    next_poll(page)
    statuses = {path: status for path, status in calls}
    assert statuses == {"/v1/models": 401, "/v1/cluster": 401}, calls


def test_with_the_key_the_cluster_view_lists_every_worker(page: Page, cluster: Cluster) -> None:
    calls = open_page(page, cluster)
    expected = registry_workers(cluster)
    assert sorted(expected) == ["decode-0", "decode-1", "prefill-0"]
    page.wait_for_function(f"() => document.querySelectorAll('#workers tbody tr').length === "
                           f"{len(expected)}")
    shown = shown_workers(page)
    assert {worker_id: cells[1] for worker_id, cells in shown.items()} == expected
    assert {cells[2] for cells in shown.values()} == {socket.gethostname()}
    assert page.text_content("#health") == "ok"
    events = page.eval_on_selector_all("#events li", "items => items.map(i => i.textContent)")
    for worker_id in expected:
        assert any(f"{worker_id} (" in event and "registered" in event for event in events)
    next_poll(page)  # it polls: later calls succeed too
    polls = [status for path, status in calls if path == "/v1/cluster"]  # one at a time
    with_key = polls[polls.index(200):]  # before the key was typed: 401 (the test above)
    assert len(with_key) >= 2 and set(with_key) == {200}, calls


def reference_answer(cluster: Cluster) -> str:
    """The same greedy request through the official openai client."""
    client = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key=KEY, max_retries=0,
                           timeout=TIMEOUT_MS / 1000)
    reply = client.chat.completions.create(
        model=cluster.model, messages=[{"role": "user", "content": QUESTION}],
        max_tokens=MAX_TOKENS, temperature=0)
    return reply.choices[0].message.content or ""


_WATCH_ANSWER = """() => {
  window.seen = [];
  new MutationObserver(() => {
    const answers = document.querySelectorAll('.message.assistant');
    const last = answers[answers.length - 1];
    if (!last) return;
    window.seen.push([last.querySelector('.text').textContent.length,
                      last.querySelector('.stats') !== null]);
  }).observe(document.getElementById('messages'),
             {childList: true, subtree: true, characterData: true});
}"""


def ask(page: Page, question: str, max_tokens: int) -> None:
    page.fill("#max-tokens", str(max_tokens))
    page.fill("#temperature", "0")
    page.fill("#prompt", question)
    page.click("#send")


def test_a_message_streams_an_answer_then_its_stats(page: Page, cluster: Cluster,
                                                   tmp_path: Path) -> None:
    expected = reference_answer(cluster)
    assert expected.strip()
    open_page(page, cluster)
    page.evaluate(_WATCH_ANSWER)
    ask(page, QUESTION, MAX_TOKENS)
    page.wait_for_selector(".message.assistant .stats")
    answer = page.text_content(".message.assistant .text") or ""
    assert answer == expected
    seen: list[list[Any]] = page.evaluate("window.seen")
    streaming = sorted({length for length, ended in seen if not ended and length > 0})
    assert len(streaming) >= 2, seen  # it grew while streaming, before the stats came
    assert streaming[-1] <= len(answer)
    stats = page.text_content(".message.assistant .stats") or ""
    match = re.match(r"(\d+) tokens · TTFT (\d+) ms · ([\d.]+) tok/s · (stop|length)", stats)
    assert match is not None, stats
    assert 0 < int(match[1]) <= MAX_TOKENS and float(match[3]) > 0
    timing = page.text_content(".message.assistant .stats .timing") or ""
    assert "prefill_compute" in timing, stats  # the page asked for the stage breakdown
    assert page.is_enabled("#send") and not page.is_enabled("#stop")
    page.screenshot(path=str(tmp_path / "web-chat.png"))


def test_stop_aborts_the_answer_and_the_cluster_frees_it(page: Page, cluster: Cluster,
                                                        tmp_path: Path) -> None:
    open_page(page, cluster)
    ask(page, "Write a very long story about a dragon who learns to sing.", 2000)
    page.wait_for_function("() => (document.querySelector('.message.assistant .text')"
                           "?.textContent.length ?? 0) > 10")
    page.click("#stop")
    page.wait_for_selector(".message.assistant .stats")
    assert (page.text_content(".message.assistant .stats") or "").endswith("stopped")
    assert page.is_enabled("#send")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        view = cluster.client.get("/v1/cluster").json()
        if view["requests"]["in_flight"] == 0 and all(
                w["kv_blocks_used"] == 0 for w in view["workers"] if w["role"] == "decode"):
            break
        time.sleep(0.5)
    assert view["requests"]["in_flight"] == 0, json.dumps(view)
    assert all(w["kv_blocks_used"] == 0 for w in view["workers"] if w["role"] == "decode")
    next_poll(page)  # after the answers of this module's tests
    page.locator("#cluster").screenshot(path=str(tmp_path / "web-cluster.png"))


def test_a_new_chat_mid_answer_starts_clean_and_an_ime_enter_sends_nothing(
        page: Page, cluster: Cluster) -> None:
    """The answer cut off by "New chat" is no part of the next chat; an Enter that confirms an
    input method's conversion leaves the text in the box."""
    open_page(page, cluster)
    bodies: list[dict[str, Any]] = []
    page.on("request", lambda request: bodies.append(json.loads(request.post_data or "{}"))
            if request.url.endswith("/v1/chat/completions") else None)
    ask(page, "Write a very long story about a dragon who learns to sing.", 2000)
    page.wait_for_function("() => (document.querySelector('.message.assistant .text')"
                           "?.textContent.length ?? 0) > 10")
    page.click("#clear")
    page.wait_for_function("() => !document.getElementById('send').disabled")
    page.fill("#prompt", "にほん")
    page.dispatch_event("#prompt", "keydown", {"key": "Enter", "isComposing": True})
    assert page.input_value("#prompt") == "にほん" and len(bodies) == 1
    ask(page, QUESTION, 4)
    page.wait_for_selector(".message.assistant .stats")
    assert bodies[-1]["messages"] == [{"role": "user", "content": QUESTION}]


def test_an_error_reply_is_shown_as_text(page: Page, cluster: Cluster) -> None:
    body = {"model": cluster.model, "messages": [{"role": "user", "content": "<b>hello</b>"}],
            "max_tokens": 999_999, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    refused = cluster.client.post("/v1/chat/completions", json=body)
    assert refused.status_code == 400
    open_page(page, cluster)
    ask(page, "<b>hello</b>", 999_999)
    page.wait_for_selector(".message.assistant .error")
    assert page.text_content(".message.assistant .error") == refused.json()["error"]["message"]
    assert page.text_content(".message.user .text") == "<b>hello</b>"  # as text, not markup
    assert page.query_selector("#messages b") is None
    assert page.is_enabled("#send")


@pytest.fixture(scope="module")
def open_cluster(tiny_model_dir: Path,
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A tiny cluster without API keys, one of whose workers the test stops."""
    with launch(tmp_path_factory.mktemp("open-run"), tiny_model_dir, prefill=1,
                decode=2) as running:
        yield running


def test_without_keys_the_page_needs_none_and_shows_a_worker_leave(
        page: Page, open_cluster: Cluster) -> None:
    calls = open_page(page, open_cluster, key=None)
    page.wait_for_function("() => document.querySelectorAll('#workers tbody tr').length === 3")
    assert page.eval_on_selector_all("#model option", "o => o.map(x => x.value)") == [
        open_cluster.model]
    pid = open_cluster.pids()["decode-1"]
    os.kill(pid, signal.SIGINT)  # it says Leave as it stops; launch.sh keeps the others
    page.wait_for_function("() => [...document.querySelectorAll('#events li')]"
                           ".some(li => li.textContent.includes('decode-1 (decode') "
                           "&& li.textContent.includes(' left'))")
    page.wait_for_function("() => document.querySelectorAll('#workers tbody tr').length === 2")
    assert set(shown_workers(page)) == {"prefill-0", "decode-0"}
    assert page.text_content("#health") == "degraded"
    deadline = time.monotonic() + 60
    while alive(pid) and time.monotonic() < deadline:  # it said Leave, then shuts down
        time.sleep(0.2)
    assert not alive(pid)
    assert {status for path, status in calls} == {200}, calls
