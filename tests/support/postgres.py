"""A PostgreSQL server for the tests, from the distribution's binaries: one per test session
(per xdist worker), in a temporary directory, on a free loopback port with its unix socket in
that directory; each test gets a database of its own. Stopped by its pid at the end.

PostgreSQL refuses to run as root (the tests do, here and in CI): then it runs as `nobody`,
its directory handed to that user."""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import signal
import sqlite3
import subprocess
import tempfile
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest

from jobs_server.manager.archive.interface import JobArchive
from jobs_server.manager.archive.postgres import PostgresArchive
from jobs_server.manager.archive.sqlite import Archive
from tests.support.processes import accepts_connections, free_port, wait_until

# Makes an archive (not yet open) of the test's store, keywords to its constructor; every one it
# makes is the same history (the `archive_factory` fixture).
ArchiveFactory = Callable[..., JobArchive]

# Debian keeps the server's programs off PATH, in /usr/lib/postgresql/<version>/bin.
_DEBIAN_BIN_DIRS = sorted(
    glob.glob("/usr/lib/postgresql/*/bin"), key=lambda path: int(Path(path).parent.name)
)
_START_TIMEOUT_S = 60
# What the server runs as when the tests run as root.
_UNPRIVILEGED_USER = "nobody"


def postgres_bin_dir() -> Path | None:
    """Where initdb and pg_ctl are (the newest Debian version's, or PATH's); None: not here."""
    for directory in reversed(_DEBIAN_BIN_DIRS):
        if os.access(Path(directory) / "initdb", os.X_OK):
            return Path(directory)
    initdb = shutil.which("initdb")
    return None if initdb is None else Path(initdb).resolve().parent


@dataclass(frozen=True)
class PostgresServer:
    directory: Path
    port: int
    pid: int
    bin_dir: Path
    # Whether a commit it acknowledged survives its crash (off by default: a test's data).
    durable: bool = False

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def create_database(self) -> str:
        """A new, empty database; its URL."""
        name = f"test_{uuid.uuid4().hex[:16]}"
        with psycopg.connect(self.url(), autocommit=True) as db:
            db.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def drop_database(self, url: str) -> None:
        name = url.rsplit("/", 1)[1]
        with psycopg.connect(self.url(), autocommit=True) as db:
            db.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def committed_rows(archive: JobArchive, sql: str) -> list[tuple[Any, ...]]:
    """What a new connection of its own reads from the archive's database (what is committed)."""
    if isinstance(archive, Archive):
        with contextlib.closing(sqlite3.connect(archive.path)) as db:
            return db.execute(sql).fetchall()
    assert isinstance(archive, PostgresArchive)
    with psycopg.connect(archive._url) as db:
        return db.execute(sql).fetchall()


def _as_server_user(command: list[str]) -> list[str]:
    if os.geteuid() != 0:
        return command
    return ["runuser", "-u", _UNPRIVILEGED_USER, "--", *command]


@contextlib.contextmanager
def running_postgres(*, durable: bool = False) -> Iterator[PostgresServer]:
    """A PostgreSQL server for as long as the context lasts (durability off, unless `durable`:
    a test that crashes it needs what it acknowledged to survive, as a real database's does)."""
    bin_dir = postgres_bin_dir()
    if bin_dir is None:
        raise RuntimeError("PostgreSQL is not installed: run scripts/install-system-packages")
    directory = Path(tempfile.mkdtemp(prefix="jobs-server-postgres-"))
    if os.geteuid() == 0:
        user = pwd.getpwnam(_UNPRIVILEGED_USER)
        os.chown(directory, user.pw_uid, user.pw_gid)
    data = directory / "data"
    subprocess.run(
        _as_server_user(
            [
                str(bin_dir / "initdb"),
                "--pgdata",
                str(data),
                "--username",
                "postgres",
                "--auth",
                "trust",
                "--encoding",
                "UTF8",
                "--no-locale",
                "--no-sync",
            ]
        ),
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    port = free_port()
    try:
        pid = _start(bin_dir, directory, port, durable=durable)
        yield PostgresServer(
            directory=directory, port=port, pid=pid, bin_dir=bin_dir, durable=durable
        )
    finally:
        # The postmaster running now (its file is gone once it stopped): a test may have
        # stopped the first and started another on the same directory.
        running = _postmaster_pid(data)
        if running is not None:
            _stop(running)
        shutil.rmtree(directory, ignore_errors=True)


def _start(bin_dir: Path, directory: Path, port: int, *, durable: bool) -> int:
    """Start the server of `directory` (its data dir `data`) on `port`; its postmaster's pid,
    once it accepts connections."""
    data = directory / "data"
    options = f"-p {port} -k {directory} -c listen_addresses=127.0.0.1"
    if not durable:
        options += " -c fsync=off -c synchronous_commit=off -c full_page_writes=off"
    subprocess.run(
        _as_server_user(
            [
                str(bin_dir / "pg_ctl"),
                "--pgdata",
                str(data),
                "--log",
                str(directory / "server.log"),
                "--options",
                options,
                "--wait",
                f"--timeout={_START_TIMEOUT_S}",
                "start",
            ]
        ),
        check=True,
        stdout=subprocess.DEVNULL,
    )
    pid = _postmaster_pid(data)
    assert pid is not None
    wait_until(lambda: accepts_connections("127.0.0.1", port), _START_TIMEOUT_S, "postgres")
    return pid


def _postmaster_pid(data: Path) -> int | None:
    try:
        return int((data / "postmaster.pid").read_text().split("\n", 1)[0])
    except (FileNotFoundError, ValueError):
        return None


def stop_immediately(server: PostgresServer) -> None:
    """`pg_ctl stop -m immediate`: every connection cut at once, no checkpoint (a crash, as
    far as clients can tell); the next start recovers from the WAL."""
    subprocess.run(
        _as_server_user(
            [
                str(server.bin_dir / "pg_ctl"),
                "--pgdata",
                str(server.directory / "data"),
                "--mode",
                "immediate",
                "--wait",
                "stop",
            ]
        ),
        check=True,
        stdout=subprocess.DEVNULL,
    )


def start_again(server: PostgresServer) -> None:
    """Start a server `stop_immediately` stopped: the same data dir and port."""
    _start(server.bin_dir, server.directory, server.port, durable=server.durable)


def _stop(pid: int) -> None:
    """An immediate shutdown (SIGQUIT to the postmaster, as `pg_ctl stop -m immediate` sends),
    then wait for it to be gone; SIGKILL if it is not within the deadline."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGQUIT)
    try:
        wait_until(lambda: not _alive(pid), 20, "postgres to stop")
    except AssertionError:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # Not our child (pg_ctl started it): a zombie is gone once init reaps it.
    with contextlib.suppress(OSError):
        if Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z":
            return False
    return True


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """The session's PostgreSQL server (one per xdist worker)."""
    with running_postgres() as server:
        yield server


@pytest.fixture
def postgres_url(postgres_server: PostgresServer) -> Iterator[str]:
    """A fresh database of the session's server, for this test only."""
    url = postgres_server.create_database()
    yield url
    postgres_server.drop_database(url)
