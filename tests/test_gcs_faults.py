"""When Ray itself fails: the GCS killed with and without GCS fault tolerance (issue 12, item 12).

With fault tolerance (an external Redis), jobs run on while the GCS is away, the API answers 503
`cluster_unavailable` for what needs the GCS and goes on serving logs, `/api/healthz` says 503
and why, and everything converges once the GCS is back. Without it, the cluster is lost: the
server says so on healthz, then exits non-zero instead of hanging.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest
import requests

from jobs_server.manager.ray_cluster import CLUSTER_LOST_EXIT_CODE, CLUSTER_LOST_EXIT_S
from tests.support.processes import free_port, stop_process_group, wait_until
from tests.support.ray_nodes import RAY_BIN, SUITE_CLUSTER_ADDRESSES
from tests.support.servers import start_jobs_server, wait_for_server

pytestmark = pytest.mark.gcs

REDIS_SERVER = shutil.which("redis-server")


@pytest.fixture(scope="module")
def redis_address() -> Iterator[str]:
    """A Redis server on a loopback port (no persistence), in its own process group."""
    if REDIS_SERVER is None:
        pytest.fail("redis-server is not installed: run scripts/install-system-packages")
    port = free_port()
    process = subprocess.Popen(
        [REDIS_SERVER, "--port", str(port), "--bind", "127.0.0.1", "--save", ""],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        wait_until(lambda: _port_open("127.0.0.1", port), 30, "redis-server")
        yield f"127.0.0.1:{port}"
    finally:
        stop_process_group(process)


def _port_open(host: str, port: int) -> bool:
    import socket

    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, port)) == 0


@dataclass
class HeadNode:
    """A Ray head started with `ray start` (no --block, which would take the whole node down
    with a killed GCS), whose gcs_server the test can kill and start again."""

    node_ip: str
    port: int
    temp_dir: Path
    sessions: set[int]

    @property
    def address(self) -> str:
        return f"{self.node_ip}:{self.port}"

    def gcs_process(self) -> psutil.Process:
        flag = f"--gcs_server_port={self.port}"
        for process in psutil.process_iter(["name", "cmdline"]):
            if process.info["name"] == "gcs_server" and flag in (process.info["cmdline"] or []):
                return process
        raise AssertionError(f"no gcs_server of {self.address}")

    def kill_gcs(self) -> tuple[list[str], str, dict[str, str]]:
        """kill -9 the GCS; return how to start it again (its command line, cwd, environment)."""
        gcs = self.gcs_process()
        command, cwd, environment = gcs.cmdline(), gcs.cwd(), gcs.environ()
        gcs.kill()
        gcs.wait(10)
        return command, cwd, environment

    def start_gcs(self, command: list[str], cwd: str, environment: dict[str, str]) -> None:
        """Start the GCS again as it was started: with fault tolerance it reloads its tables
        from Redis, and the raylets and workers reconnect."""
        process = subprocess.Popen(
            command,
            cwd=cwd,
            env=environment,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        self.sessions.add(process.pid)

    def stop(self) -> None:
        """End every process of the node: its sessions, and whatever else names its temp dir."""
        for session in self.sessions:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(session, signal.SIGKILL)
        for process in psutil.process_iter(["cmdline"]):
            with contextlib.suppress(psutil.Error):
                if any(str(self.temp_dir) in part for part in process.info["cmdline"] or []):
                    process.kill()
        shutil.rmtree(self.temp_dir, ignore_errors=True)


@contextlib.contextmanager
def head_node(redis_address: str | None) -> Iterator[HeadNode]:
    """A Ray head on a 127.0.0.x of its own; with GCS fault tolerance if `redis_address`."""
    node_ip = f"127.0.0.{random.randint(100, 250)}"
    port = free_port(node_ip)
    # A short path: Ray's socket paths under it must fit in 107 bytes.
    temp_dir = Path(tempfile.mkdtemp(prefix="rgf", dir="/tmp"))
    environment = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    if redis_address is not None:
        environment["RAY_REDIS_ADDRESS"] = redis_address
        environment["RAY_external_storage_namespace"] = f"test_{uuid.uuid4().hex[:12]}"
    process = subprocess.Popen(
        [
            str(RAY_BIN),
            "start",
            "--head",
            f"--node-ip-address={node_ip}",
            f"--port={port}",
            f"--temp-dir={temp_dir}",
            "--include-dashboard=false",
            "--disable-usage-stats",
            "--num-cpus=4",
        ],
        env=environment,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    node = HeadNode(node_ip, port, temp_dir, {process.pid})
    SUITE_CLUSTER_ADDRESSES.add(node.address)
    try:
        assert process.wait(180) == 0, "ray start failed"
        wait_until(lambda: _port_open(node_ip, port), 60, "the GCS")
        yield node
    finally:
        node.stop()


@pytest.fixture
def server_dir(tmp_path: Path) -> Path:
    return tmp_path


def start_server(node: HeadNode, workdir: Path) -> tuple[str, subprocess.Popen[bytes], Path]:
    port = free_port()
    log_path = workdir / "server.log"
    environment = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    process = start_jobs_server(
        [
            "--port",
            str(port),
            "--ray-address",
            node.address,
            "--log-dir",
            str(workdir / "logs"),
            "--state-dir",
            str(workdir / "state"),
            "--stop-grace-s",
            "1",
        ],
        log_path,
        env=environment,
    )
    url = f"http://127.0.0.1:{port}"
    wait_for_server(url, process, log_path, timeout_s=120)
    return url, process, log_path


def submit(url: str, entrypoint: str) -> str:
    response = requests.post(f"{url}/api/jobs/", json={"entrypoint": entrypoint}, timeout=60)
    assert response.status_code == 200, response.text
    return str(response.json()["submission_id"])


def wait_status(url: str, job_id: str, statuses: set[str], timeout_s: float = 120) -> Any:
    deadline = time.monotonic() + timeout_s
    job: dict[str, Any] = {}
    while time.monotonic() < deadline:
        response = requests.get(f"{url}/api/jobs/{job_id}", timeout=30)
        if response.status_code == 200:
            job = response.json()
            if job["status"] in statuses:
                return job
        time.sleep(0.2)
    raise AssertionError(f"job {job_id} not {statuses} after {timeout_s}s: {job}")


def logs(url: str, job_id: str) -> str:
    response = requests.get(f"{url}/api/jobs/{job_id}/logs", timeout=30)
    assert response.status_code == 200, response.text
    return str(response.json()["logs"])


def assert_unavailable(response: requests.Response) -> dict[str, Any]:
    """The 503 a client can act on: JSON, code cluster_unavailable, and when to retry."""
    assert response.status_code == 503, (response.status_code, response.text)
    assert response.headers["Content-Type"].startswith("application/json")
    assert int(response.headers["Retry-After"]) > 0
    error: dict[str, Any] = response.json()["error"]
    assert error["code"] == "cluster_unavailable", error
    return error


def test_gcs_restart_with_fault_tolerance(redis_address: str, server_dir: Path) -> None:
    with head_node(redis_address) as node:
        url, server, log_path = start_server(node, server_dir)
        try:
            ticker = submit(url, "for i in $(seq 1 60); do echo tick $i; sleep 0.5; done")
            # Ends while the GCS is away: its status must still arrive.
            short = submit(url, "sleep 3; echo short-done")
            for job_id in (ticker, short):
                wait_status(url, job_id, {"RUNNING"})

            gcs_command = node.kill_gcs()
            try:
                wait_until(
                    lambda: requests.get(f"{url}/api/healthz", timeout=10).status_code == 503,
                    30,
                    "healthz to say 503",
                )
                health = assert_unavailable(requests.get(f"{url}/api/healthz", timeout=10))
                assert "GCS" in health["message"], health

                assert_unavailable(
                    requests.post(f"{url}/api/jobs/", json={"entrypoint": "true"}, timeout=30)
                )
                assert_unavailable(requests.get(f"{url}/api/jobs/{ticker}", timeout=30))
                assert_unavailable(requests.post(f"{url}/api/jobs/{ticker}/stop", timeout=30))

                # Logs are files on this machine: they are served, and the job writes on.
                first = logs(url, ticker)
                assert "tick 1" in first
                wait_until(lambda: len(logs(url, ticker)) > len(first), 30, "the log to grow")
                assert server.poll() is None
            finally:
                node.start_gcs(*gcs_command)

            wait_until(
                lambda: requests.get(f"{url}/api/healthz", timeout=10).status_code == 200,
                60,
                "healthz to say 200 again",
            )
            assert wait_status(url, short, {"SUCCEEDED", "FAILED", "STOPPED"})["status"] == (
                "SUCCEEDED"
            )
            assert "short-done" in logs(url, short)
            assert wait_status(url, ticker, {"SUCCEEDED", "FAILED", "STOPPED"})["status"] == (
                "SUCCEEDED"
            )
            assert "tick 60" in logs(url, ticker)
            after = submit(url, "echo after-restart")
            assert wait_status(url, after, {"SUCCEEDED", "FAILED"})["status"] == "SUCCEEDED"
            assert "after-restart" in logs(url, after)
            assert server.poll() is None, log_path.read_text()
        finally:
            stop_process_group(server)


def test_lost_cluster_without_fault_tolerance_exits_the_server(server_dir: Path) -> None:
    with head_node(None) as node:
        url, server, log_path = start_server(node, server_dir)
        try:
            job_id = submit(url, "sleep 600")
            wait_status(url, job_id, {"RUNNING"})
            node.kill_gcs()
            wait_until(
                lambda: (
                    server.poll() is not None
                    or requests.get(f"{url}/api/healthz", timeout=10).status_code == 503
                ),
                30,
                "healthz to say 503",
            )
            # Bounded: the server gives up CLUSTER_LOST_EXIT_S after the GCS went away.
            exit_code = server.wait(CLUSTER_LOST_EXIT_S + 60)
            assert exit_code == CLUSTER_LOST_EXIT_CODE, log_path.read_text()
            assert "the Ray cluster is lost" in log_path.read_text()
        finally:
            stop_process_group(server)
