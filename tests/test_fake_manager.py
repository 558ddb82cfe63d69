"""The fake manager keeps the real one's rules: the same checks run on both, the real one on the
session's Ray cluster. What the Ray-free tests learn from the fake holds for the server."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from jobs_server.errors import (
    DuplicateJobError,
    InvalidRequestError,
    InvalidRuntimeEnvError,
    JobNotFoundError,
    JobNotTerminalError,
)
from jobs_server.manager import JobManager, JobManagerApi, JobRecord, JobSpec, JobStatus
from jobs_server.manager.archive.event_feed import EventFeed
from jobs_server.manager.archive.sqlite import Archive, JobQuery, archive_path
from tests.support.fakes import FakeJobManager
from tests.support.ray_nodes import kill_actors_in_namespace


@pytest.fixture(params=[pytest.param("real", marks=pytest.mark.ray), "fake"])
async def manager(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[JobManagerApi]:
    log_dir = tmp_path / "logs"
    if request.param == "fake":
        yield FakeJobManager(log_dir, max_package_bytes=1024)
        return
    gcs_address = request.getfixturevalue("ray_connection")
    namespace = f"test_parity_{uuid.uuid4().hex[:8]}"
    archive = Archive(archive_path(tmp_path / "state"))
    await archive.open()
    real = JobManager(
        gcs_address=gcs_address,
        namespace=namespace,
        archive=archive,
        event_feed=EventFeed(archive),
        log_dir=log_dir,
        stop_grace_s=0.5,
        job_start_timeout_s=60,
    )
    await real.start()
    try:
        yield real
    finally:
        await real.close()
        await archive.close()
        kill_actors_in_namespace(namespace)


def spec(submission_id: str, entrypoint: str = "sleep 30", **fields: object) -> JobSpec:
    return JobSpec.model_validate(
        {"submission_id": submission_id, "entrypoint": entrypoint, **fields}
    )


async def until_terminal(manager: JobManagerApi, submission_id: str) -> JobRecord:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        record = await manager.get_job(submission_id)
        if record.status.is_terminal():
            return record
        await asyncio.sleep(0.05)
    raise AssertionError(f"job {submission_id} never ended")


async def test_an_unknown_job_is_not_found_everywhere(manager: JobManagerApi) -> None:
    with pytest.raises(JobNotFoundError):
        await manager.get_job("nope")
    with pytest.raises(JobNotFoundError):
        await manager.stop_job("nope")
    with pytest.raises(JobNotFoundError):
        await manager.delete_job("nope")
    with pytest.raises(JobNotFoundError):
        await manager.read_logs("nope")
    with pytest.raises(JobNotFoundError):
        await manager.log_size("nope")
    with pytest.raises(InvalidRequestError):
        await manager.list_jobs(after="nope")


async def test_a_job_from_submit_to_delete(manager: JobManagerApi) -> None:
    submitted = await manager.submit_job(spec("life-1", metadata={"k": "v"}))
    assert (submitted.status, submitted.message) == (JobStatus.PENDING, "Job is pending.")
    assert submitted.start_time is not None
    with pytest.raises(DuplicateJobError):
        await manager.submit_job(spec("life-1", "echo other"))
    record = await manager.get_job("life-1")
    assert (record.spec.entrypoint, record.spec.metadata) == ("sleep 30", {"k": "v"})
    with pytest.raises(JobNotTerminalError):
        await manager.delete_job("life-1")
    assert await manager.stop_job("life-1", grace_period_s=0) is True
    stopped = await until_terminal(manager, "life-1")
    assert stopped.status is JobStatus.STOPPED
    assert stopped.end_time is not None
    assert await manager.stop_job("life-1") is False
    assert (await manager.get_job("life-1")).status is JobStatus.STOPPED
    await manager.delete_job("life-1")
    with pytest.raises(JobNotFoundError):
        await manager.get_job("life-1")
    assert (await manager.list_jobs()).records == []
    # The id is free again.
    assert (await manager.submit_job(spec("life-1"))).status is JobStatus.PENDING
    await manager.stop_job("life-1", grace_period_s=0)


async def test_a_runtime_env_ray_would_refuse_records_nothing(manager: JobManagerApi) -> None:
    for runtime_env in [
        {"env_vars": {"A": 1}},
        {"working_dir": 5},
        {"working_dir": "gcs://_ray_pkg_00ff.zip"},
        {"py_modules": ["gcs://_ray_pkg_00ff.zip"]},
    ]:
        with pytest.raises(InvalidRuntimeEnvError):
            await manager.submit_job(spec("env-1", runtime_env=runtime_env))
    assert (await manager.list_jobs()).records == []


async def test_lists_keep_submission_order_and_page(manager: JobManagerApi) -> None:
    ids = [f"page-{n}" for n in range(4)]
    for job_id in ids:
        await manager.submit_job(spec(job_id))
    await manager.stop_job("page-2", grace_period_s=0)
    await until_terminal(manager, "page-2")
    listed = await manager.list_jobs()
    assert ([record.submission_id for record in listed.records], listed.next_after) == (ids, None)
    first = await manager.list_jobs(limit=3)
    assert [record.submission_id for record in first.records] == ids[:3]
    assert first.next_after == "page-2"
    rest = await manager.list_jobs(after=first.next_after, limit=3)
    assert ([record.submission_id for record in rest.records], rest.next_after) == (ids[3:], None)
    stopped = await manager.list_jobs(query=JobQuery(statuses=frozenset({JobStatus.STOPPED})))
    assert [record.submission_id for record in stopped.records] == ["page-2"]
    for job_id in ids:
        await manager.stop_job(job_id, grace_period_s=0)


async def test_logs_are_read_from_the_job_log_file(manager: JobManagerApi) -> None:
    await manager.submit_job(spec("logs-1", "printf 'one\\ntwo\\n'"))
    if isinstance(manager, FakeJobManager):  # the fake's job runs what the test says
        manager.start("logs-1")
        manager.write_log("logs-1", b"one\ntwo\n")
        manager.finish("logs-1")
    assert (await until_terminal(manager, "logs-1")).status is JobStatus.SUCCEEDED
    chunks = await manager.read_logs("logs-1", offset=4, follow=True)
    assert b"".join([chunk.data async for chunk in chunks]) == b"two\n"
    assert await manager.log_size("logs-1") == 8
    await manager.delete_job("logs-1")
    with pytest.raises(JobNotFoundError):
        await manager.log_size("logs-1")
