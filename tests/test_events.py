"""`GET /api/events`: order and ids, resume without gap or duplicate, the reset for an id too old,
filters, NDJSON, heartbeats, clients that leave, shutdown; and the feed's own fan-out."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from jobs_server.app import create_app
from jobs_server.app_state import JOB_MANAGER_KEY, SHUTTING_DOWN_KEY
from jobs_server.client.sse import Event
from jobs_server.manager.archive import event_feed as event_feed_module
from jobs_server.manager.archive.event_feed import EventFeed, EventFilter, FeedReset
from jobs_server.manager.archive.events import JobEvent, JobEventType
from jobs_server.manager.archive.sqlite import Archive
from jobs_server.routes import events as events_route
from jobs_server.settings import Settings
from tests.support.api import Client, submit, wait_for_status
from tests.support.fakes import FakeJobManager, InMemoryEventLog
from tests.support.processes import poll_until
from tests.support.sse import READ_TIMEOUT_S, SseReader, wait_subscribed


def job_events(events: list[Event]) -> list[dict[str, Any]]:
    assert all(event.event == "job" for event in events), events
    bodies = [json.loads(event.data) for event in events]
    assert [int(event.id or "") for event in events] == [body["id"] for body in bodies]
    return bodies


@pytest.fixture
async def stream(fake_client: Client) -> AsyncIterator[Any]:
    """Open `/api/events` with params and headers; the responses are closed at the end."""
    opened: list[aiohttp.ClientResponse] = []

    async def open_stream(
        params: dict[str, str] | None = None, headers: dict[str, str] | None = None
    ) -> SseReader:
        response = await fake_client.get("/api/events", params=params, headers=headers)
        assert response.status == 200, await response.text()
        opened.append(response)
        return SseReader(response)

    yield open_stream
    for response in opened:
        response.close()


async def submit_fake(client: Client, submission_id: str) -> None:
    response = await client.post(
        "/api/jobs/", json={"entrypoint": "echo hi", "submission_id": submission_id}
    )
    assert response.status == 200, await response.text()


async def test_a_job_s_life_streams_in_order_with_increasing_ids(
    fake_client: Client, fake: FakeJobManager, stream: Any
) -> None:
    reader = await stream()
    await wait_subscribed(fake, 1)
    await submit_fake(fake_client, "life-1")
    fake.start("life-1")
    fake.finish("life-1")
    assert (await fake_client.delete("/api/jobs/life-1")).status == 200
    bodies = job_events(await reader.events(4))
    assert [(body["type"], body["status"]) for body in bodies] == [
        ("submitted", "PENDING"),
        ("status", "RUNNING"),
        ("status", "SUCCEEDED"),
        ("deleted", None),
    ]
    assert [body["id"] for body in bodies] == [1, 2, 3, 4]
    assert bodies[2]["job"]["submission_id"] == "life-1"
    assert bodies[2]["job"]["driver_exit_code"] == 0
    assert bodies[3]["job"] is None
    assert all("record" not in body for body in bodies)


async def test_a_stream_without_a_resume_point_starts_from_now(
    fake_client: Client, fake: FakeJobManager, stream: Any
) -> None:
    await submit_fake(fake_client, "before-1")
    reader = await stream()
    await wait_subscribed(fake, 1)
    fake.start("before-1")
    (body,) = job_events(await reader.events(1))
    assert (body["id"], body["status"]) == (2, "RUNNING")


@pytest.mark.parametrize("how", ["header", "query"])
async def test_resume_gives_exactly_the_missed_events_then_live_ones(
    fake_client: Client, fake: FakeJobManager, stream: Any, how: str
) -> None:
    await submit_fake(fake_client, "resume-1")
    fake.start("resume-1")
    fake.finish("resume-1")
    if how == "header":
        reader = await stream(headers={"Last-Event-ID": "1"})
    else:
        reader = await stream(params={"after": "1"})
    missed = job_events(await reader.events(2))
    assert [body["id"] for body in missed] == [2, 3]
    await wait_subscribed(fake, 1)
    await submit_fake(fake_client, "resume-2")
    (live,) = job_events(await reader.events(1))
    assert (live["id"], live["submission_id"]) == (4, "resume-2")


async def test_the_header_wins_over_the_query_as_an_eventsource_reconnects(
    fake_client: Client, fake: FakeJobManager, stream: Any
) -> None:
    await submit_fake(fake_client, "both-1")
    fake.start("both-1")
    reader = await stream(params={"after": "0"}, headers={"Last-Event-ID": "1"})
    (body,) = job_events(await reader.events(1))
    assert body["id"] == 2


async def test_an_id_older_than_the_oldest_kept_gets_a_reset_then_now(
    fake_client: Client, fake: FakeJobManager, stream: Any
) -> None:
    fake.event_log.keep = 2
    for index in range(3):
        await submit_fake(fake_client, f"old-{index}")
    assert (await fake.event_log.event_id_range()) == (2, 3)
    reader = await stream(headers={"Last-Event-ID": "0"})
    reset = await reader.next_event()
    assert reset.event == "reset"
    assert reset.id is None  # no id line: the client's Last-Event-ID stays what it was
    body = json.loads(reset.data)
    assert body["type"] == "reset"
    assert body["oldest_id"] == 2
    assert body["reason"]
    await wait_subscribed(fake, 1)
    fake.start("old-2")
    (live,) = job_events(await reader.events(1))
    assert live["id"] == 4  # from now: nothing already kept is replayed


async def test_the_oldest_kept_id_minus_one_still_resumes(
    fake_client: Client, fake: FakeJobManager, stream: Any
) -> None:
    fake.event_log.keep = 2
    for index in range(3):
        await submit_fake(fake_client, f"edge-{index}")
    reader = await stream(params={"after": "1"})
    assert [body["id"] for body in job_events(await reader.events(2))] == [2, 3]


async def test_filters_by_submission_id_and_status(
    fake_client: Client, fake: FakeJobManager, stream: Any
) -> None:
    by_id = await stream(params={"submission_id": "keep-me"})
    by_status = await stream(params={"status": "succeeded, failed"})
    await wait_subscribed(fake, 2)
    for job in ("other", "keep-me"):
        await submit_fake(fake_client, job)
        fake.start(job)
    fake.finish("other", exit_code=3)
    fake.finish("keep-me")
    only_mine = job_events(await by_id.events(3))
    assert {body["submission_id"] for body in only_mine} == {"keep-me"}
    assert [body["status"] for body in only_mine] == ["PENDING", "RUNNING", "SUCCEEDED"]
    ended = job_events(await by_status.events(2))
    assert [(body["submission_id"], body["status"]) for body in ended] == [
        ("other", "FAILED"),
        ("keep-me", "SUCCEEDED"),
    ]


async def test_a_resume_with_a_filter_skips_what_does_not_match(
    fake_client: Client, fake: FakeJobManager, stream: Any
) -> None:
    await submit_fake(fake_client, "a")
    await submit_fake(fake_client, "b")
    fake.start("a")
    reader = await stream(params={"after": "0", "submission_id": "a"})
    assert [body["id"] for body in job_events(await reader.events(2))] == [1, 3]


async def test_ndjson_lines_and_heartbeats(
    fake_client: Client, fake: FakeJobManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(events_route, "HEARTBEAT_S", 0.3)
    async with fake_client.get(
        "/api/events", params={"format": "ndjson", "after": "0"}
    ) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("application/x-ndjson")
        await wait_subscribed(fake, 1)
        await submit_fake(fake_client, "nd-1")
        lines = []
        while len(lines) < 2:
            raw = await asyncio.wait_for(response.content.readline(), READ_TIMEOUT_S)
            lines.append(json.loads(raw))
    event, heartbeat = lines
    assert (event["type"], event["id"], event["submission_id"]) == ("submitted", 1, "nd-1")
    assert event["job"]["status"] == "PENDING"
    assert heartbeat["type"] == "heartbeat"
    assert isinstance(heartbeat["time"], int)


async def test_sse_heartbeat_is_a_ping_comment(
    fake_client: Client, fake: FakeJobManager, stream: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(events_route, "HEARTBEAT_S", 0.3)
    reader = await stream()
    await wait_subscribed(fake, 1)
    await asyncio.sleep(0.5)
    await submit_fake(fake_client, "after-ping")
    await reader.next_event()
    assert ": ping" in reader.comments


@pytest.mark.parametrize(
    ("params", "headers"),
    [
        ({"after": "-1"}, {}),
        ({"after": "x"}, {}),
        ({"status": "BOGUS"}, {}),
        ({"status": ","}, {}),
        ({"format": "xml"}, {}),
        ({"submission_id": ""}, {}),
        ({"unknown": "1"}, {}),
        ({}, {"Last-Event-ID": "abc"}),
        ({}, {"Last-Event-ID": "-3"}),
    ],
)
async def test_bad_parameters_are_400_before_the_stream_starts(
    fake_client: Client, params: dict[str, str], headers: dict[str, str]
) -> None:
    response = await fake_client.get("/api/events", params=params, headers=headers)
    assert response.status == 400
    body = await response.json()
    assert body["error"]


async def test_a_client_that_leaves_is_released(
    fake_client: Client, fake: FakeJobManager, stream: Any
) -> None:
    response = await fake_client.get("/api/events")
    await wait_subscribed(fake, 1)
    response.close()
    await wait_subscribed(fake, 0)


async def test_server_shutdown_ends_the_stream(fake_client: Client, fake: FakeJobManager) -> None:
    async with fake_client.get("/api/events") as response:
        await wait_subscribed(fake, 1)
        fake_client.server.app[SHUTTING_DOWN_KEY].set()
        assert await asyncio.wait_for(response.read(), READ_TIMEOUT_S) == b""
    await wait_subscribed(fake, 0)


# The feed itself, on an in-memory log.


def _event(log: InMemoryEventLog, submission_id: str) -> JobEvent:
    return log.record(JobEventType.DELETED, None, submission_id)


async def _take(subscription: Any, count: int) -> list[Any]:
    return [await asyncio.wait_for(anext(subscription), READ_TIMEOUT_S) for _ in range(count)]


async def test_a_slow_subscriber_whose_buffer_overflows_reads_the_rest_from_the_log(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(event_feed_module, "MAX_BUFFERED", 5)
    log = InMemoryEventLog()
    feed = EventFeed(log)
    log.on_events = feed.publish
    subscription = feed.subscribe(after=None, event_filter=EventFilter())
    first = asyncio.ensure_future(anext(subscription))
    await asyncio.sleep(0.05)  # subscribed, waiting
    for index in range(30):  # more than the buffer holds, before the subscriber runs
        _event(log, f"many-{index}")
    received = [await first, *await _take(subscription, 29)]
    assert [event.id for event in received] == list(range(1, 31))
    await subscription.aclose()
    assert len(feed) == 0


async def test_events_committed_while_resuming_are_neither_lost_nor_repeated() -> None:
    log = InMemoryEventLog()
    feed = EventFeed(log)
    log.on_events = feed.publish
    for index in range(3):
        _event(log, f"early-{index}")
    original = log.events_after

    async def slow_events_after(after_id: int, limit: int) -> list[JobEvent]:
        page = await original(after_id, limit)
        _event(log, "during-the-read")  # committed and published while the page is read
        return page

    log.events_after = slow_events_after  # type: ignore[method-assign]
    subscription = feed.subscribe(after=1, event_filter=EventFilter())
    received = await _take(subscription, 4)
    log.events_after = original  # type: ignore[method-assign]
    ids = [event.id for event in received]
    assert ids == sorted(set(ids))
    assert ids[:4] == [2, 3, 4, 5]
    await subscription.aclose()


async def test_an_after_beyond_the_newest_starts_from_now() -> None:
    log = InMemoryEventLog()
    feed = EventFeed(log)
    log.on_events = feed.publish
    _event(log, "one")
    subscription = feed.subscribe(after=99, event_filter=EventFilter(), idle_tick_s=0.05)
    assert await _take(subscription, 1) == [None]  # an idle tick: nothing to replay
    _event(log, "two")
    (event,) = await _take(subscription, 1)
    assert isinstance(event, JobEvent)
    assert event.id == 2
    await subscription.aclose()


async def test_the_reset_names_the_oldest_kept_id() -> None:
    log = InMemoryEventLog(keep=1)
    feed = EventFeed(log)
    for index in range(3):
        _event(log, f"x-{index}")
    subscription = feed.subscribe(after=0, event_filter=EventFilter())
    (reset,) = await _take(subscription, 1)
    assert isinstance(reset, FeedReset)
    assert reset.oldest_id == 3
    await subscription.aclose()


# With the real server on real Ray, its archive holding the events.


class NdjsonReader:
    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self.response = response

    async def next_line(self) -> dict[str, Any]:
        while True:
            raw = await asyncio.wait_for(self.response.content.readline(), READ_TIMEOUT_S * 3)
            if not raw:
                raise EOFError("the stream ended")
            line: dict[str, Any] = json.loads(raw)
            if line["type"] != "heartbeat":
                return line

    async def until_status(self, submission_id: str, status: str) -> list[dict[str, Any]]:
        lines = []
        while True:
            line = await self.next_line()
            lines.append(line)
            if line["submission_id"] == submission_id and line["status"] == status:
                return lines


async def open_ndjson(client: Client, **params: str) -> NdjsonReader:
    response = await client.get("/api/events", params={"format": "ndjson", **params})
    assert response.status == 200, await response.text()
    return NdjsonReader(response)


async def test_a_real_job_s_events_then_a_resume_across_a_restart(
    aiohttp_client: Any, settings: Settings, tmp_path: Path
) -> None:
    first = await aiohttp_client(create_app(settings))
    stream = await open_ndjson(first)
    # The job runs until the test has seen it RUNNING (a job that ends at once may be learnt
    # ended before it was seen running: then there is no RUNNING event).
    flag = tmp_path / "go"
    job_id = await submit(first, entrypoint=f"until [ -e {flag} ]; do sleep 0.05; done; echo hello")
    seen = await stream.until_status(job_id, "RUNNING")
    flag.touch()
    seen += await stream.until_status(job_id, "SUCCEEDED")
    mine = [line for line in seen if line["submission_id"] == job_id]
    assert [(line["type"], line["status"]) for line in mine] == [
        ("submitted", "PENDING"),
        ("status", "RUNNING"),
        ("status", "SUCCEEDED"),
    ]
    ids = [line["id"] for line in seen]
    assert ids == sorted(ids)
    assert len(set(ids)) == len(ids)
    assert mine[-1]["job"]["driver_exit_code"] == 0

    # A resume from the first event gives exactly the rest.
    resumed = await open_ndjson(first, after=str(ids[0]))
    again = await resumed.until_status(job_id, "SUCCEEDED")
    assert [line["id"] for line in again] == ids[1:]

    # The server stops: the open streams end (cleanly, not cut), then a new server resumes.
    reading = asyncio.ensure_future(stream.response.content.read())
    await first.server.close()
    assert await asyncio.wait_for(reading, READ_TIMEOUT_S) == b""
    second = await aiohttp_client(create_app(settings))
    after_restart = await open_ndjson(second, after=str(ids[0]))
    replayed = await after_restart.until_status(job_id, "SUCCEEDED")
    assert [line["id"] for line in replayed] == ids[1:]
    assert (await second.delete(f"/api/jobs/{job_id}")).status == 200
    deleted = await after_restart.next_line()
    assert (deleted["type"], deleted["id"], deleted["job"]) == ("deleted", ids[-1] + 1, None)


async def test_real_filters_and_sse(client: Client) -> None:
    failing = await submit(client, entrypoint="exit 3")
    await wait_for_status(client, failing)
    response = await client.get(
        "/api/events", params={"after": "0", "status": "FAILED", "submission_id": failing}
    )
    reader = SseReader(response)
    (event,) = job_events(await reader.events(1))
    assert (event["submission_id"], event["status"]) == (failing, "FAILED")
    assert event["job"]["driver_exit_code"] == 3
    response.close()


async def test_a_real_id_too_old_gets_a_reset(
    aiohttp_client: Any, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The archive keeps only the last 2 events here.
    defaults = dict(Archive.__init__.__kwdefaults__ or {})
    monkeypatch.setattr(Archive.__init__, "__kwdefaults__", {**defaults, "max_events": 2})
    client = await aiohttp_client(create_app(settings))
    # Two jobs: at least 4 events (each submitted and ended), of which 2 are kept.
    job_id = await submit(client, entrypoint="true")
    await wait_for_status(client, job_id)
    second = await submit(client, entrypoint="true")
    await wait_for_status(client, second)
    stream = await open_ndjson(client, after="0")
    reset = await stream.next_line()
    assert reset["type"] == "reset"
    assert reset["oldest_id"] > 1
    assert (await client.delete(f"/api/jobs/{job_id}")).status == 200
    deleted = await stream.next_line()
    # The second job's end is archived (and streamed) a moment after its status shows it.
    while (deleted["type"], deleted["submission_id"]) == ("status", second):
        deleted = await stream.next_line()
    assert (deleted["type"], deleted["submission_id"]) == ("deleted", job_id)


async def test_a_real_client_that_leaves_is_released(client: Client) -> None:
    feed = client.server.app[JOB_MANAGER_KEY]._event_feed
    # The manager's own subscriber (the dependencies' waits follow the events) stays.
    others = len(feed)
    response = await client.get("/api/events")
    await poll_until(lambda: len(feed) == others + 1, READ_TIMEOUT_S, "the subscriber")
    response.close()
    await poll_until(lambda: len(feed) == others, READ_TIMEOUT_S, "the subscriber to be released")
