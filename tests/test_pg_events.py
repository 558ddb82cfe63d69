"""Events from any replica (issue 34, item 4): on PostgreSQL, the events another server process
on the same database commits reach this one's `on_events` too (pg_events.py), in id order, with
the same ids, each once, so `/api/events` on any replica carries every replica's events. Two
`PostgresArchive`s on one database are two replicas here; the last test runs two real servers."""

from __future__ import annotations

import asyncio
import itertools
import random
from collections.abc import AsyncIterator

import psycopg
import pytest

from jobs_server.manager.archive import pg_events
from jobs_server.manager.archive.events import JobEvent
from jobs_server.manager.archive.postgres import PostgresArchive
from jobs_server.manager.records import JobRecord, JobSpec, JobStatus, new_run_id
from tests.support.processes import poll_until

pytestmark = pytest.mark.postgres

DEADLINE_S = 30.0


class Replica:
    """An archive on the shared database, with every event its `on_events` was given."""

    def __init__(self, url: str) -> None:
        self.heard: list[JobEvent] = []
        self.archive = PostgresArchive(url, on_events=self.heard.extend)

    def ids(self) -> list[int]:
        return [event.id for event in self.heard]


@pytest.fixture
def no_periodic_catch_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only a notification (or a reconnection) wakes a replica: what the tests see arrive did
    not come from the periodic read that covers a missed notification."""
    monkeypatch.setattr(pg_events, "CATCH_UP_INTERVAL_S", 3600.0)


@pytest.fixture
async def replicas(postgres_url: str) -> AsyncIterator[tuple[Replica, Replica]]:
    first, second = Replica(postgres_url), Replica(postgres_url)
    await first.archive.open()
    await second.archive.open()
    yield first, second
    await first.archive.close()
    await second.archive.close()


def record(submission_id: str) -> JobRecord:
    return JobRecord(
        spec=JobSpec(entrypoint="true", submission_id=submission_id), run_id=new_run_id()
    )


async def committed_ids(url: str, after: int = 0) -> list[int]:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as db:
        cursor = await db.execute("SELECT id FROM events WHERE id > %s ORDER BY id", (after,))
        return [row[0] for row in await cursor.fetchall()]


async def heard_everything(replica: Replica, ids: list[int]) -> None:
    await poll_until(
        lambda: bool(replica.heard) and replica.heard[-1].id >= ids[-1],
        DEADLINE_S,
        f"event {ids[-1]} to reach the replica (it heard {len(replica.heard)})",
    )


async def write_jobs(writers: list[Replica], prefix: str, count: int) -> None:
    """`count` jobs, each submitted on one replica, run on another and ended on a third, all
    at once."""

    async def one_job(index: int) -> None:
        job = record(f"{prefix}-{index}")
        await random.choice(writers).archive.insert(job)
        running = job.with_changes(status=JobStatus.RUNNING)
        await random.choice(writers).archive.update(running)
        await random.choice(writers).archive.update(
            running.with_changes(status=JobStatus.SUCCEEDED)
        )

    await asyncio.gather(*(one_job(index) for index in range(count)))


@pytest.mark.usefixtures("no_periodic_catch_up")
async def test_every_replica_hears_every_event_once_in_order(
    postgres_url: str, replicas: tuple[Replica, Replica]
) -> None:
    first, second = replicas
    await write_jobs([first, second], "burst", 300)
    await first.archive.insert_many([record(f"many-{index}") for index in range(20)])
    await second.archive.insert_many([record(f"more-{index}") for index in range(20)])
    ids = await committed_ids(postgres_url)
    assert len(ids) == 3 * 300 + 40
    for replica in replicas:
        await heard_everything(replica, ids)
        assert replica.ids() == ids
    assert first.heard == second.heard


async def listeners(db: psycopg.AsyncConnection[tuple[object, ...]]) -> list[int]:
    """The backend pids of the database's listeners that have run their LISTEN."""
    cursor = await db.execute(
        "SELECT pid FROM pg_stat_activity WHERE application_name = %s"
        " AND datname = current_database() AND query LIKE 'LISTEN%%'",
        (pg_events.LISTENER_APPLICATION_NAME,),
    )
    return [row[0] for row in await cursor.fetchall()]


@pytest.mark.usefixtures("no_periodic_catch_up")
async def test_no_event_is_lost_when_the_listeners_connection_is_killed(
    postgres_url: str, replicas: tuple[Replica, Replica]
) -> None:
    """pg_terminate_backend on both listeners' sessions, three times, while both replicas
    write: each reconnects, and hears what was committed while it was away."""
    first, second = replicas
    stop_writing = asyncio.Event()

    async def keep_writing() -> None:
        for batch in itertools.count():
            if stop_writing.is_set():
                return
            await write_jobs([first, second], f"killed-{batch}", 20)

    writing = asyncio.create_task(keep_writing())
    try:
        async with await psycopg.AsyncConnection.connect(postgres_url, autocommit=True) as db:
            for _ in range(3):
                pids = await listeners(db)
                assert len(pids) == 2
                await db.execute(
                    "SELECT pg_terminate_backend(pid) FROM unnest(%s::int[]) pid", (pids,)
                )
                deadline = asyncio.get_running_loop().time() + DEADLINE_S
                while len(back := await listeners(db)) < 2 or set(back) & set(pids):
                    assert asyncio.get_running_loop().time() < deadline, "no listener is back"
                    await asyncio.sleep(0.05)
            assert not writing.done()
        stop_writing.set()
        await writing
    finally:
        writing.cancel()
    ids = await committed_ids(postgres_url)
    assert len(ids) % 60 == 0
    for replica in replicas:
        await heard_everything(replica, ids)
        assert replica.ids() == ids
    # What is committed while the listeners are away, and nothing after: each hears it once
    # it is back (its read on reconnecting; no notification follows).
    async with await psycopg.AsyncConnection.connect(postgres_url, autocommit=True) as db:
        pids = await listeners(db)
        assert len(pids) == 2
        await db.execute("SELECT pg_terminate_backend(pid) FROM unnest(%s::int[]) pid", (pids,))
    await write_jobs([first], "while-away", 5)
    ids = await committed_ids(postgres_url)
    await heard_everything(second, ids)
    assert second.ids() == ids


@pytest.mark.usefixtures("no_periodic_catch_up")
async def test_a_replica_opened_later_hears_what_follows_its_start(postgres_url: str) -> None:
    """The feed reads what came before a start back from the log (event_feed.py): `on_events`
    is given only what is committed after the archive opened."""
    first = Replica(postgres_url)
    await first.archive.open()
    late = Replica(postgres_url)
    try:
        await write_jobs([first], "before", 20)
        before = await committed_ids(postgres_url)
        await late.archive.open()
        await write_jobs([first, late], "after", 20)
        ids = await committed_ids(postgres_url)
        await heard_everything(late, ids)
        assert late.ids() == [id_ for id_ in ids if id_ > before[-1]]
        await heard_everything(first, ids)
        assert first.ids() == ids
    finally:
        await first.archive.close()
        await late.archive.close()


async def test_an_event_without_a_notification_is_read_within_the_catch_up_interval(
    monkeypatch: pytest.MonkeyPatch, postgres_url: str
) -> None:
    """An event whose notification never came (one committed without it, as a server of an
    older version writes them, or sent while the listener reconnected) is delivered by the
    periodic read all the same."""
    monkeypatch.setattr(pg_events, "CATCH_UP_INTERVAL_S", 0.2)
    replica = Replica(postgres_url)
    await replica.archive.open()
    try:
        await replica.archive.insert(record("notified"))
        async with await psycopg.AsyncConnection.connect(postgres_url, autocommit=True) as db:
            await db.execute(
                "INSERT INTO events (type, submission_id, time) VALUES ('deleted', 'silent', 0)"
            )
        ids = await committed_ids(postgres_url)
        await heard_everything(replica, ids)
        assert replica.ids() == ids
        assert replica.heard[-1].submission_id == "silent"
    finally:
        await replica.archive.close()
