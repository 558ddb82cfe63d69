"""History that lasts (issue 14): every job accepted is listed with its true end, its metadata,
times, exit code and log after (a) a graceful restart of an embedded server, (b) kill -9 of an
embedded server (its Ray goes with it), (c) a restart of the whole Ray cluster (a new GCS, an
empty KV) with the server restarted against it. Real servers, real Ray, real signals."""

from __future__ import annotations

import signal
import uuid
from pathlib import Path
from typing import Any

import psutil
import pytest
import requests

from tests.support.disks import fill
from tests.support.processes import wait_until
from tests.support.ray_nodes import kill_actors_in_namespace
from tests.support.restarts import JOB_TIMEOUT_S, Cluster, Server, embedded_server

pytestmark = pytest.mark.ray


def marker(server: Server) -> str:
    """A word in the running job's command line, to find its processes by."""
    return f"restart-marker-{server.tmp_path.name}"


def processes_with(word: str) -> list[int]:
    found = []
    for process in psutil.process_iter(["pid", "cmdline"]):
        if any(word in part for part in process.info["cmdline"] or []):
            found.append(process.pid)
    return found


def submit_history(server: Server, ok_id: str = "demo-1") -> dict[str, str]:
    """A job that succeeds (submitted as `ok_id`), one that fails, one left running."""
    jobs = {
        "ok": server.submit(
            submission_id=ok_id, entrypoint="echo hello from demo", metadata={"team": "a"}
        ),
        "failed": server.submit(entrypoint="echo bad; exit 3", metadata={"team": "b"}),
        "running": server.submit(entrypoint=f"echo started; sleep 1000; : {marker(server)}"),
    }
    server.wait_status(jobs["ok"], "SUCCEEDED")
    server.wait_status(jobs["failed"], "FAILED")
    server.wait_status(jobs["running"], "RUNNING")
    wait_until(lambda: "started" in server.logs(jobs["running"]), 60, "the running job's output")
    return jobs


def assert_finished_history(server: Server, jobs: dict[str, str], before: dict[str, Any]) -> None:
    listed = server.listed()
    assert set(jobs.values()) <= set(listed)
    ok, failed = listed[jobs["ok"]], listed[jobs["failed"]]
    assert ok["status"] == "SUCCEEDED"
    assert ok["metadata"] == {"team": "a"}
    assert ok["driver_exit_code"] == 0
    assert (ok["start_time"], ok["end_time"]) == (
        before[jobs["ok"]]["start_time"],
        before[jobs["ok"]]["end_time"],
    )
    assert failed["status"] == "FAILED"
    assert failed["driver_exit_code"] == 3
    assert server.logs(jobs["ok"]) == "hello from demo\n"
    assert server.logs(jobs["failed"]) == "bad\n"
    # A submission_id in the archive is taken, after a restart too (Ray's wording).
    response = requests.post(
        f"{server.url}/api/jobs/",
        json={"submission_id": jobs["ok"], "entrypoint": "echo again"},
        timeout=60,
    )
    assert response.status_code == 409, response.text
    assert "already exists" in response.text
    assert server.logs(jobs["ok"]) == "hello from demo\n"


def test_a_graceful_restart_then_kill_9_of_an_embedded_server_keep_history_and_end_running_jobs(
    tmp_path: Path, ray_tmpdir: Path
) -> None:
    """(a), then (b) on the same state dir: the start after the graceful restart is the life
    killed next (3 server lives and Ray starts for both, not 4). The graceful restart's checks
    come before the second history is submitted, and that history has an id of its own."""
    server = embedded_server(tmp_path, ray_tmpdir)
    server.start()
    try:
        # (a) A graceful restart keeps the history and stops the running job.
        jobs = submit_history(server)
        before = server.listed()
        assert processes_with(marker(server))
        server.stop()  # SIGTERM
        assert processes_with(marker(server)) == []  # stopped, not left behind
        server.start()
        assert_finished_history(server, jobs, before)
        running = server.job(jobs["running"])
        assert running["status"] == "STOPPED"
        assert "server shut down" in running["message"]
        assert "started" in server.logs(jobs["running"])
        assert server.listed(status="RUNNING,PENDING") == {}

        # (b) kill -9 keeps the history and fails the running job.
        jobs = submit_history(server, ok_id="demo-2")
        before = server.listed()
        server.kill()
        server.start()
        assert_finished_history(server, jobs, before)
        running = server.wait_status(jobs["running"], "FAILED")
        assert "cluster" in running["message"]
        assert "went away" in running["message"]
        assert "started" in server.logs(jobs["running"])
    finally:
        server.stop()


def test_an_embedded_server_stopped_on_a_full_disk_still_stops_its_jobs_gracefully(
    tmp_path: Path,
    ray_tmpdir: Path,
    small_disk: Path,
) -> None:
    """The archive's disk is full when the server is stopped: the end cannot be archived, but
    each running job is still asked to stop (SIGTERM, its grace period) before the embedded Ray
    goes, and the server exits in its own time; its next start does not list the job RUNNING."""
    log_dir = tmp_path / "logs"  # the job's output has room: only the archive's disk is full
    server = embedded_server(
        tmp_path,
        ray_tmpdir,
        *("--log-dir", str(log_dir), "--min-free-disk-bytes", "0"),
        state_dir=small_disk / "state",
    )
    server.start()
    try:
        job_id = server.submit(
            entrypoint=(
                "trap 'echo got TERM; exit 0' TERM; echo started; "
                f"while true; do sleep 0.05; done; : {marker(server)}"
            )
        )
        server.wait_status(job_id, "RUNNING")
        log = log_dir / f"job-driver-{job_id}.log"
        wait_until(lambda: "started" in log.read_text(), JOB_TIMEOUT_S, "the job's first line")
        filler = fill(small_disk, 0)
        # To the server alone (as `docker stop` does): Ray stops when the server says so.
        assert server.process is not None
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(timeout=60) == 0
        assert "got TERM" in log.read_text()
        assert processes_with(marker(server)) == []
        filler.unlink()
        server.start()
        ended = server.job(job_id)
        assert ended["status"] in ("STOPPED", "FAILED"), ended
    finally:
        server.stop()


def test_a_restarted_cluster_with_an_empty_kv_keeps_history_and_fails_the_running_jobs(
    tmp_path: Path, ray_tmpdir: Path
) -> None:
    cluster = Cluster(tmp_path, ray_tmpdir)
    server = Server(tmp_path, ray_tmpdir, ["--ray-address", cluster.address])
    second: Cluster | None = None
    try:
        server.start()
        jobs = submit_history(server)
        before = server.listed()
        server.stop()  # a server of a cluster of its own leaves its jobs running
        cluster.stop()
        second = Cluster(tmp_path, ray_tmpdir)
        server.ray_args = ["--ray-address", second.address]
        server.start()
        assert_finished_history(server, jobs, before)
        running = server.wait_status(jobs["running"], "FAILED")
        assert "went away" in running["message"]
        assert "started" in server.logs(jobs["running"])
        # The new cluster runs new jobs, and the archive lists them after the old ones.
        new = server.submit(entrypoint="echo new")
        server.wait_status(new, "SUCCEEDED")
        assert list(server.listed())[-1] == new
    finally:
        server.stop()
        cluster.stop()
        if second is not None:
            second.stop()


def test_a_log_that_belongs_to_no_record_is_never_appended_to(
    tmp_path: Path, ray_tmpdir: Path, ray_connection: str
) -> None:
    # On the session's cluster: what is tested is the server's start on its state dir.
    namespace = f"restarts_{uuid.uuid4().hex[:8]}"
    server = Server(
        tmp_path, ray_tmpdir, ["--ray-address", ray_connection, "--namespace", namespace]
    )
    logs = tmp_path / "state" / "logs"
    logs.mkdir(parents=True)
    (logs / "job-driver-orphan.log").write_text("an earlier life\n")
    server.start()
    try:
        job_id = server.submit(submission_id="orphan", entrypoint="echo fresh")
        server.wait_status(job_id, "SUCCEEDED")
        assert server.logs(job_id) == "fresh\n"
        set_aside = [path.name for path in logs.glob("job-driver-orphan.log.orphaned-*")]
        assert len(set_aside) == 1
        assert (logs / set_aside[0]).read_text() == "an earlier life\n"
    finally:
        server.stop()
        kill_actors_in_namespace(namespace)
