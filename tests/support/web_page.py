"""The web page in a real browser, for the browser tests (tests/test_web_ui*.py): Debian's
Chromium driven by Playwright, and a watch on what a page says that it should not."""

from __future__ import annotations

import re
import shutil
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp.test_utils import TestClient
from playwright.async_api import Browser, ConsoleMessage, Dialog, Page, async_playwright, expect

# Generous: a job starts in about a second, but the machine is shared.
UI_TIMEOUT_MS = 30_000
expect.set_options(timeout=UI_TIMEOUT_MS)


@pytest.fixture
async def browser() -> AsyncIterator[Browser]:
    """Chromium from the distribution (`apt-get install chromium`); Playwright downloads none."""
    executable = shutil.which("chromium")
    assert executable is not None, "install Debian's chromium: apt-get install -y chromium"
    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(executable_path=executable)
        try:
            yield browser
        finally:
            await browser.close()


@dataclass
class PageWatch:
    """What a page said that it should not: console errors, uncaught errors, dialogs."""

    page: Page
    console_errors: list[str] = field(default_factory=list)
    page_errors: list[str] = field(default_factory=list)
    dialogs: list[str] = field(default_factory=list)
    requested_paths: list[str] = field(default_factory=list)

    def assert_clean(self, *, allowed_console: re.Pattern[str] | None = None) -> None:
        unexpected = [
            message
            for message in self.console_errors
            if allowed_console is None or not allowed_console.search(message)
        ]
        assert unexpected == [], f"console errors: {self.console_errors}"
        assert self.page_errors == [], "uncaught errors in the page"
        assert self.dialogs == [], "dialogs the page opened"


async def open_page(browser: Browser, client: TestClient[Any, Any], path: str = "/") -> PageWatch:
    context = await browser.new_context(viewport={"width": 1280, "height": 720})
    page = await context.new_page()
    page.set_default_timeout(UI_TIMEOUT_MS)
    watch = PageWatch(page)

    def on_console(message: ConsoleMessage) -> None:
        if message.type == "error":
            watch.console_errors.append(f"{message.text} ({message.location.get('url')})")

    async def on_dialog(dialog: Dialog) -> None:
        watch.dialogs.append(dialog.message)
        await dialog.dismiss()

    page.on("console", on_console)
    page.on("pageerror", lambda error: watch.page_errors.append(str(error)))
    page.on("dialog", on_dialog)
    page.on("request", lambda request: watch.requested_paths.append(request.url))
    await page.goto(str(client.make_url(path)))
    return watch
