"""When Ray itself fails: the GCS killed with and without GCS fault tolerance (issue 12, item 12).

With fault tolerance (an external Redis), jobs run on while the GCS is away, the API answers 503
`cluster_unavailable` for what needs the GCS and goes on serving logs, `/api/healthz` says 503
and why, and everything converges once the GCS is back. Without it, the cluster is lost: the
server says so on healthz, then exits non-zero instead of hanging.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import requests

from jobs_server.manager.cluster.ray_cluster import CLUSTER_LOST_EXIT_CODE
from tests.support.gcs import (
    assert_unavailable,
    head_node,
    logs,
    start_server,
    submit,
    wait_status,
)
from tests.support.processes import stop_process_group, wait_until

pytestmark = pytest.mark.gcs


@pytest.fixture
def server_dir(tmp_path: Path) -> Path:
    return tmp_path


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


# The server's `--cluster-lost-exit-s` here (30 s by default: the test waited them out).
LOST_AFTER_S = 5


def test_lost_cluster_without_fault_tolerance_exits_the_server(server_dir: Path) -> None:
    with head_node(None) as node:
        url, server, log_path = start_server(
            node, server_dir, "--cluster-lost-exit-s", str(LOST_AFTER_S)
        )
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
            # Bounded: the server gives up LOST_AFTER_S after the GCS went away.
            exit_code = server.wait(LOST_AFTER_S + 60)
            assert exit_code == CLUSTER_LOST_EXIT_CODE, log_path.read_text()
            assert "the Ray cluster is lost" in log_path.read_text()
        finally:
            stop_process_group(server)
