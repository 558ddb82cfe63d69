"""Events from any replica: on PostgreSQL, the events that other server processes on the same
database commit reach this one's `on_events` too, so `/api/events` on any replica carries every
replica's events, with the same ids.

The events table is the source of truth; a notification is only a wake-up. Each transaction
that writes events sends `NOTIFY` on CHANNEL with its last event id (`announce_events`, inside
the transaction: PostgreSQL delivers it only on commit). Each process LISTENs on a connection
of its own, outside the pool, and on a notification of an id it has not delivered reads the
events after the last one it delivered (`events_after`), as it also does every
CATCH_UP_INTERVAL_S in case a notification was missed (while its listener reconnected).

One cursor, `delivered_id`, orders everything: `on_events` is given only events above it, in
id order, and the cursor moves to the last one given. Since event ids are taken one transaction
after another (postgres.py's advisory lock), a committed event's smaller ids are committed (or
were never, a rollback's gap) when it is seen: so this process's own events, right after their
commit, are delivered at once when they follow the cursor (the fast path); when they do not
(another replica's commit or a rollback lies between), a read of the table delivers what lies
between and them, in order. A read's events already delivered by the fast path meanwhile are
skipped. Each event is delivered once, and never id N+1 before N.

A process starts from the newest event at its start: what came before is in the table, where
the event feed (event_feed.py) reads a resuming subscriber's past.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

import psycopg

from jobs_server.manager.archive.events import EventLog, JobEvent

logger = logging.getLogger(__name__)

CHANNEL = "jobs_server_events"
# A read of the table every so often, whether or not a notification came: covers one missed
# while the listener was away. A catch-up that finds nothing costs one indexed query.
CATCH_UP_INTERVAL_S = 5.0
# Between attempts to connect the listener again.
RECONNECT_DELAY_S = 1.0
# Events read from the table at a time.
READ_PAGE = 1000
# The listener's session as pg_stat_activity names it.
LISTENER_APPLICATION_NAME = "jobs-server events"
# A listener whose database went silent (a host gone, a network cut) notices within about
# idle + interval * count seconds, and reconnects.
_LISTENER_OPTIONS: dict[str, Any] = {
    "autocommit": True,
    "application_name": LISTENER_APPLICATION_NAME,
    "connect_timeout": 10,
    "keepalives": 1,
    "keepalives_idle": 10,
    "keepalives_interval": 5,
    "keepalives_count": 3,
}


async def announce_events(db: psycopg.AsyncConnection[Any], events: list[JobEvent]) -> None:
    """Inside the transaction that wrote `events`: wake every replica's listener on commit."""
    if events:
        last_id = max(event.id for event in events)
        await db.execute("SELECT pg_notify(%s, %s)", (CHANNEL, str(last_id)))


class EventRelay:
    """Every committed event, this process's and other replicas', given to `on_events` once
    and in id order. `start` after the archive opened, `stop` before it closes."""

    def __init__(
        self, url: str, log: EventLog, on_events: Callable[[list[JobEvent]], None]
    ) -> None:
        self._url = url
        self._log = log
        self._on_events = on_events
        self._delivered_id = 0
        self._wanted = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        """Listen, then start from the newest event (nothing committed after it is missed)."""
        connection = await self._connect()
        try:
            _, self._delivered_id = await self._log.event_id_range()
        except BaseException:
            await connection.close()
            raise
        self._tasks = [
            asyncio.create_task(self._listen(connection), name="archive-events-listener"),
            asyncio.create_task(self._catch_up_forever(), name="archive-events-catch-up"),
        ]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []

    def committed(self, events: list[JobEvent]) -> None:
        """This process's `events`, right after their commit: delivered now if they follow
        the cursor; else (and for any after a gap) the catch-up reads what lies between."""
        following: list[JobEvent] = []
        next_id = self._delivered_id + 1
        for event in sorted(events, key=lambda event: event.id):
            if event.id < next_id:
                continue  # a read delivered it already
            if event.id > next_id:
                self._wanted.set()
                break
            following.append(event)
            next_id += 1
        self._deliver(following)

    def _deliver(self, events: list[JobEvent]) -> None:
        """Give `on_events` those of `events` (in id order) above the cursor."""
        fresh = [event for event in events if event.id > self._delivered_id]
        if not fresh:
            return
        self._delivered_id = fresh[-1].id
        try:
            self._on_events(fresh)
        except Exception:
            logger.exception("an events subscriber failed")

    async def _connect(self) -> psycopg.AsyncConnection[Any]:
        connection: psycopg.AsyncConnection[Any] = await psycopg.AsyncConnection.connect(
            self._url, **_LISTENER_OPTIONS
        )
        try:
            await connection.execute(f"LISTEN {CHANNEL}")
        except BaseException:
            await connection.close()
            raise
        return connection

    async def _listen(self, connection: psycopg.AsyncConnection[Any] | None) -> None:
        """Wake the catch-up on each notification of an event not delivered yet; reconnect
        when the connection drops (and catch up then: notifications were missed)."""
        away = False
        while True:
            try:
                if connection is None:
                    connection = await self._connect()
                    self._wanted.set()
                    if away:
                        logger.info("the events listener is connected again")
                        away = False
                async for notification in connection.notifies():
                    if _last_id(notification.payload) > self._delivered_id:
                        self._wanted.set()
            except Exception as error:  # psycopg's errors, and any other: never die
                if not away:
                    logger.warning(
                        "the events listener lost its database connection (%s);"
                        " other replicas' events arrive every %.0f s until it is back",
                        error,
                        CATCH_UP_INTERVAL_S,
                    )
                    away = True
            finally:
                if connection is not None:
                    with contextlib.suppress(psycopg.Error):
                        await connection.close()
                    connection = None
            await asyncio.sleep(RECONNECT_DELAY_S)

    async def _catch_up_forever(self) -> None:
        failing = False
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wanted.wait(), CATCH_UP_INTERVAL_S)
            self._wanted.clear()
            try:
                await self._catch_up()
            except Exception as error:  # the database away: the next wake-up tries again
                if not failing:  # once per outage
                    logger.warning("could not read the events other replicas wrote: %s", error)
                    failing = True
                await asyncio.sleep(RECONNECT_DELAY_S)
            else:
                failing = False

    async def _catch_up(self) -> None:
        """Deliver every committed event after the cursor."""
        while True:
            page = await self._log.events_after(self._delivered_id, READ_PAGE)
            self._deliver(page)
            if len(page) < READ_PAGE:
                return


def _last_id(payload: str) -> int:
    try:
        return int(payload)
    except ValueError:
        return 1 << 62  # not ours to parse: read, to be safe
