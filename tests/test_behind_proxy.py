"""The web page behind a real TLS-terminating proxy (Debian's nginx) on loopback, in Chromium.

The browser's origin is `https://localhost:<proxy port>`; the server sees plain HTTP from the
proxy. It acts for the page only when it believes the proxy (`--forwarded-allow-ips`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestClient
from playwright.async_api import Browser, expect

from jobs_server.app import create_app
from jobs_server.settings import Settings
from tests.support.processes import free_port, stop_process_group
from tests.support.servers import self_signed_certificate
from tests.support.web_page import UI_TIMEOUT_MS

STATUS_FIELD = '[data-field="status"]'

NGINX_CONF = """
daemon off;
worker_processes 1;
pid {dir}/nginx.pid;
error_log {dir}/error.log info;
{user}
events {{ worker_connections 64; }}
http {{
    access_log {dir}/access.log;
    client_body_temp_path {dir}/body;
    proxy_temp_path {dir}/proxy;
    fastcgi_temp_path {dir}/fastcgi;
    uwsgi_temp_path {dir}/uwsgi;
    scgi_temp_path {dir}/scgi;
    server {{
        listen 127.0.0.1:{port} ssl;
        ssl_certificate {dir}/cert.pem;
        ssl_certificate_key {dir}/key.pem;
        location / {{
            proxy_pass http://127.0.0.1:{upstream};
            proxy_http_version 1.1;
            proxy_buffering off;
            proxy_set_header Host 127.0.0.1:{upstream};
            proxy_set_header X-Forwarded-Proto $scheme;
            proxy_set_header X-Forwarded-Host $http_host;
            proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;
            proxy_set_header Upgrade $http_upgrade;
            proxy_set_header Connection $connection_upgrade;
        }}
    }}
    map $http_upgrade $connection_upgrade {{ default upgrade; '' ''; }}
}}
"""


@dataclass
class Proxy:
    url: str
    process: subprocess.Popen[bytes]

    def session(self) -> aiohttp.ClientSession:
        """A client of the proxy (its certificate is self-signed)."""
        return aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=False))


def _start_nginx(directory: Path, upstream_port: int) -> Proxy:
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    assert Path(nginx).exists(), "install Debian's nginx: apt-get install -y nginx"
    directory.mkdir(parents=True, exist_ok=True)
    self_signed_certificate(directory / "cert.pem", directory / "key.pem", name="DNS:localhost")
    port = free_port()
    # As root, nginx's workers would become `nobody`, who cannot enter the test's directory.
    user = "user root;" if os.geteuid() == 0 else ""
    conf = directory / "nginx.conf"
    conf.write_text(NGINX_CONF.format(dir=directory, port=port, upstream=upstream_port, user=user))
    process = subprocess.Popen(
        [nginx, "-e", str(directory / "error.log"), "-p", str(directory), "-c", str(conf)],
        start_new_session=True,
    )
    return Proxy(f"https://localhost:{port}", process)


@contextlib.asynccontextmanager
async def tls_proxy(directory: Path, upstream_port: int) -> AsyncIterator[Proxy]:
    """nginx terminating TLS on a loopback port, in front of `upstream_port` (a server on this
    test's event loop: everything here waits without blocking it)."""
    proxy = await asyncio.to_thread(_start_nginx, directory, upstream_port)
    process = proxy.process
    try:
        deadline = time.monotonic() + 30
        while True:
            assert process.poll() is None, (directory / "error.log").read_text()
            try:
                async with proxy.session() as session, session.get(f"{proxy.url}/api/healthz"):
                    break
            except aiohttp.ClientConnectionError:
                assert time.monotonic() < deadline, "nginx did not answer within 30 s"
                await asyncio.sleep(0.1)
        yield proxy
    finally:
        stop_process_group(process)


@pytest.fixture
async def proxied_page_server(
    aiohttp_client: Callable[..., Awaitable[TestClient[Any, Any]]],
    settings: Settings,
    tmp_path: Path,
) -> AsyncIterator[tuple[TestClient[Any, Any], Proxy]]:
    trusting = settings.model_copy(update={"forwarded_allow_ips": ["127.0.0.1"]})
    client = await aiohttp_client(create_app(trusting))
    async with tls_proxy(tmp_path / "nginx", client.server.port) as proxy:
        yield client, proxy


async def test_the_page_submits_stops_and_deletes_behind_a_tls_proxy(
    proxied_page_server: tuple[TestClient[Any, Any], Proxy], browser: Browser
) -> None:
    client, proxy = proxied_page_server
    context = await browser.new_context(ignore_https_errors=True)
    page = await context.new_page()
    page.set_default_timeout(UI_TIMEOUT_MS)
    await page.goto(f"{proxy.url}/#/submit")
    await page.get_by_label("Entrypoint").fill("echo behind-the-proxy; sleep 300")
    await page.get_by_role("button", name="Submit job").click()
    await page.wait_for_url(re.compile(r"#/jobs/"))
    job_id = page.url.rsplit("/", 1)[1]
    await expect(page.locator("#job-log")).to_contain_text("behind-the-proxy")
    await expect(page.locator(STATUS_FIELD)).to_have_text("RUNNING")

    await page.get_by_role("button", name="Stop", exact=True).click()
    await page.get_by_role("button", name="Stop job").click()
    await expect(page.locator(STATUS_FIELD)).to_have_text("STOPPED")
    await page.get_by_role("button", name="Delete", exact=True).click()
    await page.get_by_role("button", name="Delete job").click()
    await page.wait_for_url(re.compile(r"#/$"))
    assert (await client.get(f"/api/jobs/{job_id}")).status == 404
    await context.close()


async def test_a_page_on_another_site_cannot_act_through_the_proxy(
    proxied_page_server: tuple[TestClient[Any, Any], Proxy],
) -> None:
    """The proxy is believed about the scheme and name, not about who the browser is."""
    client, proxy = proxied_page_server
    async with proxy.session() as session:
        cross_site = await session.post(
            f"{proxy.url}/api/jobs/",
            json={"entrypoint": "echo pwned"},
            headers={"Origin": "https://evil.example"},
        )
        assert cross_site.status == 403
        assert (await cross_site.json())["error"]["code"] == "cross_site_request"
        rebound = await session.post(
            f"{proxy.url}/api/jobs/",
            json={"entrypoint": "echo pwned"},
            headers={"Host": "evil.example", "Origin": "https://evil.example"},
        )
        assert rebound.status == 400
        assert (await rebound.json())["error"]["code"] == "host_not_allowed"
    assert await (await client.get("/api/jobs/")).json() == []


async def test_without_trusting_the_proxy_the_page_cannot_submit(
    aiohttp_client: Callable[..., Awaitable[TestClient[Any, Any]]],
    settings: Settings,
    tmp_path: Path,
) -> None:
    """What the page met before --forwarded-allow-ips: its https origin is not the server's."""
    client = await aiohttp_client(create_app(settings))
    async with (
        tls_proxy(tmp_path / "nginx", client.server.port) as proxy,
        proxy.session() as session,
    ):
        response = await session.post(
            f"{proxy.url}/api/jobs/", json={"entrypoint": "true"}, headers={"Origin": proxy.url}
        )
        assert response.status == 403
