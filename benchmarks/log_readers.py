"""Clients of the log endpoints: the websocket tail (both servers), whole-body GETs, and SSE.

Every reader is bounded by a deadline and a count; none keeps more than one log in memory.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass

import aiohttp

from benchmarks.client import JobsApi
from jobs_server.client.sse import read_events

# A server sends a log in frames of at most tens of KiB; no frame limit on our side.
NO_FRAME_LIMIT = 0
TAIL_CONNECT_RETRY_INTERVAL_S = 0.01
MAX_FRAMES = 10_000_000
MAX_BODY_CHUNKS = 100_000_000


class LogReadError(Exception):
    """A log stream that ended wrongly (no end event, an error frame, the deadline)."""


@dataclass(frozen=True)
class Body:
    """A whole response body and when it came: seconds to its first byte and to its end."""

    data: bytes
    first_byte_s: float
    total_s: float


@dataclass(frozen=True)
class StreamRead:
    """A log read as a stream: how many bytes of log text it held, and how long it took."""

    log_bytes: int
    total_s: float


def logs_path(submission_id: str, suffix: str = "") -> str:
    """The path of a job's log endpoint (`suffix`: "/tail", "/stream")."""
    return f"/api/jobs/{submission_id}/logs{suffix}"


async def fetch_body(api: JobsApi, path: str, *, timeout_s: float) -> Body:
    """GET `path` and read the whole body, timing the first byte and the end."""
    started_s = time.monotonic()
    first_byte_s: float | None = None
    data = bytearray()
    async with api.session.get(
        api.url(path), timeout=aiohttp.ClientTimeout(total=timeout_s)
    ) as response:
        if response.status >= 400:
            text = await response.text()
            raise LogReadError(f"GET {path} -> {response.status}: {text[:300]!r}")
        for _ in range(MAX_BODY_CHUNKS):
            chunk = await response.content.readany()
            if not chunk:
                break
            if first_byte_s is None:
                first_byte_s = time.monotonic() - started_s
            data += chunk
    total_s = time.monotonic() - started_s
    return Body(bytes(data), total_s if first_byte_s is None else first_byte_s, total_s)


def ray_json_log(body: bytes) -> str:
    """The log in a `{"logs": "..."}` body."""
    return str(json.loads(body)["logs"])


async def connect_tail(
    api: JobsApi, submission_id: str, *, timeout_s: float
) -> aiohttp.ClientWebSocketResponse:
    """Open the websocket tail; retry while the server does not know the job yet (404)."""
    deadline_s = time.monotonic() + timeout_s
    url = api.url(logs_path(submission_id, "/tail"))
    for _ in range(int(timeout_s / TAIL_CONNECT_RETRY_INTERVAL_S) + 1):
        try:
            return await api.session.ws_connect(url, max_msg_size=NO_FRAME_LIMIT)
        except aiohttp.WSServerHandshakeError as error:
            if error.status != 404 or time.monotonic() > deadline_s:
                raise
        await asyncio.sleep(TAIL_CONNECT_RETRY_INTERVAL_S)
    raise TimeoutError(f"websocket tail of {submission_id} still 404 after {timeout_s:.0f} s")


async def tail_frames(
    websocket: aiohttp.ClientWebSocketResponse, *, deadline_s: float
) -> AsyncGenerator[str, None]:
    """The text frames until the server closes; TimeoutError at `deadline_s` (monotonic)."""
    for _ in range(MAX_FRAMES):
        remaining_s = deadline_s - time.monotonic()
        if remaining_s <= 0:
            raise TimeoutError("websocket tail still open at the deadline")
        message = await websocket.receive(timeout=remaining_s)
        if message.type is aiohttp.WSMsgType.TEXT:
            yield str(message.data)
        elif message.type in (
            aiohttp.WSMsgType.CLOSE,
            aiohttp.WSMsgType.CLOSING,
            aiohttp.WSMsgType.CLOSED,
        ):
            return
        elif message.type is aiohttp.WSMsgType.ERROR:
            raise LogReadError(f"websocket error: {websocket.exception()!r}")
    raise LogReadError(f"websocket tail sent more than {MAX_FRAMES} frames")


async def read_whole_tail(api: JobsApi, submission_id: str, *, timeout_s: float) -> StreamRead:
    """The websocket tail of a finished job, from connecting until the server closes."""
    started_s = time.monotonic()
    log_bytes = 0
    websocket = await connect_tail(api, submission_id, timeout_s=timeout_s)
    async with websocket:
        async for text in tail_frames(websocket, deadline_s=started_s + timeout_s):
            log_bytes += len(text.encode())
    return StreamRead(log_bytes, time.monotonic() - started_s)


async def read_sse_log(api: JobsApi, submission_id: str, *, timeout_s: float) -> StreamRead:
    """Our Server-Sent Events stream until its `end` event; counts the bytes of log text (each
    event's data is a JSON string of log text), with the terminal client's parser."""
    started_s = time.monotonic()
    log_bytes = 0
    ended = False
    path = logs_path(submission_id, "/stream")
    async with api.session.get(
        api.url(path), timeout=aiohttp.ClientTimeout(total=timeout_s)
    ) as response:
        if response.status >= 400:
            text = await response.text()
            raise LogReadError(f"GET {path} -> {response.status}: {text[:300]!r}")
        async for event in read_events(_body_chunks(response)):
            if event.event == "end":
                ended = True
                break
            log_bytes += len(json.loads(event.data).encode())
    if not ended:
        raise LogReadError(f"SSE stream of {submission_id} closed without an `end` event")
    return StreamRead(log_bytes, time.monotonic() - started_s)


async def _body_chunks(response: aiohttp.ClientResponse) -> AsyncGenerator[bytes, None]:
    """The chunks of a body as they come, at most `MAX_BODY_CHUNKS`."""
    for _ in range(MAX_BODY_CHUNKS):
        chunk = await response.content.readany()
        if not chunk:
            return
        yield chunk
