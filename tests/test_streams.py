"""Streams after their headers went out: clients that leave, jobs deleted mid-read, HEAD on a
follow; and request headers that are not UTF-8."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
from aiohttp import ClientTimeout, web
from pydantic import SecretStr

from jobs_server.app import create_app
from jobs_server.client.sse import parse_events
from jobs_server.settings import Settings
from tests.support.api import submit, wait_for_status
from tests.support.processes import poll_until

# Among the longest modules: started first when tests run in parallel (tests/conftest.py).
pytestmark = pytest.mark.slow

# Enough that the server is still writing, held back by the client, when the client acts.
BIG_LOG_BYTES = 30_000_000
BIG_LOG_ENTRYPOINT = f"head -c {BIG_LOG_BYTES} /dev/zero | tr '\\0' a"
FOLLOWERS_PER_KIND = 8
WEBSOCKET_HANDSHAKE = (
    "Upgrade: websocket\r\nConnection: Upgrade\r\n"
    "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
)
# Each follower kind: the path after the job's, and extra request headers.
FOLLOWER_KINDS = {
    "text follow": ("/logs?follow=true", ""),
    "sse": ("/logs/stream", ""),
    "websocket": ("/logs/tail", WEBSOCKET_HANDSHAKE),
}


@dataclass(frozen=True)
class Served:
    """The app on a loopback port, and a session with its base URL."""

    http: aiohttp.ClientSession
    port: int


@pytest.fixture
async def served(request: pytest.FixtureRequest, settings: Settings) -> AsyncIterator[Served]:
    """The app served as `jobs-server serve` serves it (a client that leaves does not cancel
    its handler), or, with the parameter True, as aiohttp's test server does (it does)."""
    runner = web.AppRunner(
        create_app(settings), handler_cancellation=getattr(request, "param", False)
    )
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    port = int(runner.addresses[0][1])
    try:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as http:
            yield Served(http, port)
    finally:
        await runner.cleanup()


LEAVING_MODES = pytest.mark.parametrize(
    "served", [False, True], ids=["as-served", "handler-cancellation"], indirect=True
)


@dataclass(frozen=True)
class RawRequest:
    """A request on a connection of its own, so that a test can read part of the answer and
    then hang up, as a client that leaves does."""

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter

    async def read_until(self, marker: bytes, timeout_s: float = 60) -> None:
        seen = b""
        async with asyncio.timeout(timeout_s):
            while marker not in seen:
                data = await self.reader.read(65536)
                assert data, f"connection closed before {marker!r}: {seen[-500:]!r}"
                seen = seen[-1000:] + data

    def hang_up(self) -> None:
        self.writer.close()


async def open_raw(served: Served, path: str, extra_headers: str = "") -> RawRequest:
    reader, writer = await asyncio.open_connection("127.0.0.1", served.port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{extra_headers}\r\n".encode())
    await writer.drain()
    return RawRequest(reader, writer)


def server_errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        f"{record.name}: {record.getMessage()}"
        for record in caplog.records
        if record.levelno >= logging.ERROR and record.name.startswith(("jobs_server", "aiohttp"))
    ]


async def counted_500s(http: aiohttp.ClientSession) -> list[str]:
    metrics = await (await http.get("/metrics")).text()
    return [
        line
        for line in metrics.splitlines()
        if line.startswith("jobs_server_http_requests_total") and 'status="500"' in line
    ]


def open_files() -> list[str]:
    """What this process's file descriptors point at (the app runs in it)."""
    names = []
    for fd in os.listdir("/proc/self/fd"):
        # Closed meanwhile: the listing's own descriptor, for one.
        with contextlib.suppress(FileNotFoundError):
            names.append(os.readlink(f"/proc/self/fd/{fd}"))
    return names


@LEAVING_MODES
async def test_clients_that_leave_mid_stream_are_not_errors(
    served: Served, settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    client = served.http
    caplog.set_level(logging.INFO)
    big = await submit(client, entrypoint=BIG_LOG_ENTRYPOINT)
    await wait_for_status(client, big)
    # It writes until it is stopped: the server's writes after the clients left are what count.
    busy = await submit(
        client, entrypoint="i=0; while true; do i=$((i+1)); echo line $i; sleep 0.05; done"
    )
    await wait_for_status(client, busy, {"RUNNING"})
    followers = [
        await open_raw(served, f"/api/jobs/{busy}{path}", headers)
        for path, headers in FOLLOWER_KINDS.values()
        for _ in range(FOLLOWERS_PER_KIND)
    ]
    downloads = [await open_raw(served, f"/api/jobs/{big}/logs") for _ in range(FOLLOWERS_PER_KIND)]
    for follower in followers:
        await follower.read_until(b"line ")
    for download in downloads:
        await download.read_until(b"aaaa")
    # They leave while the job still writes: the server's next writes find them gone.
    for request in [*followers, *downloads]:
        request.hang_up()
    busy_log = settings.log_dir / f"job-driver-{busy}.log"
    left_at = busy_log.stat().st_size
    # Some 20 lines more, each one a write to followers that are gone.
    await poll_until(lambda: busy_log.stat().st_size > left_at + 200, 30, "the job's next lines")
    response = await client.post(f"/api/jobs/{busy}/stop")
    assert response.status == 200, await response.text()
    await wait_for_status(client, busy)
    log_paths = {str(settings.log_dir / f"job-driver-{job}.log") for job in (busy, big)}
    await poll_until(lambda: not log_paths & set(open_files()), 10, "the log files to be closed")
    assert server_errors(caplog) == []
    assert await counted_500s(client) == []


@LEAVING_MODES
async def test_followers_that_leave_release_their_file_and_task_at_once(
    served: Served, settings: Settings
) -> None:
    client = served.http
    job_id = await submit(client, entrypoint="echo ready; sleep 300")
    await wait_for_status(client, job_id, {"RUNNING"})
    log_path = str(settings.log_dir / f"job-driver-{job_id}.log")
    files_before, tasks_before = len(open_files()), len(asyncio.all_tasks())
    followers = [
        await open_raw(served, f"/api/jobs/{job_id}{path}", headers)
        for path, headers in FOLLOWER_KINDS.values()
        for _ in range(FOLLOWERS_PER_KIND)
    ]
    for follower in followers:
        await follower.read_until(b"ready")
    assert open_files().count(log_path) == len(followers)
    for follower in followers:
        follower.hang_up()
    # An idle follower notices within a tick (0.5 s), long before the 15 s heartbeat.
    await poll_until(
        lambda: (
            log_path not in open_files()
            and len(open_files()) <= files_before
            and len(asyncio.all_tasks()) <= tasks_before
        ),
        5,
        "the followers' files and tasks to be released",
    )
    await client.post(f"/api/jobs/{job_id}/stop", json={})


async def test_a_job_deleted_during_a_range_read_ends_it_cleanly(served: Served) -> None:
    client = served.http
    job_id = await submit(client, entrypoint=BIG_LOG_ENTRYPOINT)
    await wait_for_status(client, job_id)
    async with client.get(f"/api/jobs/{job_id}/logs", params={"offset": 0}) as response:
        assert response.status == 200
        first = await response.content.readexactly(65536)
        await asyncio.sleep(0.5)  # the server fills the socket's buffers, then waits
        assert (await client.delete(f"/api/jobs/{job_id}")).status == 200
        body = json.loads(first + await response.read())
    assert body == {
        "offset": 0,
        "logs": "a" * BIG_LOG_BYTES,
        "next_offset": BIG_LOG_BYTES,
        "size": BIG_LOG_BYTES,
    }
    assert (await client.get(f"/api/jobs/{job_id}/logs")).status == 404


async def test_a_job_deleted_during_an_sse_read_ends_it_cleanly(served: Served) -> None:
    client = served.http
    job_id = await submit(client, entrypoint=BIG_LOG_ENTRYPOINT)
    await wait_for_status(client, job_id)
    async with client.get(f"/api/jobs/{job_id}/logs/stream") as response:
        assert response.status == 200
        first = await response.content.readexactly(65536)
        await asyncio.sleep(0.5)
        assert (await client.delete(f"/api/jobs/{job_id}")).status == 200
        raw = (first + await response.read()).decode()
    assert "HTTP/1.1" not in raw
    events = parse_events(raw)
    assert "".join(json.loads(event.data) for event in events) == "a" * BIG_LOG_BYTES
    # The job is gone: there is no status to end with; a reconnect gets its 404.
    assert all(event.event == "message" for event in events)


async def test_head_on_a_follow_answers_at_once(served: Served) -> None:
    client = served.http
    job_id = await submit(client, entrypoint="echo ready; sleep 300")
    await wait_for_status(client, job_id, {"RUNNING"})
    timeout = ClientTimeout(total=30)  # the job runs for 300 s: this must not wait for it
    for path in ("/logs?follow=true", "/logs", "/logs?format=text", "/logs?offset=1"):
        response = await client.head(f"/api/jobs/{job_id}{path}", timeout=timeout)
        assert response.status == 200, path
        assert await response.read() == b""
    # The connection is still good for the next request: no body was written into it.
    assert (await client.get(f"/api/jobs/{job_id}")).status == 200
    await client.post(f"/api/jobs/{job_id}/stop", json={})


TOKEN = "s3cret-token-for-tests"


@pytest.mark.parametrize(
    "header",
    [
        b"Authorization: Bearer \xff\xfe\xfd",
        b"Authorization: \xc3",
        b"X-Ray-Authorization: Bearer s3cret-token-for-tests\xff",
    ],
)
async def test_a_token_header_that_is_not_utf8_is_refused(
    aiohttp_client: Any, settings: Settings, caplog: pytest.LogCaptureFixture, header: bytes
) -> None:
    secured = settings.model_copy(update={"auth_token": SecretStr(TOKEN)})
    client = await aiohttp_client(create_app(secured))
    reader, writer = await asyncio.open_connection("127.0.0.1", client.port)
    writer.write(
        b"GET /api/jobs/ HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n%s\r\n\r\n" % header
    )
    response = await reader.read()
    writer.close()
    head, _, body = response.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 403 "), response
    assert json.loads(body)["error"]["code"] == "forbidden"
    assert server_errors(caplog) == []
