"""Followers of a queued job's log wait for its hand-over without reading the archive.

A queued job has no process and no log yet; its log's one watcher asks, every tick, whether the
job has ended. The queue knows in memory that it has not: reading the archive's row for it, 100
times a second for as long as it waits, is work for nothing.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from jobs_server.manager.records import JobStatus
from tests.support.queue import TERMINAL, gate, queue_manager, spec, until_status

FOLLOWERS = 5


async def test_followers_of_a_queued_job_read_no_archive_rows_while_it_waits(
    ray_connection: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with queue_manager(ray_connection, tmp_path / "state", max_running=1) as manager:
        go = tmp_path / "go"
        await manager.submit_job(spec("blocker", gate(go)))
        await until_status(manager, "blocker", {JobStatus.RUNNING})
        await manager.submit_job(spec("queued", "echo handed-over"))
        assert (await manager.get_job("queued")).status is JobStatus.PENDING

        archive = manager._archive
        rows_read: list[str] = []
        archive_get = archive.get

        async def counted_get(submission_id: str, *args: Any, **kwargs: Any) -> Any:
            rows_read.append(submission_id)
            return await archive_get(submission_id, *args, **kwargs)

        async def follow() -> bytes:
            chunks = await manager.read_logs("queued", follow=True)
            return b"".join([chunk.data async for chunk in chunks])

        followers = [asyncio.create_task(follow()) for _ in range(FOLLOWERS)]
        await asyncio.sleep(0.2)  # every follower is waiting on the log's watcher
        monkeypatch.setattr(archive, "get", counted_get)
        await asyncio.sleep(1.0)  # about 100 ticks of the watcher
        assert rows_read.count("queued") == 0
        assert not any(follower.done() for follower in followers)

        monkeypatch.setattr(archive, "get", archive_get)
        go.touch()  # the blocker ends; the queued job is handed over and runs
        logs = await asyncio.wait_for(asyncio.gather(*followers), 120)
        assert logs == [b"handed-over\n"] * FOLLOWERS
        assert (await until_status(manager, "queued", TERMINAL)).status is JobStatus.SUCCEEDED
