"""The head is protected by default (issue 35, item 5): all the jobs on the head run under one
cgroup whose memory ceiling (--head-jobs-memory-max-bytes) keeps the server, Ray and the shared
supervisors out of the OOM killer's reach. A job with no limit of its own that takes more than
the ceiling is killed alone, and ends JOB_OUT_OF_MEMORY naming the ceiling; the server, its
supervisor and the other jobs run on. Real Ray, a real server, real cgroups."""

from __future__ import annotations

import asyncio
import secrets
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from jobs_server.settings import Settings
from tests.support.api import TERMINAL_STATUSES, Client, job_logs, submit
from tests.support.job_cgroups import JobsCgroups
from tests.support.restarts import JOB_TIMEOUT_S

pytestmark = [pytest.mark.ray, pytest.mark.slow]

MIB = 1 << 20
CEILING = 200 * MIB


@pytest.fixture(scope="module")
def job_cgroups() -> Iterator[JobsCgroups]:
    """A jobs cgroup of this module's own (the ceiling must not reach other tests' jobs)."""
    cgroups = JobsCgroups(f"jobs-server-test-{secrets.token_hex(4)}")
    yield cgroups
    assert cgroups.remove() == []


@pytest.fixture
def settings(settings: Settings, job_cgroups: JobsCgroups) -> Settings:
    return settings.model_copy(
        update={"jobs_cgroup": job_cgroups.name, "head_jobs_memory_max_bytes": CEILING}
    )


async def details(client: Client, job_id: str) -> dict[str, Any]:
    response = await client.get(f"/api/jobs/{job_id}")
    assert response.status == 200, await response.text()
    return dict(await response.json())


async def until_status(client: Client, job_id: str, statuses: set[str]) -> dict[str, Any]:
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while (job := await details(client, job_id))["status"] not in statuses:
        healthz = await client.get("/api/healthz")
        assert healthz.status == 200, await healthz.text()
        assert time.monotonic() < deadline, job
        await asyncio.sleep(0.1)
    return job


async def test_jobs_past_the_heads_ceiling_are_killed_alone(
    client: Client, job_cgroups: JobsCgroups, tmp_path: Path
) -> None:
    version = await (await client.get("/api/version")).json()
    if version["limits"] == "none":
        pytest.skip("GET /api/version says limits: none")
    memory = job_cgroups.directories(version["limits"])["memory"]
    assert int((memory / "memory.limit_in_bytes").read_text()) == CEILING

    go = tmp_path / "go"
    sleeper = await submit(client, entrypoint=f"while [ ! -e {go} ]; do sleep 0.05; done")
    running = await until_status(client, sleeper, {"RUNNING"})
    supervisor = psutil.Process(int(running["driver_info"]["pid"])).parent()
    assert supervisor is not None

    # No limit of its own: only the ceiling of all the head's jobs holds it.
    hog = await submit(client, entrypoint=f"{sys.executable} -c 'data = b\"x\" * (400 << 20)'")
    job = await until_status(client, hog, TERMINAL_STATUSES)
    assert (job["status"], job["error_type"]) == ("FAILED", "JOB_OUT_OF_MEMORY"), job
    assert "ceiling" in job["message"], job["message"]
    assert job["limits"] is None

    # A limit of its own above the ceiling: the ceiling killed it, and its message says so.
    roomy = await submit(
        client,
        entrypoint=f"{sys.executable} -c 'data = b\"x\" * (400 << 20)'",
        limits={"memory_bytes": 1 << 30},
    )
    job = await until_status(client, roomy, TERMINAL_STATUSES)
    assert (job["status"], job["error_type"]) == ("FAILED", "JOB_OUT_OF_MEMORY"), job
    assert "ceiling" in job["message"], job["message"]
    assert "1 GiB" not in job["message"], job["message"]

    assert (await details(client, sleeper))["status"] == "RUNNING"
    assert supervisor.is_running()
    go.touch()
    assert (await until_status(client, sleeper, TERMINAL_STATUSES))["status"] == "SUCCEEDED"
    assert await job_logs(client, sleeper) == ""
