"""The archive and the KV at a server's start (issue 14, items 1 and 2): a job archived but never
handed over runs, a KV record the archive lacks is imported, an ended run leaves the KV. Real
Ray, a real manager, the archive on disk."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from jobs_server.manager import JobRecord, JobSpec, JobStatus
from jobs_server.manager.archive.sqlite import Archive, archive_path
from jobs_server.manager.live.kv import GcsKv
from jobs_server.manager.live.store import JobStore
from jobs_server.manager.records import new_run_id, now_ms
from tests.support.managers import running_manager
from tests.support.ray_nodes import kill_actors_in_namespace


def pending(submission_id: str) -> JobRecord:
    return JobRecord(
        spec=JobSpec(entrypoint="echo ran", submission_id=submission_id),
        start_time=now_ms(),
        message="Job is pending.",
        run_id=new_run_id(),
    )


async def until(predicate: Callable[[], object], what: str) -> None:
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if await predicate():  # type: ignore[misc]
            return
        await asyncio.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


async def test_a_job_archived_but_never_handed_over_runs_and_one_only_in_the_kv_is_imported(
    ray_connection: str, tmp_path: Path
) -> None:
    namespace = f"test_recover_{uuid.uuid4().hex[:8]}"
    state_dir = tmp_path / "state"
    # The server died between archiving `accepted` and writing it to the KV; an older server
    # (no archive) left `legacy` in the KV only.
    archive = Archive(archive_path(state_dir))
    await archive.open()
    await archive.insert(pending("accepted"))
    await archive.close()
    kv = GcsKv(ray_connection, namespace)
    await JobStore(kv).create(pending("legacy"))
    try:
        async with running_manager(ray_connection, namespace, state_dir) as (manager, _):

            async def both_succeeded() -> bool:
                statuses = {
                    job_id: (await manager.get_job(job_id)).status
                    for job_id in ("accepted", "legacy")
                }
                return set(statuses.values()) == {JobStatus.SUCCEEDED}

            await until(both_succeeded, "both jobs to succeed")
            listed = await manager.list_jobs()
            assert [record.submission_id for record in listed.records] == ["accepted", "legacy"]

            # Once archived as ended, a run is gone from the KV: it holds live jobs only.
            async def kv_empty() -> bool:
                return await kv.keys_with_prefix("") == []

            await until(kv_empty, "the KV to forget the ended runs")
            assert (await manager.get_job("legacy")).status is JobStatus.SUCCEEDED
    finally:
        kill_actors_in_namespace(namespace)
