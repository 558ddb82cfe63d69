"""Servers and Ray heads that are stopped and started again, with a state dir that outlives them."""

from __future__ import annotations

import os
import random
import signal
import subprocess
from pathlib import Path
from typing import Any

import requests

from tests.support.processes import (
    accepts_connections,
    free_port,
    stop_leader_then_group,
    stop_ray_node,
    wait_until,
)
from tests.support.ray_nodes import RAY_BIN, RAY_NODE_IP
from tests.support.servers import start_jobs_server, wait_for_server


class Server:
    """`jobs-server serve` in its own process group, on a state dir that outlives it."""

    def __init__(
        self,
        tmp_path: Path,
        ray_tmpdir: Path,
        ray_args: list[str],
        state_dir: Path | None = None,
    ) -> None:
        self.tmp_path = tmp_path
        self.state_dir = state_dir or tmp_path / "state"
        self.ray_tmpdir = ray_tmpdir
        self.ray_args = ray_args
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = {
            **{k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS",)},
            "RAY_AUTH_MODE": "disabled",
            "RAY_TMPDIR": str(self.ray_tmpdir),
        }
        log_path = self.tmp_path / "server.log"
        self.process = start_jobs_server(
            [
                *self.ray_args,
                *("--port", str(self.port)),
                *("--state-dir", str(self.state_dir)),
                *("--stop-grace-s", "1"),
            ],
            log_path,
            env,
        )
        wait_for_server(self.url, self.process, log_path, timeout_s=180)

    def stop(self) -> None:
        """SIGTERM to the server alone, as `docker stop` and systemd's `KillMode=mixed` send it
        (docs/operations.md): it stops its jobs and its embedded Ray itself. A SIGTERM to the
        whole group ends the embedded Ray under the server, which then takes up to a minute."""
        if self.process is not None:
            stop_leader_then_group(self.process, signal.SIGTERM, timeout_s=60)

    def kill(self) -> None:
        """kill -9 of the server and everything in its process group (its embedded Ray)."""
        assert self.process is not None
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()

    def submit(self, **body: Any) -> str:
        response = requests.post(f"{self.url}/api/jobs/", json=body, timeout=60)
        assert response.status_code == 200, response.text
        return str(response.json()["submission_id"])

    def job(self, job_id: str) -> dict[str, Any]:
        response = requests.get(f"{self.url}/api/jobs/{job_id}", timeout=30)
        assert response.status_code == 200, response.text
        return dict(response.json())

    def wait_status(self, job_id: str, *statuses: str) -> dict[str, Any]:
        found: dict[str, Any] = {}

        def reached() -> bool:
            found.update(self.job(job_id))
            return found["status"] in statuses

        wait_until(reached, JOB_TIMEOUT_S, f"job {job_id} {statuses}")
        return found

    def logs(self, job_id: str) -> str:
        response = requests.get(f"{self.url}/api/jobs/{job_id}/logs", timeout=30)
        assert response.status_code == 200, response.text
        return str(response.json()["logs"])

    def listed(self, **params: str) -> dict[str, dict[str, Any]]:
        response = requests.get(f"{self.url}/api/jobs/", params=params, timeout=60)
        assert response.status_code == 200, response.text
        return {job["submission_id"]: job for job in response.json()}


def embedded_server(
    tmp_path: Path, ray_tmpdir: Path, *extra_args: str, state_dir: Path | None = None
) -> Server:
    node_ip = f"127.0.0.{random.randint(100, 250)}"
    return Server(
        tmp_path,
        ray_tmpdir,
        ["--ray-address", "local", "--embedded-ray-node-ip", node_ip, *extra_args],
        state_dir,
    )


class Cluster:
    """A Ray head of its own (`ray start --head --block`, its own process group)."""

    def __init__(self, tmp_path: Path, ray_tmpdir: Path) -> None:
        self.port = free_port(RAY_NODE_IP)
        self.address = f"{RAY_NODE_IP}:{self.port}"
        log = (tmp_path / f"ray-{self.port}.log").open("wb")
        self.process = subprocess.Popen(
            [
                str(RAY_BIN),
                "start",
                "--head",
                "--block",
                f"--node-ip-address={RAY_NODE_IP}",
                f"--port={self.port}",
                "--include-dashboard=false",
                "--disable-usage-stats",
                "--num-cpus=2",
            ],
            env={**os.environ, "RAY_TMPDIR": str(ray_tmpdir), "RAY_AUTH_MODE": "disabled"},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        wait_until(lambda: accepts_connections(RAY_NODE_IP, self.port), 60, "the Ray head node")

    def stop(self) -> None:
        stop_ray_node(self.process, timeout_s=60)


JOB_TIMEOUT_S = 120
