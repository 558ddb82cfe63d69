"""A retry is an event (issue 36: `job.retrying`): the server learns each failed attempt that
another follows while the job is RUNNING still, so the archive writes its status event (and its
webhooks' deliveries). Real Ray, real processes, a real server; on a shared supervisor (runs
handed over and reported in batches) and on one of the job's own."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from jobs_server.app import create_app
from jobs_server.manager.live.history import JobHistory
from jobs_server.manager.records import JobRecord
from jobs_server.settings import Settings
from tests.support.api import Client, submit, wait_for_status
from tests.support.commands import counted

MakeClient = Callable[..., Awaitable[Client]]

BACKOFF_S = 0.2
# Longer than the job's attempts take, shorter than its end waits for its retries
# (watcher.RETRIES_SETTLE_S).
SLOW_ARCHIVE_S = 3.0
READ_TIMEOUT_S = 30.0


async def events_until(
    client: Client, job_id: str, status: str, ended: int | None = None
) -> list[dict[str, Any]]:
    """The job's events in GET /api/events (NDJSON, from the first), up to its `status` (with
    `ended` attempts ended, if given)."""
    response = await client.get(
        "/api/events", params={"format": "ndjson", "after": "0", "submission_id": job_id}
    )
    assert response.status == 200, await response.text()
    lines = []
    try:
        while True:
            raw = await asyncio.wait_for(response.content.readline(), READ_TIMEOUT_S)
            assert raw, "the stream ended"
            line = json.loads(raw)
            if line["type"] == "heartbeat":
                continue
            lines.append(line)
            if line["status"] == status and ended in (None, ended_attempts(line)):
                return lines
    finally:
        response.close()


def ended_attempts(line: dict[str, Any]) -> int:
    return sum(1 for attempt in line["job"]["attempts"] if attempt["end_time"] is not None)


@pytest.mark.parametrize(
    ("shared_supervisors", "backoff_s"),
    [(1, BACKOFF_S), (0, BACKOFF_S), (1, 0.0)],
    ids=["shared", "own-supervisor", "no-backoff"],
)
async def test_each_failed_attempt_retried_is_a_status_event_before_the_end(
    aiohttp_client: MakeClient,
    settings: Settings,
    tmp_path: Path,
    shared_supervisors: int,
    backoff_s: float,
) -> None:
    client = await aiohttp_client(
        create_app(
            settings.model_copy(
                update={"retry_backoff_s": backoff_s, "shared_supervisors": shared_supervisors}
            )
        )
    )
    counter = tmp_path / "attempts"
    entrypoint = counted(counter, "if [ $n -lt 3 ]; then exit 7; fi; echo done")
    job_id = await submit(client, entrypoint=entrypoint, max_retries=2)
    job = await wait_for_status(client, job_id)
    assert [attempt["exit_code"] for attempt in job["attempts"]] == [7, 7, 0]

    lines = await events_until(client, job_id, "SUCCEEDED")
    assert [(line["type"], line["status"]) for line in lines] == [
        ("submitted", "PENDING"),
        ("status", "RUNNING"),  # its start (with its first attempt's end, if that came first)
        ("status", "RUNNING"),  # the first attempt failed: a retry
        ("status", "RUNNING"),  # the second: a retry
        ("status", "SUCCEEDED"),
    ]
    assert ended_attempts(lines[1]) in (0, 1)
    assert [ended_attempts(line) for line in lines[2:4]] == [1, 2]
    assert all("starts in" in line["job"]["message"] for line in lines[2:4])
    ids = [line["id"] for line in lines]
    assert ids == sorted(ids)


async def test_retries_that_end_before_the_server_asks_are_still_archived(
    aiohttp_client: MakeClient,
    settings: Settings,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The start's archiving is slow (a loaded machine, a slow database), and the server asks
    for the retries only after it: the job's attempts have all ended by then, and its
    supervisor has forgotten the run. The retries must still be archived, each an event before
    the end (fresh-clone run O lost the last one this way)."""
    learn_started = JobHistory.learn_started
    slowed: list[str] = []

    async def slow_first(
        self: JobHistory, record: JobRecord, *, written: JobRecord | None = None
    ) -> None:
        if not slowed:
            slowed.append(record.submission_id)
            await asyncio.sleep(SLOW_ARCHIVE_S)
        await learn_started(self, record, written=written)

    monkeypatch.setattr(JobHistory, "learn_started", slow_first)
    client = await aiohttp_client(
        create_app(settings.model_copy(update={"retry_backoff_s": 0.0, "shared_supervisors": 1}))
    )
    counter = tmp_path / "attempts"
    entrypoint = counted(counter, "if [ $n -lt 3 ]; then exit 7; fi; echo done")
    job_id = await submit(client, entrypoint=entrypoint, max_retries=2)
    await wait_for_status(client, job_id)
    lines = await events_until(client, job_id, "SUCCEEDED")
    assert slowed == [job_id]
    assert [(line["status"], ended_attempts(line)) for line in lines[-3:]] == [
        ("RUNNING", 1),
        ("RUNNING", 2),
        ("SUCCEEDED", 3),
    ]


async def test_a_job_without_retries_has_one_event_per_status(
    aiohttp_client: MakeClient, settings: Settings
) -> None:
    client = await aiohttp_client(create_app(settings))
    job_id = await submit(client, entrypoint="sleep 0.5; exit 3")
    assert (await wait_for_status(client, job_id))["status"] == "FAILED"
    lines = await events_until(client, job_id, "FAILED")
    assert [(line["type"], line["status"]) for line in lines] == [
        ("submitted", "PENDING"),
        ("status", "RUNNING"),
        ("status", "FAILED"),
    ]


async def test_a_retry_is_an_event_while_the_job_waits_for_its_next_attempt(
    aiohttp_client: MakeClient, settings: Settings
) -> None:
    """Learnt as it happens, not with the end: here the end is a stop during the back-off."""
    client = await aiohttp_client(create_app(settings.model_copy(update={"retry_backoff_s": 120})))
    job_id = await submit(client, entrypoint="sleep 0.5; exit 7", max_retries=1)
    retry = (await events_until(client, job_id, "RUNNING", ended=1))[-1]
    assert "attempt 2 starts in 120 s" in retry["job"]["message"]
    assert (await client.post(f"/api/jobs/{job_id}/stop")).status == 200
    lines = await events_until(client, job_id, "STOPPED")
    assert [(line["status"], ended_attempts(line)) for line in lines[1:]] == [
        ("RUNNING", 0),
        ("RUNNING", 1),
        ("STOPPED", 1),
    ]
