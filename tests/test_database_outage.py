"""What a client and an operator see while the PostgreSQL database of a server on `--database-url`
is away (issue 34, item 1; the restart test of item 3 builds on it): every request that needs the
archive answers 503 `database_unavailable` with a Retry-After (never a 500 or a traceback),
`/api/healthz` says so, nothing accepted before is lost, and once the database is back the same
server serves again (its pool reconnects) and a job that ended during the outage is archived
with its true end. And a full disk on PostgreSQL is the disk guard's 507, as SQLite's is."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
import requests

from jobs_server.disk_guard import is_disk_full
from jobs_server.manager.live.deferred_ends import DeferredEnds
from jobs_server.manager.records import JobRecord, JobSpec, JobStatus, new_run_id
from tests.support.database_outage import (
    archived_status,
    assert_database_unavailable,
    server_on,
    submit_kept_and_during,
)
from tests.support.postgres import (
    PostgresServer,
    running_postgres,
    start_again,
    stop_immediately,
)
from tests.support.processes import wait_until

pytestmark = pytest.mark.postgres

# Generous: a loaded machine (the suite in parallel on 2 cores) answers late, never wrongly.
REQUEST_TIMEOUT_S = 60
DEADLINE_S = 60


@pytest.fixture
def own_postgres() -> Iterator[PostgresServer]:
    """A PostgreSQL server of this test's own: the session's is shared by a worker's tests, and
    this one stops it. Durable, as a real one: what it acknowledged survives its crash (the
    session's, without fsync and with asynchronous commits, loses the last commits)."""
    with running_postgres(durable=True) as server:
        yield server


@pytest.mark.slow
def test_a_database_outage_answers_503_and_the_server_recovers_on_its_own(
    tmp_path: Path, ray_connection: str, own_postgres: PostgresServer
) -> None:
    database_url = own_postgres.create_database()
    with server_on(database_url, ray_connection, tmp_path, "db_outage") as server:
        url, process, log_path = server.url, server.process, server.log_path
        submit_kept_and_during(url, database_url)

        stop_immediately(own_postgres)
        outage_started = time.monotonic()
        not_refused: dict[str, tuple[int, str]] = {}
        for what, method, path in [
            ("submit", "POST", "/api/jobs/"),
            ("get", "GET", "/api/jobs/kept"),
            ("list", "GET", "/api/jobs/"),
            ("list page", "GET", "/api/jobs/?limit=10"),
            ("stop", "POST", "/api/jobs/kept/stop"),
            ("delete", "DELETE", "/api/jobs/kept"),
            ("healthz", "GET", "/api/healthz"),
        ]:
            body = {"entrypoint": "true", "submission_id": "refused"} if what == "submit" else None
            response = requests.request(
                method, f"{url}{path}", json=body, timeout=REQUEST_TIMEOUT_S
            )
            try:
                assert_database_unavailable(response)
            except (AssertionError, KeyError, ValueError):
                not_refused[what] = (response.status_code, response.text)
        assert not_refused == {}
        # A scrape answers, saying the database is away (tests/test_replica_health.py).
        metrics = requests.get(f"{url}/metrics", timeout=REQUEST_TIMEOUT_S)
        assert metrics.status_code == 200, metrics.text
        assert "jobs_server_database_connected 0.0" in metrics.text.splitlines()
        # The job's end came while the database was away (its supervisor wrote it in the KV).
        time.sleep(max(0.0, 4.0 - (time.monotonic() - outage_started)))
        assert process.poll() is None, log_path.read_text()

        start_again(own_postgres)
        wait_until(
            lambda: requests.get(f"{url}/api/healthz", timeout=REQUEST_TIMEOUT_S).ok,
            DEADLINE_S,
            "the probe to answer 200 again",
        )
        # The same server process, its pool reconnected: nothing lost, the end archived.
        wait_until(
            lambda: archived_status(database_url, "during") == "SUCCEEDED",
            DEADLINE_S,
            "the end of the job that ended during the outage to be archived",
        )
        wait_until(
            lambda: requests.get(f"{url}/api/jobs/kept", timeout=REQUEST_TIMEOUT_S).ok,
            DEADLINE_S,
            "a get to answer again",
        )
        jobs = requests.get(f"{url}/api/jobs/", timeout=REQUEST_TIMEOUT_S).json()
        assert sorted((job["submission_id"], job["status"]) for job in jobs) == [
            ("during", "SUCCEEDED"),
            ("kept", "SUCCEEDED"),
        ]
        logs = requests.get(f"{url}/api/jobs/during/logs", timeout=REQUEST_TIMEOUT_S).json()
        assert logs["logs"] == "ended\n"
        after = requests.post(
            f"{url}/api/jobs/",
            json={"entrypoint": "echo after", "submission_id": "after"},
            timeout=REQUEST_TIMEOUT_S,
        )
        assert after.status_code == 200, after.text
        wait_until(
            lambda: archived_status(database_url, "after") == "SUCCEEDED",
            DEADLINE_S,
            "a job submitted after the outage to succeed",
        )
        deleted = requests.delete(f"{url}/api/jobs/kept", timeout=REQUEST_TIMEOUT_S)
        assert deleted.status_code == 200, deleted.text
        assert process.poll() is None
    # No request ended in the 500 path (its line is "unexpected error handling ..."), and the
    # archive's retries say the database is away in a line each, without a traceback.
    server_log = log_path.read_text()
    assert "unexpected error handling" not in server_log
    assert "the database does not answer" in server_log
    assert "Traceback" not in server_log


class _DiskFull(Exception):
    """What psycopg raises for SQLSTATE 53100 (psycopg.errors.DiskFull), by its attribute."""

    sqlstate = "53100"


@pytest.mark.parametrize(
    ("error", "full"),
    [
        (psycopg.errors.DiskFull("could not extend file: No space left on device"), True),
        (_DiskFull("could not write to file"), True),
        (psycopg.errors.UniqueViolation("duplicate key"), False),
        (psycopg.OperationalError("server closed the connection unexpectedly"), False),
        (sqlite3.OperationalError("database or disk is full"), False),
    ],
    ids=["psycopg-disk-full", "sqlstate-53100", "unique-violation", "connection-lost", "sqlite"],
)
def test_postgres_full_disk_is_recognised_by_its_sqlstate(error: Exception, full: bool) -> None:
    assert is_disk_full(error) is full
    # Raised while handling one (a rollback that fails after the write did) counts too.
    during_handling = RuntimeError("rollback failed")
    during_handling.__context__ = error
    assert is_disk_full(during_handling) is full


class _HistoryWhileTheDatabaseIsAway:
    """A JobHistory whose archive refuses the first write as a lost connection does."""

    def __init__(self) -> None:
        self.archived: list[str] = []
        self.forgotten: list[str] = []
        self.forgot = asyncio.Event()

    async def archive_end(self, ended: JobRecord) -> JobRecord | None:
        raise psycopg.OperationalError("server closed the connection unexpectedly")

    async def learn_end(self, record: JobRecord, *, ended: JobRecord | None = None) -> JobRecord:
        self.archived.append(record.submission_id)
        return record

    async def forget(self, record: JobRecord, archived: JobRecord | None = None) -> None:
        self.forgotten.append(record.submission_id)
        self.forgot.set()


async def test_an_end_decided_while_the_database_is_away_is_archived_once_it_is_back() -> None:
    """An end the server decides itself (a stop before the start, a refused hand-over) is in
    the KV; the archive takes it later, as on a full disk, instead of failing the caller."""
    history = _HistoryWhileTheDatabaseIsAway()
    ends = DeferredEnds(history)  # type: ignore[arg-type]
    ended = JobRecord(
        spec=JobSpec(entrypoint="true", submission_id="stopped"),
        run_id=new_run_id(),
        status=JobStatus.STOPPED,
    )
    assert await ends.archive(ended) is False
    assert ends.waiting_ids() == {"stopped"}
    await asyncio.wait_for(history.forgot.wait(), DEADLINE_S)
    assert history.archived == ["stopped"]
    assert history.forgotten == ["stopped"]
    await ends.close()
