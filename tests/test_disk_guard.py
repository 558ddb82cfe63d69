"""A full disk is not a crash: on a real small filesystem (tmpfs) that fills up, submits and
uploads are refused with 507, healthz stays 200 and says so, running jobs go on."""

from __future__ import annotations

import asyncio
import io
import os
import sqlite3
import zipfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from jobs_server.app import create_app
from jobs_server.disk_guard import (
    REUSE_HEADROOM_BYTES,
    REUSE_S,
    DiskGuard,
    is_disk_full,
    storage_errors_refused,
)
from jobs_server.errors import InsufficientStorageError
from jobs_server.manager.archive.sqlite import archive_path
from jobs_server.settings import Settings
from tests.support.api import Client, submit, wait_for_status
from tests.support.disks import SMALL_DISK_BYTES, fill
from tests.support.fakes import FakeJobManager
from tests.support.openapi_contract import Contract

MIN_FREE_BYTES = 4 * 1024 * 1024
# What the filler file leaves free: below the threshold, above nothing.
LEFT_FREE_BYTES = 1024 * 1024


def tiny_zip() -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("hello.py", "print('hello')\n")
    return buffer.getvalue()


@pytest.fixture
def fake_settings(small_disk: Path) -> Settings:
    return Settings(
        port=0,
        state_dir=small_disk / "state",
        log_dir=small_disk / "logs",
        namespace="fake",
        min_free_disk_bytes=MIN_FREE_BYTES,
    )


@pytest.fixture
def contract() -> Contract:
    return Contract.load()


async def checked(
    contract: Contract, client: Client, method: str, path: str, **request: Any
) -> tuple[int, Any]:
    """Send the request and check its answer against openapi.yaml; its status and JSON."""
    async with client.request(method, path, **request) as response:
        body = await response.read()
        data = contract.check_response(method, path, response.status, response.headers, body)
    return response.status, data


async def test_a_nearly_full_disk_refuses_new_work_and_healthz_says_so(
    fake_client: Client, fake: FakeJobManager, small_disk: Path, contract: Contract
) -> None:
    status, health = await checked(contract, fake_client, "GET", "/api/healthz")
    assert status == 200
    assert health["disk"]["low"] is False
    assert health["disk"]["min_free_bytes"] == MIN_FREE_BYTES
    assert MIN_FREE_BYTES < health["disk"]["free_bytes"] <= SMALL_DISK_BYTES
    before = await submit(fake_client, entrypoint="true")

    filler = fill(small_disk, LEFT_FREE_BYTES)

    status, health = await checked(contract, fake_client, "GET", "/api/healthz")
    assert status == 200
    assert health["status"] == "ok"
    assert health["disk"]["low"] is True
    assert health["disk"]["free_bytes"] < MIN_FREE_BYTES
    status, refused = await checked(
        contract, fake_client, "POST", "/api/jobs/", json={"entrypoint": "true"}
    )
    assert status == 507
    assert refused["error"]["code"] == "insufficient_storage"
    assert "--min-free-disk-bytes" in refused["error"]["message"]
    assert "submit" in refused["error"]["message"]
    package = "/api/packages/gcs/_ray_pkg_0123456789abcdef.zip"
    status, refused = await checked(contract, fake_client, "PUT", package, data=tiny_zip())
    assert status == 507
    assert "upload" in refused["error"]["message"]
    assert (await fake_client.get(package)).status == 404
    # What was there is still served.
    assert [record.submission_id for record in (await fake.list_jobs()).records] == [before]
    assert (await fake_client.get(f"/api/jobs/{before}")).status == 200

    filler.unlink()

    status, health = await checked(contract, fake_client, "GET", "/api/healthz")
    assert health["disk"]["low"] is False
    await submit(fake_client, entrypoint="true")
    assert (await fake_client.put(package, data=tiny_zip())).status == 200


async def test_the_log_directory_s_own_disk_is_guarded_too(
    aiohttp_client: Callable[..., Awaitable[Client]], small_disk: Path, tmp_path: Path
) -> None:
    """Logs on another filesystem than the state: the fuller of the two decides."""
    settings = Settings(
        port=0,
        state_dir=tmp_path / "state",
        log_dir=small_disk / "logs",
        namespace="fake",
        min_free_disk_bytes=MIN_FREE_BYTES,
    )
    assert os.stat(tmp_path).st_dev != os.stat(small_disk).st_dev
    fake = FakeJobManager(settings.log_dir, max_package_bytes=settings.max_package_bytes)
    client = await aiohttp_client(create_app(settings, backend=fake.backend()))
    fill(small_disk, LEFT_FREE_BYTES)
    assert (await client.post("/api/jobs/", json={"entrypoint": "true"})).status == 507


@pytest.mark.parametrize(
    ("error", "full"),
    [
        (OSError(28, "No space left on device"), True),
        (OSError(122, "Disk quota exceeded"), True),
        (OSError(13, "Permission denied"), False),
        (ValueError("no"), False),
    ],
)
def test_what_counts_as_a_full_disk(error: BaseException, full: bool) -> None:
    assert is_disk_full(error) is full


def test_an_error_while_handling_a_full_disk_is_a_full_disk() -> None:
    def rollback_after_a_full_disk() -> None:
        try:
            raise OSError(28, "No space left on device")
        except OSError:
            raise sqlite3.OperationalError("cannot rollback - no transaction is active")  # noqa: B904

    with pytest.raises(InsufficientStorageError), storage_errors_refused("a submit"):
        rollback_after_a_full_disk()


async def test_concurrent_checks_share_a_measurement_and_a_later_one_measures_again(
    small_disk: Path,
) -> None:
    """A burst of submits costs one statvfs at a time, not one each; a check that comes after
    a measurement ended sees the disk as it is then (here: filled meanwhile)."""
    guard = DiskGuard([small_disk], MIN_FREE_BYTES)
    measured = 0
    real_measure = guard._least_free_bytes

    def counted() -> int:
        nonlocal measured
        measured += 1
        return real_measure()

    guard._least_free_bytes = counted  # type: ignore[method-assign]
    spaces = await asyncio.gather(*(guard.space() for _ in range(20)))
    assert measured == 1
    assert {space.is_low for space in spaces} == {False}
    fill(small_disk, LEFT_FREE_BYTES)
    assert (await guard.space()).is_low
    assert measured == 2


async def test_a_roomy_measurement_is_reused_for_a_moment_a_close_one_never(
    tmp_path: Path, small_disk: Path
) -> None:
    """Far above the threshold (the test machine's own disk, threshold 0) a measurement
    serves the checks of the next REUSE_S, then the disk is measured again; near it (the
    16 MiB disk with a 4 MiB threshold) every check measures."""
    now = [0.0]
    roomy = DiskGuard([tmp_path], 0, clock=lambda: now[0])
    close = DiskGuard([small_disk], MIN_FREE_BYTES, clock=lambda: now[0])
    measured = {"roomy": 0, "close": 0}
    for name, guard in (("roomy", roomy), ("close", close)):
        real_measure = guard._least_free_bytes

        def counted(name: str = name, real_measure: Callable[[], int] = real_measure) -> int:
            measured[name] += 1
            return real_measure()

        guard._least_free_bytes = counted  # type: ignore[method-assign]
    assert os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize > REUSE_HEADROOM_BYTES
    for _ in range(3):
        await roomy.space()
        await close.space()
    assert measured == {"roomy": 1, "close": 3}
    # A little older: it still serves, while a new measurement is taken beside.
    now[0] += REUSE_S + 0.01
    await roomy.space()
    in_flight = roomy._measuring
    assert in_flight is not None, "no new measurement was taken"
    # Wait for its end, not for its start: one still running would serve the next check
    # (as it should), and the count below would miss the third (seen under load).
    await in_flight  # the guard's own callback (it records the value) runs before this returns
    assert measured["roomy"] == 2
    # Much older (no check came for a while): the check waits for a new measurement.
    now[0] += 3 * REUSE_S
    await roomy.space()
    assert measured["roomy"] == 3


def test_sqlite_full_is_a_refusal_not_a_crash(small_disk: Path) -> None:
    """SQLite on a disk that fills up: SQLITE_FULL becomes a 507's error, and the database
    (rolled back) is whole."""
    database = small_disk / "jobs.db"
    connection = sqlite3.connect(database)
    try:
        connection.execute("PRAGMA journal_mode=WAL")
        connection.execute("CREATE TABLE jobs (id INTEGER PRIMARY KEY, record BLOB)")
        connection.execute("INSERT INTO jobs (record) VALUES (?)", (b"kept",))
        connection.commit()
        fill(small_disk, 0)
        refused = pytest.raises(InsufficientStorageError, match="disk is full")
        with refused, storage_errors_refused("a submit"), connection:
            for _ in range(64):
                connection.execute("INSERT INTO jobs (record) VALUES (?)", (b"x" * 65536,))
        (small_disk / "filler").unlink()
        assert connection.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        assert connection.execute("SELECT record FROM jobs").fetchall() == [(b"kept",)]
    finally:
        connection.close()


async def test_running_jobs_go_on_while_the_disk_is_nearly_full(
    aiohttp_client: Callable[..., Awaitable[Client]],
    settings: Settings,
    small_disk: Path,
    tmp_path: Path,
) -> None:
    settings = settings.model_copy(
        update={
            "state_dir": small_disk / "state",
            "log_dir": small_disk / "logs",
            "min_free_disk_bytes": MIN_FREE_BYTES,
        }
    )
    client = await aiohttp_client(create_app(settings))
    go_on = tmp_path / "go-on"
    job_id = await submit(
        client,
        entrypoint=f"echo before; while [ ! -e {go_on} ]; do sleep 0.05; done; echo after",
    )
    await wait_for_status(client, job_id, {"RUNNING"})

    fill(small_disk, LEFT_FREE_BYTES)
    refused = await client.post("/api/jobs/", json={"entrypoint": "true"})
    assert refused.status == 507, await refused.text()
    assert (await (await client.get("/api/healthz")).json())["disk"]["low"] is True
    go_on.touch()

    job = await wait_for_status(client, job_id)
    assert job["status"] == "SUCCEEDED", job
    logs = await (await client.get(f"/api/jobs/{job_id}/logs")).json()
    assert logs["logs"] == "before\nafter\n"


async def test_a_write_that_finds_the_disk_full_is_a_507_and_the_archive_stays_whole(
    aiohttp_client: Callable[..., Awaitable[Client]],
    settings: Settings,
    small_disk: Path,
    contract: Contract,
) -> None:
    """No threshold (0 bytes): the archive's own write meets the full disk (SQLITE_FULL)."""
    state_dir = small_disk / "state"
    settings = settings.model_copy(
        update={"state_dir": state_dir, "log_dir": small_disk / "logs", "min_free_disk_bytes": 0}
    )
    client = await aiohttp_client(create_app(settings))
    kept = await submit(client, entrypoint="echo kept", metadata={"team": "x"})
    assert (await wait_for_status(client, kept))["status"] == "SUCCEEDED"

    filler = fill(small_disk, 0)
    body = {"entrypoint": "echo refused", "metadata": {"team": "x" * 60_000}}
    status, refused = await checked(contract, client, "POST", "/api/jobs/", json=body)
    assert status == 507, refused
    assert refused["error"]["code"] == "insufficient_storage"
    assert (await client.get(f"/api/jobs/{kept}")).status == 200

    filler.unlink()
    again = await submit(client, entrypoint="echo again")
    assert (await wait_for_status(client, again))["status"] == "SUCCEEDED"
    listed = await (await client.get("/api/jobs/")).json()
    assert [job["submission_id"] for job in listed] == [kept, again]
    with sqlite3.connect(archive_path(state_dir)) as database:
        assert database.execute("PRAGMA integrity_check").fetchone() == ("ok",)
