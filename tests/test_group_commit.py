"""Group commit (jobs_server/manager/archive/group_commit.py, and PostgreSQL's in postgres.py)
through the archive, on a real file and on a real PostgreSQL:
writes made at once share transactions, each answered once committed; a failing write fails alone;
rows and events keep the order of the calls; what was answered is on disk for the next reader."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from jobs_server.errors import DuplicateJobError
from jobs_server.manager.archive.events import JobEvent
from jobs_server.manager.archive.interface import JobArchive
from jobs_server.manager.archive.queries import JobQuery
from jobs_server.manager.records import JobRecord, JobSpec, JobStatus, new_run_id
from tests.support.postgres import ArchiveFactory, committed_rows


def record(submission_id: str) -> JobRecord:
    return JobRecord(
        spec=JobSpec(entrypoint="true", submission_id=submission_id), run_id=new_run_id()
    )


@pytest.fixture
async def archive(archive_factory: ArchiveFactory) -> AsyncIterator[JobArchive]:
    published: list[JobEvent] = []
    archive = archive_factory(on_events=published.extend)
    archive.published = published  # type: ignore[attr-defined]
    await archive.open()
    yield archive
    await archive.close()


async def test_writes_at_once_commit_together_in_call_order_and_a_duplicate_fails_alone(
    archive: JobArchive,
) -> None:
    await archive.insert(record("taken"))
    names = [f"job-{n:03d}" for n in range(100)]
    names.insert(50, "taken")
    outcomes = await asyncio.gather(
        *(archive.insert(record(name)) for name in names), return_exceptions=True
    )
    assert [type(outcome) for outcome in outcomes].count(DuplicateJobError) == 1
    assert isinstance(outcomes[50], DuplicateJobError)
    # Every answered write is on disk: another connection reads them, in the order called.
    rows = [
        row[0] for row in committed_rows(archive, "SELECT submission_id FROM jobs ORDER BY seq")
    ]
    assert rows == ["taken", *(name for name in names if name != "taken")]
    published = archive.published  # type: ignore[attr-defined]
    assert [event.submission_id for event in published] == rows
    assert [event.id for event in published] == sorted(event.id for event in published)


async def test_updates_and_deletes_share_batches_with_inserts(archive: JobArchive) -> None:
    first = record("first")
    await archive.insert(first)
    running = first.with_changes(status=JobStatus.RUNNING)
    ended = first.with_changes(status=JobStatus.SUCCEEDED, end_time=2)
    second = record("second")
    stored_running, inserted, stored_ended, deleted_unknown = await asyncio.gather(
        archive.update(running),
        archive.insert(second),
        archive.update(ended),
        archive.delete("unknown"),
    )
    assert stored_running == running
    assert inserted is None
    assert stored_ended == ended
    assert deleted_unknown is False
    assert (await archive.get("first")) == ended
    assert (await archive.get("second")) == second
    # The first terminal status wins, batched or not.
    assert await archive.update(first.with_changes(status=JobStatus.FAILED)) == ended


async def test_new_jobs_added_together_are_as_if_added_one_by_one(archive: JobArchive) -> None:
    """A batch adds its new jobs in one statement per table (new_rows.py): their metadata,
    an imported job's second event, the events' numbers in call order, and two submits of one
    new id in the same batch (the first wins)."""
    await archive.insert(record("before"))
    tagged = record("tagged").model_copy(
        update={"spec": JobSpec(entrypoint="true", submission_id="tagged", metadata={"team": "a"})}
    )
    imported = record("imported").with_changes(status=JobStatus.RUNNING, driver_pid=7)
    burst = [record(f"job-{n:03d}") for n in range(150)]
    burst[10:10] = [tagged, imported]
    burst[30:30] = [record("twice")]
    burst[40:40] = [record("twice")]
    outcomes = await asyncio.gather(*(archive.insert(job) for job in burst), return_exceptions=True)
    assert [index for index, outcome in enumerate(outcomes) if outcome is not None] == [40]
    assert isinstance(outcomes[40], DuplicateJobError)
    added = [job.submission_id for index, job in enumerate(burst) if index != 40]
    rows = [
        row[0] for row in committed_rows(archive, "SELECT submission_id FROM jobs ORDER BY seq")
    ]
    stored_events = committed_rows(
        archive, "SELECT id, type, submission_id FROM events ORDER BY id"
    )
    stored = [(row[1], row[2]) for row in stored_events]
    assert rows == ["before", *added]
    expected = [("submitted", name) for name in ["before", *added]]
    expected.insert(expected.index(("submitted", "imported")) + 1, ("status", "imported"))
    assert stored == expected
    published = archive.published  # type: ignore[attr-defined]
    assert [(event.type.value, event.submission_id) for event in published] == expected
    assert [event.id for event in published] == list(range(1, len(expected) + 1))
    (page, _) = await archive.page(JobQuery(metadata=(("team", "a"),)))
    assert [job.submission_id for job in page] == ["tagged"]
    assert (await archive.get("imported")) == imported


async def test_event_numbers_added_together_are_never_reused_after_trimming(
    archive_factory: ArchiveFactory,
) -> None:
    archive = archive_factory(max_events=5)
    await archive.open()
    try:
        numbers: list[int] = []
        for round_ in range(3):
            await asyncio.gather(*(archive.insert(record(f"r{round_}-{n}")) for n in range(20)))
            numbers += [event.id for event in await archive.events_after(max(numbers or [0]), 100)]
            await archive.delete(f"r{round_}-0")
        assert (await archive.event_id_range())[1] == 3 * 21
        assert numbers == sorted(set(numbers))  # increasing, none given twice
    finally:
        await archive.close()
