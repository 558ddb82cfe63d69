"""`--shutdown-timeout-s` bounds a shutdown even when a client does not play its part."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from tests.support.api import submit, wait_for_status
from tests.support.servers import wait_for_server
from tests.support.shutdown import EXIT_MARGIN_S, Server

SHUTDOWN_TIMEOUT_S = 5.0
# aiohttp waits this long for a websocket client's close frame unless told otherwise (the
# connection was held this long, past the shutdown timeout).
AIOHTTP_CLOSE_WAIT_S = 10.0


@pytest.fixture
async def timeout_server(ray_connection: str, tmp_path: Path) -> AsyncIterator[Server]:
    server = Server(
        tmp_path,
        [
            "--ray-address",
            ray_connection,
            "--shutdown-timeout-s",
            str(SHUTDOWN_TIMEOUT_S),
        ],
    )
    try:
        await asyncio.to_thread(wait_for_server, server.url, server.process, server.log_path)
        yield server
    finally:
        server.stop()


async def test_a_websocket_client_that_never_answers_the_close_does_not_hold_the_shutdown(
    timeout_server: Server,
) -> None:
    server = timeout_server
    async with aiohttp.ClientSession(server.url) as http:
        job_id = await submit(http, entrypoint="echo ready; sleep 300")
        await wait_for_status(http, job_id, {"RUNNING"})
    # A raw websocket client: it reads, but never sends the close frame back.
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(
        (
            f"GET /api/jobs/{job_id}/logs/tail HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            "Connection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Version: 13\r\n"
            "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n"
        ).encode()
    )
    head = await reader.readuntil(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 101"), head
    assert b"ready" in await asyncio.wait_for(reader.readuntil(b"ready"), 30)

    signalled_s = time.monotonic()
    server.process.send_signal(signal.SIGTERM)
    # The server sends its close frame, waits for the answer at most the shutdown timeout,
    # then drops the connection.
    await asyncio.wait_for(reader.read(), AIOHTTP_CLOSE_WAIT_S + EXIT_MARGIN_S)
    held_s = time.monotonic() - signalled_s
    writer.close()
    assert held_s < SHUTDOWN_TIMEOUT_S, f"the connection was held {held_s:.1f} s"
    code = await asyncio.to_thread(server.process.wait, EXIT_MARGIN_S)
    assert code == 0, server.output()
