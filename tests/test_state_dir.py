"""The state dir is the server's alone (issue 32, items 7 and 10).

Item 7: a job runs as the server's user or one of its own, and must not read by path what is not
its own (the archive of every tenant's jobs, other jobs' logs): the state dir and every directory
the server makes in it are 0700, and every file in them 0600, whatever the umask.

Item 10: two servers on one state dir would hand the same queued jobs over twice. The dir is
locked for the server's life: a second server exits 1 within seconds, naming the holder, and
the first goes on serving; once the first has stopped, a server starts there again.

Real `jobs-server serve` processes on the session's cluster, real files.
"""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests

from jobs_server.manager.supervisor.log_shipping import pull_spooled_log
from tests.support.api import TERMINAL_STATUSES
from tests.support.processes import free_port, stop_process_group, wait_until
from tests.support.ray_nodes import kill_actors_in_namespace
from tests.support.servers import start_jobs_server, wait_for_server

# A second server must give up this soon (it starts no Ray before it does).
SECOND_SERVER_EXIT_S = 10


@dataclass
class ServerProcess:
    url: str
    process: subprocess.Popen[bytes]
    log_path: Path


@pytest.fixture
def namespace(ray_connection: str) -> Iterator[str]:
    name = f"test_state_dir_{uuid.uuid4().hex[:8]}"
    yield name
    kill_actors_in_namespace(name)


def start_server(
    ray_address: str, state_dir: Path, namespace: str, log_path: Path
) -> ServerProcess:
    """A server on `state_dir` (its logs in `<state_dir>/logs`), not yet known to be ready."""
    port = free_port()
    process = start_jobs_server(
        [
            *("--port", str(port)),
            *("--ray-address", ray_address),
            *("--state-dir", str(state_dir)),
            *("--namespace", namespace),
            *("--stop-grace-s", "1"),
        ],
        log_path,
    )
    return ServerProcess(f"http://127.0.0.1:{port}", process, log_path)


def run_job(url: str, **body: object) -> dict[str, object]:
    """Submit a job and wait for its end; its details."""
    response = requests.post(f"{url}/api/jobs/", json=body, timeout=60)
    assert response.status_code == 200, response.text
    job_id = response.json()["submission_id"]
    job: dict[str, object] = {}

    def ended() -> bool:
        job.update(requests.get(f"{url}/api/jobs/{job_id}", timeout=30).json())
        return job["status"] in TERMINAL_STATUSES

    wait_until(ended, 60, f"job {job_id} to end")
    return job


def not_private(root: Path) -> list[str]:
    """Every directory under `root` (itself too) that is not 0700, every file not 0600."""
    found = []
    for path in [root, *root.rglob("*")]:
        mode = path.lstat().st_mode
        expected = 0o700 if stat.S_ISDIR(mode) else 0o600
        if stat.S_IMODE(mode) != expected:
            found.append(f"{path.relative_to(root)}: {stat.S_IMODE(mode):o}")
    return found


def test_the_state_dir_and_its_files_are_private(
    ray_connection: str, namespace: str, tmp_path: Path
) -> None:
    state_dir = tmp_path / "state"
    state_dir.mkdir(mode=0o755)  # as an older server left it
    os.chmod(state_dir, 0o755)
    server = start_server(ray_connection, state_dir, namespace, tmp_path / "server.log")
    try:
        wait_for_server(server.url, server.process, server.log_path)
        # On a shared supervisor, and on one of its own (a job with resources).
        shared = run_job(server.url, entrypoint="echo shared")
        own = run_job(server.url, entrypoint="echo own >&2", entrypoint_num_cpus=0.5)
        assert (shared["status"], own["status"]) == ("SUCCEEDED", "SUCCEEDED"), (shared, own)
        logs = sorted(path.name for path in (state_dir / "logs").iterdir())
        # The log directory's id (logs.py `log_dir_id`) beside the logs.
        assert logs == sorted(
            [".log-dir-id", *(f"job-driver-{job['submission_id']}.log" for job in (shared, own))]
        )
        assert (state_dir / "jobs.db").exists()
        assert not_private(state_dir) == []
    finally:
        stop_process_group(server.process)
    assert not_private(state_dir) == []


async def test_the_head_copy_of_a_remote_jobs_log_is_private(tmp_path: Path) -> None:
    """A job on a worker node: the server pulls its log into the log dir (log_shipping.py)."""
    log_path = tmp_path / "logs" / "job-driver-remote.log"
    chunks = [(b"one\n", False), (b"two\n", True)]

    async def read_chunk(offset: int) -> tuple[bytes, bool]:
        return chunks.pop(0)

    umask = os.umask(0o022)
    try:
        await pull_spooled_log(read_chunk, log_path)
    finally:
        os.umask(umask)
    assert log_path.read_bytes() == b"one\ntwo\n"
    assert oct(stat.S_IMODE(log_path.stat().st_mode)) == oct(0o600)


def test_a_second_server_on_the_state_dir_exits_naming_the_first(
    ray_connection: str, namespace: str, tmp_path: Path
) -> None:
    state_dir = tmp_path / "state"
    first = start_server(ray_connection, state_dir, namespace, tmp_path / "first.log")
    second = third = None
    try:
        wait_for_server(first.url, first.process, first.log_path)
        second = start_server(ray_connection, state_dir, namespace, tmp_path / "second.log")
        began = time.monotonic()
        try:
            exit_code = second.process.wait(timeout=SECOND_SERVER_EXIT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"a second server ran on the state dir: {second.log_path.read_text()}")
        assert exit_code == 1, second.log_path.read_text()
        said = second.log_path.read_text()
        assert f"state dir {state_dir} is in use by pid {first.process.pid}" in said, said
        assert f"on host {socket.gethostname()}" in said, said
        assert "Traceback" not in said, said
        assert time.monotonic() - began < SECOND_SERVER_EXIT_S
        # The first goes on serving, and runs jobs.
        assert run_job(first.url, entrypoint="echo still here")["status"] == "SUCCEEDED"
        assert "state dir" not in first.log_path.read_text()

        stop_process_group(first.process)
        assert first.process.returncode == 0, first.log_path.read_text()
        third = start_server(ray_connection, state_dir, namespace, tmp_path / "third.log")
        wait_for_server(third.url, third.process, third.log_path)
        listed = requests.get(f"{third.url}/api/jobs/", timeout=30).json()
        assert [job["entrypoint"] for job in listed] == ["echo still here"]
        lock = (state_dir / "lock").read_text()
        assert lock.split() == [str(third.process.pid), socket.gethostname()], lock
    finally:
        for server in (first, second, third):
            if server is not None:
                stop_process_group(server.process)
