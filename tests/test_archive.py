"""The archive on its own (no Ray): schema, uniqueness, first terminal wins, events in the same
transaction, queries, retention's view, and what survives reopening the file."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from pathlib import Path
from typing import Any

import pytest

from jobs_server.errors import DuplicateJobError
from jobs_server.manager.archive.events import JobEvent, JobEventType
from jobs_server.manager.archive.interface import JobArchive
from jobs_server.manager.archive.schema_versions import SchemaTooNewError
from jobs_server.manager.archive.sqlite import (
    _MIGRATIONS,
    Archive,
    JobQuery,
    UnknownCursorError,
    archive_path,
)
from jobs_server.manager.records import JobRecord, JobSpec, JobStatus, new_run_id
from tests.support.postgres import ArchiveFactory


def record(
    submission_id: str,
    *,
    start_time: int = 1_000,
    metadata: dict[str, str] | None = None,
) -> JobRecord:
    return JobRecord(
        spec=JobSpec(entrypoint="true", submission_id=submission_id, metadata=metadata or {}),
        start_time=start_time,
        run_id=new_run_id(),
        message="Job is pending.",
    )


async def test_a_submission_id_is_taken_once(archive: JobArchive) -> None:
    await archive.insert(record("a"))
    with pytest.raises(DuplicateJobError):
        await archive.insert(record("a"))
    assert [job.submission_id for job in (await archive.page(JobQuery()))[0]] == ["a"]


async def test_the_first_terminal_status_wins(archive: JobArchive) -> None:
    job = record("a")
    await archive.insert(job)
    running = job.with_changes(status=JobStatus.RUNNING, driver_pid=7)
    assert await archive.update(running) == running
    stopped = running.with_changes(status=JobStatus.STOPPED, end_time=2_000)
    assert await archive.update(stopped) == stopped
    late = running.with_changes(status=JobStatus.SUCCEEDED, end_time=3_000)
    assert await archive.update(late) == stopped
    assert await archive.get("a") == stopped
    assert await archive.unfinished() == []


async def test_an_update_of_another_run_changes_nothing(archive: JobArchive) -> None:
    job = record("a")
    await archive.insert(job)
    other = record("a").with_changes(status=JobStatus.FAILED)
    assert await archive.update(other) is None
    assert await archive.get("a") == job


async def test_every_change_is_an_event_in_order_and_reported_after_commit(
    archive_factory: ArchiveFactory,
) -> None:
    seen: list[JobEvent] = []
    archive = archive_factory(on_events=seen.extend)
    await archive.open()
    job = record("a")
    await archive.insert(job)
    await archive.update(job.with_changes(status=JobStatus.RUNNING))
    await archive.update(job.with_changes(status=JobStatus.RUNNING, message="same status"))
    await archive.update(job.with_changes(status=JobStatus.SUCCEEDED, end_time=5))
    await archive.delete("a")
    events = await archive.events_after(0, 100)
    assert [(event.type, event.status) for event in events] == [
        (JobEventType.SUBMITTED, JobStatus.PENDING),
        (JobEventType.STATUS, JobStatus.RUNNING),
        (JobEventType.STATUS, JobStatus.SUCCEEDED),
        (JobEventType.DELETED, None),
    ]
    assert [event.id for event in events] == [1, 2, 3, 4]
    assert seen == events
    assert await archive.event_id_range() == (1, 4)
    assert events[2].record is not None
    assert events[2].record.end_time == 5
    await archive.close()


async def test_events_are_bounded_and_their_ids_never_reused(
    archive_factory: ArchiveFactory,
) -> None:
    archive = archive_factory(max_events=3)
    await archive.open()
    for index in range(5):
        await archive.insert(record(f"job-{index}"))
    assert await archive.event_id_range() == (3, 5)
    await archive.close()
    reopened = archive_factory(max_events=3)
    await reopened.open()
    await reopened.insert(record("job-5"))
    assert await reopened.event_id_range() == (4, 6)
    await reopened.close()


async def test_a_duplicate_writes_no_event(archive: JobArchive) -> None:
    await archive.insert(record("a"))
    with pytest.raises(DuplicateJobError):
        await archive.insert(record("a"))
    assert await archive.event_id_range() == (1, 1)


async def test_many_new_jobs_go_in_all_or_none(archive: JobArchive) -> None:
    """insert_many: one transaction; a taken id (in the archive, or twice in the batch) is
    named by DuplicateJobError and nothing of the batch is written, not even its events."""
    await archive.insert(record("taken"))
    with pytest.raises(DuplicateJobError, match="taken"):
        await archive.insert_many([record("new-1"), record("taken"), record("new-2")])
    with pytest.raises(DuplicateJobError, match="twice"):
        await archive.insert_many([record("twice"), record("new-3"), record("twice")])
    assert [await archive.get(name) for name in ("new-1", "new-2", "new-3", "twice")] == [None] * 4
    assert await archive.event_id_range() == (1, 1)
    # More rows than one statement binds (PostgreSQL's ids may skip what the failures reserved).
    await archive.insert_many([record(f"job-{index}") for index in range(250)])
    assert None not in [await archive.get(f"job-{index}") for index in (0, 249)]
    assert (await archive.event_id_range())[1] >= 251


async def test_queries_filter_order_and_page(archive: JobArchive) -> None:
    for index in range(6):
        job = record(
            f"job-{index}",
            start_time=1_000 + index,
            metadata={"team": "x" if index % 2 else "y", "n": str(index)},
        )
        await archive.insert(job)
        if index % 3 == 0:
            await archive.update(job.with_changes(status=JobStatus.FAILED, end_time=9))

    async def ids(query: JobQuery, **page: object) -> list[str]:
        jobs, _ = await archive.page(query, **page)  # type: ignore[arg-type]
        return [job.submission_id for job in jobs]

    assert await ids(JobQuery(statuses=frozenset({JobStatus.FAILED}))) == ["job-0", "job-3"]
    assert await ids(JobQuery(metadata=(("team", "x"),))) == ["job-1", "job-3", "job-5"]
    assert await ids(JobQuery(metadata=(("team", "x"), ("n", "3")))) == ["job-3"]
    assert await ids(
        JobQuery(statuses=frozenset({JobStatus.FAILED}), metadata=(("team", "x"),))
    ) == ["job-3"]
    assert await ids(JobQuery(submitted_after=1_001, submitted_before=1_004)) == [
        "job-2",
        "job-3",
    ]
    assert await ids(JobQuery(descending=True), limit=2) == ["job-5", "job-4"]
    assert await ids(JobQuery(descending=True), after="job-4", limit=2) == ["job-3", "job-2"]
    jobs, more = await archive.page(JobQuery(), after="job-3", limit=2)
    assert [job.submission_id for job in jobs] == ["job-4", "job-5"]
    assert not more
    _, more = await archive.page(JobQuery(), limit=2)
    assert more
    with pytest.raises(UnknownCursorError):
        await archive.page(JobQuery(), after="nope")


async def test_the_stream_reads_every_job_in_batches(archive: JobArchive) -> None:
    from jobs_server.manager.archive import sqlite as archive_module

    count = archive_module.STREAM_BATCH_ROWS * 2 + 3
    for index in range(count):
        await archive.insert(record(f"job-{index:05d}"))
    batches = [batch async for batch in archive.stream(JobQuery())]
    assert len(batches) == 3
    assert [job.submission_id for batch in batches for job in batch] == [
        f"job-{index:05d}" for index in range(count)
    ]


async def test_expired_jobs_are_finished_ones_oldest_first(archive: JobArchive) -> None:
    jobs = [record(f"job-{index}") for index in range(5)]
    for index, job in enumerate(jobs):
        await archive.insert(job)
        if index != 1:  # job-1 stays live
            await archive.update(job.with_changes(status=JobStatus.SUCCEEDED, end_time=index))

    async def ids(**bounds: int | None) -> list[str]:
        expired = await archive.expired_jobs(
            older_than_ms=bounds.get("older_than_ms"),
            keep_newest=bounds.get("keep_newest"),
            limit=int(bounds.get("limit") or 100),
        )
        return [job.submission_id for job in expired]

    assert await ids() == []
    assert await ids(older_than_ms=3) == ["job-0", "job-2"]
    assert await ids(keep_newest=2) == ["job-0", "job-2"]
    assert await ids(keep_newest=1, limit=2) == ["job-0", "job-2"]
    assert await ids(keep_newest=10) == []
    assert await ids(older_than_ms=1, keep_newest=4) == ["job-0"]


async def test_the_history_survives_reopening_and_metadata_goes_with_its_job(
    archive_factory: ArchiveFactory,
) -> None:
    archive = archive_factory()
    await archive.open()
    await archive.insert(record("a", metadata={"team": "x"}))
    await archive.insert(record("b"))
    await archive.close()
    reopened = archive_factory()
    await reopened.open()
    assert [job.submission_id for job in await reopened.unfinished()] == ["a", "b"]
    assert await reopened.delete("a")
    assert not await reopened.delete("a")
    jobs, _ = await reopened.page(JobQuery(metadata=(("team", "x"),)))
    assert jobs == []
    await reopened.close()


async def test_the_sqlite_file_is_wal_at_the_latest_schema(tmp_path: Path) -> None:
    path = archive_path(tmp_path)
    archive = Archive(path)
    await archive.open()
    await archive.insert(record("a", metadata={"team": "x"}))
    assert await archive.delete("a")
    await archive.close()
    db = sqlite3.connect(path)
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert db.execute("PRAGMA user_version").fetchone()[0] == len(_MIGRATIONS)
    assert db.execute("SELECT COUNT(*) FROM job_metadata").fetchone()[0] == 0
    db.close()


async def test_a_newer_schema_is_refused(tmp_path: Path) -> None:
    path = archive_path(tmp_path)
    db = sqlite3.connect(path)
    db.execute("PRAGMA user_version = 99")
    db.close()
    archive = Archive(path)
    with pytest.raises(SchemaTooNewError, match="newer"):
        await archive.open()
    await archive.close()


async def test_counts_by_status_read_no_record(archive: JobArchive) -> None:
    first, second = record("a"), record("b")
    await archive.insert(first)
    await archive.insert(second)
    await archive.update(first.with_changes(status=JobStatus.FAILED, end_time=1))
    assert await archive.count_by_status() == {JobStatus.FAILED: 1, JobStatus.PENDING: 1}


async def test_a_slow_read_delays_no_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A list that takes long (a big page, a cold disk) must not hold up submits: reads have a
    connection and a thread of their own (SQLite's; PostgreSQL's reads take a connection of
    the pool). The read here is held until the writes are done."""
    from jobs_server.manager.archive import queries as archive_queries

    archive = Archive(archive_path(tmp_path))
    await archive.open()
    await archive.insert(record("before"))
    read_began, release_read = threading.Event(), threading.Event()
    page_of_jobs = archive_queries.page_of_jobs

    def held_page(*args: Any) -> Any:
        read_began.set()
        release_read.wait(timeout=60)
        return page_of_jobs(*args)

    monkeypatch.setattr(archive_queries, "page_of_jobs", held_page)
    reading = asyncio.create_task(archive.page(JobQuery()))
    try:
        assert await asyncio.to_thread(read_began.wait, 10)
        # Each write is committed while the read still holds its thread.
        for index in range(3):
            await asyncio.wait_for(archive.insert(record(f"during-{index}")), timeout=10)
        assert not reading.done()
    finally:
        release_read.set()
    jobs, _ = await reading
    # Its query ran once released: it sees every commit before it, from its own connection.
    assert [job.submission_id for job in jobs] == ["before", "during-0", "during-1", "during-2"]
    await archive.close()


@pytest.mark.parametrize("descending", [False, True])
async def test_a_status_filter_also_reads_the_live_jobs_named_in_order(
    archive: JobArchive, descending: bool
) -> None:
    """`live_ids`: those jobs are read whatever their archived status (the caller keeps them by
    the status they have now), merged into the query's order, pages and stream alike."""
    for index in range(6):
        job = record(f"job-{index}", start_time=1_000 + index)
        await archive.insert(job)
        if index % 2:
            await archive.update(job.with_changes(status=JobStatus.FAILED, end_time=9))
    query = JobQuery(
        statuses=frozenset({JobStatus.FAILED}),
        live_ids=frozenset({"job-0", "job-4", "job-3"}),
        descending=descending,
    )
    expected = ["job-0", "job-1", "job-3", "job-4", "job-5"]
    if descending:
        expected.reverse()
    jobs, more = await archive.page(query, limit=3)
    assert ([job.submission_id for job in jobs], more) == (expected[:3], True)
    jobs, more = await archive.page(query, after=expected[2], limit=3)
    assert ([job.submission_id for job in jobs], more) == (expected[3:], False)
    streamed = [job.submission_id async for batch in archive.stream(query) for job in batch]
    assert streamed == expected


async def test_counts_come_with_the_unfinished_records_of_the_jobs_named(
    archive: JobArchive,
) -> None:
    """What `/metrics` reads: every count, and of the jobs named (more than one statement
    binds) only the unfinished ones of the tenant asked for."""
    jobs = [record(f"job-{index:04d}").model_copy(update={"tenant": "a"}) for index in range(1200)]
    jobs += [record("other").model_copy(update={"tenant": "b"})]
    await archive.insert_many(jobs)
    for job in jobs[:100]:
        await archive.update(job.with_changes(status=JobStatus.SUCCEEDED, end_time=2_000))
    named = frozenset({f"job-{index:04d}" for index in range(0, 1200, 2)} | {"other", "gone"})

    counts, unfinished = await archive.counts_and_unfinished_of("a", named)
    assert counts == {"a": {JobStatus.SUCCEEDED: 100, JobStatus.PENDING: 1100}}
    assert sorted(job.submission_id for job in unfinished) == [
        f"job-{index:04d}" for index in range(100, 1200, 2)
    ]
    counts, unfinished = await archive.counts_and_unfinished_of(None, named)
    assert counts["b"] == {JobStatus.PENDING: 1}
    assert len(unfinished) == 551


async def test_windows_go_on_from_a_position_and_deleted_runs_are_remembered(
    archive: JobArchive,
) -> None:
    """What the list's stream and recovery read: a window from the position of a job (of its
    tenant only), and whether a run was deleted (a delete of another run deletes nothing)."""
    jobs = [record(f"job-{index}") for index in range(5)]
    for job in jobs:
        await archive.insert(job)
    position = await archive.seq_of("job-1", None)
    window, more, last = await archive.window(JobQuery(), after_seq=position, limit=2)
    assert ([job.submission_id for job in window], more) == (["job-2", "job-3"], True)
    window, more, last = await archive.window(JobQuery(), after_seq=last, limit=2)
    assert ([job.submission_id for job in window], more) == (["job-4"], False)
    assert last == await archive.seq_of("job-4", jobs[4].tenant)
    with pytest.raises(UnknownCursorError):
        await archive.seq_of("job-1", "another-tenant")
    assert not await archive.delete("job-0", new_run_id())
    assert not await archive.was_deleted("job-0", jobs[0].run_id)
    assert await archive.delete("job-0", jobs[0].run_id)
    assert await archive.was_deleted("job-0", jobs[0].run_id)
    assert await archive.get("job-0") is None
    assert await archive.count_by_tenant() == {jobs[0].tenant: {JobStatus.PENDING: 4}}
