"""What tests of a database that does not answer share: a server on a database of the test's
own, the jobs it runs before the database goes away, the 503 a client can act on, and the
archive's own row."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import requests

from tests.support.processes import free_port, stop_leader_then_group, wait_until
from tests.support.ray_nodes import kill_actors_in_namespace
from tests.support.servers import start_jobs_server, wait_for_server

REQUEST_TIMEOUT_S = 60.0
JOB_DEADLINE_S = 60.0


@dataclass(frozen=True)
class ServerOnDatabase:
    url: str
    process: subprocess.Popen[bytes]
    log_path: Path


@contextlib.contextmanager
def server_on(
    database_url: str, ray_address: str, tmp_path: Path, name: str
) -> Iterator[ServerOnDatabase]:
    """A `jobs-server serve` on `database_url` and the session's cluster, in a namespace of its
    own, answering; stopped (and its supervisors killed) at the end."""
    namespace = f"{name}_{uuid.uuid4().hex[:8]}"
    port = free_port()
    log_path = tmp_path / "server.log"
    process = start_jobs_server(
        [
            *("--port", str(port)),
            *("--ray-address", ray_address),
            *("--state-dir", str(tmp_path / "state")),
            *("--database-url", database_url),
            *("--namespace", namespace),
        ],
        log_path,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_server(url, process, log_path, timeout_s=120)
        yield ServerOnDatabase(url, process, log_path)
    finally:
        stop_leader_then_group(process, signal.SIGTERM, timeout_s=60)
        kill_actors_in_namespace(namespace)


def submit_kept_and_during(url: str, database_url: str) -> None:
    """Before the database goes away: `kept`, a job that has ended (SUCCEEDED in the archive),
    and `during`, one that ends while it is away (`sleep 2; echo ended`)."""
    kept = requests.post(
        f"{url}/api/jobs/",
        json={"entrypoint": "echo kept", "submission_id": "kept"},
        timeout=REQUEST_TIMEOUT_S,
    )
    assert kept.status_code == 200, kept.text
    wait_until(
        lambda: archived_status(database_url, "kept") == "SUCCEEDED",
        JOB_DEADLINE_S,
        "the first job to succeed",
    )
    during = requests.post(
        f"{url}/api/jobs/",
        json={"entrypoint": "sleep 2; echo ended", "submission_id": "during"},
        timeout=REQUEST_TIMEOUT_S,
    )
    assert during.status_code == 200, during.text


def assert_database_unavailable(response: requests.Response) -> dict[str, Any]:
    """The 503 a client can act on: JSON in the server's error shape, code
    database_unavailable, and when to retry."""
    assert response.status_code == 503, (response.status_code, response.text)
    assert response.headers["Content-Type"].startswith("application/json")
    assert int(response.headers["Retry-After"]) > 0
    error: dict[str, Any] = response.json()["error"]
    assert error["code"] == "database_unavailable", error
    assert "Traceback" not in error["message"]
    return error


def archived_status(database_url: str, submission_id: str) -> str | None:
    """The job's status in the archive's own row (not a live overlay): what the history says."""
    with psycopg.connect(database_url) as db:
        row = db.execute(
            "SELECT status FROM jobs WHERE submission_id = %s", (submission_id,)
        ).fetchone()
    return None if row is None else str(row[0])
