"""Ends the server decides while its disk is full (a real small filesystem that fills up, a real
server on real Ray): a hand-over that Ray refuses, a stop. What cannot be archived now is held
in the KV and archived when the disk takes it (or by the next server's start): nothing is lost,
no job stays PENDING, and a stop never answers 500."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, cast

import pytest

from jobs_server.app import create_app
from jobs_server.app_state import JOB_MANAGER_KEY
from jobs_server.manager import JobManager, JobRecord
from jobs_server.manager.archive.sqlite import archive_path
from jobs_server.manager.supervisor.job_run import NEVER_STARTED_MESSAGE
from jobs_server.settings import Settings
from tests.support.api import Client, submit, wait_for_status
from tests.support.disks import fill
from tests.support.openapi_contract import Contract

AiohttpClient = Callable[..., Awaitable[Client]]
WAIT_S = 60.0


@pytest.fixture
def contract() -> Contract:
    return Contract.load()


@pytest.fixture
def disk_settings(settings: Settings, small_disk: Path, tmp_path: Path) -> Settings:
    """The state (the archive) on the small disk, no threshold: its writes meet the full disk
    (the logs elsewhere: the jobs' own output is not what is tested)."""
    return settings.model_copy(
        update={
            "state_dir": small_disk / "state",
            "log_dir": tmp_path / "logs",
            "min_free_disk_bytes": 0,
            "max_running_jobs": 1,
        }
    )


def archived(state_dir: Path, submission_id: str) -> str | None:
    """The job's status in the archive on disk (None: no row)."""
    with sqlite3.connect(archive_path(state_dir)) as database:
        row = database.execute(
            "SELECT status FROM jobs WHERE submission_id = ?", (submission_id,)
        ).fetchone()
    return None if row is None else str(row[0])


async def until_archived(state_dir: Path, submission_id: str, status: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while (found := archived(state_dir, submission_id)) != status:
        assert time.monotonic() < deadline, f"{submission_id} is archived {found}, not {status}"
        await asyncio.sleep(0.1)


def refuse_hand_over_on_a_full_disk(
    manager: JobManager, disk: Path, monkeypatch: pytest.MonkeyPatch
) -> list[Path]:
    """Ray refuses the next hand-over, and the disk fills up just then (the filler is returned
    in the list)."""
    fillers: list[Path] = []

    async def refused(record: JobRecord) -> Any:
        fillers.append(fill(disk, 0))
        raise ValueError("Ray refused the supervisor's options")

    monkeypatch.setattr(manager._launcher, "supervisor_for", refused)
    return fillers


@pytest.mark.parametrize("space_back", ["while_running", "before_next_start"])
@pytest.mark.parametrize("path", ["submitted", "queued"])
async def test_a_hand_over_refused_on_a_full_disk_ends_failed_not_pending(
    aiohttp_client: AiohttpClient,
    disk_settings: Settings,
    small_disk: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    contract: Contract,
    path: str,
    space_back: str,
) -> None:
    client = await aiohttp_client(create_app(disk_settings))
    manager = cast(JobManager, client.app[JOB_MANAGER_KEY])
    state_dir, marker, gate = disk_settings.state_dir, tmp_path / "ran", tmp_path / "gate"
    body = {"submission_id": "refused", "entrypoint": f"touch {marker}"}
    if path == "submitted":
        fillers = refuse_hand_over_on_a_full_disk(manager, small_disk, monkeypatch)
        async with client.post("/api/jobs/", json=body) as response:
            answer = contract.check_response(
                "POST", "/api/jobs/", response.status, response.headers, await response.read()
            )
        # It could not be withdrawn (the disk is full): it is recorded, and failed.
        assert response.status == 507, answer
        assert answer["error"]["code"] == "insufficient_storage"
        assert "Ray refused the supervisor's options" in answer["error"]["message"]
        assert "recorded FAILED" in answer["error"]["message"]
    else:
        blocker = await submit(client, entrypoint=f"while [ ! -e {gate} ]; do sleep 0.05; done")
        await wait_for_status(client, blocker, {"RUNNING"})
        assert await submit(client, **body) == "refused"
        fillers = refuse_hand_over_on_a_full_disk(manager, small_disk, monkeypatch)
        gate.touch()  # the blocker ends: the queued job is handed over, and Ray refuses it
    job = await wait_for_status(client, "refused", timeout_s=WAIT_S)
    assert job["status"] == "FAILED", job
    assert job["error_type"] == "JOB_SUPERVISOR_ACTOR_START_FAILURE"
    assert "Ray refused the supervisor's options" in job["message"]
    assert archived(state_dir, "refused") == "PENDING"  # the disk took nothing yet

    if space_back == "while_running":
        fillers[0].unlink()
        await until_archived(state_dir, "refused", "FAILED")
        await client.close()
    else:
        await client.close()
        fillers[0].unlink()
    # The next server (on the same state and cluster) shows the truth, and it never ran.
    client = await aiohttp_client(create_app(disk_settings))
    again = await wait_for_status(client, "refused", timeout_s=WAIT_S)
    assert (again["status"], again["message"]) == ("FAILED", job["message"])
    assert archived(state_dir, "refused") == "FAILED"
    assert not marker.exists()
    # Its slot is free: a job runs.
    (tmp_path / "gate").touch()
    after = await submit(client, entrypoint="true")
    assert (await wait_for_status(client, after, timeout_s=WAIT_S))["status"] == "SUCCEEDED"


@pytest.mark.parametrize("space_back", ["while_running", "before_next_start"])
async def test_a_stop_while_the_disk_is_full_stops_the_job_and_is_archived_later(
    aiohttp_client: AiohttpClient,
    disk_settings: Settings,
    small_disk: Path,
    tmp_path: Path,
    contract: Contract,
    space_back: str,
) -> None:
    """A running job, one handed over that waits for resources it will never get, and a queued
    one, each stopped on a full disk: 200 {"stopped": true}, STOPPED at once (the KV has it),
    archived once the disk takes it or by the next server."""
    settings = disk_settings.model_copy(update={"max_running_jobs": 2})
    client = await aiohttp_client(create_app(settings))
    state_dir, gate, marker = settings.state_dir, tmp_path / "gate", tmp_path / "ran"
    await submit(
        client, submission_id="running", entrypoint=f"while [ ! -e {gate} ]; do sleep 0.05; done"
    )
    await wait_for_status(client, "running", {"RUNNING"})
    await submit(
        client, submission_id="waiting", entrypoint=f"touch {marker}", entrypoint_num_cpus=1000
    )
    await submit(client, submission_id="queued", entrypoint=f"touch {marker}")
    assert (await wait_for_status(client, "queued", {"PENDING"}))["message"].startswith("Queued")
    filler = fill(small_disk, 0)

    for job_id in ("queued", "waiting", "running"):
        path = f"/api/jobs/{job_id}/stop"
        async with client.post(path) as response:
            answer = contract.check_response(
                "POST", path, response.status, response.headers, await response.read()
            )
        assert (response.status, answer) == (200, {"stopped": True}), (job_id, answer)
    ended = {job_id: await wait_for_status(client, job_id) for job_id in ("queued", "waiting")}
    assert {job["status"] for job in ended.values()} == {"STOPPED"}
    assert {job["message"] for job in ended.values()} == {NEVER_STARTED_MESSAGE}
    running = await wait_for_status(client, "running", timeout_s=WAIT_S)
    assert running["status"] == "STOPPED", running
    assert archived(state_dir, "queued") == "PENDING"  # the disk took nothing yet

    if space_back == "while_running":
        filler.unlink()
        for job_id in ("queued", "waiting", "running"):
            await until_archived(state_dir, job_id, "STOPPED")
        await client.close()
    else:
        await client.close()
        filler.unlink()
    client = await aiohttp_client(create_app(settings))
    for job_id in ("queued", "waiting", "running"):
        again = await wait_for_status(client, job_id, timeout_s=WAIT_S)
        assert again["status"] == "STOPPED", again
        assert archived(state_dir, job_id) == "STOPPED"
    assert not marker.exists()
