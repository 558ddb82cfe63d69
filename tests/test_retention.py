"""Retention deletes the oldest finished jobs beyond an age or a count, never a live one: the
sweep on the real archive here; through a real server on real Ray below."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from jobs_server.app import create_app
from jobs_server.errors import JobNotFoundError
from jobs_server.manager.archive.interface import JobArchive
from jobs_server.manager.archive.retention import RETENTION_BATCH_JOBS, Retention, RetentionPolicy
from jobs_server.manager.archive.sqlite import JobQuery, archive_path
from jobs_server.manager.live.kv import GcsKv
from jobs_server.manager.logs import job_log_path
from jobs_server.manager.records import JobRecord, JobSpec, JobStatus, new_run_id, now_ms
from jobs_server.settings import Settings
from tests.support.api import Client, submit, wait_for_status

DAY_MS = 24 * 3600 * 1000


async def add_job(
    archive: JobArchive, submission_id: str, *, status: JobStatus, ended_ms_ago: int = 0
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


def retention(
    archive: JobArchive, *, max_age_s: float, max_jobs: int
) -> tuple[Retention, list[int]]:
    counted: list[int] = []

    async def delete_job(record: JobRecord) -> bool:
        return await archive.delete(record.submission_id, record.run_id)

    policy = RetentionPolicy(max_age_s=max_age_s, max_jobs=max_jobs, interval_s=3600)
    return Retention(
        archive=archive, delete_job=delete_job, policy=policy, on_deleted=counted.append
    ), counted


async def kept(archive: JobArchive) -> list[str]:
    return [record.submission_id for record in (await archive.page(JobQuery()))[0]]


async def test_finished_jobs_older_than_the_age_go_live_ones_stay(archive: JobArchive) -> None:
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


async def test_beyond_the_count_the_oldest_finished_go(archive: JobArchive) -> None:
    for number in range(6):
        status = JobStatus.RUNNING if number == 1 else JobStatus.SUCCEEDED
        await add_job(archive, f"job-{number}", status=status)
    sweeper, _ = retention(archive, max_age_s=1e9, max_jobs=3)

    assert await sweeper.sweep() == 2
    # The live job-1 counts among those kept, and stays though it is among the oldest.
    assert await kept(archive) == ["job-1", "job-3", "job-4", "job-5"]


async def test_a_sweep_goes_on_past_one_batch(archive: JobArchive) -> None:
    total = RETENTION_BATCH_JOBS + 20
    for number in range(total):
        await add_job(archive, f"job-{number}", status=JobStatus.SUCCEEDED)
    sweeper, counted = retention(archive, max_age_s=1e9, max_jobs=10)

    assert await sweeper.sweep() == total - 10
    assert len(await kept(archive)) == 10
    assert sum(counted) == total - 10


async def test_a_job_deleted_meanwhile_is_no_failure(archive: JobArchive) -> None:
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


async def test_the_background_task_sweeps_and_is_cancelled_on_close(archive: JobArchive) -> None:
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


# Through a real server on real Ray: the record, the KV entry and the log file go, a `deleted`
# event is written, the metric counts, and a live job stays.

RETENTION_TIMEOUT_S = 60.0


async def listed(client: Client) -> dict[str, str]:
    response = await client.get("/api/jobs/")
    assert response.status == 200, await response.text()
    return {job["submission_id"]: job["status"] for job in await response.json()}


async def wait_for_listed(client: Client, expected: dict[str, str]) -> None:
    deadline = time.monotonic() + RETENTION_TIMEOUT_S
    while (jobs := await listed(client)) != expected:
        assert time.monotonic() < deadline, f"listed {jobs}, waiting for {expected}"
        await asyncio.sleep(0.05)


async def deleted_metric(client: Client) -> float:
    text = await (await client.get("/metrics")).text()
    [line] = [
        line
        for line in text.splitlines()
        if line.startswith("jobs_server_retention_deleted_jobs_total")
    ]
    return float(line.split()[-1])


async def assert_forgotten(client: Client, settings: Settings, job_id: str) -> None:
    assert (await client.get(f"/api/jobs/{job_id}")).status == 404
    assert not job_log_path(settings.log_dir, job_id).exists()
    kv = GcsKv(settings.ray_address or "", settings.namespace)
    assert [key for key in await kv.keys_with_prefix("") if job_id in key] == []
    with sqlite3.connect(archive_path(settings.state_dir)) as database:
        events = database.execute(
            "SELECT type FROM events WHERE submission_id = ? ORDER BY id", (job_id,)
        ).fetchall()
    assert events[-1] == ("deleted",)


def waiting_for(marker: Path) -> str:
    return f"while [ ! -e {marker} ]; do sleep 0.05; done; echo live"


@pytest.fixture
def retention_settings(settings: Settings) -> Settings:
    return settings.model_copy(update={"retention_interval_s": 0.1})


async def test_beyond_the_count_the_oldest_finished_jobs_go_never_a_live_one(
    aiohttp_client: Callable[..., Awaitable[Client]],
    retention_settings: Settings,
    tmp_path: Path,
) -> None:
    settings = retention_settings.model_copy(update={"retention_max_jobs": 3})
    client = await aiohttp_client(create_app(settings))
    marker = tmp_path / "go-on"
    live = await submit(client, entrypoint=waiting_for(marker))
    await wait_for_status(client, live, {"RUNNING"})
    finished = [await submit(client, entrypoint=f"echo job-{number}") for number in range(4)]

    # The live job is the oldest but stays (it counts among the 3 kept): the oldest finished go.
    await wait_for_listed(
        client, {live: "RUNNING", **{job_id: "SUCCEEDED" for job_id in finished[1:]}}
    )
    await assert_forgotten(client, settings, finished[0])
    assert await deleted_metric(client) == 1
    assert all(job_log_path(settings.log_dir, job_id).exists() for job_id in finished[1:])

    marker.touch()  # now it has ended, it is the oldest finished job beyond the count
    await wait_for_listed(client, {job_id: "SUCCEEDED" for job_id in finished[1:]})
    await assert_forgotten(client, settings, live)
    assert await deleted_metric(client) == 2


async def test_finished_jobs_older_than_the_age_go_a_live_one_stays(
    aiohttp_client: Callable[..., Awaitable[Client]],
    retention_settings: Settings,
    tmp_path: Path,
) -> None:
    settings = retention_settings.model_copy(update={"retention_max_age_s": 1.0})
    client = await aiohttp_client(create_app(settings))
    marker = tmp_path / "go-on"
    live = await submit(client, entrypoint=waiting_for(marker))
    await wait_for_status(client, live, {"RUNNING"})
    done = await submit(client, entrypoint="echo done")

    await wait_for_listed(client, {live: "RUNNING"})
    await assert_forgotten(client, settings, done)
    marker.touch()
    await wait_for_listed(client, {})
    await assert_forgotten(client, settings, live)
