"""A client that leaves half-way is not a server error: counted 499, no traceback, nothing stored.

Raw sockets play the client that goes (closing, or resetting as a killed process does). The
server runs as `jobs-server serve` runs it (aiohttp's runner without handler cancellation,
unlike the test client's, which cancels the handler and so hides what a write meets); the HTTP
layer alone decides this, so the app runs on the in-memory fake manager (tests/support/fakes.py).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from aiohttp import ClientSession, web

from jobs_server.app import create_app
from jobs_server.manager.records import JobSpec
from jobs_server.settings import Settings
from tests.support.api import Client
from tests.support.fakes import FakeJobManager

Leave = Callable[[asyncio.StreamWriter], Awaitable[None]]
PACKAGE = "/api/packages/gcs/_ray_pkg_00112233445566778899.zip"


async def _requests_counted(client: ClientSession, route: str) -> dict[str, float]:
    """`jobs_server_http_requests_total` of `route`, by status."""
    text = await (await client.get("/metrics")).text()
    counts: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("jobs_server_http_requests_total{") and f'route="{route}"' in line:
            status = line.split('status="', 1)[1].split('"', 1)[0]
            counts[status] = float(line.rsplit(" ", 1)[1])
    return counts


async def _wait_for_count(client: ClientSession, route: str) -> dict[str, float]:
    deadline = time.monotonic() + 10
    while not (counts := await _requests_counted(client, route)):
        assert time.monotonic() < deadline, f"{route} was never counted"
        await asyncio.sleep(0.05)
    return counts


async def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with a reset (SO_LINGER 0), as a client that was killed."""
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.close()


async def _close(writer: asyncio.StreamWriter) -> None:
    writer.close()


@pytest.fixture
async def served(
    fake_settings: Settings, fake: FakeJobManager, aiohttp_client: Callable[..., Any]
) -> AsyncIterator[tuple[int, Client]]:
    """The app on a loopback port as `jobs-server serve` runs it, and a test client of it."""
    runner = web.AppRunner(create_app(fake_settings, backend=fake.backend()))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        async with ClientSession(f"http://127.0.0.1:{port}") as session:
            yield port, session
    finally:
        await runner.cleanup()


LEAVING = pytest.mark.parametrize("leave", [_close, _reset], ids=["closes", "resets"])


@LEAVING
async def test_a_client_that_leaves_during_an_upload_body_counts_499(
    served: tuple[int, ClientSession],
    fake: FakeJobManager,
    caplog: pytest.LogCaptureFixture,
    leave: Leave,
) -> None:
    port, client = served
    caplog.set_level(logging.DEBUG)
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        f"PUT {PACKAGE} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 1000000\r\n"
        "Content-Type: application/zip\r\n\r\n".encode()
        + b"PK" * 5000
    )
    await writer.drain()
    await asyncio.sleep(0.2)  # the server is reading the body
    await leave(writer)

    assert await _wait_for_count(client, "upload_package") == {"499": 1.0}
    assert fake.packages.kv.values == {}
    errors = [record for record in caplog.records if record.levelno >= logging.ERROR]
    assert errors == [], [record.getMessage() for record in errors]


@LEAVING
async def test_a_client_that_leaves_during_an_unpaginated_list_counts_499(
    served: tuple[int, ClientSession],
    fake: FakeJobManager,
    caplog: pytest.LogCaptureFixture,
    leave: Leave,
) -> None:
    port, client = served
    # A list far larger than the socket buffers: the server is still writing when it is reset.
    for index in range(3000):
        await fake.submit_job(
            JobSpec(
                entrypoint="echo " + "x" * 2000,
                submission_id=f"job-{index:05}",
                metadata={},
                runtime_env={},
            )
        )
    caplog.set_level(logging.DEBUG)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /api/jobs/ HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    await writer.drain()
    assert (await reader.readline()).startswith(b"HTTP/1.1 200")
    await reader.readexactly(64 * 1024)  # the list has begun
    await leave(writer)

    assert await _wait_for_count(client, "list_jobs") == {"499": 1.0}
    errors = [record for record in caplog.records if record.levelno >= logging.ERROR]
    assert errors == [], [record.getMessage() for record in errors]
