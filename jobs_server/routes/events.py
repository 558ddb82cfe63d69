"""`GET /api/events`: the job event stream, as Server-Sent Events or newline-delimited JSON.

Each event is one change of one job (submitted, a status change, deleted) with an increasing
id; `Last-Event-ID` (or `?after=`) resumes after it with no gap and no duplicate, also across a
restart. An id older than the server keeps gets a `reset` event (list again, as Kubernetes'
410 Gone), then the stream continues from now; so does a stream whose client fell behind the kept
window (never a silent gap). Heartbeats every 15 s keep proxies open. A stream whose key is
revoked (a reload of the tokens file) ends, saying why last (`revoked`).
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from typing import Annotated, Literal

from aiohttp import web
from aiohttp_sse import EventSourceResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from jobs_server.api_models import EventStreamHeartbeat, EventStreamReset, StreamedJobEvent
from jobs_server.app_state import JOB_MANAGER_KEY, PRINCIPAL_KEY
from jobs_server.errors import InvalidRequestError
from jobs_server.manager.archive.event_feed import EventFilter, FeedReset
from jobs_server.manager.archive.events import JobEvent
from jobs_server.manager.records import JobStatus
from jobs_server.serving.query_params import parse_statuses
from jobs_server.serving.request_body import describe_validation_error
from jobs_server.serving.streams import CLIENT_CHECK_S, REVOKED_EVENT, open_stream

routes = web.RouteTableDef()

FeedItems = AsyncGenerator[JobEvent | FeedReset | None, None]

HEARTBEAT_S = 15.0
NDJSON_CONTENT_TYPE = "application/x-ndjson; charset=utf-8"


class EventsQuery(BaseModel):
    """Query parameters of `GET /api/events`."""

    model_config = ConfigDict(extra="forbid")

    after: Annotated[int, Field(ge=0)] | None = None
    format: Literal["sse", "ndjson"] = "sse"
    submission_id: Annotated[str, Field(min_length=1)] | None = None
    status: str | None = None

    def statuses(self) -> frozenset[JobStatus] | None:
        return parse_statuses(self.status)


@routes.get("/api/events", name="stream_events")
async def stream_events(request: web.Request) -> web.StreamResponse:
    query = _parse_query(request)
    after = query.after
    last_event_id = request.headers.get("Last-Event-ID")
    if last_event_id is not None:  # a reconnecting EventSource: it wins over the URL's `after`
        after = _parse_event_id(last_event_id)
    # The one place a key's view of events is decided: its tenant's (an admin's: all).
    event_filter = EventFilter(
        submission_id=query.submission_id,
        statuses=query.statuses(),
        tenant=request[PRINCIPAL_KEY].tenant_scope,
    )
    manager = request.app[JOB_MANAGER_KEY]
    # Before the stream is prepared: a database that does not answer is a 503 the client can
    # act on, not a stream that ends before its first event.
    await manager.check_database()
    items = await manager.subscribe_events(
        after=after, event_filter=event_filter, idle_tick_s=CLIENT_CHECK_S
    )
    if query.format == "ndjson":
        return await _ndjson(request, items)
    return await _sse(request, items)


async def _sse(request: web.Request, items: FeedItems) -> web.StreamResponse:
    response = EventSourceResponse(ping_interval=HEARTBEAT_S)
    async with open_stream(request, response) as stream, response:
        async for item in stream.items(items):
            if item is None:  # an idle tick: aiohttp-sse sends the pings itself
                continue
            if isinstance(item, FeedReset):
                await response.send(reset_json(item), event="reset")
            else:
                await response.send(event_json(item), id=str(item.id), event="job")
        if stream.revoked is not None:
            await response.send(stream.revoked_json(), event=REVOKED_EVENT)
    return response


async def _ndjson(request: web.Request, items: FeedItems) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": NDJSON_CONTENT_TYPE})
    async with open_stream(request, response) as stream:
        last_write = time.monotonic()
        async for item in stream.items(items):
            if item is None:
                if time.monotonic() - last_write < HEARTBEAT_S:
                    continue
                line = EventStreamHeartbeat(time=int(time.time() * 1000)).model_dump_json()
            elif isinstance(item, FeedReset):
                line = reset_json(item)
            else:
                line = event_json(item)
            await stream.write(line.encode() + b"\n")
            last_write = time.monotonic()
        if stream.revoked is not None:
            await stream.write(stream.revoked_json().encode() + b"\n")
    return response


def event_json(event: JobEvent) -> str:
    """The event as the stream sends it: the job's details under `job` (null once deleted)."""
    return StreamedJobEvent.from_event(event).model_dump_json()


def reset_json(reset: FeedReset) -> str:
    return EventStreamReset(reason=reset.reason, oldest_id=reset.oldest_id).model_dump_json()


def _parse_query(request: web.Request) -> EventsQuery:
    try:
        return EventsQuery.model_validate(dict(request.query))
    except ValidationError as error:
        raise InvalidRequestError(describe_validation_error(error)) from error


def _parse_event_id(raw: str) -> int:
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise InvalidRequestError(
            f"Last-Event-ID: expected an event id (an integer >= 0), got {raw!r}"
        )
    return value
