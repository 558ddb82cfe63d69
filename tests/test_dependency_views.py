"""Job dependencies and webhook deliveries (issue 36) on the web page, in Debian's Chromium: a
job's page links the jobs it depends on (each with its condition, its status and whether it is
met) and the jobs that depend on it, says plainly why a job that can never run failed, and shows
its webhook deliveries.

Mostly on the fake manager, whose jobs move only when the test moves them: the answers the page
reads for `met` and for the deliveries are the contract's (api_models.JobDetails,
WebhookDeliveryDetails), served through the browser's request routing where the fake has nothing
to say (it keeps no outbox). Then end to end on real Ray: a chain, and a job's webhook to a
receiver on loopback."""

from __future__ import annotations

import base64
import re
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from playwright.async_api import Browser, Page, Route, expect

from jobs_server.app import create_app
from jobs_server.manager import JobStatus
from jobs_server.manager.records import JobErrorType
from jobs_server.settings import Settings
from tests.support.api import submit, wait_for_status
from tests.support.fakes import FakeJobManager
from tests.support.web_page import open_page

DELIVERIES: list[dict[str, Any]] = [
    {
        "id": "msg_started", "event_id": 3, "event_type": "job.started",
        "url": "https://hooks.example.com/jobs", "state": "delivered", "attempts": 2,
        "created_at": 1_700_000_000_000, "last_attempt_at": 1_700_000_001_000,
        "next_attempt_at": None, "last_status_code": 200, "last_error": None,
        "delivered_at": 1_700_000_001_000,
    },
    {
        "id": "msg_succeeded", "event_id": 5, "event_type": "job.succeeded",
        "url": "https://hooks.example.com/<b>jobs</b>", "state": "pending", "attempts": 3,
        "created_at": 1_700_000_000_000, "last_attempt_at": 1_700_000_002_000,
        "next_attempt_at": 1_700_000_009_000, "last_status_code": 503,
        "last_error": "<img src=x onerror=alert(1)> answered 503",
        "delivered_at": None,
    },
]  # fmt: skip


async def serve_met(page: Page, met: Mapping[tuple[str, str], bool]) -> None:
    """The server's details of a job, with `met` of each (job, dependency) in `met` set as
    the real manager fills it (the fake leaves it null: not known)."""

    async def patch(route: Route) -> None:
        response = await route.fetch()
        job = await response.json()
        for dependency in job["depends_on"]:
            dependency["met"] = met.get((job["submission_id"], dependency["submission_id"]))
        await route.fulfill(response=response, json=job)

    for job_id in {job_id for job_id, _ in met}:
        await page.route(f"**/api/jobs/{job_id}", patch)


async def serve_deliveries(
    page: Page, deliveries: Mapping[str, list[dict[str, Any]] | None]
) -> None:
    """`GET /api/jobs/{id}/deliveries` as the server answers it (None: a 404, a server without
    the route); a job not named has none."""

    async def answer(route: Route) -> None:
        job_id = route.request.url.split("/api/jobs/")[1].removesuffix("/deliveries")
        listed = deliveries.get(job_id, [])
        if listed is None:
            error = {"error": {"code": "not_found", "message": "Not Found"}}
            await route.fulfill(status=404, json=error)
        else:
            await route.fulfill(json={"deliveries": listed})

    await page.route("**/api/jobs/*/deliveries", answer)


def rows(page: Page, section: str) -> Any:
    return page.locator(f"#{section} tbody tr")


def cell(page: Page, section: str, job_id: str, name: str) -> Any:
    return page.locator(f'#{section} tr[data-job-id="{job_id}"] [data-field="{name}"]')


async def row_ids(page: Page, section: str) -> list[str]:
    return list(
        await rows(page, section).evaluate_all("rows => rows.map(row => row.dataset.jobId)")
    )


async def test_a_jobs_page_links_its_dependencies_and_dependents(
    fake_client: TestClient[Any, Any], fake: FakeJobManager, browser: Browser
) -> None:
    prep = await submit(fake_client, entrypoint="prepare")
    unrelated = await submit(fake_client, entrypoint="other")
    train = await submit(fake_client, entrypoint="train", depends_on=[{"submission_id": prep}])
    cleanup = await submit(
        fake_client,
        entrypoint="cleanup",
        depends_on=[{"submission_id": prep, "condition": "failed"}],
    )
    report = await submit(
        fake_client,
        entrypoint="report",
        depends_on=[
            {"submission_id": train, "condition": "ended"},
            {"submission_id": unrelated, "condition": "succeeded"},
        ],
    )
    fake.start(prep)
    fake.finish(prep)

    watch = await open_page(browser, fake_client)
    page = watch.page
    await serve_met(page, {(train, prep): True, (report, train): False, (report, unrelated): False})
    await serve_deliveries(page, {prep: DELIVERIES})

    await page.goto(str(fake_client.make_url(f"/#/jobs/{report}")))
    await expect(rows(page, "dependencies")).to_have_count(2)
    assert await row_ids(page, "dependencies") == [train, unrelated]  # in the job's order
    await expect(cell(page, "dependencies", train, "condition")).to_have_text("ended")
    await expect(cell(page, "dependencies", train, "status")).to_have_text("PENDING")
    await expect(cell(page, "dependencies", train, "met")).to_have_text("not yet")
    await expect(cell(page, "dependencies", unrelated, "condition")).to_have_text("succeeded")
    await expect(page.locator("#dependencies-summary")).to_have_text("0 of 2 met")
    await expect(page.locator("#dependents")).to_be_hidden()  # nothing depends on report
    await expect(page.locator("#deliveries")).to_be_hidden()  # and it has no deliveries

    # A dependency's link opens its page, which lists the jobs that depend on it.
    await page.locator("#dependencies").get_by_role("link", name=train).click()
    await expect(rows(page, "dependencies")).to_have_count(1)
    await expect(cell(page, "dependencies", prep, "status")).to_have_text("SUCCEEDED")
    await expect(cell(page, "dependencies", prep, "met")).to_have_text("met")
    await expect(page.locator("#dependencies-summary")).to_have_text("1 of 1 met")
    await expect(rows(page, "dependents")).to_have_count(1)
    await expect(cell(page, "dependents", report, "condition")).to_have_text("ended")
    await expect(cell(page, "dependents", report, "status")).to_have_text("PENDING")

    await page.locator("#dependencies").get_by_role("link", name=prep).click()
    await expect(rows(page, "dependents")).to_have_count(2)
    assert await row_ids(page, "dependents") == [train, cleanup]  # not unrelated, nor report
    await expect(cell(page, "dependents", train, "condition")).to_have_text("succeeded")
    await expect(cell(page, "dependents", cleanup, "condition")).to_have_text("failed")
    await expect(page.locator("#dependencies")).to_be_hidden()  # prep waits for nothing

    # Its webhook deliveries, each with its state, attempts, last status and last error (text).
    deliveries = page.locator("#deliveries tbody tr")
    await expect(deliveries).to_have_count(2)
    first, second = deliveries.nth(0), deliveries.nth(1)
    await expect(first.locator('[data-field="event"]')).to_have_text("job.started")
    await expect(first.locator('[data-field="state"]')).to_have_text("delivered")
    await expect(first.locator('[data-field="attempts"]')).to_have_text("2")
    await expect(first.locator('[data-field="last-status"]')).to_have_text("200")
    await expect(first.locator('[data-field="last-error"]')).to_have_text("")
    await expect(second.locator('[data-field="url"]')).to_have_text(
        "https://hooks.example.com/<b>jobs</b>"
    )
    await expect(second.locator('[data-field="state"]')).to_have_text("pending")
    await expect(second.locator('[data-field="attempts"]')).to_have_text("3")
    await expect(second.locator('[data-field="last-status"]')).to_have_text("503")
    await expect(second.locator('[data-field="last-error"]')).to_have_text(
        "<img src=x onerror=alert(1)> answered 503"
    )
    await expect(second.locator('[data-field="next-attempt"]')).not_to_have_text("")
    await expect(page.locator("#deliveries img, #deliveries b")).to_have_count(0)

    # A dependent that can never run (prep succeeded; cleanup waited for it to fail).
    fake._update(
        cleanup,
        status=JobStatus.FAILED,
        error_type=JobErrorType.DEPENDENCY_NEVER_SATISFIED,
        message=f"Job {prep}, which this job depends on (failed), ended SUCCEEDED.",
    )
    await page.locator("#dependents").get_by_role("link", name=cleanup).click()
    failure = page.locator("#dependency-failure")
    await expect(failure).to_have_text(
        f"This job never ran: it was to run after {prep} failed, but {prep} ended SUCCEEDED."
    )
    await expect(cell(page, "dependencies", prep, "met")).to_have_text("never")
    await expect(page.locator('#job-details [data-field="status"]')).to_have_text("FAILED")
    watch.assert_clean()


async def test_a_deleted_dependency_and_a_server_without_deliveries(
    fake_client: TestClient[Any, Any], fake: FakeJobManager, browser: Browser
) -> None:
    prep = await submit(fake_client, entrypoint="prepare")
    train = await submit(fake_client, entrypoint="train", depends_on=[{"submission_id": prep}])
    fake.start(prep)
    fake.finish(prep, exit_code=1)
    fake._update(
        train,
        status=JobStatus.FAILED,
        error_type=JobErrorType.DEPENDENCY_NEVER_SATISFIED,
        message=f"Job {prep}, which this job depends on (succeeded), was deleted.",
    )
    await fake.delete_job(prep)

    watch = await open_page(browser, fake_client)
    page = watch.page
    await serve_deliveries(page, {train: None})
    await page.goto(str(fake_client.make_url(f"/#/jobs/{train}")))
    await expect(page.locator("#dependency-failure")).to_have_text(
        f"This job never ran: it was to run after {prep} succeeded, but {prep} was deleted."
    )
    await expect(cell(page, "dependencies", prep, "status")).to_have_text("deleted")
    # The dependency's link is still there (its page says it does not exist).
    link = page.locator("#dependencies").get_by_role("link", name=prep)
    assert await link.get_attribute("href") == f"#/jobs/{prep}"
    await expect(page.locator("#deliveries")).to_be_hidden()
    await expect(page.locator('#job-details [data-field="status"]')).to_have_text("FAILED")
    # The browser says so of the 404s it was given (the deleted job's, the missing route's).
    watch.assert_clean(allowed_console=re.compile(r"status of 404"))


async def test_a_dependency_deleted_after_it_held_stays_met(
    fake_client: TestClient[Any, Any], fake: FakeJobManager, browser: Browser
) -> None:
    held = await submit(fake_client, entrypoint="prepare")
    other = await submit(fake_client, entrypoint="train")
    child = await submit(
        fake_client,
        entrypoint="report",
        depends_on=[{"submission_id": held}, {"submission_id": other}],
    )
    fake.start(held)
    fake.finish(held)
    await fake.delete_job(held)  # its condition held first: the server keeps it met

    watch = await open_page(browser, fake_client)
    page = watch.page
    await serve_met(page, {(child, held): True, (child, other): False})
    await page.goto(str(fake_client.make_url(f"/#/jobs/{child}")))
    await expect(cell(page, "dependencies", held, "status")).to_have_text("deleted")
    await expect(cell(page, "dependencies", held, "met")).to_have_text("met")
    await expect(cell(page, "dependencies", other, "met")).to_have_text("not yet")
    await expect(page.locator("#dependencies-summary")).to_have_text("1 of 2 met")
    await expect(page.locator("#dependency-failure")).to_be_empty()
    watch.assert_clean(allowed_console=re.compile(r"status of 404"))


async def test_a_real_chains_pages(client: TestClient[Any, Any], browser: Browser) -> None:
    """End to end on real Ray: the server decides `met` and runs the child after its parent."""
    parent = await submit(client, entrypoint="echo parent")
    child = await submit(client, entrypoint="echo child", depends_on=[{"submission_id": parent}])
    never = await submit(
        client,
        entrypoint="echo never",
        depends_on=[{"submission_id": parent, "condition": "failed"}],
    )
    assert (await wait_for_status(client, child))["status"] == "SUCCEEDED"
    assert (await wait_for_status(client, never))["status"] == "FAILED"

    watch = await open_page(browser, client, f"/#/jobs/{child}")
    page = watch.page
    await expect(cell(page, "dependencies", parent, "met")).to_have_text("met")
    await expect(cell(page, "dependencies", parent, "status")).to_have_text("SUCCEEDED")
    await expect(page.locator("#dependencies-summary")).to_have_text("1 of 1 met")
    await expect(page.locator("#dependency-failure")).to_be_empty()

    await page.locator("#dependencies").get_by_role("link", name=parent).click()
    await expect(rows(page, "dependents")).to_have_count(2)
    assert await row_ids(page, "dependents") == [child, never]
    await expect(cell(page, "dependents", child, "status")).to_have_text("SUCCEEDED")
    await expect(cell(page, "dependents", never, "condition")).to_have_text("failed")

    await page.locator("#dependents").get_by_role("link", name=never).click()
    await expect(page.locator("#dependency-failure")).to_have_text(
        f"This job never ran: it was to run after {parent} failed, but {parent} ended SUCCEEDED."
    )
    await expect(cell(page, "dependencies", parent, "met")).to_have_text("never")
    # No webhooks: no deliveries (or, before the route was served, a 404), the section hidden.
    await expect(page.locator("#deliveries")).to_be_hidden()
    watch.assert_clean(allowed_console=re.compile(r"status of 404 .*/deliveries"))


async def test_a_real_jobs_webhook_deliveries(
    aiohttp_client: Callable[..., Awaitable[TestClient[Any, Any]]],
    aiohttp_server: Callable[..., Awaitable[TestServer]],
    settings: Settings,
    tmp_path: Path,
    browser: Browser,
) -> None:
    """End to end: a receiver on loopback answers 503, then 204; the job's page shows the one
    delivery, tried twice, delivered."""
    answers = [503]

    async def hook(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(status=answers.pop() if answers else 204)

    receiver = web.Application()
    receiver.router.add_post("/hook", hook)
    receiver_server = await aiohttp_server(receiver)
    secret_file = tmp_path / "webhook-secret"
    secret_file.write_text(
        "whsec_" + base64.b64encode(b"0123456789abcdef0123456789abcdef").decode()
    )
    client = await aiohttp_client(
        create_app(
            settings.model_copy(
                update={
                    "webhook_secret_file": secret_file,
                    "webhook_allow_http": True,
                    "webhook_allow_private": True,
                }
            )
        )
    )
    url = str(receiver_server.make_url("/hook"))
    job_id = await submit(
        client, entrypoint="echo hi", notify=[{"url": url, "events": ["job.succeeded"]}]
    )
    assert (await wait_for_status(client, job_id))["status"] == "SUCCEEDED"

    watch = await open_page(browser, client, f"/#/jobs/{job_id}")
    page = watch.page
    delivery = page.locator("#deliveries tbody tr")
    await expect(delivery.locator('[data-field="state"]')).to_have_text("delivered")
    await expect(delivery).to_have_count(1)
    await expect(delivery.locator('[data-field="event"]')).to_have_text("job.succeeded")
    await expect(delivery.locator('[data-field="url"]')).to_have_text(url)
    await expect(delivery.locator('[data-field="attempts"]')).to_have_text("2")
    await expect(delivery.locator('[data-field="last-status"]')).to_have_text("204")
    await expect(delivery.locator('[data-field="delivered"]')).not_to_be_empty()
    watch.assert_clean()


async def test_the_dependency_a_job_never_ran_for_is_never_even_if_its_id_runs_again(
    fake_client: TestClient[Any, Any], fake: FakeJobManager, browser: Browser
) -> None:
    """The page says what the terminal client says (`jobs-server status`): the dependency a
    job ended DEPENDENCY_NEVER_SATISFIED for is 'never', by the job's own word, though its id
    was submitted again since and runs; one that may still hold is 'not yet'."""
    prep = await submit(fake_client, entrypoint="prepare")
    other = await submit(fake_client, entrypoint="train")
    child = await submit(
        fake_client,
        entrypoint="report",
        depends_on=[{"submission_id": prep}, {"submission_id": other}],
    )
    fake.start(prep)
    fake.finish(prep)
    await fake.delete_job(prep)
    fake._update(
        child,
        status=JobStatus.FAILED,
        error_type=JobErrorType.DEPENDENCY_NEVER_SATISFIED,
        message=f"{prep} was deleted; this job needed it to succeed",
    )
    await submit(fake_client, submission_id=prep, entrypoint="prepare again")

    watch = await open_page(browser, fake_client)
    page = watch.page
    await serve_met(page, {(child, prep): False, (child, other): False})
    await page.goto(str(fake_client.make_url(f"/#/jobs/{child}")))
    await expect(cell(page, "dependencies", prep, "status")).to_have_text("PENDING")
    await expect(cell(page, "dependencies", prep, "met")).to_have_text("never")
    await expect(cell(page, "dependencies", other, "met")).to_have_text("not yet")
    await expect(page.locator("#dependency-failure")).to_have_text(
        f"This job never ran: it was to run after {prep} succeeded, but {prep} was deleted."
    )
    watch.assert_clean()


async def test_a_fan_in_reads_its_dependencies_in_one_request_until_all_are_decided(
    fake_client: TestClient[Any, Any], fake: FakeJobManager, browser: Browser
) -> None:
    """A waiting job's page is read again every 5 s (job.js): its dependencies' statuses come
    in one request each time, not one per dependency, and no more once each has ended."""
    parents = [await submit(fake_client, entrypoint=f"part {i}") for i in range(20)]
    join = await submit(
        fake_client,
        entrypoint="join",
        depends_on=[{"submission_id": parent} for parent in parents],
    )
    watch = await open_page(browser, fake_client)
    page = watch.page
    asked: list[str] = []
    page.on("request", lambda request: asked.append(request.url))

    def reads() -> tuple[int, int]:
        """(requests of one dependency's details, requests of several by id)."""
        one = sum(1 for url in asked if any(url.endswith(f"/api/jobs/{p}") for p in parents))
        several = sum(1 for url in asked if "/api/jobs/?submission_id=" in url)
        return one, several

    await page.goto(str(fake_client.make_url(f"/#/jobs/{join}")))
    await expect(rows(page, "dependencies")).to_have_count(20)
    await expect(cell(page, "dependencies", parents[0], "status")).to_have_text("PENDING")
    assert reads() == (0, 1)
    for parent in parents:
        fake.start(parent)
        fake.finish(parent)
    # The next refresh (5 s) reads them ended; then none is read again.
    await expect(cell(page, "dependencies", parents[-1], "status")).to_have_text(
        "SUCCEEDED", timeout=15_000
    )
    decided = reads()
    refreshes = sum(1 for url in asked if url.endswith(f"/api/jobs/{join}"))
    await page.wait_for_timeout(6_000)
    assert sum(1 for url in asked if url.endswith(f"/api/jobs/{join}")) > refreshes
    assert reads() == decided
    watch.assert_clean()


async def test_dependents_are_shown_when_their_read_is_overtaken(
    fake_client: TestClient[Any, Any], fake: FakeJobManager, browser: Browser
) -> None:
    """An ended job's page reads its details twice at once (its first read, and the log's end):
    the first read of its dependents, overtaken by the second, must not leave them unshown (the
    second, seeing the same status, did not look again)."""
    prep = await submit(fake_client, entrypoint="prepare")
    train = await submit(fake_client, entrypoint="train", depends_on=[{"submission_id": prep}])
    fake.start(prep)
    fake.finish(prep)
    watch = await open_page(browser, fake_client)
    page = watch.page
    await serve_deliveries(page, {})
    held: list[Route] = []

    async def hold_the_first(route: Route) -> None:
        if "submitted_after" in route.request.url and not held:
            held.append(route)  # answered after the log's end has read the job again
            return
        await route.continue_()

    await page.route("**/api/jobs/?*", hold_the_first)
    await page.goto(str(fake_client.make_url(f"/#/jobs/{prep}")))
    await expect(page.locator("#log-state")).to_contain_text("has ended")
    await page.wait_for_timeout(300)  # the log end's read of the job and its related parts
    assert len(held) == 1
    await held[0].continue_()
    await expect(rows(page, "dependents")).to_have_count(1)
    assert await row_ids(page, "dependents") == [train]
