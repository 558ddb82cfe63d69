"""A job's attempt (attempts.py) when the fork server that starts its command fails, with a
real fork server, real processes and the real GCS KV: the end it records."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path

from jobs_server.manager.live.kv import GcsKv
from jobs_server.manager.live.store import JobStore
from jobs_server.manager.records import JobRecord, JobSpec, JobStatus, new_run_id
from jobs_server.manager.supervisor.attempts import STOPPED_MESSAGE, JobAttempts
from jobs_server.manager.supervisor.job_run import JobRun, SupervisedJob
from tests.support.fork_servers import Host, subreaper_fork_server, wait_until


@contextlib.contextmanager
def frozen(pid: int) -> Iterator[None]:
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


async def test_a_stop_asked_while_the_fork_server_dies_starting_the_command_ends_stopped(
    ray_connection: str, tmp_path: Path
) -> None:
    """The user asked to stop, and the command never ran on: STOPPED, as any stop before the
    command's start, not FAILED for a start that failed."""
    store = JobStore(GcsKv(ray_connection, f"attempt-faults-{uuid.uuid4().hex}"))
    run_id = new_run_id()
    spec = JobSpec(entrypoint="sleep 60", submission_id="stopped")
    await store.create(JobRecord(spec=spec, run_id=run_id))
    job = SupervisedJob(
        spec=spec,
        run_id=run_id,
        log_path=tmp_path / "stopped.log",
        stop_grace_s=1.0,
    )
    run = JobRun(job=job, log_path=job.log_path)
    async with subreaper_fork_server() as forks:
        assert forks.pid is not None
        zygote = forks.pid
        with frozen(zygote):  # the start is asked for and not answered
            attempt = asyncio.create_task(JobAttempts(run, Host(store, forks)).run())
            await wait_until(lambda: run.start_began, "the command's start never began")
            await asyncio.sleep(0.2)
            run.stop_requested.set()  # as the supervisor's stop_job does
            os.kill(zygote, signal.SIGKILL)
            ended = await asyncio.wait_for(attempt, 30)
    assert ended is not None
    assert (ended.status, ended.message) == (JobStatus.STOPPED, STOPPED_MESSAGE)
    assert (await store.get("stopped", run_id)).status is JobStatus.STOPPED
