"""No second door in embedded mode (issue 12, item 13): of every TCP port that the server and
its embedded Ray listen on, only the server's own API runs a job, even with RAY_AUTH_MODE=disabled
in the server's environment."""

from __future__ import annotations

import contextlib
import os
import random
import time
from pathlib import Path

import psutil
import pytest
import requests
from ray.job_submission import JobSubmissionClient

from tests.support.processes import free_port, stop_process_group, wait_until
from tests.support.servers import start_jobs_server, wait_for_server

pytestmark = pytest.mark.ray

# How long a job that some port accepted gets to leave its marker.
MARKER_WAIT_S = 15


def listening_ports(root_pid: int) -> set[tuple[str, int]]:
    """(address to connect to, port) of every TCP socket the process tree listens on."""
    root = psutil.Process(root_pid)
    found = set()
    for process in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            for connection in process.net_connections(kind="tcp"):
                if connection.status == psutil.CONN_LISTEN:
                    host = connection.laddr.ip
                    if host in ("0.0.0.0", "::", "::1"):
                        host = "127.0.0.1"
                    found.add((host, connection.laddr.port))
    return found


def try_to_submit(host: str, port: int, marker: Path) -> None:
    """Ray's job API, with plain HTTP and with Ray's own client: whatever the port answers."""
    url = f"http://{host}:{port}"
    entrypoint = f"touch {marker}"
    # The dashboard's job API, and the one each node's dashboard agent serves.
    for path in ("/api/jobs/", "/api/job_agent/jobs/"):
        with contextlib.suppress(requests.RequestException):
            requests.post(f"{url}{path}", json={"entrypoint": entrypoint}, timeout=5)
    with contextlib.suppress(Exception):
        JobSubmissionClient(url).submit_job(entrypoint=entrypoint)


def test_only_the_server_accepts_jobs_in_embedded_mode(tmp_path: Path, ray_tmpdir: Path) -> None:
    node_ip = f"127.0.0.{random.randint(100, 250)}"
    port = free_port()
    log_path = tmp_path / "server.log"
    env = {
        **{k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_TOKEN")},
        "RAY_AUTH_MODE": "disabled",
        "RAY_TMPDIR": str(ray_tmpdir),
    }
    server = start_jobs_server(
        [
            "--ray-address",
            "local",
            "--embedded-ray-node-ip",
            node_ip,
            "--port",
            str(port),
            "--log-dir",
            str(tmp_path / "logs"),
            "--state-dir",
            str(tmp_path / "state"),
        ],
        log_path,
        env,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_server(url, server, log_path, timeout_s=120)
        # The dashboard agent and the workers start after the server is ready: a job first.
        response = requests.post(f"{url}/api/jobs/", json={"entrypoint": "true"}, timeout=60)
        assert response.status_code == 200, response.text
        ports = listening_ports(server.pid) - {("127.0.0.1", port)}
        assert len(ports) >= 3, ports  # at least the GCS, the raylet, the agent

        markers = {}
        for host, ray_port in sorted(ports):
            marker = tmp_path / f"marker-{host}-{ray_port}"
            markers[(host, ray_port)] = marker
            try_to_submit(host, ray_port, marker)

        # The server's own API does run a job, so a marker would appear if a port ran one.
        own_marker = tmp_path / "marker-own"
        response = requests.post(
            f"{url}/api/jobs/", json={"entrypoint": f"touch {own_marker}"}, timeout=60
        )
        assert response.status_code == 200, response.text
        wait_until(own_marker.exists, 60, "the server's own job")
        # Ray's job API answers at once and runs the job a moment later: give it that moment.
        time.sleep(MARKER_WAIT_S)
        accepted = [address for address, marker in markers.items() if marker.exists()]
        assert accepted == [], f"ports that ran a job past the server: {accepted}"
        assert requests.get(f"{url}/api/jobs/", timeout=30).status_code == 200
    finally:
        stop_process_group(server)
