"""The web page and the queue (issue 15): the form's priority and retries, checked by the server
(its message shown as the page shows other errors, nothing recorded); a job page's priority, its
queue message, and its attempts, each with its own part of the log."""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient
from playwright.async_api import Browser, expect

from jobs_server.app import create_app
from jobs_server.settings import Settings
from tests.support.api import submit, wait_for_status
from tests.support.web_page import open_page


@pytest.fixture
async def queue_client(
    aiohttp_client: Callable[..., Awaitable[TestClient[Any, Any]]], settings: Settings
) -> TestClient[Any, Any]:
    """The app on real Ray with one running slot, and retries without a wait."""
    capped = settings.model_copy(update={"max_running_jobs": 1, "retry_backoff_s": 0.0})
    return await aiohttp_client(create_app(capped))


async def test_a_job_submitted_with_retries_from_the_form_lists_its_attempts(
    queue_client: TestClient[Any, Any], browser: Browser, tmp_path: Path
) -> None:
    counter = tmp_path / "attempts"
    # Attempts 1 and 2 fail with exit code 3, attempt 3 succeeds; each prints its number.
    entrypoint = (
        f"n=$(( $(cat {counter} 2>/dev/null || echo 0) + 1 )); echo $n > {counter};"
        ' echo "output of attempt $n"; [ "$n" -ge 3 ] || exit 3'
    )
    watch = await open_page(browser, queue_client, "/#/submit")
    page = watch.page
    await page.get_by_label("Entrypoint").fill(entrypoint)
    await page.get_by_label("Priority").fill("5")
    await page.get_by_label("Max retries").fill("2")
    await page.get_by_label("Retry on exit codes").fill("3, 137")
    await page.get_by_role("button", name="Submit job").click()
    await page.wait_for_url(re.compile(r"#/jobs/"))
    job_id = page.url.rsplit("/", 1)[1]

    await expect(page.locator('[data-field="status"]')).to_have_text("SUCCEEDED")
    await expect(page.locator('[data-field="priority"]')).to_have_text("5")
    await expect(page.locator('[data-field="retries"]')).to_have_text(
        "up to 2, on exit codes 3, 137"
    )
    rows = page.locator("#attempts tbody tr")
    await expect(rows).to_have_count(3)
    for number, exit_code in ((1, "3"), (2, "3"), (3, "0")):
        cells = rows.nth(number - 1).locator("td")
        await expect(cells.nth(0)).to_have_text(str(number))
        await expect(cells.nth(3)).to_have_text(exit_code)
        await expect(cells.nth(1)).not_to_be_empty()
        await expect(cells.nth(2)).not_to_be_empty()
    # Each attempt's log is its own part of the job's log: the offsets split it.
    for number in (2, 1, 3):
        await page.get_by_role("link", name=f"Log of attempt {number}").click()
        await expect(page.get_by_role("heading", name=f"Log of attempt {number}")).to_be_visible()
        await expect(page.locator("#attempt-log")).to_have_text(f"output of attempt {number}\n")
    await expect(page.locator("#job-log")).to_have_text(
        "".join(f"output of attempt {number}\n" for number in (1, 2, 3))
    )

    details = await (await queue_client.get(f"/api/jobs/{job_id}")).json()
    assert details["priority"] == 5
    assert details["max_retries"] == 2
    assert details["retry_on_exit_codes"] == [3, 137]
    assert [attempt["exit_code"] for attempt in details["attempts"]] == [3, 3, 0]
    watch.assert_clean()


async def test_a_queued_job_shows_its_place_and_priority(
    queue_client: TestClient[Any, Any], browser: Browser
) -> None:
    running = await submit(queue_client, entrypoint="sleep 600")
    await wait_for_status(queue_client, running, {"RUNNING"})
    queued = await submit(queue_client, entrypoint="echo ran", priority=-7)
    watch = await open_page(browser, queue_client, f"/#/jobs/{queued}")
    page = watch.page
    await expect(page.locator('[data-field="status"]')).to_have_text("PENDING")
    await expect(page.locator('[data-field="message"]')).to_contain_text("Queued: 1st of 1")
    await expect(page.locator('[data-field="message"]')).to_contain_text("1 of 1 running")
    await expect(page.locator('[data-field="priority"]')).to_have_text("-7")
    await expect(page.locator('[data-field="retries"]')).to_have_text("none")
    await expect(page.locator("#attempts")).to_be_hidden()  # no retries asked for

    assert (await queue_client.post(f"/api/jobs/{running}/stop")).status == 200
    await expect(page.locator('[data-field="status"]')).to_have_text("SUCCEEDED")
    await expect(page.locator("#job-log")).to_have_text("ran\n")
    watch.assert_clean()


@pytest.mark.parametrize(
    ("label", "typed", "message"),
    [
        ("Priority", "high", "priority: Input should be a valid integer"),
        ("Priority", "1.5", "priority: Input should be a valid integer"),
        ("Priority", "1001", "priority: Input should be less than or equal to 1000"),
        ("Max retries", "-1", "max_retries: Input should be greater than or equal to 0"),
        ("Max retries", "101", "max_retries: Input should be less than or equal to 100"),
        ("Retry on exit codes", "1, x", "retry_on_exit_codes.1: Input should be a valid integer"),
        ("Retry on exit codes", "0", "retry_on_exit_codes: Value error, 0 is success"),
    ],
)
async def test_the_server_refuses_bad_queue_fields_and_the_form_says_why(
    fake_client: TestClient[Any, Any], browser: Browser, label: str, typed: str, message: str
) -> None:
    watch = await open_page(browser, fake_client, "/#/submit")
    page = watch.page
    await page.get_by_label("Entrypoint").fill("true")
    await page.get_by_label(label).fill(typed)
    await page.get_by_role("button", name="Submit job").click()
    alert = page.locator("#submit-error")
    await expect(alert).to_contain_text(message)
    await expect(alert).to_have_attribute("role", "alert")
    assert "#/submit" in page.url
    assert (await (await fake_client.get("/api/jobs/")).json()) == []  # nothing recorded
    # The browser logs the refused request itself; nothing else may go wrong.
    watch.assert_clean(allowed_console=re.compile(r"status of 400"))


async def test_an_attempt_that_printed_nothing_shows_an_empty_log(
    queue_client: TestClient[Any, Any], browser: Browser, tmp_path: Path
) -> None:
    """Its part of the log is empty: there is nothing to ask the server for (limit=0 is a 400)."""
    counter = tmp_path / "attempts"
    entrypoint = (
        f"n=$(( $(cat {counter} 2>/dev/null || echo 0) + 1 )); echo $n > {counter};"
        ' [ "$n" -ge 2 ] || exit 3; echo "output of attempt $n"'
    )
    job_id = await submit(queue_client, entrypoint=entrypoint, max_retries=1)
    assert (await wait_for_status(queue_client, job_id))["status"] == "SUCCEEDED"
    watch = await open_page(browser, queue_client, f"/#/jobs/{job_id}")
    page = watch.page
    await expect(page.locator("#attempts tbody tr")).to_have_count(2)
    await page.get_by_role("link", name="Log of attempt 1").click()
    await expect(page.get_by_role("heading", name="Log of attempt 1")).to_be_visible()
    await expect(page.locator("#attempt-log")).to_have_text("")
    await page.get_by_role("link", name="Log of attempt 2").click()
    await expect(page.locator("#attempt-log")).to_have_text("output of attempt 2\n")
    await expect(page.locator("#job-error")).to_have_text("")
    watch.assert_clean()
