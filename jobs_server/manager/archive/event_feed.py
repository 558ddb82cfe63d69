"""The live job event feed: every subscriber of `GET /api/events`, woken by the archive.

The archive calls `publish` (its `on_events`) after each commit with the new events; each
subscriber buffers them and delivers them in id order from its own cursor. Whatever is not in
its buffer (a resume, a gap, a buffer that overflowed while its client was slow) is read back
from the `EventLog`, which is the source of truth: so a subscriber never skips an id and never
repeats one. What the log no longer keeps cannot be read back: an `after` older than the log
keeps, or a subscriber so slow that the log's window moved past its cursor while it was not
reading, gets a `FeedReset` and continues from now; never a silent jump to the oldest kept.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncGenerator
from dataclasses import dataclass

from jobs_server.manager.archive.events import EventLog, JobEvent
from jobs_server.manager.records import JobStatus
from jobs_server.manager.tenancy import DEFAULT_TENANT

# Events read back from the log at a time.
LOG_PAGE = 500
# Live events a subscriber holds before it drops them and reads them back from the log later:
# a slow client costs bounded memory.
MAX_BUFFERED = 1000


@dataclass(frozen=True)
class EventFilter:
    """Which events a subscriber sees; the one place a tenant's filter applies (a key that is
    not an admin's sees only its tenant's events)."""

    submission_id: str | None = None
    statuses: frozenset[JobStatus] | None = None
    tenant: str | None = None
    """None: every tenant's events (an admin)."""

    def matches(self, event: JobEvent) -> bool:
        return (
            (self.submission_id is None or event.submission_id == self.submission_id)
            and (self.statuses is None or event.status in self.statuses)
            # Events recorded before tenants existed are the default tenant's.
            and (self.tenant is None or (event.tenant or DEFAULT_TENANT) == self.tenant)
        )


@dataclass(frozen=True)
class FeedReset:
    """The requested id is older than the oldest kept: the client must list again."""

    oldest_id: int
    reason: str


class _Subscriber:
    def __init__(self) -> None:
        self.cursor = 0
        """The id of the last event delivered (or skipped by the filter)."""
        self.buffer: collections.deque[JobEvent] = collections.deque()
        self.overflowed = False
        self.synced = False
        """The cursor has caught up with the log: the buffer holds everything after it."""
        self.woken = asyncio.Event()

    def notify(self, events: list[JobEvent]) -> None:
        if not self.overflowed:
            if len(self.buffer) + len(events) > MAX_BUFFERED:
                self.buffer.clear()
                self.overflowed = True  # read them back from the log instead
                self.synced = False
            else:
                self.buffer.extend(events)
        self.woken.set()


class EventFeed:
    """Fans the archive's new events out to every subscriber."""

    def __init__(self, log: EventLog) -> None:
        self._log = log
        self._subscribers: set[_Subscriber] = set()

    def publish(self, events: list[JobEvent]) -> None:
        """The archive's `on_events`: called on the loop after each commit."""
        if events:
            for subscriber in self._subscribers:
                subscriber.notify(events)

    def __len__(self) -> int:
        return len(self._subscribers)

    async def subscribe(
        self,
        *,
        after: int | None,
        event_filter: EventFilter,
        idle_tick_s: float | None = None,
    ) -> AsyncGenerator[JobEvent | FeedReset | None, None]:
        """The events after id `after` (from now when None) that match, in id order, forever;
        a `FeedReset` first if `after` is too old; None every `idle_tick_s` without an event
        (for heartbeats, and to notice a client that left)."""
        subscriber = _Subscriber()
        # Registered before reading the log: nothing committed from here on can be missed.
        self._subscribers.add(subscriber)
        try:
            oldest, newest = await self._log.event_id_range()
            if after is None or after >= newest:
                subscriber.cursor = newest
                subscriber.synced = True
            elif after < oldest - 1:
                yield FeedReset(oldest, f"event {after} is no longer kept; list the jobs again")
                subscriber.cursor = newest
                subscriber.synced = True
            else:
                subscriber.cursor = after
            while True:
                delivered_any = False
                async for item in self._events_after(subscriber):
                    if isinstance(item, FeedReset) or event_filter.matches(item):
                        delivered_any = True
                        yield item
                if delivered_any:
                    continue
                if not await _wait(subscriber.woken, idle_tick_s):
                    yield None
        finally:
            self._subscribers.discard(subscriber)

    async def _events_after(
        self, subscriber: _Subscriber
    ) -> AsyncGenerator[JobEvent | FeedReset, None]:
        """Every event now known after the subscriber's cursor, in order, each once: from the
        buffer when it continues the cursor, from the log when it does not (a resume, an
        overflow, a gap); a `FeedReset` where the log no longer has what follows the cursor
        (the cursor moves to the newest event then)."""
        subscriber.woken.clear()
        while True:
            buffer = subscriber.buffer
            while buffer and buffer[0].id <= subscriber.cursor:
                buffer.popleft()
            if subscriber.synced and buffer and buffer[0].id == subscriber.cursor + 1:
                event = buffer.popleft()
                subscriber.cursor = event.id
                yield event
                continue
            if subscriber.synced and not buffer:
                return
            subscriber.overflowed = False
            page = await self._log.events_after(subscriber.cursor, LOG_PAGE)
            if page and page[0].id > subscriber.cursor + 1:
                reset = await self._lost_after(subscriber)
                if reset is not None:
                    yield reset
                    continue
            for event in page:
                subscriber.cursor = event.id
                yield event
            if page:
                continue
            subscriber.synced = not subscriber.overflowed
            if buffer and buffer[0].id > subscriber.cursor + 1:
                reset = await self._lost_after(subscriber)
                if reset is not None:
                    yield reset
                    continue
                # The log has nothing before it: the numbering skips ids there.
                event = buffer.popleft()
                subscriber.cursor = event.id
                yield event

    async def _lost_after(self, subscriber: _Subscriber) -> FeedReset | None:
        """Whether the events right after the cursor, found missing, were trimmed from the log
        (its window moved past the cursor): then a reset, and the cursor moves to the newest.
        None: the log still reaches back to the cursor, so the numbering skips ids there.
        Read after the missing ids were seen missing, so a trim in between is not missed (it
        can only make a reset of a skip in the numbering: a reset too many, never a gap)."""
        oldest, newest = await self._log.event_id_range()
        cursor = subscriber.cursor
        if oldest <= cursor + 1:
            return None
        subscriber.cursor = max(cursor, newest)
        return FeedReset(
            oldest,
            f"the events after {cursor} up to {oldest - 1} are no longer kept (this stream fell"
            " behind); list the jobs again",
        )


async def _wait(woken: asyncio.Event, timeout_s: float | None) -> bool:
    if timeout_s is None:
        await woken.wait()
        return True
    try:
        await asyncio.wait_for(woken.wait(), timeout_s)
    except TimeoutError:
        return False
    return True
