"""The event stream never skips ids silently (issue 32, item 15): a subscriber that falls behind
the window of events the archive keeps gets a `reset` (list again), never the oldest kept event
as if it came next. Injected: a slow subscriber whose buffer overflows while the window moves
past its cursor, and a resume whose `after` falls out of the window while it is being read.
On the real archive (SQLite and PostgreSQL, their own trimming), and through the HTTP stream."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest

from jobs_server.manager.archive import event_feed as event_feed_module
from jobs_server.manager.archive.event_feed import EventFeed, EventFilter, FeedReset
from jobs_server.manager.archive.events import JobEvent, JobEventType
from jobs_server.manager.records import JobRecord, JobSpec, new_run_id
from tests.support.api import Client
from tests.support.fakes import FakeJobManager
from tests.support.postgres import ArchiveFactory
from tests.support.sse import READ_TIMEOUT_S, SseReader, wait_subscribed

KEPT_EVENTS = 20

Item = JobEvent | FeedReset | None


class FeedOnArchive:
    """A real archive that keeps KEPT_EVENTS events, and the feed it wakes."""

    def __init__(self, archive_factory: ArchiveFactory) -> None:
        self.archive = archive_factory(on_events=self._publish, max_events=KEPT_EVENTS)
        self.feed = EventFeed(self.archive)
        self._count = 0

    def _publish(self, events: list[JobEvent]) -> None:
        self.feed.publish(events)

    async def add_jobs(self, count: int) -> None:
        """`count` new jobs in one commit: one `submitted` event each, published together."""
        records = []
        for _ in range(count):
            self._count += 1
            spec = JobSpec(entrypoint="true", submission_id=f"job-{self._count}")
            records.append(JobRecord(spec=spec, run_id=new_run_id()))
        await self.archive.insert_many(records)


@pytest.fixture
async def on_archive(archive_factory: ArchiveFactory) -> AsyncIterator[FeedOnArchive]:
    feed = FeedOnArchive(archive_factory)
    await feed.archive.open()
    yield feed
    await feed.archive.close()


async def take(subscription: AsyncIterator[Item], count: int) -> list[Item]:
    return [await asyncio.wait_for(anext(subscription), READ_TIMEOUT_S) for _ in range(count)]


def assert_no_silent_gap(previous_id: int, items: list[Item]) -> None:
    """Each event follows the one before it, unless a reset came between them."""
    for item in items:
        if isinstance(item, FeedReset):
            previous_id = -1
        elif isinstance(item, JobEvent):
            assert previous_id == -1 or item.id == previous_id + 1, (previous_id, item.id)
            previous_id = item.id


async def test_a_slow_subscriber_the_window_moved_past_gets_a_reset_then_now(
    on_archive: FeedOnArchive,
) -> None:
    subscription = on_archive.feed.subscribe(after=None, event_filter=EventFilter())
    first = asyncio.ensure_future(anext(subscription))
    await asyncio.sleep(0.05)  # subscribed, waiting
    await on_archive.add_jobs(1)
    seen = await asyncio.wait_for(first, READ_TIMEOUT_S)
    assert isinstance(seen, JobEvent)

    # While the subscriber does not read: more events than it buffers, and than the archive
    # keeps, so that the window moves past its cursor.
    await on_archive.add_jobs(event_feed_module.MAX_BUFFERED + 5)
    oldest, newest = await on_archive.archive.event_id_range()
    assert oldest > seen.id + 1

    (reset,) = await take(subscription, 1)
    assert isinstance(reset, FeedReset), f"event {reset} came after {seen.id}, skipping ids"
    assert reset.oldest_id == oldest
    assert str(seen.id) in reset.reason
    # Then from now: the next event is the next one committed, nothing already kept replayed.
    await on_archive.add_jobs(1)
    (live,) = await take(subscription, 1)
    assert isinstance(live, JobEvent)
    assert live.id == newest + 1
    await subscription.aclose()


async def test_a_resume_whose_point_leaves_the_window_while_it_is_read_gets_a_reset(
    on_archive: FeedOnArchive,
) -> None:
    await on_archive.add_jobs(5)
    assert (await on_archive.archive.event_id_range())[0] == 1
    archive = on_archive.archive
    read_range = archive.event_id_range

    async def range_then_the_window_moves() -> tuple[int, int]:
        answer = await read_range()
        archive.event_id_range = read_range  # type: ignore[method-assign]
        await on_archive.add_jobs(KEPT_EVENTS + 10)  # the resume point is trimmed meanwhile
        return answer

    archive.event_id_range = range_then_the_window_moves  # type: ignore[method-assign]
    subscription = on_archive.feed.subscribe(after=2, event_filter=EventFilter())
    items = await take(subscription, 1)
    assert isinstance(items[0], FeedReset), f"resumed after 2 at {items[0]}, skipping ids"
    await on_archive.add_jobs(1)
    items += await take(subscription, 1)
    assert_no_silent_gap(2, items)
    await subscription.aclose()


async def test_a_resume_after_an_id_older_than_the_oldest_kept_gets_a_reset(
    on_archive: FeedOnArchive,
) -> None:
    await on_archive.add_jobs(KEPT_EVENTS + 5)
    oldest, newest = await on_archive.archive.event_id_range()
    for after in (0, oldest - 2):
        subscription = on_archive.feed.subscribe(after=after, event_filter=EventFilter())
        (reset,) = await take(subscription, 1)
        assert isinstance(reset, FeedReset)
        assert reset.oldest_id == oldest
        await subscription.aclose()
    # The oldest kept minus one still resumes, each kept event in order.
    subscription = on_archive.feed.subscribe(after=oldest - 1, event_filter=EventFilter())
    items = await take(subscription, newest - oldest + 1)
    assert [item.id for item in items if isinstance(item, JobEvent)] == list(
        range(oldest, newest + 1)
    )
    await subscription.aclose()


async def test_a_filtered_subscriber_gets_the_reset_too(on_archive: FeedOnArchive) -> None:
    """The lost events may have been of its job: a filter does not hide the reset."""
    subscription = on_archive.feed.subscribe(
        after=None, event_filter=EventFilter(submission_id="job-1")
    )
    first = asyncio.ensure_future(anext(subscription))
    await asyncio.sleep(0.05)
    await on_archive.add_jobs(1)
    assert isinstance(await asyncio.wait_for(first, READ_TIMEOUT_S), JobEvent)
    await on_archive.add_jobs(event_feed_module.MAX_BUFFERED + 5)
    (reset,) = await take(subscription, 1)
    assert isinstance(reset, FeedReset)
    await subscription.aclose()


# Through the HTTP stream (the app on the in-memory manager: the feed and route are the real ones).


async def test_an_sse_client_that_fell_behind_reads_a_reset_event(
    fake_client: Client, fake: FakeJobManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(event_feed_module, "MAX_BUFFERED", 5)
    fake.event_log.keep = 10
    response = await fake_client.get("/api/events")
    assert response.status == 200
    reader = SseReader(response)
    await wait_subscribed(fake, 1)
    first = fake.event_log.record(JobEventType.DELETED, None, "first")
    (event,) = await reader.events(1)
    assert (event.event, int(event.id or "")) == ("job", first.id)

    # 30 events at once, none read by the stream meanwhile: its buffer overflows, and the log
    # keeps only the last 10.
    for number in range(30):
        fake.event_log.record(JobEventType.DELETED, None, f"burst-{number}")
    reset = await reader.next_event()
    assert reset.event == "reset", f"got {reset} after event {first.id}"
    # No id line: the last event ID stays the last job event's, where a reconnect resumes.
    assert reset.id == str(first.id)
    body = json.loads(reset.data)
    assert body["type"] == "reset"
    assert body["oldest_id"] == fake.event_log.events[0].id
    after = fake.event_log.record(JobEventType.DELETED, None, "after")
    (event,) = await reader.events(1)
    assert (event.event, int(event.id or "")) == ("job", after.id)
    response.close()
