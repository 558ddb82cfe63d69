"""What each job used (issue 35) on the web page, in Debian's Chromium: a job's limits, its
peak memory and CPU time and each attempt's, and the job list sorted by them. On the fake
manager, whose jobs end with the measurements the test gives them; one real job end to end."""

from __future__ import annotations

import re
from typing import Any

from aiohttp.test_utils import TestClient
from playwright.async_api import Browser, Page, expect

from tests.support.accounting import GIBIBYTE, MEBIBYTE, finish_measured, measured_attempt
from tests.support.api import submit, wait_for_status
from tests.support.fakes import FakeJobManager
from tests.support.web_page import open_page

LIMITS = {"memory_bytes": GIBIBYTE, "cpu_cores": 0.5, "max_processes": 64}


def field(page: Page, name: str) -> Any:
    return page.locator(f'#job-details [data-field="{name}"]')


async def shown_order(page: Page) -> list[str]:
    return list(
        await page.locator("tbody tr").evaluate_all("rows => rows.map(row => row.dataset.jobId)")
    )


async def test_the_list_sorts_by_use_and_a_job_page_shows_its_limits_and_use(
    fake_client: TestClient[Any, Any], fake: FakeJobManager, browser: Browser
) -> None:
    retried = await submit(fake_client, entrypoint="train", limits=LIMITS, max_retries=1)
    small = await submit(fake_client, entrypoint="echo small")
    running = await submit(fake_client, entrypoint="sleep")
    for job_id in (retried, small, running):
        fake.start(job_id)
    finish_measured(
        fake,
        retried,
        [
            measured_attempt(50 * MEBIBYTE, 0.4, 0.1, 0.0, exit_code=3),
            measured_attempt(3 * GIBIBYTE // 2, 61.25, 0.5, 2.0, log_offset=4),
        ],
    )
    finish_measured(fake, small, [measured_attempt(200 * MEBIBYTE, 0.3, 0.2)])

    watch = await open_page(browser, fake_client)
    page = watch.page
    row = page.locator(f'tr[data-job-id="{retried}"]')
    await expect(row.locator('[data-field="peak-memory"]')).to_have_text("1.5 GiB")
    await expect(row.locator('[data-field="cpu-time"]')).to_have_text("1 min 1.75 s")
    running_row = page.locator(f'tr[data-job-id="{running}"]')
    await expect(running_row.locator('[data-field="peak-memory"]')).to_have_text("")
    assert await shown_order(page) == [retried, small, running]  # the server's order

    peak_memory = page.get_by_role("button", name="Peak memory")
    await peak_memory.click()  # largest first; the unmeasured last
    assert await shown_order(page) == [retried, small, running]
    await expect(page.locator('th[data-sort-column="peak-memory"]')).to_have_attribute(
        "aria-sort", "descending"
    )
    await peak_memory.click()  # smallest first; the unmeasured still last
    assert await shown_order(page) == [small, retried, running]
    await expect(page.locator('th[data-sort-column="peak-memory"]')).to_have_attribute(
        "aria-sort", "ascending"
    )
    # A job that ends takes its place in the order from its event, without a reload.
    finish_measured(fake, running, [measured_attempt(10 * MEBIBYTE, 5.0, 0.0)])
    await expect(running_row.locator('[data-field="peak-memory"]')).to_have_text("10.0 MiB")
    assert await shown_order(page) == [running, small, retried]

    cpu_time = page.get_by_role("button", name="CPU time")
    await cpu_time.click()
    assert await shown_order(page) == [retried, running, small]
    await expect(page.locator("th[aria-sort]")).to_have_count(1)
    await cpu_time.click()
    await cpu_time.click()  # the third click: the server's order again
    assert await shown_order(page) == [retried, small, running]
    await expect(page.locator("th[aria-sort]")).to_have_count(0)

    await page.get_by_role("link", name=retried).click()
    await expect(field(page, "limits")).to_have_text("memory 1.0 GiB, 0.5 CPU cores, 64 processes")
    await expect(field(page, "peak-memory")).to_have_text("1.5 GiB")
    await expect(field(page, "cpu-time")).to_have_text(
        "1 min 1.75 s (user 1 min 1.25 s, system 0.50 s)"
    )
    await expect(field(page, "cpu-throttled")).to_have_text("2.00 s")
    attempts = page.locator("#attempts tbody tr")
    await expect(attempts).to_have_count(2)
    for index, (peak, user, system, throttled) in enumerate(
        (
            ("50.0 MiB", "0.40 s", "0.10 s", "0.00 s"),
            ("1.5 GiB", "1 min 1.25 s", "0.50 s", "2.00 s"),
        )
    ):
        cells = attempts.nth(index)
        await expect(cells.locator('[data-field="peak-memory"]')).to_have_text(peak)
        await expect(cells.locator('[data-field="cpu-user"]')).to_have_text(user)
        await expect(cells.locator('[data-field="cpu-system"]')).to_have_text(system)
        await expect(cells.locator('[data-field="cpu-throttled"]')).to_have_text(throttled)

    # Without limits or a CPU limit's throttling: "none", and no throttled row.
    await page.goto(str(fake_client.make_url(f"/#/jobs/{small}")))
    await expect(field(page, "peak-memory")).to_have_text("200.0 MiB")
    await expect(field(page, "limits")).to_have_text("none")
    await expect(field(page, "cpu-time")).to_have_text("0.50 s (user 0.30 s, system 0.20 s)")
    await expect(field(page, "cpu-throttled")).to_have_count(0)
    watch.assert_clean()


FORMATS = [
    ("formatBytes", None, ""),
    ("formatBytes", 0, "0 B"),
    ("formatBytes", 1023, "1023 B"),
    ("formatBytes", 1024, "1.0 KiB"),
    ("formatBytes", 200 * MEBIBYTE, "200.0 MiB"),
    ("formatBytes", 5 * 1024 * GIBIBYTE, "5.0 TiB"),
    ("formatBytes", 2**62, "4.0 EiB"),
    ("formatCpuSeconds", None, ""),
    ("formatCpuSeconds", 0, "0.00 s"),
    ("formatCpuSeconds", 59.994, "59.99 s"),
    ("formatCpuSeconds", 61.25, "1 min 1.25 s"),
    ("formatCpuSeconds", 3600, "1 h 0 min 0 s"),
    ("formatCpuSeconds", 90061.5, "25 h 1 min 1 s"),
]


async def test_sizes_and_cpu_seconds_read_as_people_read_them(
    fake_client: TestClient[Any, Any], browser: Browser
) -> None:
    watch = await open_page(browser, fake_client)
    shown = await watch.page.evaluate(
        """async (cases) => {
            const dom = await import("/ui/dom.js");
            return cases.map(([name, value]) => dom[name](value));
        }""",
        [[name, value] for name, value, _ in FORMATS],
    )
    assert shown == [text for _, _, text in FORMATS]
    watch.assert_clean()


async def test_a_real_jobs_page_shows_what_it_used(
    client: TestClient[Any, Any], browser: Browser
) -> None:
    """End to end, with the supervisor's measurements (issue 35): a job that touches 50 MiB."""
    job_id = await submit(client, entrypoint="python -c 'block = bytearray(50 << 20)'")
    assert (await wait_for_status(client, job_id))["status"] == "SUCCEEDED"
    watch = await open_page(browser, client, f"/#/jobs/{job_id}")
    page = watch.page
    await expect(field(page, "peak-memory")).to_have_text(re.compile(r"^\d+\.\d MiB$"))
    await expect(field(page, "cpu-time")).to_contain_text("(user ")
    await page.get_by_role("link", name="Jobs", exact=True).click()
    listed = page.locator(f'tr[data-job-id="{job_id}"] [data-field="peak-memory"]')
    await expect(listed).to_contain_text("MiB")
    watch.assert_clean()
