"""The archive's PostgreSQL store where it differs from SQLite (issue 34, item 1): event ids become
visible in commit order when transactions of two servers interleave, migrations at start (once,
when servers start together; a newer schema refused), and a real server whose history is in
PostgreSQL across a restart. The queries and writes both stores share are tested on both by
the `archive` fixture (tests/test_archive.py and the retention tests)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

import psycopg
import pytest
import requests

from jobs_server.cli import _forget_secrets_in_environment, load_settings
from jobs_server.manager.archive import postgres as postgres_module
from jobs_server.manager.archive.postgres import PostgresArchive
from jobs_server.manager.archive.queries import JobQuery
from jobs_server.manager.archive.schema_versions import Migration, SchemaTooNewError
from jobs_server.manager.records import JobRecord, JobSpec, JobStatus, new_run_id
from tests.support.processes import free_port, stop_leader_then_group, wait_until
from tests.support.servers import start_jobs_server, wait_for_server

pytestmark = pytest.mark.postgres

DEADLINE_S = 10.0


def record(submission_id: str) -> JobRecord:
    return JobRecord(
        spec=JobSpec(entrypoint="true", submission_id=submission_id), run_id=new_run_id()
    )


async def waiting_for_a_lock(url: str) -> bool:
    """Whether a session of the database waits for an advisory lock now."""
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as db:
        cursor = await db.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
        )
        row = await cursor.fetchone()
        return row is not None and row[0] > 0


async def test_an_event_id_is_visible_only_after_every_smaller_one(postgres_url: str) -> None:
    """Two servers on one database: A's transaction has taken its event's id and not committed
    yet when B writes an event. Were B's (larger) id committed first, a reader that saw it and
    resumes "after" it would never see A's. B must wait for A instead."""
    server_a, server_b, reader = (PostgresArchive(postgres_url) for _ in range(3))
    for archive in (server_a, server_b, reader):
        await archive.open()
    try:
        job = record("first")
        await server_a.insert(job)
        holding, release = asyncio.Event(), asyncio.Event()
        trim_events = server_a._trim_events

        async def held_before_commit(db: postgres_module.Connection) -> None:
            # The batch's events are inserted: hold its transaction open here.
            holding.set()
            await release.wait()
            await trim_events(db)

        server_a._trim_events = held_before_commit  # type: ignore[method-assign]
        update = asyncio.create_task(server_a.update(job.with_changes(status=JobStatus.RUNNING)))
        await asyncio.wait_for(holding.wait(), DEADLINE_S)
        insert = asyncio.create_task(server_b.insert(record("second")))
        deadline = time.monotonic() + DEADLINE_S
        while not insert.done() and not await waiting_for_a_lock(postgres_url):
            assert time.monotonic() < deadline, "B neither committed nor waited"
            await asyncio.sleep(0.05)

        seen = await reader.events_after(0, 100)
        cursor = max(event.id for event in seen)
        release.set()
        await asyncio.wait_for(asyncio.gather(update, insert), DEADLINE_S)
        resumed = await reader.events_after(cursor, 100)
        every = await reader.events_after(0, 100)
        assert [event.submission_id for event in every] == ["first", "first", "second"]
        assert [event.id for event in seen + resumed] == [event.id for event in every]
    finally:
        release.set()
        for archive in (server_a, server_b, reader):
            await archive.close()


async def test_servers_that_start_together_migrate_once(postgres_url: str) -> None:
    archives = [PostgresArchive(postgres_url) for _ in range(4)]
    await asyncio.gather(*(archive.open() for archive in archives))
    try:
        await archives[0].insert(record("a"))
        assert [job.submission_id for job in (await archives[3].page(JobQuery()))[0]] == ["a"]
        async with await psycopg.AsyncConnection.connect(postgres_url) as db:
            cursor = await db.execute("SELECT version FROM schema_version")
            assert await cursor.fetchall() == [(len(postgres_module._MIGRATIONS),)]
    finally:
        for archive in archives:
            await archive.close()


async def test_a_newer_schema_is_refused(postgres_url: str) -> None:
    async with await psycopg.AsyncConnection.connect(postgres_url, autocommit=True) as db:
        await db.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
        await db.execute("INSERT INTO schema_version VALUES (99)")
    archive = PostgresArchive(postgres_url)
    with pytest.raises(SchemaTooNewError, match="newer"):
        await archive.open()
    await archive.close()


def _start_server(
    tmp_path: Path, name: str, ray_cluster: str, database_url: str, namespace: str
) -> tuple[str, subprocess.Popen[bytes]]:
    port = free_port()
    workdir = tmp_path / name
    workdir.mkdir()
    log_path = workdir / "server.log"
    process = start_jobs_server(
        [
            *("--port", str(port)),
            *("--ray-address", ray_cluster),
            *("--state-dir", str(workdir / "state")),
            *("--database-url", database_url),
            *("--namespace", namespace),
        ],
        log_path,
    )
    url = f"http://127.0.0.1:{port}"
    wait_for_server(url, process, log_path, timeout_s=120)
    return url, process


@pytest.mark.slow
def test_a_server_keeps_its_history_in_postgres_across_a_restart(
    tmp_path: Path, ray_cluster: str, postgres_url: str
) -> None:
    """A job submitted to a server on `--database-url` is listed by the next server on that
    database, though its state dir is another (nothing of the history is in a state dir)."""
    namespace = f"test_postgres_{uuid.uuid4().hex[:8]}"
    url, process = _start_server(tmp_path, "first", ray_cluster, postgres_url, namespace)
    try:
        response = requests.post(
            f"{url}/api/jobs/",
            json={"entrypoint": "echo hello", "submission_id": "kept", "metadata": {"k": "v"}},
            timeout=60,
        )
        assert response.status_code == 200, response.text

        def ended() -> bool:
            job = requests.get(f"{url}/api/jobs/kept", timeout=30).json()
            return bool(job["status"] == "SUCCEEDED")

        wait_until(ended, 120, "the job to succeed")
    finally:
        stop_leader_then_group(process, signal.SIGTERM, timeout_s=60)
    assert not (tmp_path / "first" / "state" / "jobs.db").exists()

    url, process = _start_server(tmp_path, "second", ray_cluster, postgres_url, namespace)
    try:
        jobs = requests.get(f"{url}/api/jobs/?metadata.k=v", timeout=30).json()
        assert [(job["submission_id"], job["status"]) for job in jobs] == [("kept", "SUCCEEDED")]
        response = requests.post(
            f"{url}/api/jobs/", json={"entrypoint": "true", "submission_id": "kept"}, timeout=60
        )
        assert response.status_code == 409, response.text
    finally:
        stop_leader_then_group(process, signal.SIGTERM, timeout_s=60)


def test_the_database_url_is_gone_from_the_environment_jobs_inherit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its password is the database's: an embedded Ray's processes, and so every job, inherit
    the server's environment, where it was read from (as the token is)."""
    monkeypatch.setenv("JOBS_SERVER_DATABASE_URL", "postgresql://jobs:pw-7f3a9c@db/jobs")
    monkeypatch.setenv("JOBS_SERVER_AUTH_TOKEN", "token")
    settings = load_settings({})
    _forget_secrets_in_environment()
    assert "JOBS_SERVER_DATABASE_URL" not in os.environ
    assert "JOBS_SERVER_AUTH_TOKEN" not in os.environ
    assert settings.database_url is not None
    assert settings.database_url.get_secret_value() == "postgresql://jobs:pw-7f3a9c@db/jobs"
    assert "pw-7f3a9c" not in repr(settings)


async def test_a_database_of_an_older_schema_is_migrated_in_place(
    postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server of the next schema version finds the history of this one: it adds what its
    migration adds, in place, and every job is still there."""
    archive = PostgresArchive(postgres_url)
    await archive.open()
    await archive.insert(record("before"))
    await archive.close()
    released = postgres_module._MIGRATIONS
    monkeypatch.setattr(
        postgres_module,
        "_MIGRATIONS",
        (
            *released,
            Migration(("ALTER TABLE jobs ADD COLUMN note TEXT",), readable_by_previous=True),
        ),
    )
    upgraded = PostgresArchive(postgres_url)
    await upgraded.open()
    try:
        assert [job.submission_id for job in await upgraded.unfinished()] == ["before"]
        await upgraded.insert(record("after"))
    finally:
        await upgraded.close()
    async with await psycopg.AsyncConnection.connect(postgres_url) as db:
        cursor = await db.execute("SELECT version FROM schema_version")
        assert await cursor.fetchall() == [(len(released) + 1,)]
        cursor = await db.execute("SELECT submission_id, note FROM jobs ORDER BY seq")
        assert await cursor.fetchall() == [("before", None), ("after", None)]


async def test_a_write_whose_commit_is_cancelled_is_answered(postgres_url: str) -> None:
    """The task that commits the writes is cancelled mid-transaction (the loop going away):
    the callers waiting for it are cancelled too, not left waiting forever, and nothing of the
    transaction is committed."""
    archive = PostgresArchive(postgres_url)
    await archive.open()
    holding = asyncio.Event()

    async def held_before_commit(db: postgres_module.Connection) -> None:
        holding.set()
        await asyncio.Event().wait()

    archive._trim_events = held_before_commit  # type: ignore[method-assign]
    insert = asyncio.create_task(archive.insert(record("a")))
    await asyncio.wait_for(holding.wait(), DEADLINE_S)
    committing = archive._committing
    assert committing is not None
    committing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(insert, DEADLINE_S)
    await archive.close()
    reopened = PostgresArchive(postgres_url)
    await reopened.open()
    try:
        assert await reopened.get("a") is None
        assert await reopened.event_id_range() == (0, 0)
    finally:
        await reopened.close()
