"""A shared supervisor writes a job's start a moment after its command began (or with its end):
in between, the job reads PENDING while its command runs. Neither a stop nor the supervisor's
death in that moment may treat the command as never started. The moment is stretched here so
that a test can act inside it."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest
import ray

from jobs_server.manager import launcher
from jobs_server.settings import Settings
from tests.support.api import Client, job_logs, submit, wait_for_status

SHARED_SUPERVISOR_PREFIX = "jobs_server_shared_supervisor:"
# Far longer than any step of these tests: the start stays unwritten throughout.
STRETCHED_DELAY_S = 120.0


@pytest.fixture
def stretched_start_record(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launcher, "SHARED_START_RECORD_DELAY_S", STRETCHED_DELAY_S)


async def wait_for_log(client: Client, job_id: str, text: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while await job_logs(client, job_id) != text:
        assert time.monotonic() < deadline, f"job {job_id} never wrote {text!r}"
        await asyncio.sleep(0.05)


@pytest.mark.usefixtures("stretched_start_record")
async def test_a_stop_of_a_command_whose_start_is_unwritten_gives_it_its_grace(
    client: Client,
) -> None:
    job_id = await submit(
        client, entrypoint="trap 'echo bye; exit 0' TERM; echo ready; sleep 1000 & wait"
    )
    await wait_for_log(client, job_id, "ready\n")
    assert (await (await client.get(f"/api/jobs/{job_id}")).json())["status"] == "PENDING"
    response = await client.post(f"/api/jobs/{job_id}/stop", json={"grace_period_s": 30})
    assert await response.json() == {"stopped": True}
    job = await wait_for_status(client, job_id, timeout_s=30)
    assert job["status"] == "STOPPED", job
    # SIGTERM first (its trap ran), not SIGKILL at once.
    assert await job_logs(client, job_id) == "ready\nbye\n"
    assert job["driver_node_id"], job


@pytest.mark.usefixtures("stretched_start_record")
async def test_a_command_that_began_is_not_run_again_when_its_supervisor_dies(
    client: Client, settings: Settings, tmp_path: Path
) -> None:
    runs = tmp_path / "runs"
    job_id = await submit(client, entrypoint=f"echo run >> {runs}; echo ready; sleep 1000")
    await wait_for_log(client, job_id, "ready\n")
    assert (await (await client.get(f"/api/jobs/{job_id}")).json())["status"] == "PENDING"
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor["namespace"] == settings.namespace and actor["name"].startswith(
            SHARED_SUPERVISOR_PREFIX
        ):
            handle = ray.get_actor(actor["name"], namespace=settings.namespace)
            os.kill(ray.get(handle.pid.remote(), timeout=30), signal.SIGKILL)
    job = await wait_for_status(client, job_id, timeout_s=60)
    assert job["status"] == "FAILED", job
    assert job["error_type"] == "JOB_SUPERVISOR_ACTOR_DIED", job
    assert runs.read_text() == "run\n"
