"""Ray's own clients, unchanged, with a tenant's `submit` and `read` keys (they send the key in
the headers they are given)."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator

import pytest
from ray.exceptions import AuthenticationError
from ray.job_submission import JobStatus, JobSubmissionClient

from tests.support.processes import wait_until
from tests.support.ray_nodes import RAY_CLI
from tests.support.tenant_server import TenantServer, run_tenant_server


@pytest.fixture(scope="module")
def server(ray_connection: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TenantServer]:
    yield from run_tenant_server(ray_connection, tmp_path_factory.mktemp("tenant-clients"))


def client_of(server: TenantServer, name: str) -> JobSubmissionClient:
    return JobSubmissionClient(server.url, headers=server.headers(name))


def test_submission_client_with_a_submit_key_and_a_read_key(server: TenantServer) -> None:
    submitter, reader = client_of(server, "a-submit"), client_of(server, "a-read")
    job_id = submitter.submit_job(entrypoint="echo from team-a", metadata={"who": "sdk"})
    wait_until(
        lambda: submitter.get_job_status(job_id) == JobStatus.SUCCEEDED, 60, f"{job_id} ends"
    )
    # The read key sees its tenant's job and its log.
    assert reader.get_job_status(job_id) == JobStatus.SUCCEEDED
    assert reader.get_job_info(job_id).metadata == {"who": "sdk"}
    assert reader.get_job_logs(job_id) == "from team-a\n"
    assert job_id in {job.submission_id for job in reader.list_jobs()}
    # ... and may change nothing (Ray's client raises its AuthenticationError for a 403, with
    # the server's answer in its message).
    with pytest.raises(AuthenticationError, match="permission_denied"):
        reader.submit_job(entrypoint="true")
    with pytest.raises(AuthenticationError, match="permission_denied"):
        reader.delete_job(job_id)
    # The other tenant cannot tell the job exists.
    other = client_of(server, "b-submit")
    with pytest.raises(RuntimeError, match="404"):
        other.get_job_info(job_id)
    assert job_id not in {job.submission_id for job in other.list_jobs()}
    assert submitter.delete_job(job_id) is True


def test_submission_client_stop_with_a_submit_key(server: TenantServer) -> None:
    submitter = client_of(server, "b-submit")
    job_id = submitter.submit_job(entrypoint="sleep 60")
    with pytest.raises(RuntimeError, match="404"):
        client_of(server, "a-submit").stop_job(job_id)
    assert submitter.stop_job(job_id) is True
    wait_until(lambda: submitter.get_job_status(job_id) == JobStatus.STOPPED, 60, "stopped")


def _ray_job(
    server: TenantServer, key_name: str, command: str, *args: str
) -> subprocess.CompletedProcess[str]:
    """`ray job COMMAND` with the key in `--headers` (before ARGS: they may end with `-- CMD`)."""
    return subprocess.run(
        [
            RAY_CLI,
            "job",
            command,
            "--address",
            server.url,
            "--headers",
            json.dumps(server.headers(key_name)),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "RAY_ADDRESS": server.url},
        check=False,
    )


def test_ray_job_cli_with_a_submit_key_and_a_read_key(server: TenantServer) -> None:
    submitted = _ray_job(
        server, "a-submit", "submit", "--submission-id", "tenant-cli-1", "--", "echo", "cli-a"
    )
    assert submitted.returncode == 0, submitted.stderr
    assert "cli-a" in submitted.stdout + submitted.stderr
    status = _ray_job(server, "a-read", "status", "tenant-cli-1")
    assert status.returncode == 0, status.stderr
    assert "Job 'tenant-cli-1' succeeded" in status.stdout + status.stderr
    logs = _ray_job(server, "a-read", "logs", "tenant-cli-1")
    assert logs.returncode == 0, logs.stderr
    assert "cli-a" in logs.stdout
    refused = _ray_job(server, "a-read", "submit", "--", "true")
    assert refused.returncode != 0
    assert "permission_denied" in refused.stdout + refused.stderr
    assert _ray_job(server, "b-read", "status", "tenant-cli-1").returncode != 0
