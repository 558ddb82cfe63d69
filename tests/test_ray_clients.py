"""Ray's own clients, unchanged, against a `jobs-server serve` process."""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from pathlib import Path

import pytest
from ray.job_submission import JobStatus, JobSubmissionClient

from tests.support.processes import wait_until
from tests.support.ray_nodes import RAY_CLI

# Runs Ray's own CLI and SDK as processes of their own, each a few seconds.
pytestmark = pytest.mark.slow


@pytest.fixture
def ray_client(server_url: str) -> JobSubmissionClient:
    return JobSubmissionClient(server_url)


def wait_for_client_status(
    client: JobSubmissionClient, job_id: str, statuses: set[JobStatus], timeout_s: float = 60
) -> JobStatus:
    wait_until(lambda: client.get_job_status(job_id) in statuses, timeout_s, f"{job_id} {statuses}")
    return client.get_job_status(job_id)


def test_submission_client_round_trip(ray_client: JobSubmissionClient) -> None:
    job_id = ray_client.submit_job(
        entrypoint="for i in 1 2 3; do echo tick $i; sleep 0.2; done",
        metadata={"who": "sdk-test"},
        runtime_env={"env_vars": {"UNUSED": "1"}},
    )
    assert job_id.startswith("raysubmit_")

    async def tail() -> str:
        return "".join([chunk async for chunk in ray_client.tail_job_logs(job_id)])

    assert asyncio.run(tail()) == "tick 1\ntick 2\ntick 3\n"
    assert ray_client.get_job_status(job_id) == JobStatus.SUCCEEDED
    info = ray_client.get_job_info(job_id)
    assert info.submission_id == job_id
    assert info.metadata == {"who": "sdk-test"}
    assert info.runtime_env == {"env_vars": {"UNUSED": "1"}}
    assert info.driver_exit_code == 0
    assert ray_client.get_job_logs(job_id) == "tick 1\ntick 2\ntick 3\n"
    assert job_id in {job.submission_id for job in ray_client.list_jobs()}
    assert ray_client.stop_job(job_id) is False
    assert ray_client.delete_job(job_id) is True
    with pytest.raises(RuntimeError, match="404"):
        ray_client.get_job_info(job_id)


def test_submission_client_stop(ray_client: JobSubmissionClient) -> None:
    job_id = ray_client.submit_job(entrypoint="sleep 60")
    wait_for_client_status(ray_client, job_id, {JobStatus.RUNNING})
    assert ray_client.stop_job(job_id) is True
    assert wait_for_client_status(ray_client, job_id, {JobStatus.STOPPED}) == JobStatus.STOPPED


def test_submission_client_duplicate_id_raises(ray_client: JobSubmissionClient) -> None:
    ray_client.submit_job(entrypoint="true", submission_id="sdk-dup")
    with pytest.raises(RuntimeError, match="409"):
        ray_client.submit_job(entrypoint="true", submission_id="sdk-dup")


def test_working_dir_is_uploaded_and_used(ray_client: JobSubmissionClient, tmp_path: Path) -> None:
    (tmp_path / "main.py").write_text("import helper\nprint(helper.GREETING)\n")
    (tmp_path / "helper.py").write_text("GREETING = 'hello from the working dir'\n")
    job_id = ray_client.submit_job(
        entrypoint="python main.py", runtime_env={"working_dir": str(tmp_path)}
    )
    status = wait_for_client_status(
        ray_client, job_id, {JobStatus.SUCCEEDED, JobStatus.FAILED}, timeout_s=120
    )
    logs = ray_client.get_job_logs(job_id)
    assert status == JobStatus.SUCCEEDED, logs
    assert logs == "hello from the working dir\n"
    assert ray_client.get_job_info(job_id).runtime_env["working_dir"].startswith("gcs://_ray_pkg_")


def _ray_job(
    server_url: str, *args: str, timeout_s: float = 120
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [RAY_CLI, "job", *args, "--address", server_url],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env={**os.environ, "RAY_ADDRESS": server_url},
        check=False,
    )


def test_ray_job_cli_round_trip(server_url: str, tmp_path: Path) -> None:
    (tmp_path / "job.py").write_text("print('cli job output')\n")
    submitted = _ray_job(
        server_url,
        "submit",
        "--submission-id",
        "cli-1",
        "--working-dir",
        str(tmp_path),
        "--",
        "python",
        "job.py",
    )
    assert submitted.returncode == 0, submitted.stderr
    assert "cli job output" in submitted.stdout + submitted.stderr
    assert "succeeded" in submitted.stdout + submitted.stderr

    status = _ray_job(server_url, "status", "cli-1")
    assert status.returncode == 0, status.stderr
    assert "Job 'cli-1' succeeded" in status.stdout + status.stderr

    logs = _ray_job(server_url, "logs", "cli-1")
    assert logs.returncode == 0, logs.stderr
    assert logs.stdout.endswith(" -- cli job output\n")

    listed = _ray_job(server_url, "list")
    assert listed.returncode == 0, listed.stderr
    assert "cli-1" in listed.stdout + listed.stderr

    deleted = _ray_job(server_url, "delete", "cli-1")
    assert deleted.returncode == 0, deleted.stderr
    assert _ray_job(server_url, "status", "cli-1").returncode != 0


def test_ray_job_cli_follow_and_stop(server_url: str) -> None:
    submitted = _ray_job(
        # The CLI quotes each word after `--`, as Ray's does.
        server_url,
        "submit",
        "--no-wait",
        "--submission-id",
        "cli-2",
        "--",
        "sh",
        "-c",
        "echo begin; sleep 60",
    )
    assert submitted.returncode == 0, submitted.stderr
    follower = subprocess.Popen(
        [RAY_CLI, "job", "logs", "-f", "cli-2", "--address", server_url],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "RAY_ADDRESS": server_url},
    )
    try:
        deadline = time.monotonic() + 60
        while "RUNNING" not in _ray_job(server_url, "status", "cli-2").stdout.upper():
            assert time.monotonic() < deadline
            time.sleep(0.2)
        stopped = _ray_job(server_url, "stop", "cli-2")
        assert stopped.returncode == 0, stopped.stderr
        stdout, _ = follower.communicate(timeout=60)
    finally:
        follower.kill()
    assert "\nbegin\n" in stdout
    assert "Job 'cli-2' was stopped" in stdout
    assert follower.returncode == 0
    assert "Job 'cli-2' was stopped" in _ray_job(server_url, "status", "cli-2").stdout
