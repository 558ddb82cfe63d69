"""The web page in a real browser: Debian's Chromium driven by Playwright, against the app on
real Ray. Each test collects the browser's console errors, page errors and dialogs, and fails on
any it did not expect."""

from __future__ import annotations

import asyncio
import os
import re
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient
from playwright.async_api import Browser, Page, expect
from pydantic import SecretStr

from jobs_server.app import create_app
from jobs_server.errors import ClusterUnavailableError
from jobs_server.routes.ui import CONTENT_SECURITY_POLICY
from jobs_server.settings import Settings
from tests.support.api import submit, wait_for_status
from tests.support.fakes import FakeJobManager
from tests.support.web_page import UI_TIMEOUT_MS, open_page

# README's screenshot is rewritten only when asked (`UPDATE_SCREENSHOT=1`): each run's
# image differs (ids, times), and a test run must not leave the checkout changed. Not a
# JOBS_SERVER_* name: conftest clears those from the environment before any test runs.
README_SCREENSHOT_PATH = Path(__file__).resolve().parent.parent / "docs" / "screenshot.png"


def screenshot_path(tmp_path: Path) -> Path:
    if os.environ.get("UPDATE_SCREENSHOT") == "1":
        return README_SCREENSHOT_PATH
    return tmp_path / "screenshot.png"


PAGE_POLL_S = 0.02
XSS_PAYLOADS = ("<script>alert(1)</script>", "<img src=x onerror=alert(2)>")
STATUS_FIELD = '[data-field="status"]'
WEB_TOKEN = f"web-{uuid.uuid4().hex}"


async def events_status(client: TestClient[Any, Any]) -> int:
    """What `/api/events` answers on this app (the stream is opened and dropped)."""
    async with client.get("/api/events") as response:
        return response.status


def job_row(page: Page, job_id: str) -> Any:
    return page.locator(f'tr[data-job-id="{job_id}"]')


async def test_the_list_shows_jobs_and_updates_live(
    client: TestClient[Any, Any], browser: Browser, tmp_path: Path
) -> None:
    finished = await submit(client, entrypoint="echo done", metadata={"team": "web"})
    await wait_for_status(client, finished)
    watch = await open_page(browser, client)
    page = watch.page
    await expect(job_row(page, finished).locator(".status-cell")).to_have_text("SUCCEEDED")
    await expect(job_row(page, finished)).to_contain_text("team=web")
    await page.evaluate("window.loadedOnce = true")

    # A job submitted elsewhere appears, then changes status, without a reload.
    live = await submit(client, entrypoint="sleep 3; echo live", metadata={"team": "ml-ops"})
    await expect(job_row(page, live)).to_be_visible()
    await expect(job_row(page, live).locator(".status-cell")).to_have_text("RUNNING")
    await expect(page.get_by_label("API key")).to_be_hidden()  # no token: no prompt
    screenshot = screenshot_path(tmp_path)
    await page.screenshot(path=str(screenshot))
    assert screenshot.stat().st_size > 0
    await expect(job_row(page, live).locator(".status-cell")).to_have_text("SUCCEEDED")
    assert await page.evaluate("window.loadedOnce") is True, "the page was reloaded"
    assert await events_status(client) == 200
    assert any("/api/events" in url for url in watch.requested_paths), "no event stream"

    # The filter asks the server; the search narrows what is shown; the link opens the job.
    await page.get_by_label("Status").select_option("RUNNING")
    await expect(page.locator("tbody tr")).to_have_count(0)
    await page.get_by_label("Status").select_option("")
    await expect(page.locator("tbody tr")).to_have_count(2)
    await page.get_by_label("Search id or metadata").fill("ml-ops")  # a hyphen: in no generated id
    await expect(page.locator("tbody tr")).to_have_count(1)
    await expect(job_row(page, live)).to_be_visible()
    await page.get_by_label("Search id or metadata").fill("team=web")  # asks the server
    await expect(job_row(page, finished)).to_be_visible()
    await expect(page.locator("tbody tr")).to_have_count(1)
    assert any("metadata.team=web" in url for url in watch.requested_paths)
    await page.get_by_label("Search id or metadata").fill("")
    await page.get_by_role("link", name=finished).click()
    await expect(page.locator(STATUS_FIELD)).to_have_text("SUCCEEDED")
    await expect(page.locator("#job-log")).to_have_text("done\n")
    watch.assert_clean()


async def test_the_list_and_a_job_page_follow_the_event_stream(
    fake_client: TestClient[Any, Any], fake: FakeJobManager, browser: Browser
) -> None:
    """On the in-memory manager, whose changes are events: rows appear, change in place and go
    from the events alone (the list is not asked again for a status change), and a job's page
    follows its job."""
    watch = await open_page(browser, fake_client)
    page = watch.page
    await expect(page.locator(".empty")).to_be_visible()
    job_id = await submit(fake_client, entrypoint="echo hi", metadata={"team": "web"})
    await expect(job_row(page, job_id).locator(".status-cell")).to_have_text("PENDING")
    list_calls = sum("/api/jobs/?" in url for url in watch.requested_paths)
    fake.start(job_id)
    await expect(job_row(page, job_id).locator(".status-cell")).to_have_text("RUNNING")
    fake.finish(job_id, exit_code=3)
    await expect(job_row(page, job_id).locator(".status-cell")).to_have_text("FAILED")
    assert sum("/api/jobs/?" in url for url in watch.requested_paths) == list_calls
    await (await fake_client.delete(f"/api/jobs/{job_id}")).json()
    await expect(job_row(page, job_id)).to_have_count(0)

    other = await submit(fake_client, entrypoint="echo there")
    await page.get_by_role("link", name=other).click()
    await expect(page.locator(STATUS_FIELD)).to_have_text("PENDING")
    fake.start(other)
    fake.write_log(other, b"there\n")
    await expect(page.locator("#job-log")).to_have_text("there\n")
    await expect(page.locator(STATUS_FIELD)).to_have_text("RUNNING")
    fake.finish(other, exit_code=0)
    await expect(page.locator(STATUS_FIELD)).to_have_text("SUCCEEDED")
    await expect(page.locator('[data-field="exit-code"]')).to_have_text("0")
    assert any("/api/events" in url for url in watch.requested_paths)
    # Leaving the page with the question open answers it "no".
    await page.get_by_role("button", name="Delete", exact=True).click()
    await expect(page.get_by_role("dialog")).to_be_visible()
    await page.go_back()
    await expect(page.get_by_role("dialog")).to_be_hidden()
    await expect(page.get_by_role("heading", name="Jobs")).to_be_visible()
    assert (await fake_client.get(f"/api/jobs/{other}")).status == 200
    watch.assert_clean()


async def test_without_an_event_stream_the_list_polls(
    fake_client: TestClient[Any, Any],
    fake: FakeJobManager,
    browser: Browser,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A server that cannot stream events (an older one: 404; no event log: 503) still gets a
    live list: the page polls the list API instead."""

    async def no_event_log(**_: Any) -> Any:
        raise ClusterUnavailableError("The event stream needs the job archive; it is off.")

    monkeypatch.setattr(fake, "subscribe_events", no_event_log)
    watch = await open_page(browser, fake_client)
    page = watch.page
    await expect(page.locator(".empty")).to_be_visible()
    job_id = await submit(fake_client, entrypoint="echo polled")
    await expect(job_row(page, job_id).locator(".status-cell")).to_have_text("PENDING")
    fake.start(job_id)
    await expect(job_row(page, job_id).locator(".status-cell")).to_have_text("RUNNING")
    watch.assert_clean(allowed_console=re.compile(r"status of 503 .*/api/events"))


async def test_pages_follow_the_list_apis_link(
    client: TestClient[Any, Any], browser: Browser
) -> None:
    job_ids = [await submit(client, entrypoint="true") for _ in range(3)]
    watch = await open_page(browser, client, "/#/?limit=2")
    page = watch.page
    await expect(page.locator("tbody tr")).to_have_count(2)
    first_page = await page.locator("tbody tr").evaluate_all(
        "rows => rows.map(row => row.dataset.jobId)"
    )
    await page.get_by_role("button", name="Next page").click()
    await expect(page.locator("tbody tr")).to_have_count(1)
    await expect(page.get_by_role("button", name="Next page")).to_be_disabled()
    last = await page.locator("tbody tr").get_attribute("data-job-id")
    assert sorted([*first_page, last]) == sorted(job_ids)
    await page.get_by_role("button", name="Previous page").click()
    await expect(page.locator("tbody tr")).to_have_count(2)
    watch.assert_clean()


async def test_a_job_submitted_from_the_form_shows_its_log_live_and_stops(
    client: TestClient[Any, Any], browser: Browser, record_property: Callable[[str, Any], None]
) -> None:
    watch = await open_page(browser, client, "/#/submit")
    page = watch.page
    # Each line carries the time it was printed; the page is polled to see when it shows.
    entrypoint = (
        'echo "$GREETING"; for i in 1 2 3 4 5; do echo "line-$i $(date +%s.%N)"; sleep 0.5;'
        " done; sleep 300"
    )
    await page.get_by_label("Entrypoint").fill(entrypoint)
    await page.get_by_label("Environment variables").fill("GREETING=hello from the form")
    await page.get_by_label("Metadata").fill("team=web\nrun=browser")
    await page.get_by_label("CPUs").fill("0.5")
    await page.get_by_role("button", name="Submit job").click()
    await page.wait_for_url(re.compile(r"#/jobs/"))
    job_id = page.url.rsplit("/", 1)[1]
    await expect(page.locator('[data-field="metadata"]')).to_contain_text("run=browser")

    latencies_s = await _log_line_latencies(page, count=5)
    record_property("log_line_latency_s", latencies_s)
    print(
        f"log line to page: median {statistics.median(latencies_s) * 1000:.0f} ms,"
        f" max {max(latencies_s) * 1000:.0f} ms over {len(latencies_s)} lines"
    )
    await expect(page.locator("#job-log")).to_contain_text("hello from the form")
    await expect(page.locator(STATUS_FIELD)).to_have_text("RUNNING")
    await expect(page.get_by_role("button", name="Delete", exact=True)).to_be_disabled()

    # Cancel leaves it running; confirming stops it.
    await page.get_by_role("button", name="Stop", exact=True).click()
    await expect(page.get_by_role("dialog")).to_be_visible()
    await page.get_by_role("button", name="Cancel").click()
    await expect(page.get_by_role("dialog")).to_be_hidden()
    assert (await wait_for_status(client, job_id, {"RUNNING"}))["status"] == "RUNNING"
    await page.get_by_role("button", name="Stop", exact=True).click()
    await page.get_by_role("button", name="Stop job").click()
    await expect(page.locator(STATUS_FIELD)).to_have_text("STOPPED")
    await expect(page.locator('[data-field="message"]')).not_to_be_empty()
    await expect(page.locator("#log-state")).to_contain_text("ended")
    await expect(page.get_by_role("button", name="Stop", exact=True)).to_be_disabled()

    async with page.expect_download() as download_info:
        await page.get_by_role("link", name="Download log").click()
    downloaded = await (await download_info.value).path()
    assert "line-5" in downloaded.read_text()

    await page.get_by_role("button", name="Delete", exact=True).click()
    await page.get_by_role("button", name="Delete job").click()
    await page.wait_for_url(re.compile(r"#/$"))
    assert (await client.get(f"/api/jobs/{job_id}")).status == 404
    watch.assert_clean()


async def _log_line_latencies(page: Page, count: int) -> list[float]:
    """Seconds from each `line-N <time>` being printed to it showing on the page."""
    seen: dict[str, float] = {}
    deadline = time.monotonic() + UI_TIMEOUT_MS / 1000
    while len(seen) < count and time.monotonic() < deadline:
        text = await page.locator("#job-log").text_content() or ""
        now = time.time()
        for name, printed in re.findall(r"(line-\d+) (\d+\.\d+)", text):
            seen.setdefault(name, now - float(printed))
        await asyncio.sleep(PAGE_POLL_S)
    assert len(seen) == count, f"lines on the page after {UI_TIMEOUT_MS} ms: {sorted(seen)}"
    return list(seen.values())


async def test_output_and_metadata_are_shown_as_text(
    client: TestClient[Any, Any], browser: Browser
) -> None:
    printed = " ".join(f"'{payload}'" for payload in XSS_PAYLOADS)
    job_id = await submit(
        client,
        entrypoint=f"printf '%s\\n' {printed}",
        metadata={"note": XSS_PAYLOADS[1], "title": XSS_PAYLOADS[0]},
    )
    await wait_for_status(client, job_id)
    watch = await open_page(browser, client)
    page = watch.page
    await expect(job_row(page, job_id)).to_contain_text(f"note={XSS_PAYLOADS[1]}")
    await page.get_by_role("link", name=job_id).click()
    await expect(page.locator("#job-log")).to_have_text("\n".join(XSS_PAYLOADS) + "\n")
    await expect(page.locator('[data-field="metadata"]')).to_contain_text(XSS_PAYLOADS[0])
    await expect(page.locator('[data-field="entrypoint"]')).to_contain_text(XSS_PAYLOADS[1])
    assert await page.locator("main img, main script").count() == 0
    assert not any(url.endswith("/x") for url in watch.requested_paths), "an <img> was loaded"
    watch.assert_clean()


@pytest.fixture
async def secured_client(
    aiohttp_client: Callable[..., Awaitable[TestClient[Any, Any]]], settings: Settings
) -> TestClient[Any, Any]:
    """The app with a token; the test client sends it, the browser must be given it."""
    secured = settings.model_copy(update={"auth_token": SecretStr(WEB_TOKEN)})
    return await aiohttp_client(
        create_app(secured), headers={"Authorization": f"Bearer {WEB_TOKEN}"}
    )


async def test_with_a_token_the_page_asks_for_a_key(
    secured_client: TestClient[Any, Any], browser: Browser
) -> None:
    job_id = await submit(secured_client, entrypoint="echo secret-output")
    watch = await open_page(browser, secured_client)
    page = watch.page
    key_input = page.get_by_label("API key")
    await expect(key_input).to_be_focused()
    assert not any("/api/" in url for url in watch.requested_paths), "called the API without a key"

    await key_input.fill("wrong-key")
    await key_input.press("Enter")
    await expect(page.get_by_role("alert")).to_have_text("The server rejected that key.")
    await expect(key_input).to_be_visible()
    assert await page.evaluate("sessionStorage.length") == 0

    await key_input.fill(WEB_TOKEN)
    await page.get_by_role("button", name="Use key").click()
    await page.get_by_role("link", name=job_id).click()
    await expect(page.locator("#job-log")).to_have_text("secret-output\n")
    await page.reload()  # the key stays for the tab
    await expect(page.locator("#job-log")).to_have_text("secret-output\n")
    async with page.expect_download() as download_info:  # a link cannot send the key
        await page.get_by_role("link", name="Download log").click()
    assert (await (await download_info.value).path()).read_text() == "secret-output\n"
    await page.get_by_role("button", name="Forget key").click()
    await expect(key_input).to_be_visible()
    watch.assert_clean(allowed_console=re.compile(r"status of 403 .*/api/jobs/"))


async def test_every_control_has_a_name(client: TestClient[Any, Any], browser: Browser) -> None:
    """Inputs, selects and textareas have a label; buttons and links have text."""
    await submit(client, entrypoint="true")
    watch = await open_page(browser, client)
    page = watch.page
    unnamed_script = """() => [...document.querySelectorAll('input, select, textarea, button, a')]
        .filter(el => el.offsetParent !== null || el.closest('main'))
        .filter(el => ['A', 'BUTTON'].includes(el.tagName)
            ? !el.textContent.trim() && !el.getAttribute('aria-label')
            : el.labels.length === 0)
        .map(el => el.outerHTML)"""
    await expect(page.locator("tbody tr")).to_have_count(1)
    assert await page.evaluate(unnamed_script) == []
    await page.get_by_role("link", name="Submit a job").click()
    await expect(page.get_by_label("Entrypoint")).to_be_focused()
    assert await page.evaluate(unnamed_script) == []
    # The form works from the keyboard alone.
    await page.keyboard.type("echo typed")
    await page.get_by_role("button", name="Submit job").focus()
    await page.keyboard.press("Enter")
    await expect(page.locator("#job-log")).to_have_text("typed\n")
    watch.assert_clean()


async def test_the_page_and_its_files_carry_strict_headers(
    fake_client: TestClient[Any, Any],
) -> None:
    for path, content_type in (
        ("/", "text/html"),
        ("/ui/app.js", "text/javascript"),
        ("/ui/style.css", "text/css"),
    ):
        response = await fake_client.get(path)
        assert response.status == 200, path
        assert response.content_type == content_type
        assert response.headers["Content-Security-Policy"] == CONTENT_SECURITY_POLICY
        assert response.headers["X-Content-Type-Options"] == "nosniff"
        assert response.headers["Referrer-Policy"] == "no-referrer"
    assert "frame-ancestors 'none'" in CONTENT_SECURITY_POLICY
    assert "unsafe-inline" not in CONTENT_SECURITY_POLICY
    page = await (await fake_client.get("/")).text()
    assert "<script>" not in page, "inline script"
    assert "style=" not in page, "inline style"
    assert 'data-auth="off"' in page
    missing = await fake_client.get("/ui/../app.py")
    assert missing.status == 404
    assert (await missing.json())["error"]["code"] == "not_found"


async def test_with_a_token_the_page_is_public_and_says_so(
    aiohttp_client: Callable[..., Awaitable[TestClient[Any, Any]]],
    fake_settings: Settings,
    fake: FakeJobManager,
) -> None:
    """The page and its files answer without a token (the page asks for the key); the API does
    not; the page is told to ask before calling it."""
    secured = fake_settings.model_copy(update={"auth_token": SecretStr(WEB_TOKEN)})
    client = await aiohttp_client(create_app(secured, backend=fake.backend()))
    page = await client.get("/")
    assert page.status == 200
    assert 'data-auth="on"' in await page.text()
    assert (await client.get("/ui/app.js")).status == 200
    assert (await client.get("/api/jobs/")).status == 401
    assert (await client.get("/uiX/app.js")).status == 401  # the exemption is the prefix /ui/
