"""The queue survives a server killed with SIGKILL, in the same order (issue 15, item 4): a real
server on a Ray cluster of its own, a full queue, kill -9 of the server, a new server on the same
state dir and cluster. Queued jobs are archive rows never handed over; the new server queues them
again in their order, and they run in it. And an embedded server that stops leaves its queued
jobs queued for the next one."""

from __future__ import annotations

from pathlib import Path

import pytest
import requests

from tests.support.restarts import Cluster, Server, embedded_server

pytestmark = pytest.mark.ray


def test_a_full_queue_survives_kill_9_of_the_server_in_the_same_order(
    tmp_path: Path,
    ray_tmpdir: Path,
) -> None:
    order = tmp_path / "order"
    go = tmp_path / "go"
    cluster = Cluster(tmp_path, ray_tmpdir)
    server = Server(
        tmp_path,
        ray_tmpdir,
        ["--ray-address", cluster.address, "--max-running-jobs", "1", "--max-queued-jobs", "5"],
    )
    try:
        server.start()
        blocker = server.submit(entrypoint=f"while [ ! -e {go} ]; do sleep 0.05; done")
        server.wait_status(blocker, "RUNNING")
        queued = {}
        for name, priority in [("q0", 0), ("q1", 0), ("q2", 3), ("q3", 0), ("q4", 3)]:
            queued[name] = server.submit(
                submission_id=name, entrypoint=f"echo {name} >> {order}", priority=priority
            )
        full = requests.post(
            f"{server.url}/api/jobs/", json={"entrypoint": "true", "submission_id": "x"}, timeout=60
        )
        assert full.status_code == 429, full.text
        stopped = requests.post(f"{server.url}/api/jobs/q3/stop", timeout=60)
        assert stopped.json() == {"stopped": True}
        before = {name: server.job(name)["message"] for name in ("q0", "q1", "q2", "q4")}
        assert before == {
            "q2": "Queued: 1st of 4; 1 of 1 running",
            "q4": "Queued: 2nd of 4; 1 of 1 running",
            "q0": "Queued: 3rd of 4; 1 of 1 running",
            "q1": "Queued: 4th of 4; 1 of 1 running",
        }

        server.kill()
        server.start()
        # The blocker runs on (its supervisor is detached) and holds the slot; the queue is
        # the same, in the same order; the stopped job stays stopped.
        assert server.job(blocker)["status"] == "RUNNING"
        assert {name: server.job(name)["message"] for name in before} == before
        assert server.job("q3")["status"] == "STOPPED"
        server.submit(submission_id="q5", entrypoint=f"echo q5 >> {order}")
        assert server.job("q5")["message"] == "Queued: 5th of 5; 1 of 1 running"

        go.touch()
        for name in ("q2", "q4", "q0", "q1", "q5"):
            assert server.wait_status(name, "SUCCEEDED", "FAILED")["status"] == "SUCCEEDED"
        assert order.read_text().split() == ["q2", "q4", "q0", "q1", "q5"]
        assert server.wait_status(blocker, "SUCCEEDED")["status"] == "SUCCEEDED"
    finally:
        server.stop()
        cluster.stop()


def test_queued_jobs_wait_for_the_next_embedded_server_when_one_stops(
    tmp_path: Path,
    ray_tmpdir: Path,
) -> None:
    """An embedded server's jobs stop with it (its Ray does); a queued job never started, so it
    stays queued and the next server runs it."""
    order = tmp_path / "order"
    server = embedded_server(tmp_path, ray_tmpdir)
    server.ray_args += ["--max-running-jobs", "1"]
    try:
        server.start()
        blocker = server.submit(entrypoint=f"while [ ! -e {tmp_path / 'go'} ]; do sleep 0.05; done")
        server.wait_status(blocker, "RUNNING")
        queued = server.submit(submission_id="queued", entrypoint=f"echo queued >> {order}")
        assert server.job(queued)["message"] == "Queued: 1st of 1; 1 of 1 running"
        server.stop()  # SIGTERM
        server.start()
        assert server.job(blocker)["status"] == "STOPPED"
        assert server.wait_status(queued, "SUCCEEDED", "FAILED")["status"] == "SUCCEEDED"
        assert order.read_text() == "queued\n"
    finally:
        server.stop()
