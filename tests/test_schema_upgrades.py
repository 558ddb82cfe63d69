"""A rolling upgrade (issue 34, item 5): a server of release N finds a database that release N+1
already migrated. After a migration N can read (a new nullable column) it runs on, saying so in
one line of its log, and leaves the database at N+1's version; after one it cannot (a renamed
column) it refuses to start with one line that names both versions and says to upgrade it,
exit 1, no traceback, the database untouched. Both stores, a real SQLite file and a real
PostgreSQL; the newer release is simulated by writing what it writes: its change, its version
and the lowest version a server must know to use the database (`schema_versions.py`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sqlite3
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest
import requests

from jobs_server.manager.archive import postgres as postgres_module
from jobs_server.manager.archive import sqlite as sqlite_module
from jobs_server.manager.archive.interface import JobArchive, create_archive
from jobs_server.manager.archive.leases import ReplicaLeases
from jobs_server.manager.archive.postgres import PostgresArchive
from jobs_server.manager.archive.queries import JobQuery
from jobs_server.manager.archive.schema_versions import (
    Migration,
    OlderServersRunningError,
    SchemaTooNewError,
    min_reader_version,
)
from jobs_server.manager.records import JobRecord, JobSpec, new_run_id
from tests.support.processes import free_port, stop_leader_then_group
from tests.support.ray_nodes import kill_actors_in_namespace
from tests.support.servers import start_jobs_server, wait_for_server

# A change release N reads right (its statements ignore the column), and one it would misread.
ADDITIVE_CHANGE = "ALTER TABLE jobs ADD COLUMN note TEXT"
BREAKING_CHANGE = "ALTER TABLE jobs RENAME COLUMN record TO record_json"
SERVER_EXIT_TIMEOUT_S = 120
SCHEMA_LOGGER = "jobs_server.manager.archive.schema_versions"


def record(submission_id: str) -> JobRecord:
    return JobRecord(
        spec=JobSpec(entrypoint="true", submission_id=submission_id), run_id=new_run_id()
    )


@dataclass
class Store:
    """One store's database for a test, and what a newer release would write into it."""

    name: str
    state_dir: Path
    url: str | None  # PostgreSQL's; None: SQLite in the state dir

    @property
    def path(self) -> Path:
        return sqlite_module.archive_path(self.state_dir)

    @property
    def known_version(self) -> int:
        """The newest schema version this release knows."""
        module = sqlite_module if self.url is None else postgres_module
        return len(module._MIGRATIONS)

    def archive(self) -> JobArchive:
        return create_archive(self.url, self.state_dir)

    def server_args(self) -> list[str]:
        args = ["--state-dir", str(self.state_dir)]
        return args if self.url is None else [*args, "--database-url", self.url]

    def migrate_as_newer_release(self, change: str, version: int, min_reader: int) -> None:
        """What a newer release's start does: its change, its version and the lowest version a
        server must know to use the database, in one transaction."""
        if self.url is None:
            with contextlib.closing(sqlite3.connect(self.path, isolation_level=None)) as db:
                db.executescript(
                    f"BEGIN; {change}; PRAGMA user_version = {version};"
                    " CREATE TABLE IF NOT EXISTS schema_compatibility"
                    " (min_reader_version INTEGER NOT NULL);"
                    " DELETE FROM schema_compatibility;"
                    f" INSERT INTO schema_compatibility VALUES ({min_reader}); COMMIT;"
                )
            return
        with psycopg.connect(self.url) as db:
            db.execute(change)
            db.execute(
                "ALTER TABLE schema_version ADD COLUMN IF NOT EXISTS min_reader_version INTEGER"
            )
            db.execute(
                "UPDATE schema_version SET version = %s, min_reader_version = %s",
                (version, min_reader),
            )

    def forget_min_reader(self) -> None:
        """Back to what a release before min reader versions left."""
        if self.url is None:
            with contextlib.closing(sqlite3.connect(self.path)) as db:
                db.execute("DROP TABLE schema_compatibility")
            return
        with psycopg.connect(self.url) as db:
            db.execute("ALTER TABLE schema_version DROP COLUMN min_reader_version")

    def schema(self) -> tuple[int, int | None]:
        """(schema version, min reader version) as recorded."""
        if self.url is None:
            with contextlib.closing(sqlite3.connect(self.path)) as db:
                version = db.execute("PRAGMA user_version").fetchone()[0]
                rows = db.execute("SELECT min_reader_version FROM schema_compatibility").fetchall()
        else:
            with psycopg.connect(self.url) as db:
                rows = db.execute(
                    "SELECT version, min_reader_version FROM schema_version"
                ).fetchall()
                assert len(rows) == 1, rows
                return rows[0][0], rows[0][1]
        assert len(rows) == 1, rows
        return version, rows[0][0]

    def snapshot(self) -> list[Any]:
        """Everything in the database: schema, version and rows."""
        if self.url is None:
            with contextlib.closing(sqlite3.connect(self.path)) as db:
                return [db.execute("PRAGMA user_version").fetchone(), *db.iterdump()]
        with psycopg.connect(self.url) as db:
            return [
                *db.execute(
                    "SELECT table_name, column_name, data_type FROM information_schema.columns"
                    " WHERE table_schema = 'public' ORDER BY 1, 2"
                ),
                *db.execute(
                    "SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = 'public'"
                    " ORDER BY 1"
                ),
                *db.execute("SELECT * FROM schema_version"),
                *db.execute("SELECT * FROM jobs ORDER BY seq"),
                *db.execute("SELECT * FROM events ORDER BY id"),
            ]


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Store:
    url = None if request.param == "sqlite" else request.getfixturevalue("postgres_url")
    return Store(request.param, tmp_path / "state", url)


async def with_history(store: Store) -> None:
    """The database as this release leaves it, with a job in it."""
    archive = store.archive()
    await archive.open()
    try:
        await archive.insert(record("kept"))
    finally:
        await archive.close()


@contextlib.contextmanager
def jobs_server(
    store: Store, tmp_path: Path, ray_cluster: str
) -> Iterator[tuple[str, subprocess.Popen[bytes], Path]]:
    """A real server of this release on the store's database: (its URL, process, log)."""
    port = free_port()
    namespace = f"test_schema_upgrades_{uuid.uuid4().hex[:8]}"
    log_path = tmp_path / "server.log"
    process = start_jobs_server(
        [
            *("--port", str(port)),
            *("--ray-address", ray_cluster),
            *("--namespace", namespace),
            *store.server_args(),
        ],
        log_path,
    )
    try:
        yield f"http://127.0.0.1:{port}", process, log_path
    finally:
        stop_leader_then_group(process, signal.SIGTERM, timeout_s=60)
        kill_actors_in_namespace(namespace)


def test_the_lowest_version_a_server_must_know_is_the_last_one_its_release_could_not_read() -> None:
    migrations = [
        Migration("the tables", readable_by_previous=False),
        Migration("a new nullable column", readable_by_previous=True),
        Migration("a renamed column", readable_by_previous=False),
        Migration("a new index", readable_by_previous=True),
    ]
    assert [min_reader_version(migrations, version) for version in range(5)] == [0, 1, 1, 3, 3]


async def test_a_database_records_the_lowest_version_a_server_must_know(store: Store) -> None:
    """Written at each migration; a database of a release before the record gets it at the
    next start, its version unchanged."""
    module = sqlite_module if store.url is None else postgres_module
    expected = (store.known_version, min_reader_version(module._MIGRATIONS, store.known_version))
    await with_history(store)
    assert store.schema() == expected
    store.forget_min_reader()
    archive = store.archive()
    await archive.open()  # nothing to migrate: the record only
    await archive.close()
    assert store.schema() == expected


async def test_a_newer_schema_a_server_can_read_is_used_as_it_is(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    """Release N+1 added a nullable column and says N can read its schema: N opens it, reads
    and writes its jobs, says once that the database is newer, and leaves its version be."""
    await with_history(store)
    newer = store.known_version + 1
    store.migrate_as_newer_release(ADDITIVE_CHANGE, newer, min_reader=store.known_version)
    archive = store.archive()
    with caplog.at_level(logging.INFO, logger=SCHEMA_LOGGER):
        await archive.open()
    try:
        said = [entry.getMessage() for entry in caplog.records if entry.name == SCHEMA_LOGGER]
        assert len(said) == 1, said
        assert f"schema version {newer}" in said[0], said
        assert f"up to {newer - 1}" in said[0], said
        await archive.insert(record("new"))
        page, _ = await archive.page(JobQuery())
        assert sorted(job.submission_id for job in page) == ["kept", "new"]
    finally:
        await archive.close()
    assert store.schema() == (newer, store.known_version)


async def test_a_newer_schema_a_server_cannot_read_is_refused_by_its_archive(
    store: Store,
) -> None:
    await with_history(store)
    newer = store.known_version + 1
    store.migrate_as_newer_release(BREAKING_CHANGE, newer, min_reader=newer)
    before = store.snapshot()
    archive = store.archive()
    with pytest.raises(SchemaTooNewError, match=f"schema version {newer},"):
        await archive.open()
    await archive.close()
    assert store.snapshot() == before


@pytest.mark.ray
@pytest.mark.slow
def test_a_server_that_cannot_read_the_schema_refuses_to_start(
    store: Store, tmp_path: Path, ray_connection: str
) -> None:
    """Exit 1 with one line that names both versions and what to do; nothing written."""
    asyncio.run(with_history(store))
    known, newer = store.known_version, store.known_version + 1
    store.migrate_as_newer_release(BREAKING_CHANGE, newer, min_reader=newer)
    before = store.snapshot()
    with jobs_server(store, tmp_path, ray_connection) as (_, process, log_path):
        code = process.wait(timeout=SERVER_EXIT_TIMEOUT_S)
        log = log_path.read_text(errors="replace")
    assert code == 1, log
    assert "Traceback" not in log, log
    last_line = log.strip().splitlines()[-1]
    assert last_line.startswith("jobs-server: "), log
    assert f"schema version {newer}," in last_line, log
    assert f"knows versions up to {known}" in last_line, log
    assert "upgrade this server" in last_line, log
    assert store.snapshot() == before


@pytest.mark.ray
@pytest.mark.slow
def test_a_server_that_can_read_a_newer_schema_serves(
    store: Store, tmp_path: Path, ray_connection: str
) -> None:
    """N beside N+1 after an additive migration: it answers, writes its jobs, logs once that
    the database is newer, and leaves the database at N+1's version."""
    asyncio.run(with_history(store))
    known, newer = store.known_version, store.known_version + 1
    store.migrate_as_newer_release(ADDITIVE_CHANGE, newer, min_reader=known)
    with jobs_server(store, tmp_path, ray_connection) as (url, process, log_path):
        wait_for_server(url, process, log_path, timeout_s=SERVER_EXIT_TIMEOUT_S)
        assert requests.get(f"{url}/api/jobs/kept", timeout=30).status_code == 200
        response = requests.post(
            f"{url}/api/jobs/", json={"entrypoint": "true", "submission_id": "new"}, timeout=60
        )
        assert response.status_code == 200, response.text
    log = log_path.read_text(errors="replace")
    said = [line for line in log.splitlines() if "migrated by a newer jobs-server" in line]
    assert len(said) == 1, log
    assert f"schema version {newer}" in said[0], log
    assert f"up to {known}" in said[0], log
    assert "Traceback" not in log, log
    assert store.schema() == (newer, known)


@pytest.mark.postgres
async def test_a_migration_the_running_servers_cannot_read_waits_until_they_stopped(
    tmp_path: Path, postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Release N runs (it holds its `server` lease); N+1, whose migration N cannot read,
    starts: it refuses to migrate, naming N, and changes nothing. Once N stopped, N+1 migrates,
    and N, started again, refuses the schema."""
    store = Store("postgres", tmp_path / "state", postgres_url)
    await with_history(store)
    running = PostgresArchive(postgres_url)
    await running.open()
    leases = ReplicaLeases(running)
    assert await leases.acquire("server", ttl_s=600) is not None
    released = postgres_module._MIGRATIONS
    newer = len(released) + 1
    monkeypatch.setattr(
        postgres_module,
        "_MIGRATIONS",
        (*released, Migration((BREAKING_CHANGE,), readable_by_previous=False)),
    )
    before = store.snapshot()
    try:
        upgraded = PostgresArchive(postgres_url)
        with pytest.raises(OlderServersRunningError, match=leases.replica_id):
            await upgraded.open()
        await upgraded.close()
        assert store.snapshot() == before
    finally:
        await leases.release("server")
        await running.close()

    upgraded = PostgresArchive(postgres_url)
    await upgraded.open()
    await upgraded.close()
    assert store.schema() == (newer, newer)
    monkeypatch.setattr(postgres_module, "_MIGRATIONS", released)
    with pytest.raises(SchemaTooNewError, match=f"schema version {newer},"):
        await PostgresArchive(postgres_url).open()


@pytest.mark.postgres
async def test_a_migration_the_running_servers_can_read_goes_ahead_under_them(
    tmp_path: Path, postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = Store("postgres", tmp_path / "state", postgres_url)
    await with_history(store)
    running = PostgresArchive(postgres_url)
    await running.open()
    leases = ReplicaLeases(running)
    try:
        assert await leases.acquire("server", ttl_s=600) is not None
        released = postgres_module._MIGRATIONS
        monkeypatch.setattr(
            postgres_module,
            "_MIGRATIONS",
            (*released, Migration((ADDITIVE_CHANGE,), readable_by_previous=True)),
        )
        upgraded = PostgresArchive(postgres_url)
        await upgraded.open()
        await upgraded.close()
        assert store.schema() == (len(released) + 1, min_reader_version(released, len(released)))
        await running.insert(record("after"))  # the running server goes on
        assert await running.get("after") is not None
    finally:
        await leases.release("server")
        await running.close()
