"""While the cluster watch knows Ray's GCS is away, what needs it answers 503 at once.

Before, each such request waited out its own GCS call (5 s) to find the same thing, and a list
answered the statuses it last knew as if they were current. The GCS is a real one with fault
tolerance (redis-server on loopback), killed and started again (tests/test_gcs_faults.py).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import requests

from tests.support.gcs import assert_unavailable, head_node, logs, start_server, submit, wait_status
from tests.support.processes import stop_process_group, wait_until

pytestmark = pytest.mark.gcs

# The watch's reason, as /api/healthz says it; a GCS call that timed out says another thing.
WATCH_REASON = "does not answer"


def test_requests_that_need_the_gcs_answer_503_from_the_watch(
    redis_address: str, tmp_path: Path
) -> None:
    with head_node(redis_address) as node:
        url, server, log_path = start_server(node, tmp_path)
        try:
            job_id = submit(url, "for i in $(seq 1 40); do echo tick $i; sleep 0.5; done")
            wait_status(url, job_id, {"RUNNING"})
            package = f"{url}/api/packages/gcs/_ray_pkg_{os.urandom(8).hex()}.zip"
            gcs_command = node.kill_gcs()
            try:
                wait_until(
                    lambda: requests.get(f"{url}/api/healthz", timeout=10).status_code == 503,
                    30,
                    "healthz to say 503",
                )
                answers = {
                    "submit": requests.post(
                        f"{url}/api/jobs/", json={"entrypoint": "true"}, timeout=30
                    ),
                    "list": requests.get(f"{url}/api/jobs/", timeout=30),
                    "get": requests.get(f"{url}/api/jobs/{job_id}", timeout=30),
                    "stop": requests.post(f"{url}/api/jobs/{job_id}/stop", timeout=30),
                    "delete": requests.delete(f"{url}/api/jobs/{job_id}", timeout=30),
                    "package": requests.get(package, timeout=30),
                    "metrics": requests.get(f"{url}/metrics", timeout=30),
                }
                for name, response in answers.items():
                    error = assert_unavailable(response)
                    assert WATCH_REASON in error["message"], (name, error)
                # Logs are files on this machine: still served.
                assert "tick 1" in logs(url, job_id)
            finally:
                node.start_gcs(*gcs_command)
            wait_until(
                lambda: requests.get(f"{url}/api/healthz", timeout=10).status_code == 200,
                60,
                "healthz to say 200 again",
            )
            listed = requests.get(f"{url}/api/jobs/", timeout=30)
            assert listed.status_code == 200
            assert [job["submission_id"] for job in listed.json()] == [job_id]
            stopped = requests.post(f"{url}/api/jobs/{job_id}/stop", timeout=30)
            assert stopped.status_code == 200
            assert wait_status(url, job_id, {"STOPPED", "SUCCEEDED"})["status"] == "STOPPED"
            assert server.poll() is None, log_path.read_text()
        finally:
            stop_process_group(server)
