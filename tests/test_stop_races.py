"""A stop that meets another end (issue 32, items 11 and 12): the job ends as it truly did. A
stop that comes just after the job's supervisor died leaves it FAILED with the death's reason,
not STOPPED "before it started"; a stop that comes just after the command exited on its own
leaves it ended as its command did. Real Ray, real processes; the interleavings are injected."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import ray

from jobs_server.manager import JobSpec, JobStatus
from jobs_server.manager.live.kv import GcsKv
from jobs_server.manager.live.store import JobStore
from jobs_server.manager.live.watcher import JobWatchers
from jobs_server.manager.logs import job_log_path
from jobs_server.manager.records import JobErrorType, JobRecord, new_run_id, now_ms
from jobs_server.manager.supervisor.attempts import JobAttempts
from jobs_server.manager.supervisor.command_start import CommandProcess
from jobs_server.manager.supervisor.containment import Containment
from jobs_server.manager.supervisor.fork_server import ForkServer
from jobs_server.manager.supervisor.job_run import JobRun, SupervisedJob
from tests.support.fork_servers import CONTAINMENTS, Host, subreaper_fork_server, wait_until
from tests.support.managers import running_manager
from tests.support.ray_nodes import kill_actors_in_namespace


async def until(predicate: Callable[[], Awaitable[object]], what: str) -> None:
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if await predicate():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def namespace() -> Iterator[str]:
    name = f"test_stop_races_{uuid.uuid4().hex[:8]}"
    yield name
    kill_actors_in_namespace(name)


def actor_is_gone(name: str, namespace: str) -> bool:
    try:
        ray.get_actor(name, namespace=namespace)
    except ValueError:
        return True
    return False


async def test_a_stop_just_after_the_supervisor_died_leaves_the_job_failed_with_its_reason(
    ray_connection: str, tmp_path: Path, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The watcher learns of the death as the stop comes: it records the failure only once the
    # stop has answered (the order in which the two met in the field).
    stop_answered = asyncio.Event()
    record_failure = JobWatchers._record_failure

    async def after_the_stop(self: JobWatchers, *args: Any) -> None:
        await stop_answered.wait()
        await record_failure(self, *args)

    monkeypatch.setattr(JobWatchers, "_record_failure", after_the_stop)
    async with running_manager(ray_connection, namespace, tmp_path / "state") as (manager, _):
        # Resources: a supervisor of its own, which dies alone.
        submitted = await manager.submit_job(
            JobSpec(entrypoint="sleep 60", submission_id="died", entrypoint_num_cpus=0.1)
        )

        async def running() -> bool:
            return (await manager.get_job("died")).status is JobStatus.RUNNING

        await until(running, "the job to run")
        name = submitted.supervisor_name
        assert name is not None
        # Its process killed at once (SIGKILL): it writes nothing more, as a supervisor whose
        # node or process died. The job's first process is its child.
        job = await manager.get_job("died")
        assert job.driver_pid is not None
        os.kill(psutil.Process(job.driver_pid).ppid(), signal.SIGKILL)

        async def gone() -> bool:
            return actor_is_gone(name, namespace)

        await until(gone, "the supervisor's name to be released")
        assert (await manager.get_job("died")).status is JobStatus.RUNNING
        try:
            stopped = await manager.stop_job("died", 0)
        finally:
            stop_answered.set()

        async def ended() -> bool:
            return (await manager.get_job("died")).status.is_terminal()

        await until(ended, "the job's end")
        job = await manager.get_job("died")
        assert job.status is JobStatus.FAILED, job
        assert job.error_type == JobErrorType.JOB_SUPERVISOR_ACTOR_DIED
        assert job.message is not None
        assert "supervisor" in job.message
        assert "died" in job.message
        assert "before it started" not in job.message
        assert stopped is False  # it had ended (with its supervisor) before the stop


class ContainedHost(Host):
    """A supervisor's side of an attempt, its jobs held together by `containment`."""

    def __init__(self, store: JobStore, forks: ForkServer, containment: Containment) -> None:
        super().__init__(store, forks)
        self._containment = containment

    async def prepare_processes(self, jobs_cgroup: str | None) -> Containment:
        return self._containment


@pytest.mark.parametrize("containment", CONTAINMENTS)
async def test_a_stop_that_meets_the_commands_own_exit_leaves_the_job_ended_as_it_did(
    ray_connection: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    containment: Containment,
) -> None:
    """The command exits on its own (0) after the supervisor found it running and before the
    SIGTERM reaches it: the job SUCCEEDED, as its command did; it was not stopped. In a PID
    namespace its init tells; without one, the supervisor sees its child exited as it is
    about to signal it."""
    store = JobStore(GcsKv(ray_connection, f"stop-races-{uuid.uuid4().hex}"))
    run_id = new_run_id()
    go = tmp_path / "go"
    entrypoint = f"echo all of it; while [ ! -e {go} ]; do sleep 0.01; done; echo the end"
    spec = JobSpec(entrypoint=entrypoint, submission_id="race")
    await store.create(JobRecord(spec=spec, run_id=run_id))
    job = SupervisedJob(
        spec=spec,
        run_id=run_id,
        log_path=tmp_path / "race.log",
        stop_grace_s=5.0,
    )
    run = JobRun(job=job, log_path=job.log_path)
    has_ended = JobAttempts._run_until_end.__globals__["command_has_ended"]
    checks: list[bool] = []

    def exits_right_after_the_check(process: CommandProcess, containment: Containment) -> bool:
        # "Has it ended?" says no; then the command exits on its own, before the SIGTERM.
        answer = has_ended(process, containment)
        checks.append(answer)
        go.touch()
        deadline = time.monotonic() + 30
        while not has_ended(process, containment):
            assert time.monotonic() < deadline, "the command did not exit"
            time.sleep(0.01)
        return answer

    # Where the method looks the name up: after a manager's test in this process, cloudpickle
    # (the supervisor's code goes by value) may have given it globals of its own.
    monkeypatch.setitem(
        JobAttempts._run_until_end.__globals__, "command_has_ended", exits_right_after_the_check
    )
    async with subreaper_fork_server() as forks:
        attempt = asyncio.create_task(
            JobAttempts(run, ContainedHost(store, forks, containment)).run()
        )
        await wait_until(lambda: run.pid is not None, "the command to start")
        await asyncio.sleep(0.2)
        run.stop_requested.set()  # as the supervisor's stop_job does
        ended = await asyncio.wait_for(attempt, 30)
    assert ended is not None
    assert checks == [False], (ended, job.log_path.read_text())
    assert (ended.status, ended.driver_exit_code) == (JobStatus.SUCCEEDED, 0), ended
    assert job.log_path.read_text() == "all of it\nthe end\n"


async def test_a_stop_of_a_pending_job_whose_command_began_under_a_dead_supervisor_fails_it(
    ray_connection: str, tmp_path: Path, namespace: str
) -> None:
    """Its supervisor died after the command began (its log is there) and before its start
    was recorded, and no watcher has noticed yet: a stop finds it PENDING without a
    supervisor. It began, so it did not stop "before it started": it FAILED with its
    supervisor."""
    state_dir = tmp_path / "state"
    async with running_manager(ray_connection, namespace, state_dir) as (manager, archive):
        began = JobRecord(
            spec=JobSpec(entrypoint="sleep 60", submission_id="began"),
            start_time=now_ms(),
            message="Job is pending.",
            run_id=new_run_id(),
        )
        began = began.with_changes(
            supervisor_name=f"jobs_server_supervisor:began:{began.run_id}",
            handed_over_time=now_ms(),
        )
        await archive.insert(began)
        await JobStore(GcsKv(ray_connection, namespace)).create(began)
        job_log_path(state_dir / "logs", "began").write_text("output until then\n")
        stopped = await manager.stop_job("began", 0)
        job = await manager.get_job("began")
        assert job.status is JobStatus.FAILED, job
        assert job.error_type == JobErrorType.JOB_SUPERVISOR_ACTOR_DIED
        assert job.message is not None
        assert "died" in job.message
        assert stopped is False
