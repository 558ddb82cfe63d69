"""A list filtered by status lists each job by the status it has now, the one its GET shows:
also while the archive has not learned it yet (the KV, where the supervisor writes, knows
first). Real Ray, a real server; the archive's learning of the start is held back, so the window
in which the two differ stays open while the lists are read."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from jobs_server.app import create_app
from jobs_server.keys import JOB_MANAGER_KEY
from jobs_server.manager.records import JobRecord, JobStatus
from jobs_server.settings import Settings
from tests.conftest import submit, wait_for_status

Client = TestClient[Any, Any]


async def listed(client: Client, query: str) -> dict[str, str]:
    response = await client.get(f"/api/jobs/?{query}")
    assert response.status == 200, await response.text()
    return {job["submission_id"]: job["status"] for job in await response.json()}


async def test_a_status_filter_sees_the_status_a_job_has_now(
    client: Client, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    manager = client.app[JOB_MANAGER_KEY]
    history, archive = manager._history, manager._archive
    release = asyncio.Event()
    learn_started, learn_end = history.learn_started, history.learn_end

    async def held_start(record: JobRecord) -> None:
        await release.wait()
        await learn_started(record)

    async def held_end(record: JobRecord, **known: Any) -> JobRecord | None:
        await release.wait()
        return await learn_end(record, **known)

    gate = tmp_path / "gate"
    other = await submit(client, entrypoint="true")
    await wait_for_status(client, other, {"SUCCEEDED"})
    # From here on the archive learns nothing of a run until released (whichever way its
    # watcher goes: a job that ends at once is archived only ended).
    monkeypatch.setattr(history, "learn_started", held_start)
    monkeypatch.setattr(history, "learn_end", held_end)
    job = await submit(client, entrypoint=f"while [ ! -e {gate} ]; do sleep 0.05; done")
    try:
        await wait_for_status(client, job, {"RUNNING"})
        archived = await archive.get(job)
        assert archived is not None
        assert archived.status is JobStatus.PENDING  # the window is open
        for query in ("status=RUNNING", "status=RUNNING&limit=1", "status=PENDING,RUNNING"):
            assert await listed(client, query) == {job: "RUNNING"}, query
        for query in ("status=PENDING", "status=PENDING&limit=5", "status=SUCCEEDED,FAILED"):
            assert job not in await listed(client, query), query
        assert (await listed(client, "status=SUCCEEDED")) == {other: "SUCCEEDED"}

        gate.touch()
        await wait_for_status(client, job, {"SUCCEEDED"})
        archived = await archive.get(job)
        assert archived is not None
        assert archived.status is JobStatus.PENDING  # still: nothing was archived since
        for query in ("status=SUCCEEDED", "status=SUCCEEDED&limit=5", "status=FAILED,SUCCEEDED"):
            assert await listed(client, query) == {other: "SUCCEEDED", job: "SUCCEEDED"}, query
        # A page of one that ends on the first: the second is on the next page.
        first = await client.get("/api/jobs/?status=SUCCEEDED&limit=1")
        assert [found["submission_id"] for found in await first.json()] == [other]
        for query in ("status=RUNNING", "status=PENDING,RUNNING&limit=5"):
            assert job not in await listed(client, query), query
    finally:
        release.set()
        gate.touch()
    await wait_for_status(client, job, {"SUCCEEDED"})
    assert await listed(client, "status=SUCCEEDED") == {other: "SUCCEEDED", job: "SUCCEEDED"}


async def test_a_list_of_unfinished_jobs_is_empty_only_once_every_job_has_ended(
    aiohttp_client: Callable[..., Awaitable[Client]], settings: Settings
) -> None:
    """A burst over a cap: a client that polls for unfinished jobs (one at a time) and stops
    when there are none has seen every job end."""
    client = await aiohttp_client(create_app(settings.model_copy(update={"max_running_jobs": 4})))
    ids = [f"burst-{index:03d}" for index in range(120)]

    async def post(job_id: str) -> None:
        await submit(client, submission_id=job_id, entrypoint="true")

    posting = asyncio.gather(*(post(job_id) for job_id in ids))
    await asyncio.sleep(0.2)
    deadline = asyncio.get_running_loop().time() + 120
    while await listed(client, "status=PENDING,RUNNING&limit=1"):
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.02)
    await posting
    statuses = await listed(client, "")
    assert [statuses.get(job_id) for job_id in ids] == ["SUCCEEDED"] * len(ids)
