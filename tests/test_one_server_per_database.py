"""One server per PostgreSQL database until replicas can share one (issue 34): a second server
on a database another runs on would settle that server's running jobs as its own at its start
and hand its queued jobs over again, so it is refused; a server paused past its lease while
another took the database over exits when it wakes, writing nothing more. Real servers on the
session's Ray cluster (each in a namespace of its own), a real PostgreSQL, real signals."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest
import requests

from jobs_server.app import DATABASE_LOST_EXIT_CODE
from jobs_server.manager.archive.leases import LEASE_RENEW_INTERVAL_S, LEASE_TTL_S
from tests.support.processes import free_port, stop_leader_then_group
from tests.support.ray_nodes import kill_actors_in_namespace
from tests.support.servers import start_jobs_server, wait_for_server

pytestmark = [pytest.mark.postgres, pytest.mark.ray, pytest.mark.slow]

# What a second server waits for a holder's lease before it is refused, and a margin for a
# loaded machine.
LEASE_WAIT_S = LEASE_TTL_S + LEASE_RENEW_INTERVAL_S
MARGIN_S = 30.0


class Server:
    def __init__(self, tmp_path: Path, name: str, ray_cluster: str, database_url: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.namespace = f"test_one_server_{name}_{uuid.uuid4().hex[:8]}"
        workdir = tmp_path / name
        workdir.mkdir()
        self.log_path = workdir / "server.log"
        self.process = start_jobs_server(
            [
                *("--port", str(self.port)),
                *("--ray-address", ray_cluster),
                *("--state-dir", str(workdir / "state")),
                *("--database-url", database_url),
                *("--namespace", self.namespace),
            ],
            self.log_path,
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self) -> None:
        wait_for_server(self.url, self.process, self.log_path, timeout_s=120)

    def stop(self) -> None:
        stop_leader_then_group(self.process, signal.SIGTERM, timeout_s=60)
        kill_actors_in_namespace(self.namespace)


def test_a_second_server_is_refused_while_the_first_runs_and_starts_once_it_stopped(
    tmp_path: Path, ray_connection: str, postgres_url: str
) -> None:
    first = Server(tmp_path, "first", ray_connection, postgres_url)
    servers = [first]
    try:
        first.wait_ready()
        response = requests.post(
            f"{first.url}/api/jobs/", json={"entrypoint": "sleep 600"}, timeout=60
        )
        assert response.status_code == 200, response.text
        running = response.json()["submission_id"]

        second = Server(tmp_path, "second", ray_connection, postgres_url)
        servers.append(second)
        assert second.process.wait(timeout=LEASE_WAIT_S + MARGIN_S) == 1, second.log()
        assert "the database is in use by the server" in second.log(), second.log()
        assert f":{first.process.pid}:" in second.log()  # the holder: host:pid:id
        assert "Traceback" not in second.log(), second.log()
        # The first is untouched: its running job was not settled by the second's start.
        job = requests.get(f"{first.url}/api/jobs/{running}", timeout=30).json()
        assert job["status"] in ("PENDING", "RUNNING"), job

        first.stop()
        # Released at its stop: the next server takes the database at once.
        third = Server(tmp_path, "third", ray_connection, postgres_url)
        servers.append(third)
        started = time.monotonic()
        third.wait_ready()
        assert time.monotonic() - started < LEASE_TTL_S + MARGIN_S
    finally:
        for server in servers:
            server.stop()


def test_a_server_paused_past_its_lease_exits_once_another_took_the_database(
    tmp_path: Path, ray_connection: str, postgres_url: str
) -> None:
    """Frozen (SIGSTOP) while a second server starts: the second waits out the lease, takes
    the database; the first, continued, finds its lease lost at its next renewal and exits
    (75) at once instead of writing as if it still held the database."""
    first = Server(tmp_path, "first", ray_connection, postgres_url)
    servers = [first]
    try:
        first.wait_ready()
        os.kill(first.process.pid, signal.SIGSTOP)
        try:
            second = Server(tmp_path, "second", ray_connection, postgres_url)
            servers.append(second)
            second.wait_ready()
        finally:
            os.kill(first.process.pid, signal.SIGCONT)
        code = first.process.wait(timeout=LEASE_RENEW_INTERVAL_S + MARGIN_S)
        assert code == DATABASE_LOST_EXIT_CODE, first.log()
        assert "another server took over the database" in first.log(), first.log()
        assert requests.get(f"{second.url}/api/healthz", timeout=30).status_code == 200
    except subprocess.TimeoutExpired:
        pytest.fail("the paused server ran on after its lease was taken:\n" + first.log())
    finally:
        for server in servers:
            server.stop()
