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

from jobs_server.app import create_app
from jobs_server.app_state import JOB_MANAGER_KEY
from jobs_server.manager.records import JobRecord, JobStatus
from jobs_server.settings import Settings
from tests.support.api import Client, submit, wait_for_status


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

    async def held_start(record: JobRecord, **known: Any) -> None:
        await release.wait()
        await learn_started(record, **known)

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
        # Counted as listed; the archive's one PENDING moved on, so no PENDING (not a 0).
        assert await manager.count_by_status() == {
            JobStatus.RUNNING: 1,
            JobStatus.SUCCEEDED: 1,
        }
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


async def test_a_polled_list_parses_only_what_changed_since_the_last_poll(
    client: Client, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A dashboard polls a status-filtered list, which reads every live job from the archive
    and the KV: a job's text that was parsed before is not parsed again, and one that changed
    is (the list is never stale)."""
    gates = [tmp_path / f"gate-{index}" for index in range(3)]
    jobs = [
        await submit(client, entrypoint=f"while [ ! -e {gate} ]; do sleep 0.05; done")
        for gate in gates
    ]
    try:
        for job in jobs:
            await wait_for_status(client, job, {"RUNNING"})
        # Until every job's archived row says RUNNING too (the archive learns it a moment
        # after the KV), a poll may still meet a text it has not seen.
        archive = client.app[JOB_MANAGER_KEY]._archive
        for _ in range(200):
            rows = [await archive.get(job) for job in jobs]
            if all(row is not None and row.status is JobStatus.RUNNING for row in rows):
                break
            await asyncio.sleep(0.05)
        assert await listed(client, "status=RUNNING") == dict.fromkeys(jobs, "RUNNING")

        parsed: list[str | bytes] = []
        parse = JobRecord.model_validate_json

        def counting_parse(text: str | bytes, *args: Any, **kwargs: Any) -> JobRecord:
            parsed.append(text)
            return parse(text, *args, **kwargs)

        monkeypatch.setattr(JobRecord, "model_validate_json", counting_parse)
        running = dict.fromkeys(jobs, "RUNNING")
        for query, expected in (("status=RUNNING", running), ("status=PENDING", {}), ("", running)):
            assert await listed(client, query) == expected, query
        assert len(await listed(client, "status=RUNNING&limit=2")) == 2
        assert parsed == []

        gates[0].touch()
        await wait_for_status(client, jobs[0], {"SUCCEEDED"})
        assert await listed(client, "status=RUNNING") == dict.fromkeys(jobs[1:], "RUNNING")
        assert parsed  # the ended job's new text
    finally:
        for gate in gates:
            gate.touch()
