"""A replica's log reads on a log directory it does not share (issue 34, item 4).

Every job's log is a file in the log directory of the server that handed it over. On PostgreSQL
a server on another machine (or a lost disk, a wrong --log-dir) sees every job of the database
but none of those files: its log reads must say so (503 `log_unavailable`), not answer an empty
log (a client would conclude the job printed nothing) nor follow a file that never grows.
"""

from __future__ import annotations

import asyncio
import base64
import secrets
import signal
import stat
import subprocess
import threading
import uuid
from pathlib import Path
from typing import cast

import aiohttp
import pytest
import requests

from jobs_server.manager import JobRecord, JobSpec
from jobs_server.manager.archive.postgres import PostgresArchive
from jobs_server.manager.launcher import Launcher
from jobs_server.manager.live.kv import GcsKv
from jobs_server.manager.live.store import JobStore
from jobs_server.manager.logs import job_log_path, log_dir_id
from jobs_server.manager.records import new_run_id, now_ms
from jobs_server.manager.supervisors import Supervisors
from tests.support.openapi_contract import Contract
from tests.support.processes import free_port, stop_leader_then_group, wait_until
from tests.support.servers import start_jobs_server, wait_for_server

REQUEST_TIMEOUT_S = 30.0
JOB_DEADLINE_S = 120.0

# Every way to read a log over HTTP but the websocket (its handshake is checked on its own).
LOG_READS: list[tuple[str, str, dict[str, str]]] = [
    ("Ray's JSON", "/logs", {}),
    ("plain text", "/logs?format=text", {}),
    ("a byte range as JSON", "/logs?offset=0&limit=5", {}),
    ("a Range header", "/logs?format=text", {"Range": "bytes=0-4"}),
    ("a follow", "/logs?follow=true", {}),
    ("Server-Sent Events", "/logs/stream", {}),
    (
        "a websocket handshake",
        "/logs/tail",
        {
            "Connection": "Upgrade",
            "Upgrade": "websocket",
            "Sec-WebSocket-Version": "13",
            "Sec-WebSocket-Key": base64.b64encode(secrets.token_bytes(16)).decode(),
        },
    ),
]


def _start_server(
    tmp_path: Path, state: str, log_dir: Path, ray_cluster: str, database_url: str, namespace: str
) -> tuple[str, subprocess.Popen[bytes]]:
    port = free_port()
    log_path = tmp_path / f"server-{state}-{port}.log"
    process = start_jobs_server(
        [
            *("--port", str(port)),
            *("--ray-address", ray_cluster),
            *("--state-dir", str(tmp_path / state)),
            *("--log-dir", str(log_dir)),
            *("--database-url", database_url),
            *("--namespace", namespace),
        ],
        log_path,
    )
    url = f"http://127.0.0.1:{port}"
    wait_for_server(url, process, log_path, timeout_s=120)
    return url, process


def _submit(url: str, submission_id: str, entrypoint: str) -> None:
    response = requests.post(
        f"{url}/api/jobs/",
        json={"entrypoint": entrypoint, "submission_id": submission_id},
        timeout=REQUEST_TIMEOUT_S,
    )
    assert response.status_code == 200, response.text


def _status(url: str, submission_id: str) -> str:
    job = requests.get(f"{url}/api/jobs/{submission_id}", timeout=REQUEST_TIMEOUT_S).json()
    return str(job["status"])


def _wait_for_status(url: str, submission_id: str, status: str) -> None:
    wait_until(
        lambda: _status(url, submission_id) == status,
        JOB_DEADLINE_S,
        f"job {submission_id} to be {status}",
    )


def _logs(url: str, submission_id: str) -> str:
    response = requests.get(f"{url}/api/jobs/{submission_id}/logs", timeout=REQUEST_TIMEOUT_S)
    assert response.status_code == 200, response.text
    return str(response.json()["logs"])


def _unavailable_reads(url: str, submission_id: str) -> dict[str, tuple[int, str]]:
    """The reads of the job's log that were not a 503 `log_unavailable` naming --log-dir, as
    openapi.yaml documents it."""
    contract = Contract.load()
    wrong = {}
    for what, path, headers in LOG_READS:
        response = requests.get(
            f"{url}/api/jobs/{submission_id}{path}", headers=headers, timeout=REQUEST_TIMEOUT_S
        )
        try:
            contract.check_response(
                "GET",
                response.request.path_url.split("?")[0],
                response.status_code,
                response.headers,
                response.content,
            )
            error = response.json()["error"]
            assert response.status_code == 503
            assert error["code"] == "log_unavailable"
            assert "--log-dir" in error["message"]
            assert "shared log volume" in error["message"]
        except (AssertionError, KeyError, ValueError):
            wrong[what] = (response.status_code, response.text[:200])
    return wrong


async def _websocket_handshake_status(url: str, submission_id: str) -> int:
    async with aiohttp.ClientSession() as session:
        try:
            async with session.ws_connect(f"{url}/api/jobs/{submission_id}/logs/tail"):
                return 101
        except aiohttp.WSServerHandshakeError as error:
            return error.status


@pytest.mark.postgres
@pytest.mark.slow
def test_a_server_on_another_log_dir_answers_503_for_logs_it_cannot_see(
    tmp_path: Path, ray_cluster: str, postgres_url: str
) -> None:
    """A server on the database, a job that printed and one still running; the server stops
    and another starts on the same database with another --log-dir: every read of the two
    jobs' logs answers 503, while a job of its own logs as usual. Back on the first log
    directory, both old logs read whole."""
    namespace = f"test_log_volume_{uuid.uuid4().hex[:8]}"
    first_logs, second_logs = tmp_path / "head-logs", tmp_path / "other-machine-logs"
    release = tmp_path / "release"
    url, process = _start_server(
        tmp_path, "first", first_logs, ray_cluster, postgres_url, namespace
    )
    try:
        _submit(url, "printed", "echo printed")
        _submit(
            url,
            "running",
            f"echo started; while [ ! -e {release} ]; do sleep 0.05; done; echo released",
        )
        _wait_for_status(url, "printed", "SUCCEEDED")
        _wait_for_status(url, "running", "RUNNING")
        assert _logs(url, "printed") == "printed\n"
        wait_until(lambda: _logs(url, "running") == "started\n", 30, "the running job to print")
    finally:
        stop_leader_then_group(process, signal.SIGTERM, timeout_s=60)

    url, process = _start_server(
        tmp_path, "second", second_logs, ray_cluster, postgres_url, namespace
    )
    try:
        assert _unavailable_reads(url, "printed") == {}
        assert asyncio.run(_websocket_handshake_status(url, "printed")) == 503
        # A job still running (this server adopted it) is followed nowhere but where it writes.
        assert _unavailable_reads(url, "running") == {}
        assert asyncio.run(_websocket_handshake_status(url, "running")) == 503
        _submit(url, "second", "echo second")
        _wait_for_status(url, "second", "SUCCEEDED")
        assert _logs(url, "second") == "second\n"
        release.touch()
        _wait_for_status(url, "running", "SUCCEEDED")
        assert _unavailable_reads(url, "running") == {}
    finally:
        release.touch()
        stop_leader_then_group(process, signal.SIGTERM, timeout_s=60)

    url, process = _start_server(
        tmp_path, "first", first_logs, ray_cluster, postgres_url, namespace
    )
    try:
        assert _logs(url, "printed") == "printed\n"
        assert _logs(url, "running") == "started\nreleased\n"
        text = requests.get(f"{url}/api/jobs/printed/logs?follow=true", timeout=REQUEST_TIMEOUT_S)
        assert (text.status_code, text.text) == (200, "printed\n")
        # The second server's job: its log is in the other directory.
        assert _unavailable_reads(url, "second") == {}
    finally:
        stop_leader_then_group(process, signal.SIGTERM, timeout_s=60)


def _pending(submission_id: str, marker: Path, written_to: str | None) -> JobRecord:
    """A job recorded PENDING whose command appends to `marker`; handed over on the log
    directory of id `written_to` (None: a record of an earlier server, never handed over)."""
    return JobRecord(
        spec=JobSpec(entrypoint=f"echo ran >> {marker}", submission_id=submission_id),
        start_time=now_ms(),
        message="Job is pending.",
        run_id=new_run_id(),
        handed_over_time=None if written_to is None else now_ms(),
        log_dir_id=written_to,
    )


async def _left_by_a_server_on(
    database_url: str, ray_cluster: str, namespace: str, archived: list[JobRecord], live: JobRecord
) -> None:
    """The state a server dies in: `archived` rows, `live` also in the KV; no supervisor."""
    archive = PostgresArchive(database_url)
    await archive.open()
    try:
        for record in [*archived, live]:
            await archive.insert(record)
    finally:
        await archive.close()
    await JobStore(GcsKv(ray_cluster, namespace)).create(live)


@pytest.mark.postgres
@pytest.mark.slow
def test_a_server_on_another_log_dir_never_runs_again_a_job_that_may_have_begun_there(
    tmp_path: Path, ray_cluster: str, postgres_url: str
) -> None:
    """A server on the first log directory died with two jobs PENDING that it had handed over
    and whose commands began there (their logs are there), with no supervisor left: one only
    in the archive, one in the KV too. A server on another --log-dir does not see those logs:
    it must not take "no log here" for "never began" and run them again; it fails them, naming
    the log directory. A job it can judge (an earlier server's record without a log directory,
    or one handed over on its own) runs as before."""
    namespace = f"test_log_volume_{uuid.uuid4().hex[:8]}"
    first_logs, second_logs = tmp_path / "head-logs", tmp_path / "other-machine-logs"
    first_logs.mkdir()
    second_logs.mkdir()
    first_id, second_id = log_dir_id(first_logs), log_dir_id(second_logs)
    ran = {job: tmp_path / f"ran-{job}" for job in ("archived", "live", "older", "here")}
    archived = _pending("archived", ran["archived"], first_id)
    live = _pending("live", ran["live"], first_id)
    for began in (archived, live):
        job_log_path(first_logs, began.submission_id).write_text("began\n")
    asyncio.run(
        _left_by_a_server_on(
            postgres_url,
            ray_cluster,
            namespace,
            [
                archived,
                _pending("older", ran["older"], None),
                _pending("here", ran["here"], second_id),
            ],
            live,
        )
    )

    url, process = _start_server(
        tmp_path, "second", second_logs, ray_cluster, postgres_url, namespace
    )
    try:
        _wait_for_status(url, "older", "SUCCEEDED")
        _wait_for_status(url, "here", "SUCCEEDED")
        jobs = {
            job: requests.get(f"{url}/api/jobs/{job}", timeout=REQUEST_TIMEOUT_S).json()
            for job in ran
        }
        assert {job: (jobs[job]["status"], ran[job].exists()) for job in ran} == {
            "archived": ("FAILED", False),
            "live": ("FAILED", False),
            "older": ("SUCCEEDED", True),
            "here": ("SUCCEEDED", True),
        }
        for job in ("archived", "live"):
            assert "--log-dir" in jobs[job]["message"], jobs[job]
            assert first_id in jobs[job]["message"], jobs[job]
        assert ran["older"].read_text() == ran["here"].read_text() == "ran\n"
    finally:
        stop_leader_then_group(process, signal.SIGTERM, timeout_s=60)


def test_a_log_directory_keeps_one_id_whoever_creates_it_first(tmp_path: Path) -> None:
    """Replicas on the head share the log directory: those that start together must agree on
    its id (one marker file, created once), and another directory has another id."""
    shared = tmp_path / "logs"
    shared.mkdir()
    ids: list[str] = []
    threads = [threading.Thread(target=lambda: ids.append(log_dir_id(shared))) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(ids) == 8
    assert len(set(ids)) == 1
    assert log_dir_id(shared) == ids[0]
    other = tmp_path / "other"
    other.mkdir()
    assert log_dir_id(other) != ids[0]
    assert sorted(path.name for path in shared.iterdir()) == [".log-dir-id"]
    assert stat.S_IMODE((shared / ".log-dir-id").stat().st_mode) == 0o600


@pytest.mark.parametrize(
    ("written_to", "log_here", "may_have_begun"),
    [
        ("other", False, True),  # begun, perhaps, on another log directory: never run again
        ("this", False, False),  # this directory's, and no log: its command never began
        ("this", True, True),
        (None, False, False),  # an earlier server's record: judged by this directory
        (None, True, True),
    ],
)
def test_whether_a_command_began_is_never_judged_from_another_log_directory(
    tmp_path: Path, written_to: str | None, log_here: bool, may_have_begun: bool
) -> None:
    """The watcher (a supervisor that died: run the job on its replacement if its command
    never began) and the stop (a run called off before it began) ask the launcher whether a
    run's command began, by its log on this log directory. A run handed over on another one
    (a leader on another machine, before this replica took the lead) may have begun there: the
    answer must be yes, or its command would run twice."""
    launcher = Launcher(
        supervisors=cast(Supervisors, None),
        log_dir=tmp_path / "logs",
        stop_grace_s=1,
        head_node_id="head",
    )
    this_id = asyncio.run(launcher.open_log_dir())
    record = _pending(
        "job",
        tmp_path / "ran",
        {"other": "another-id", "this": this_id}.get(written_to or ""),
    )
    if log_here:
        job_log_path(tmp_path / "logs", "job").write_text("began\n")
    assert asyncio.run(launcher.has_log(record)) is may_have_begun
