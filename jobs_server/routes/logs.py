"""Job logs, every form framed from the manager's one chunk iterator.

- `GET .../logs`: Ray's `{"logs": ...}` (streamed), a byte range as JSON (`?offset=&limit=`),
  plain text (`?format=text` or `Accept: text/plain`, with `Range: bytes=` and 206), and
  `?follow=true` plain text that grows with the log until the job ends.
- `GET .../logs/tail`: Ray's websocket tail (`?offset=` too).
- `GET .../logs/stream`: Server-Sent Events; each event's id is the byte offset after it, so a
  reconnect with `Last-Event-ID` resumes exactly.

Everything that can fail is checked before the headers go out; after them, `open_stream` ends a
stream cleanly when the client leaves, the job is deleted, the server shuts down or the key is
revoked.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncGenerator
from typing import Annotated, Literal, TypeVar

from aiohttp import web
from aiohttp_sse import EventSourceResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from jobs_server.app_state import JOB_MANAGER_KEY, PRINCIPAL_KEY, SETTINGS_KEY
from jobs_server.errors import InvalidRequestError
from jobs_server.manager import LogChunk
from jobs_server.manager.logs import complete_utf8_length
from jobs_server.serving.request_body import describe_validation_error
from jobs_server.serving.streams import (
    CLIENT_CHECK_S,
    REVOKED_EVENT,
    follower_should_stop,
    open_stream,
)

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
# The longest a websocket waits for the client's answer to its close frame (a client that
# answers does so within a round trip); at most --shutdown-timeout-s.
WEBSOCKET_CLOSE_WAIT_S = 2.0
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
    chunks = await request.app[JOB_MANAGER_KEY].read_logs(
        request.match_info["job_id"], tenant=request[PRINCIPAL_KEY].tenant_scope
    )
    response = web.StreamResponse(headers={"Content-Type": "application/json; charset=utf-8"})
    async with open_stream(request, response) as stream:
        await stream.write(b'{"logs": "')
        async for text, _ in _texts(stream.chunks(chunks, follows=False)):
            await stream.write(_json_string_body(text))
        await stream.write(b'"}')
    return response


async def _json_log_range(request: web.Request, query: LogQuery) -> web.StreamResponse:
    """A byte range as `{"offset", "logs", "next_offset", "size"}`, streamed like the whole log.

    The range ends at the size the log had when the read began, so everything the body says is
    known before its headers go out (and a job deleted meanwhile cannot break it)."""
    manager, job_id = request.app[JOB_MANAGER_KEY], request.match_info["job_id"]
    tenant = request[PRINCIPAL_KEY].tenant_scope
    offset = query.offset or 0
    size = await manager.log_size(job_id, tenant=tenant)
    limit = max(0, size - offset)
    if query.limit is not None:
        limit = min(limit, query.limit)
    chunks = await manager.read_logs(job_id, offset=offset, limit=limit, tenant=tenant)
    response = web.StreamResponse(headers={"Content-Type": "application/json; charset=utf-8"})
    async with open_stream(request, response) as stream:
        await stream.write(f'{{"offset": {offset}, "logs": "'.encode())
        next_offset = offset
        # A character cut by the limit is left for the next read: next_offset points at it.
        texts = _texts(stream.chunks(chunks, follows=False), flush_partial=query.limit is None)
        async for text, text_end in texts:
            await stream.write(_json_string_body(text))
            next_offset = text_end
        await stream.write(f'", "next_offset": {next_offset}, "size": {size}}}'.encode())
    return response


async def _text_logs(request: web.Request, query: LogQuery) -> web.StreamResponse:
    """The raw bytes: whole, from an offset, a `Range`, or followed until the job ends."""
    manager, job_id = request.app[JOB_MANAGER_KEY], request.match_info["job_id"]
    tenant = request[PRINCIPAL_KEY].tenant_scope
    offset, limit, status = query.offset or 0, query.limit, 200
    headers = {"Content-Type": TEXT_CONTENT_TYPE, "Accept-Ranges": "bytes"}
    if "Range" in request.headers and not query.follow:
        size = await manager.log_size(job_id, tenant=tenant)
        offset, end = _byte_range(request, size)
        limit, status = end - offset, 206
        headers["Content-Range"] = f"bytes {offset}-{end - 1}/{size}"
        headers["Content-Length"] = str(limit)
    chunks = await manager.read_logs(
        job_id,
        offset=offset,
        limit=limit,
        follow=query.follow,
        idle_tick_s=CLIENT_CHECK_S,
        stop_when=follower_should_stop(request),
        tenant=tenant,
    )
    response = web.StreamResponse(status=status, headers=headers)
    async with open_stream(request, response) as stream:
        async for chunk in stream.chunks(chunks, follows=query.follow):
            await stream.write(chunk.data)
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
    byte was sent, with 1001 when the server shuts down, with 1008 when the key is revoked."""
    query = _parse_query(request, LogStreamQuery)
    chunks = await request.app[JOB_MANAGER_KEY].read_logs(
        request.match_info["job_id"],
        offset=query.offset,
        follow=True,
        idle_tick_s=CLIENT_CHECK_S,
        stop_when=follower_should_stop(request),
        tenant=request[PRINCIPAL_KEY].tenant_scope,
    )
    # aiohttp waits 10 s for the client's answer to our close frame by default: a client that
    # never answers would hold a shutdown past its timeout.
    close_wait_s = min(request.app[SETTINGS_KEY].shutdown_timeout_s, WEBSOCKET_CLOSE_WAIT_S)
    websocket = web.WebSocketResponse(heartbeat=HEARTBEAT_S, timeout=close_wait_s)
    async with open_stream(request, websocket) as stream:
        texts = (text async for text, _ in _texts(stream.chunks(chunks, follows=True)) if text)
        await stream.serve_websocket(websocket, texts)
    return websocket


@routes.get("/api/jobs/{job_id}/logs/stream", name="stream_job_logs")
async def stream_job_logs(request: web.Request) -> web.StreamResponse:
    """Server-Sent Events: each event's data is a JSON string of log text and its id the byte
    offset after it; `Last-Event-ID` (or `?offset=`) resumes there. A final `end` event carries
    the job's status; a `revoked` event says why the stream of a revoked key ended."""
    manager, job_id = request.app[JOB_MANAGER_KEY], request.match_info["job_id"]
    tenant = request[PRINCIPAL_KEY].tenant_scope
    offset = _parse_query(request, LogStreamQuery).offset
    last_event_id = request.headers.get("Last-Event-ID")
    if last_event_id is not None:
        offset = _parse_query_value("Last-Event-ID", last_event_id)
    chunks = await manager.read_logs(
        job_id,
        offset=offset,
        follow=True,
        idle_tick_s=CLIENT_CHECK_S,
        stop_when=follower_should_stop(request),
        tenant=tenant,
    )
    response = EventSourceResponse(ping_interval=HEARTBEAT_S)
    async with open_stream(request, response) as stream, response:
        async for text, next_offset in _texts(stream.chunks(chunks, follows=True)):
            if text:
                await response.send(json.dumps(text), id=str(next_offset))
                offset = next_offset
        if stream.revoked is not None:
            await response.send(stream.revoked_json(), event=REVOKED_EVENT)
        elif not stream.cut_short:  # the job has ended (or is gone: then no `end`)
            job = await manager.get_job(job_id, tenant=tenant)
            await response.send(
                json.dumps({"status": job.status, "offset": offset}), event="end", id=str(offset)
            )
    return response


async def _texts(
    chunks: AsyncGenerator[LogChunk, None], *, flush_partial: bool = True
) -> AsyncGenerator[tuple[str, int], None]:
    """`(text, offset after it)` of the chunks. A character split across chunks is held back until
    it is whole; invalid bytes become U+FFFD.
    """
    held, offset = b"", 0
    async with contextlib.aclosing(chunks):
        async for chunk in chunks:
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
