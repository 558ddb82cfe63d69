"""Retention deletes the oldest finished jobs beyond an age or a count, never a live one: the
sweep on the real archive here; through a real server on real Ray below."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from jobs_server.errors import JobNotFoundError
from jobs_server.manager.archive import Archive, JobQuery, archive_path
from jobs_server.manager.records import JobRecord, JobSpec, JobStatus, new_run_id, now_ms
from jobs_server.manager.retention import RETENTION_BATCH_JOBS, Retention, RetentionPolicy

DAY_MS = 24 * 3600 * 1000


@pytest.fixture
async def archive(tmp_path: Path) -> AsyncIterator[Archive]:
    archive = Archive(archive_path(tmp_path / "state"))
    await archive.open()
    yield archive
    await archive.close()


async def add_job(
    archive: Archive, submission_id: str, *, status: JobStatus, ended_ms_ago: int = 0
) -> JobRecord:
    now = now_ms()
    record = JobRecord(
        spec=JobSpec(entrypoint="true", submission_id=submission_id),
        start_time=now - ended_ms_ago - 1000,
        run_id=new_run_id(),
    )
    await archive.insert(record)
    if status is not JobStatus.PENDING:
        end_time = now - ended_ms_ago if status.is_terminal() else None
        record = record.with_changes(status=status, end_time=end_time)
        await archive.update(record)
    return record


def retention(archive: Archive, *, max_age_s: float, max_jobs: int) -> tuple[Retention, list[int]]:
    counted: list[int] = []

    async def delete_job(record: JobRecord) -> bool:
        return await archive.delete(record.submission_id, record.run_id)

    policy = RetentionPolicy(max_age_s=max_age_s, max_jobs=max_jobs, interval_s=3600)
    return Retention(
        archive=archive, delete_job=delete_job, policy=policy, on_deleted=counted.append
    ), counted


async def kept(archive: Archive) -> list[str]:
    return [record.submission_id for record in (await archive.page(JobQuery()))[0]]


async def test_finished_jobs_older_than_the_age_go_live_ones_stay(archive: Archive) -> None:
    await add_job(archive, "old-done", status=JobStatus.SUCCEEDED, ended_ms_ago=3 * DAY_MS)
    await add_job(archive, "old-live", status=JobStatus.RUNNING, ended_ms_ago=3 * DAY_MS)
    await add_job(archive, "old-pending", status=JobStatus.PENDING, ended_ms_ago=3 * DAY_MS)
    await add_job(archive, "old-failed", status=JobStatus.FAILED, ended_ms_ago=2 * DAY_MS)
    await add_job(archive, "recent", status=JobStatus.STOPPED, ended_ms_ago=DAY_MS // 2)
    sweeper, counted = retention(archive, max_age_s=86_400, max_jobs=1000)

    assert await sweeper.sweep() == 2
    assert await kept(archive) == ["old-live", "old-pending", "recent"]
    assert counted == [2]
    assert await sweeper.sweep() == 0
    assert counted == [2]


async def test_beyond_the_count_the_oldest_finished_go(archive: Archive) -> None:
    for number in range(6):
        status = JobStatus.RUNNING if number == 1 else JobStatus.SUCCEEDED
        await add_job(archive, f"job-{number}", status=status)
    sweeper, _ = retention(archive, max_age_s=1e9, max_jobs=3)

    assert await sweeper.sweep() == 2
    # The live job-1 counts among those kept, and stays though it is among the oldest.
    assert await kept(archive) == ["job-1", "job-3", "job-4", "job-5"]


async def test_a_sweep_goes_on_past_one_batch(archive: Archive) -> None:
    total = RETENTION_BATCH_JOBS + 20
    for number in range(total):
        await add_job(archive, f"job-{number}", status=JobStatus.SUCCEEDED)
    sweeper, counted = retention(archive, max_age_s=1e9, max_jobs=10)

    assert await sweeper.sweep() == total - 10
    assert len(await kept(archive)) == 10
    assert sum(counted) == total - 10


async def test_a_job_deleted_meanwhile_is_no_failure(archive: Archive) -> None:
    await add_job(archive, "gone", status=JobStatus.SUCCEEDED, ended_ms_ago=3 * DAY_MS)
    await add_job(archive, "old", status=JobStatus.SUCCEEDED, ended_ms_ago=3 * DAY_MS)

    async def delete_job(record: JobRecord) -> bool:
        if record.submission_id == "gone":
            raise JobNotFoundError("gone")  # a client's DELETE came first
        return await archive.delete(record.submission_id, record.run_id)

    policy = RetentionPolicy(max_age_s=86_400, max_jobs=1000, interval_s=3600)
    sweeper = Retention(archive=archive, delete_job=delete_job, policy=policy)
    assert await sweeper.sweep() == 1
    assert await kept(archive) == ["gone"]


async def test_the_background_task_sweeps_and_is_cancelled_on_close(archive: Archive) -> None:
    await add_job(archive, "old", status=JobStatus.SUCCEEDED, ended_ms_ago=3 * DAY_MS)
    policy = RetentionPolicy(max_age_s=86_400, max_jobs=1000, interval_s=0.01)
    swept = asyncio.Event()

    async def delete_job(record: JobRecord) -> bool:
        deleted = await archive.delete(record.submission_id, record.run_id)
        swept.set()
        return deleted

    sweeper = Retention(archive=archive, delete_job=delete_job, policy=policy)
    await asyncio.sleep(0.05)
    assert not swept.is_set(), "the constructor started the sweep"
    sweeper.start()
    await asyncio.wait_for(swept.wait(), timeout=30)
    await sweeper.close()
    assert await kept(archive) == []
    assert not [task for task in asyncio.all_tasks() if task.get_name() == "retention"]
