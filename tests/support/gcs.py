"""Ray heads whose GCS the tests kill and start again, with GCS fault tolerance (an external
Redis: the `redis_address` fixture) or without, and a server on them, driven with requests."""

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
import requests

from tests.support.processes import accepts_connections, free_port, wait_until
from tests.support.ray_nodes import RAY_BIN, SUITE_CLUSTER_ADDRESSES
from tests.support.servers import start_jobs_server, wait_for_server

REDIS_SERVER = shutil.which("redis-server")


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
        wait_until(lambda: accepts_connections(node_ip, port), 60, "the GCS")
        yield node
    finally:
        node.stop()


def start_server(
    node: HeadNode, workdir: Path, *extra_args: str
) -> tuple[str, subprocess.Popen[bytes], Path]:
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
            *extra_args,
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
