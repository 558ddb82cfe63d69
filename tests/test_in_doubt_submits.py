"""A submit whose COMMIT reached the database but whose answer was lost (issue 34, item 1: a
retried request is safe, nothing submitted is lost): the client is told 503 and that the job
may have been recorded; once the database answers, the server reads the job back and runs it
(no restart), and a retry of the submit finds it (409) instead of making a second job. A real
server on the session's Ray, a real PostgreSQL behind a loopback proxy that loses that answer
(tests/support/commit_answer_loss.py). And the read-back itself on both stores."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import psycopg
import pytest
from aiohttp.test_utils import TestClient
from pydantic import SecretStr

from jobs_server.app import create_app
from jobs_server.manager.archive.interface import JobArchive
from jobs_server.manager.in_doubt_submits import InDoubtSubmits
from jobs_server.manager.records import JobRecord, JobSpec, JobStatus, new_run_id, now_ms
from jobs_server.settings import Settings
from tests.support.api import wait_for_status
from tests.support.commit_answer_loss import commit_answer_loss
from tests.support.postgres import PostgresServer

Client = TestClient[Any, Any]

DEADLINE_S = 30.0


def archived_rows(database_url: str, submission_id: str) -> list[tuple[str, str]]:
    """The job's rows as committed (a connection of its own, not through the proxy)."""
    with psycopg.connect(database_url) as db:
        rows = db.execute(
            "SELECT submission_id, status FROM jobs WHERE submission_id = %s", (submission_id,)
        ).fetchall()
    return [(str(sid), str(status)) for sid, status in rows]


# How long the database stays away after the lost answer: none (the pool reconnects at once),
# or long enough that the read-back and a retry of the submit meet the outage first.
AWAY_S = [0.0, 4.0]


@pytest.mark.postgres
@pytest.mark.ray
@pytest.mark.parametrize("away_s", AWAY_S, ids=["back-at-once", "away-for-a-while"])
async def test_a_submit_whose_commit_answer_was_lost_runs_once_the_database_answers(
    aiohttp_client: Callable[..., Awaitable[Client]],
    settings: Settings,
    postgres_server: PostgresServer,
    away_s: float,
) -> None:
    database_url = postgres_server.create_database()
    job_id = "in-doubt-submit"
    try:
        with commit_answer_loss(postgres_server.port) as proxy:
            via_proxy = proxy.url(database_url.rsplit("/", 1)[1])
            client = await aiohttp_client(
                create_app(settings.model_copy(update={"database_url": SecretStr(via_proxy)}))
            )
            try:
                body = {"entrypoint": "echo ran", "submission_id": job_id}
                proxy.arm(job_id.encode(), away_after=away_s > 0)
                response = await client.post("/api/jobs/", json=body)
                assert proxy.answer_lost.is_set(), "the proxy lost no COMMIT's answer"
                assert response.status == 503, await response.text()
                assert int(response.headers["Retry-After"]) > 0
                error = (await response.json())["error"]
                assert error["code"] == "database_unavailable"
                assert "may have recorded it" in error["message"]
                # The database did commit it: the answer alone was lost.
                assert await asyncio.to_thread(archived_rows, database_url, job_id) == [
                    (job_id, "PENDING")
                ]

                if away_s:
                    # A retry while the database is away: in doubt too (another run of the id).
                    retried = await client.post("/api/jobs/", json=body)
                    assert retried.status == 503, await retried.text()
                    await asyncio.sleep(away_s)  # the outage's length, not a wait for a state
                    assert await asyncio.to_thread(archived_rows, database_url, job_id) == [
                        (job_id, "PENDING")
                    ]
                    proxy.reconnect()

                # The database answers again (the pool reconnects through the disarmed proxy):
                # the job runs to its end, no restart.
                job = await wait_for_status(client, job_id, timeout_s=DEADLINE_S)
                assert job["status"] == "SUCCEEDED", job
                logs = await client.get(f"/api/jobs/{job_id}/logs")
                assert (await logs.json())["logs"] == "ran\n"

                # The client's retry makes no second job: the first is there.
                retry = await client.post("/api/jobs/", json=body)
                assert retry.status == 409, await retry.text()
                assert (await retry.json())["error"]["code"] == "duplicate_submission_id"
                listed = await (await client.get("/api/jobs/")).json()
                assert [(j["submission_id"], j["status"]) for j in listed] == [
                    (job_id, "SUCCEEDED")
                ]
            finally:
                await client.close()
    finally:
        postgres_server.drop_database(database_url)


def pending(submission_id: str) -> JobRecord:
    return JobRecord(
        spec=JobSpec(entrypoint="true", submission_id=submission_id),
        start_time=now_ms(),
        run_id=new_run_id(),
    )


async def test_a_read_back_queues_the_recorded_run_and_forgets_the_others(
    archive: JobArchive,
) -> None:
    recorded, absent, replaced = pending("recorded"), pending("absent"), pending("replaced")
    other_run = pending("replaced")
    await archive.insert(recorded)
    await archive.insert(other_run)
    queued: list[JobRecord] = []
    in_doubt = InDoubtSubmits(archive=archive, on_recorded=queued.append)
    try:
        for record in (recorded, absent, replaced):
            in_doubt.add(record)
        assert len(in_doubt) == 3
        for _ in range(int(DEADLINE_S / 0.05)):
            if not len(in_doubt):
                break
            await asyncio.sleep(0.05)
        assert len(in_doubt) == 0
        assert [(r.submission_id, r.run_id, r.status) for r in queued] == [
            ("recorded", recorded.run_id, JobStatus.PENDING)
        ]
    finally:
        await in_doubt.close()
