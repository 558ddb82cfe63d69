"""Job logs, every form framed from the manager's one chunk iterator.

- `GET .../logs`: Ray's `{"logs": ...}` (streamed), a byte range as JSON (`?offset=&limit=`),
  plain text (`?format=text` or `Accept: text/plain`, with `Range: bytes=` and 206), and
  `?follow=true` plain text that grows with the log until the job ends.
- `GET .../logs/tail`: Ray's websocket tail (`?offset=` too).
- `GET .../logs/stream`: Server-Sent Events; each event's id is the byte offset after it, so a
  reconnect with `Last-Event-ID` resumes exactly.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncGenerator
from typing import Annotated, Literal, TypeVar

from aiohttp import WSMsgType, web
from aiohttp_sse import EventSourceResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from jobs_server.errors import InvalidRequestError
from jobs_server.keys import JOB_MANAGER_KEY
from jobs_server.manager import LogChunk
from jobs_server.manager.logs import complete_utf8_length
from jobs_server.request_body import describe_validation_error

logger = logging.getLogger(__name__)

QueryT = TypeVar("QueryT", bound=BaseModel)


class LogQuery(BaseModel):
    """Query parameters of `GET .../logs` (extensions; Ray's clients send none)."""

    model_config = ConfigDict(extra="forbid")

    offset: Annotated[int, Field(ge=0)] | None = None
    limit: Annotated[int, Field(gt=0)] | None = None
    format: Literal["json", "text"] | None = None
    follow: bool = False


class LogStreamQuery(BaseModel):
    """Query parameters of the websocket tail and the SSE stream."""

    model_config = ConfigDict(extra="forbid")

    offset: Annotated[int, Field(ge=0)] = 0


routes = web.RouteTableDef()

# Keeps idle streams alive through proxies and notices clients that went away.
HEARTBEAT_S = 15.0
# How often an idle follower checks that its client is still there.
CLIENT_CHECK_S = 1.0
TEXT_CONTENT_TYPE = "text/plain; charset=utf-8"


@routes.get("/api/jobs/{job_id}/logs", name="get_job_logs")
async def get_job_logs(request: web.Request) -> web.StreamResponse:
    query = _parse_query(request, LogQuery)
    as_text = query.format == "text" or (query.format is None and _prefers_text(request))
    if query.follow and query.format == "json":
        raise InvalidRequestError("follow: a followed log is plain text; drop format=json.")
    if query.follow or as_text:
        return await _text_logs(request, query)
    if query.offset is None and query.limit is None:
        return await _ray_json_logs(request)
    return await _json_log_range(request, query)


async def _ray_json_logs(request: web.Request) -> web.StreamResponse:
    """Ray's `{"logs": "..."}`, written piece by piece: constant memory for any log size."""
    chunks = await request.app[JOB_MANAGER_KEY].read_logs(request.match_info["job_id"])
    response = web.StreamResponse(headers={"Content-Type": "application/json; charset=utf-8"})
    await response.prepare(request)
    await response.write(b'{"logs": "')
    async for text, _ in _texts(chunks):
        await response.write(_json_string_body(text))
    await response.write(b'"}')
    await response.write_eof()
    return response


async def _json_log_range(request: web.Request, query: LogQuery) -> web.StreamResponse:
    """A byte range as `{"offset", "logs", "next_offset", "size"}`, streamed like the whole log."""
    manager, job_id = request.app[JOB_MANAGER_KEY], request.match_info["job_id"]
    offset = query.offset or 0
    chunks = await manager.read_logs(job_id, offset=offset, limit=query.limit)
    response = web.StreamResponse(headers={"Content-Type": "application/json; charset=utf-8"})
    await response.prepare(request)
    await response.write(f'{{"offset": {offset}, "logs": "'.encode())
    next_offset = offset
    # A character cut by the limit is left for the next read: next_offset points at it.
    async for text, text_end in _texts(chunks, flush_partial=query.limit is None):
        await response.write(_json_string_body(text))
        next_offset = text_end
    size = await manager.log_size(job_id)
    await response.write(f'", "next_offset": {next_offset}, "size": {size}}}'.encode())
    await response.write_eof()
    return response


async def _text_logs(request: web.Request, query: LogQuery) -> web.StreamResponse:
    """The raw bytes: whole, from an offset, a `Range`, or followed until the job ends."""
    manager, job_id = request.app[JOB_MANAGER_KEY], request.match_info["job_id"]
    offset, limit, status = query.offset or 0, query.limit, 200
    headers = {"Content-Type": TEXT_CONTENT_TYPE, "Accept-Ranges": "bytes"}
    if "Range" in request.headers and not query.follow:
        size = await manager.log_size(job_id)
        offset, end = _byte_range(request, size)
        limit, status = end - offset, 206
        headers["Content-Range"] = f"bytes {offset}-{end - 1}/{size}"
        headers["Content-Length"] = str(limit)
    chunks = await manager.read_logs(
        job_id, offset=offset, limit=limit, follow=query.follow, idle_tick_s=CLIENT_CHECK_S
    )
    response = web.StreamResponse(status=status, headers=headers)
    await response.prepare(request)
    async with contextlib.aclosing(chunks):
        async for chunk in chunks:
            if chunk.data:
                await response.write(chunk.data)
            elif _client_left(request):
                return response
    await response.write_eof()
    return response


def _byte_range(request: web.Request, size: int) -> tuple[int, int]:
    """The requested `[start, end)` of a single-range `Range` header, clamped to the log."""
    try:
        requested = request.http_range
    except ValueError as error:
        raise InvalidRequestError(f"Range: {error}") from error
    start, stop = requested.start, requested.stop
    if start is None:
        start = 0
    elif start < 0:  # a suffix: the last N bytes
        start = max(0, size + start)
    end = size if stop is None else min(stop, size)
    if start >= size or start >= end:
        raise web.HTTPRequestRangeNotSatisfiable(headers={"Content-Range": f"bytes */{size}"})
    return start, end


@routes.get("/api/jobs/{job_id}/logs/tail", name="tail_job_logs")
async def tail_job_logs(request: web.Request) -> web.StreamResponse:
    """Websocket: text frames of the log; closes with 1000 once the job has ended and every
    byte was sent."""
    query = _parse_query(request, LogStreamQuery)
    chunks = await request.app[JOB_MANAGER_KEY].read_logs(
        request.match_info["job_id"], offset=query.offset, follow=True
    )
    websocket = web.WebSocketResponse(heartbeat=HEARTBEAT_S)
    await websocket.prepare(request)
    sender = asyncio.create_task(_send_websocket_log(websocket, chunks))
    try:
        # Reading is how a closed connection is noticed; the client sends nothing else.
        async for message in websocket:
            if message.type is WSMsgType.ERROR:
                break
    finally:
        if not sender.done():
            sender.cancel()
        with contextlib.suppress(asyncio.CancelledError, ConnectionError):
            await sender
    return websocket


async def _send_websocket_log(
    websocket: web.WebSocketResponse, chunks: AsyncGenerator[LogChunk, None]
) -> None:
    try:
        async for text, _ in _texts(chunks):
            if text:
                await websocket.send_str(text)
    except ConnectionError:
        logger.debug("log tail client went away")
        return
    await websocket.close()


@routes.get("/api/jobs/{job_id}/logs/stream", name="stream_job_logs")
async def stream_job_logs(request: web.Request) -> web.StreamResponse:
    """Server-Sent Events: each event's data is a JSON string of log text and its id the byte
    offset after it; `Last-Event-ID` (or `?offset=`) resumes there. A final `end` event carries
    the job's status."""
    manager, job_id = request.app[JOB_MANAGER_KEY], request.match_info["job_id"]
    offset = _parse_query(request, LogStreamQuery).offset
    last_event_id = request.headers.get("Last-Event-ID")
    if last_event_id is not None:
        offset = _parse_query_value("Last-Event-ID", last_event_id)
    chunks = await manager.read_logs(job_id, offset=offset, follow=True, idle_tick_s=CLIENT_CHECK_S)
    response = EventSourceResponse(ping_interval=HEARTBEAT_S)
    await response.prepare(request)
    async with response:
        async for text, next_offset in _texts(chunks):
            if text:
                await response.send(json.dumps(text), id=str(next_offset))
                offset = next_offset
            elif not response.is_connected():
                return response
        job = await manager.get_job(job_id)
        await response.send(
            json.dumps({"status": job.status, "offset": offset}), event="end", id=str(offset)
        )
    return response


async def _texts(
    chunks: AsyncGenerator[LogChunk, None], *, flush_partial: bool = True
) -> AsyncGenerator[tuple[str, int], None]:
    """`(text, offset after it)` of the chunks. A character split across chunks is held back until
    it is whole; invalid bytes become U+FFFD. Idle ticks come through as `("", offset)`.
    """
    held, offset = b"", 0
    async with contextlib.aclosing(chunks):
        async for chunk in chunks:
            if not chunk.data:
                yield "", chunk.offset - len(held)
                continue
            data = held + chunk.data
            cut = complete_utf8_length(data)
            held, offset = data[cut:], chunk.end
            yield data[:cut].decode("utf-8", errors="replace"), offset - len(held)
    if held and flush_partial:
        yield held.decode("utf-8", errors="replace"), offset


def _json_string_body(text: str) -> bytes:
    # json.dumps escapes the text exactly as inside a JSON string; drop its quotes.
    return json.dumps(text)[1:-1].encode()


def _prefers_text(request: web.Request) -> bool:
    accept = request.headers.get("Accept", "")
    return "text/plain" in accept and "application/json" not in accept


def _client_left(request: web.Request) -> bool:
    return request.transport is None or request.transport.is_closing()


def _parse_query(request: web.Request, model: type[QueryT]) -> QueryT:
    try:
        return model.model_validate(dict(request.query))
    except ValidationError as error:
        raise InvalidRequestError(describe_validation_error(error)) from error


def _parse_query_value(name: str, raw: str) -> int:
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise InvalidRequestError(f"{name}: expected a byte offset (an integer >= 0), got {raw!r}")
    return value
