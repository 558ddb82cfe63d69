"""The queue as the tests drive it: a manager with a queue on the session's cluster, jobs that
wait for a gate, statuses to wait for."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

from jobs_server.manager import JobManager, JobRecord, JobSpec, JobStatus
from jobs_server.manager.tenancy import NO_LIMITS, TenantLimits
from tests.support.managers import running_manager
from tests.support.ray_nodes import kill_actors_in_namespace


def gate(path: Path) -> str:
    """A command that runs until `path` exists (the test opens the gate)."""
    return f"while [ ! -e {path} ]; do sleep 0.05; done"


@asynccontextmanager
async def queue_manager(
    gcs_address: str,
    state_dir: Path,
    *,
    max_running: int | None = None,
    max_queued: int | None = None,
    tenant_limits: Callable[[str], TenantLimits] = lambda _: NO_LIMITS,
) -> AsyncIterator[JobManager]:
    """A manager on the session's Ray, in a namespace of its own, with the caps given."""
    namespace = f"test_queue_{uuid.uuid4().hex[:8]}"
    try:
        async with running_manager(
            gcs_address,
            namespace,
            state_dir,
            max_running_jobs=max_running,
            max_queued_jobs=max_queued,
            tenant_limits=tenant_limits,
        ) as (manager, _):
            yield manager
    finally:
        kill_actors_in_namespace(namespace)


def spec(submission_id: str, entrypoint: str = "true", priority: int = 0) -> JobSpec:
    return JobSpec(entrypoint=entrypoint, submission_id=submission_id, priority=priority)


async def until_status(
    manager: JobManager, submission_id: str, statuses: set[JobStatus]
) -> JobRecord:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        record = await manager.get_job(submission_id)
        if record.status in statuses:
            return record
        await asyncio.sleep(0.05)
    raise AssertionError(f"job {submission_id} is still {record.status}: {record.message}")


TERMINAL = {JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED}


WAIT_S = 90.0
