"""Jobs handed to a shared supervisor in batches, their starts and ends reported in batches
(run_batches.py, run_reports.py): fewer Ray calls under load, and nothing lost or doubled."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
from ray.exceptions import ActorUnavailableError

from jobs_server.manager import run_batches
from jobs_server.manager.archive.events import JobEventType
from jobs_server.manager.archive.sqlite import Archive
from jobs_server.manager.live.watcher import JobWatchers
from jobs_server.manager.records import JobSpec, JobStatus
from jobs_server.manager.submission_ids import new_submission_id
from jobs_server.manager.supervisor.run_reports import ENDED, STARTED, RunReports
from tests.support.managers import running_manager


async def test_reports_stay_until_a_later_poll_says_it_has_them() -> None:
    reports = RunReports(incarnation="this")
    reports.add(("a", "r1", ENDED, {"status": "SUCCEEDED"}))
    incarnation, last, first = await reports.take(None, 0, wait_s=0)
    assert (incarnation, last, first) == ("this", 1, [("a", "r1", ENDED, {"status": "SUCCEEDED"})])
    # The answer was lost on its way: the same poll gets the same report again.
    assert await reports.take(None, 0, wait_s=0) == ("this", 1, first)
    reports.add(("b", "r2", STARTED, {"status": "RUNNING"}))
    # A poll that had report 1 gets only what came after it; report 1 is forgotten.
    assert await reports.take("this", 1, wait_s=0) == (
        "this",
        2,
        [("b", "r2", STARTED, {"status": "RUNNING"})],
    )
    assert await reports.take("this", 2, wait_s=0) == ("this", 2, [])
    reports.add(("c", "r3", ENDED, "STOPPED"))
    # A poll numbered by another incarnation (an earlier supervisor under the same name) gets
    # everything not yet taken.
    assert await reports.take("earlier", 7, wait_s=0) == (
        "this",
        3,
        [("c", "r3", ENDED, "STOPPED")],
    )


async def test_a_poll_waits_for_the_next_report_and_answers_at_once() -> None:
    reports = RunReports(incarnation="this")
    poll = asyncio.create_task(reports.take("this", 0, wait_s=30))
    await asyncio.sleep(0.05)
    assert not poll.done()
    reports.add(("a", "r1", ENDED, "STOPPED"))
    assert await asyncio.wait_for(poll, timeout=5) == ("this", 1, [("a", "r1", ENDED, "STOPPED")])


async def test_a_burst_is_handed_over_and_reported_in_fewer_calls_than_jobs(
    ray_connection: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    batches: list[int] = []
    send_batch = run_batches.SupervisorRuns._send_batch

    def counting(self: run_batches.SupervisorRuns, batch: list[dict[str, Any]]) -> Any:
        batches.append(len(batch))
        return send_batch(self, batch)

    monkeypatch.setattr(run_batches.SupervisorRuns, "_send_batch", counting)
    async with running_manager(ray_connection, "batches_burst", tmp_path) as (manager, archive):
        records = await asyncio.gather(
            *(manager.submit_job(_spec(f"echo {index}")) for index in range(60))
        )
        ids = [record.submission_id for record in records]
        for job_id in ids:
            await _wait_ended(archive, job_id)
        for index, job_id in enumerate(ids):
            assert (await manager.get_job(job_id)).status is JobStatus.SUCCEEDED
            assert (tmp_path / "logs" / f"job-driver-{job_id}.log").read_text() == f"{index}\n"
    # Every job went exactly once, most of them with others.
    assert sum(batches) == 60, batches
    assert len(batches) < 60, batches


async def test_a_short_job_s_start_is_never_archived_a_long_one_s_is_as_its_supervisor_wrote_it(
    ray_connection: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """No `wait_started` call and no KV read for the start of a job handed over in a batch:
    the supervisor reports the start it wrote, and a job that ends first has none."""
    asked: list[str] = []

    async def no_call(self: JobWatchers, record: Any, supervisor: Any) -> None:
        asked.append(record.submission_id)
        raise AssertionError("the supervisor reports the start: nothing to ask")

    monkeypatch.setattr(JobWatchers, "_wait_until_started", no_call)
    async with running_manager(ray_connection, "batches_starts", tmp_path) as (manager, archive):
        short = (await manager.submit_job(_spec("true"))).submission_id
        long = (await manager.submit_job(_spec("sleep 2"))).submission_id
        for job_id in (short, long):
            await _wait_ended(archive, job_id)
        events = await archive.events_after(0, 1000)
    statuses = {
        job_id: [
            event.status
            for event in events
            if event.submission_id == job_id and event.type is JobEventType.STATUS
        ]
        for job_id in (short, long)
    }
    assert statuses[short] == [JobStatus.SUCCEEDED], (statuses, caplog.text)
    assert statuses[long] == [JobStatus.RUNNING, JobStatus.SUCCEEDED], (statuses, caplog.text)
    (running,) = [
        event.record
        for event in events
        if event.submission_id == long and event.status is JobStatus.RUNNING
    ]
    assert running is not None
    assert running.driver_pid is not None
    assert asked == []


async def _wait_ended(archive: Archive, job_id: str, timeout_s: float = 60) -> None:
    """Until the job's end is archived (the KV has it first)."""
    deadline = time.monotonic() + timeout_s
    while True:
        record = await archive.get(job_id)
        if record is not None and record.status.is_terminal():
            return
        assert time.monotonic() < deadline, f"job {job_id} did not end"
        await asyncio.sleep(0.05)


def _spec(entrypoint: str) -> JobSpec:
    return JobSpec(entrypoint=entrypoint, submission_id=new_submission_id())


async def test_a_batch_sent_twice_runs_each_job_once(
    ray_connection: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As when the supervisor was out of reach as it got the batch, and it is sent again."""
    send_batch = run_batches.SupervisorRuns._send_batch

    def twice(self: run_batches.SupervisorRuns, batch: list[dict[str, Any]]) -> Any:
        send_batch(self, batch)
        return send_batch(self, batch)

    monkeypatch.setattr(run_batches.SupervisorRuns, "_send_batch", twice)
    async with running_manager(ray_connection, "batches_twice", tmp_path) as (manager, archive):
        records = await asyncio.gather(
            *(manager.submit_job(_spec(f"echo {index}; sleep 0.3")) for index in range(10))
        )
        for index, record in enumerate(records):
            await _wait_ended(archive, record.submission_id)
            ended = await manager.get_job(record.submission_id)
            assert ended.status is JobStatus.SUCCEEDED, ended
            log = tmp_path / "logs" / f"job-driver-{record.submission_id}.log"
            assert log.read_text() == f"{index}\n"


async def test_reports_whose_answer_was_lost_come_with_the_next_poll(
    ray_connection: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every other poll's answer is lost on its way (the call cut off): the next poll, which
    says it had nothing of it, gets the same starts and ends again."""
    polls = {"count": 0}

    class LosingHandle:
        def __init__(self, supervisor: Any) -> None:
            self._supervisor = supervisor
            self._actor_id = supervisor._actor_id
            self.run_jobs = supervisor.run_jobs

        @property
        def run_reports(self) -> Any:
            return self

        def remote(self, incarnation: str | None, after: int) -> Any:
            polls["count"] += 1
            answer = self._supervisor.run_reports.remote(incarnation, after)
            if polls["count"] % 2 == 1:
                return self._lost(answer)
            return answer

        async def _lost(self, answer: Any) -> Any:
            await answer
            raise ActorUnavailableError("injected: the answer was lost", None)

    original_init = run_batches.SupervisorRuns.__init__

    def losing_init(self: run_batches.SupervisorRuns, supervisor: Any) -> None:
        original_init(self, LosingHandle(supervisor))

    monkeypatch.setattr(run_batches.SupervisorRuns, "__init__", losing_init)
    monkeypatch.setattr(run_batches, "SUPERVISOR_UNAVAILABLE_RETRY_S", 0.01)
    async with running_manager(ray_connection, "batches_lost", tmp_path) as (manager, archive):
        short = [(await manager.submit_job(_spec("true"))).submission_id for _ in range(5)]
        long = (await manager.submit_job(_spec("sleep 1"))).submission_id
        for job_id in [*short, long]:
            await _wait_ended(archive, job_id)
            assert (await manager.get_job(job_id)).status is JobStatus.SUCCEEDED
        events = await archive.events_after(0, 1000)
    assert polls["count"] >= 4, polls
    assert [event.status for event in events if event.submission_id == long][-2:] == [
        JobStatus.RUNNING,
        JobStatus.SUCCEEDED,
    ]


async def test_a_start_first_written_with_the_wait_to_retry_is_reported(
    ray_connection: str, tmp_path: Path
) -> None:
    """An attempt that fails within 0.1 s has its start written with the wait before its
    retry: that write is the job's RUNNING, reported like any other start. Unreported, the
    server would wait for a start past its start timeout (1 s here), and fail a job that runs."""
    async with running_manager(
        ray_connection, "batches_retry", tmp_path, job_start_timeout_s=1, retry_backoff_s=2
    ) as (manager, archive):
        spec = JobSpec(entrypoint="exit 3", submission_id=new_submission_id(), max_retries=1)
        job_id = (await manager.submit_job(spec)).submission_id
        await _wait_ended(archive, job_id)
        ended = await manager.get_job(job_id)
        events = await archive.events_after(0, 1000)
    assert ended.status is JobStatus.FAILED, ended
    assert ended.error_type == "JOB_ENTRYPOINT_COMMAND_ERROR", ended
    assert ended.driver_exit_code == 3
    assert len(ended.attempts) == 2
    assert [
        event.status
        for event in events
        if event.submission_id == job_id and event.type is JobEventType.STATUS
    ] == [JobStatus.RUNNING, JobStatus.RUNNING, JobStatus.FAILED]  # its start, its retry, its end
