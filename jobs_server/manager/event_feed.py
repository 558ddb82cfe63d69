"""The live job event feed: every subscriber of `GET /api/events`, woken by the archive.

The archive calls `publish` (its `on_events`) after each commit with the new events; each
subscriber buffers them and delivers them in id order from its own cursor. Whatever is not in
its buffer (a resume, a gap, a buffer that overflowed while its client was slow) is read back
from the `EventLog`, which is the source of truth: so a subscriber never skips an id and never
repeats one. An `after` older than the log keeps gets a `FeedReset` and continues from now.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncGenerator
from dataclasses import dataclass

from jobs_server.manager.events import EventLog, JobEvent
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
                cursor = newest
                subscriber.synced = True
            elif after < oldest - 1:
                yield FeedReset(oldest, f"event {after} is no longer kept; list the jobs again")
                cursor = newest
                subscriber.synced = True
            else:
                cursor = after
            while True:
                delivered_any = False
                async for event in self._events_after(subscriber, cursor):
                    cursor = event.id
                    if event_filter.matches(event):
                        delivered_any = True
                        yield event
                if delivered_any:
                    continue
                if not await _wait(subscriber.woken, idle_tick_s):
                    yield None
        finally:
            self._subscribers.discard(subscriber)

    async def _events_after(
        self, subscriber: _Subscriber, cursor: int
    ) -> AsyncGenerator[JobEvent, None]:
        """Every event now known after `cursor`, in order, each once: from the buffer when it
        continues the cursor, from the log when it does not (a resume, an overflow, a gap)."""
        subscriber.woken.clear()
        while True:
            buffer = subscriber.buffer
            while buffer and buffer[0].id <= cursor:
                buffer.popleft()
            if subscriber.synced and buffer and buffer[0].id == cursor + 1:
                event = buffer.popleft()
                cursor = event.id
                yield event
                continue
            if subscriber.synced and not buffer:
                return
            subscriber.overflowed = False
            page = await self._log.events_after(cursor, LOG_PAGE)
            for event in page:
                cursor = event.id
                yield event
            if page:
                continue
            subscriber.synced = not subscriber.overflowed
            if buffer and buffer[0].id > cursor + 1:
                # The log has nothing before it: the numbering skips ids there.
                event = buffer.popleft()
                cursor = event.id
                yield event


async def _wait(woken: asyncio.Event, timeout_s: float | None) -> bool:
    if timeout_s is None:
        await woken.wait()
        return True
    try:
        await asyncio.wait_for(woken.wait(), timeout_s)
    except TimeoutError:
        return False
    return True
