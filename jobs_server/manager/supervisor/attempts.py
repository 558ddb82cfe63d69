"""One job in its supervisor, from its start to its end: attempt after attempt of its command.

A failed attempt is retried (as the job's `max_retries` and `retry_on_exit_codes` say) after a
backoff (retries.py); the job stays RUNNING between attempts, and its end is the last attempt's.
Every attempt appends to the one log, and the record lists the attempts with the byte offset at
which each one's output begins: nothing of an attempt outlives it (its leftover processes are
killed before the next one starts), so the offsets split the log exactly. A stop ends the
retries, during an attempt or between two. The job's `timeout_s` bounds all of it together.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from typing import Any, Protocol

import ray

from jobs_server.errors import JobNotFoundError
from jobs_server.manager.limits import ResourceUsage
from jobs_server.manager.live.store import JobStore
from jobs_server.manager.logs import log_size, read_log_tail
from jobs_server.manager.queue.retries import (
    attempts_ran,
    backoff_message,
    retry_backoff_s,
    running_message,
    why_not_retried,
)
from jobs_server.manager.records import (
    JobAttempt,
    JobErrorType,
    JobRecord,
    JobStatus,
    RayDriver,
    now_ms,
)
from jobs_server.manager.supervisor.cgroups import AttemptCgroup, attempt_usage
from jobs_server.manager.supervisor.command_start import CommandProcess, start_entrypoint
from jobs_server.manager.supervisor.containment import Containment
from jobs_server.manager.supervisor.early_stop import EarlyStop
from jobs_server.manager.supervisor.fork_server import ForkServer
from jobs_server.manager.supervisor.job_run import (
    JOB_TIMEOUT_ERROR_TYPE,
    NEVER_STARTED_MESSAGE,
    CommandEnd,
    JobRun,
    driver_env,
    end_grace_within,
    failure_message,
    out_of_memory_message,
)
from jobs_server.manager.supervisor.log_shipping import LOG_DRAIN_TIMEOUT_S
from jobs_server.manager.supervisor.process import (
    command_has_ended,
    ended_before_the_stop,
    ended_with_its_namespace,
    kill_job_processes,
    stop_job_processes,
)

logger = logging.getLogger(__name__)

STOPPED_MESSAGE = "Job was intentionally stopped."


class AttemptHost(Protocol):
    """What a job's attempts need of the supervisor that runs them (actor.py)."""

    @property
    def supervisor_token(self) -> str: ...

    def job_store(self) -> JobStore: ...

    async def ray_driver_of(self, submission_id: str) -> RayDriver | None:
        """The last Ray driver the job's command started, as Ray's job table has it now."""

    async def prepare_processes(self, jobs_cgroup: str | None) -> Containment: ...

    def attempt_cgroup(self, run: JobRun, attempt: int) -> AttemptCgroup | None:
        """A new cgroup for the run's attempt (cgroups.py), or None where there are none."""

    def fork_server(self) -> ForkServer | None:
        """What forks the jobs' launchers (None: a launcher is started per job)."""

    def spool(self, run: JobRun) -> None:
        """From now on the server pulls the run's log from this node's spool."""

    def unspool(self, run: JobRun) -> None: ...

    def is_spooled(self, run: JobRun) -> bool: ...

    def command_starting(self) -> contextlib.AbstractContextManager[None]:
        """While a command starts: no orphan reaping (see actor.py)."""

    def other_roots(self, run: JobRun) -> frozenset[int]: ...

    def reap_orphans(self) -> None: ...


class JobAttempts:
    """Runs one job (`run`) to its end, and records its status and attempts as they change."""

    def __init__(self, run: JobRun, host: AttemptHost) -> None:
        self._run = run
        self._job = run.job
        self._host = host
        self._store = host.job_store()
        self._attempts: list[JobAttempt] = []
        # The job's timeout, over all its attempts and the waits between them (monotonic).
        self._deadline: float | None = None
        # The running attempt's start, until a write of the record carries it.
        self._unwritten_start: dict[str, Any] = {}
        # The run's live record as this supervisor last read or wrote it: nothing else writes
        # it once the run is handed over, so a write needs no read first (store.py).
        self._record: JobRecord | None = None
        # Whether the job's RUNNING has been written (and told: `JobRun.on_start_written`).
        self._start_written = False
        # What the last attempt used, measured at its end.
        self._last_usage = ResourceUsage()

    async def run(self) -> JobRecord | None:
        """Run the job's attempts and return its record as it ended (the end that won in the
        store: the server need not read it back); None if it was deleted before it could
        start. A record of another run means this one was replaced before it started."""
        try:
            return await self._start_and_retry()
        except JobNotFoundError:
            return None
        finally:
            self._run.started.set()
            self._run.exited.set()  # nothing of it runs any more

    async def _start_and_retry(self) -> JobRecord:
        job, run = self._job, self._run
        record = await self._store.get(job.submission_id, job.run_id)
        if record.status.is_terminal() or record.run_id != job.run_id:
            return record
        self._record = record
        containment = await self._host.prepare_processes(job.jobs_cgroup)
        if not self._may_start():
            return await self._record_never_started()
        job_token = secrets.token_hex(16)
        if run.log_path != job.log_path:
            # A spool left by an earlier job of the same id (deleted, then submitted again)
            # must not prefix this one's log.
            run.log_path.unlink(missing_ok=True)
            self._host.spool(run)
        while True:
            outcome = await self._attempt(job_token, containment)
            if isinstance(outcome, JobRecord):
                return outcome
            ended = await self._back_off(outcome)
            if ended is not None:
                return ended

    def _may_start(self) -> bool:
        """Whether the command may start now; if so, from now on calling the job off stops the
        command instead (no await may come between this and the start)."""
        if self._run.called_off:
            return False
        self._run.start_began = True
        return True

    async def _record_never_started(self) -> JobRecord:
        return await self._store.update(
            self._job.submission_id,
            self._job.run_id,
            status=JobStatus.STOPPED,
            message=NEVER_STARTED_MESSAGE,
        )

    async def _attempt(self, job_token: str, containment: Containment) -> JobRecord | float:
        """Run the command once: the job's terminal record if this attempt ends the job, else
        the seconds to wait before the next one."""
        job, run = self._job, self._run
        # Everything of the attempt before is dead: nothing but this attempt's writes follow.
        log_offset = log_size(run.log_path)
        # A stop while the command starts reaches it at once, not when its start is reported:
        # that may take a second (a batch of starts before it), and it would run on meanwhile.
        early_stop = EarlyStop(run.stop_requested)
        cgroup: AttemptCgroup | None = None
        try:
            # Every attempt gets one: the kernel holds it to its limits (and the head's ceiling)
            # and counts what it used, limits or not.
            cgroup = self._host.attempt_cgroup(run, len(self._attempts) + 1)
            with self._host.command_starting():
                process = await start_entrypoint(
                    job.spec.entrypoint,
                    log_path=run.log_path,
                    env=driver_env(job, job_token, self._host.supervisor_token),
                    containment=containment,
                    fork_server=self._host.fork_server(),
                    early_stop=early_stop,
                    run_as=job.run_as,
                    cgroup_join_files=() if cgroup is None else cgroup.join_files,
                )
        except asyncio.CancelledError:
            if cgroup is not None:
                cgroup.remove_now()  # the start killed what it began (fork_server.py)
            raise
        except OSError as error:
            # A fork server that died as it started the command killed it: not its orphans.
            await kill_job_processes(job_token, other_roots=self._host.other_roots(run))
            if cgroup is not None:
                await cgroup.remove()
            if not self._attempts:
                self._host.unspool(run)  # nothing was written: nothing to pull
            if run.stop_requested.is_set():
                # Asked to stop as it started: the command does not run on, as the stop asked.
                return await self._record_end(status=JobStatus.STOPPED, message=STOPPED_MESSAGE)
            return await self._record_end(
                status=JobStatus.FAILED,
                error_type=JobErrorType.JOB_ENTRYPOINT_COMMAND_START_ERROR,
                message=f"Job entrypoint command could not start: {error}",
            )
        run.pid = process.pid
        if self._deadline is None and job.spec.timeout_s is not None:
            self._deadline = time.monotonic() + job.spec.timeout_s
        self._attempts.append(JobAttempt(start_time=now_ms(), log_offset=log_offset))
        # From the moment the command runs, a stop (or the timeout) acts on it at once, also
        # while the attempt is being recorded: that write may take long on a busy GCS.
        ending = asyncio.create_task(
            self._run_until_end(process, job_token, containment, terminated=early_stop.sent)
        )
        try:
            record = await self._record_attempt_start(process.pid, ending)
            run.started.set()
            if record is not None and record.status.is_terminal():
                # Ended (by the server) while the command was starting: it must not run on
                # (a stop asked for meanwhile keeps its grace period).
                if not run.stop_requested.is_set():
                    end_grace_within(run, 0)
                run.stop_requested.set()
                await ending
                return record
            end = await ending
        finally:
            ending.cancel()
            # Whatever the command left behind ends with it, before the attempt's end is
            # recorded or the next attempt starts. In a PID namespace the kernel saw to it
            # (no scan), unless a signal killed the launcher: its init may live on a moment,
            # re-parented here in the launcher's process group.
            if not ended_with_its_namespace(process, containment):
                await kill_job_processes(
                    job_token, other_roots=self._host.other_roots(run), group=process.pid
                )
            run.pid = None
            self._host.reap_orphans()
            # Read once nothing of the attempt runs, then gone with it.
            self._last_usage = attempt_usage(cgroup, getattr(process, "rusage", None))
            if cgroup is not None:
                await cgroup.remove()
        usage = self._last_usage
        self._attempts[-1] = self._attempts[-1].model_copy(
            update={
                "end_time": now_ms(),
                "exit_code": end.exit_code,
                "peak_memory_bytes": usage.peak_memory_bytes,
                "cpu_user_s": usage.cpu_user_s,
                "cpu_system_s": usage.cpu_system_s,
                "cpu_throttled_s": usage.cpu_throttled_s,
            }
        )
        return await self._after_attempt(end)

    async def _record_attempt_start(
        self, pid: int, ending: asyncio.Task[CommandEnd]
    ) -> JobRecord | None:
        """RUNNING with the first attempt; each later one adds itself (and its pid). Written
        once the attempt has run for the job's `start_record_delay_s`: an attempt that ends
        sooner (most short jobs) has its start written with its end, in one write instead of
        two (None)."""
        self._unwritten_start = self._attempt_start_changes(pid)
        if self._job.start_record_delay_s > 0:
            done, _ = await asyncio.wait({ending}, timeout=self._job.start_record_delay_s)
            if done:
                return None
        return await self._update()

    def _attempt_start_changes(self, pid: int) -> dict[str, Any]:
        changes: dict[str, Any] = {
            "message": running_message(len(self._attempts), self._job.spec.max_retries),
            "driver_pid": pid,
            "attempts": tuple(self._attempts),
        }
        if len(self._attempts) == 1:
            context = ray.get_runtime_context()
            changes.update(
                status=JobStatus.RUNNING,
                supervisor_actor_id=context.get_actor_id(),
                driver_node_id=context.get_node_id(),
                driver_node_ip=ray.util.get_node_ip_address(),
            )
        return changes

    async def _update(self, **changes: Any) -> JobRecord:
        """Write `changes` to the job's record, with the attempt's start if it is not written
        yet (what `changes` says wins: an end's status and message over RUNNING's)."""
        changes = {**self._unwritten_start, **changes}
        assert self._record is not None  # read as the run began
        record = await self._store.update_from(self._record, **changes)
        self._unwritten_start = {}
        self._record = record
        if record.status is JobStatus.RUNNING and not self._start_written:
            # Written at the attempt's start, or (it ended sooner) with the wait before a retry.
            self._start_written = True
            if self._run.on_start_written is not None:
                self._run.on_start_written(record)
        return record

    async def _run_until_end(
        self,
        process: CommandProcess,
        job_token: str,
        containment: Containment,
        *,
        terminated: bool = False,
    ) -> CommandEnd:
        """Wait for the command to exit, or stop it when asked to (or at the job's timeout).
        `terminated`: a stop sent it SIGTERM as it started; it ends as a stopped command."""
        run = self._run
        if not terminated:
            exited = asyncio.ensure_future(process.wait())
            stop_requested = asyncio.ensure_future(run.stop_requested.wait())
            await asyncio.wait(
                {exited, stop_requested},
                timeout=self._time_left_s(),
                return_when=asyncio.FIRST_COMPLETED,
            )
            stop_requested.cancel()
            if exited.done() or command_has_ended(process, containment):
                # It ended on its own, if only just before the stop: its end is its exit's.
                return CommandEnd(exit_code=await exited, stopped=False)
        exit_code = await stop_job_processes(
            process,
            job_token=job_token,
            # A stop set it; a timeout did not.
            deadline=run.stop_deadline or end_grace_within(run, self._job.stop_grace_s),
            containment=containment,
            other_roots=self._host.other_roots(run),
            terminated=terminated,
        )
        # Unless it had exited on its own just before the SIGTERM: it ends as it did.
        return CommandEnd(exit_code=exit_code, stopped=not ended_before_the_stop(process))

    def _time_left_s(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    async def _after_attempt(self, end: CommandEnd) -> JobRecord | float:
        """The job's end after this attempt, or the wait before the next one."""
        job, count = self._job, len(self._attempts)
        if end.stopped:
            if self._run.stop_requested.is_set():
                return await self._record_end(
                    status=JobStatus.STOPPED,
                    message=STOPPED_MESSAGE,
                    driver_exit_code=end.exit_code,
                )
            return await self._record_timeout(end.exit_code, "and was stopped")
        if end.exit_code == 0:
            return await self._record_end(
                status=JobStatus.SUCCEEDED,
                message="Job finished successfully.",
                driver_exit_code=0,
            )
        refusal = why_not_retried(
            end.exit_code,
            count,
            max_retries=job.spec.max_retries,
            retry_on_exit_codes=job.spec.retry_on_exit_codes,
        )
        if self._run.stop_requested.is_set():
            refusal = "it was asked to stop"  # it ended on its own just before the stop
        if refusal is not None:
            return await self._record_failure(end.exit_code, refusal)
        delay_s = retry_backoff_s(job.retry_backoff_s, count)
        record = await self._update(
            message=backoff_message(count, job.spec.max_retries, end.exit_code, delay_s),
            attempts=tuple(self._attempts),
        )
        if record.status.is_terminal():
            return record
        # The server learns it (a retry is an event), before the next attempt can end.
        self._run.retry_was_written(record)
        return delay_s

    async def _back_off(self, delay_s: float) -> JobRecord | None:
        """Wait `delay_s` before the next attempt: None when it may start, or the job's end if
        it was stopped (or reached its timeout) meanwhile."""
        time_left_s = self._time_left_s()
        stop_requested = self._run.stop_requested
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(
                stop_requested.wait(),
                timeout=delay_s if time_left_s is None else min(delay_s, time_left_s),
            )
        # Checked after the wait whichever way it ended: a stop that came as the wait ran out
        # must not start the next attempt.
        if stop_requested.is_set():
            return await self._record_end(
                status=JobStatus.STOPPED,
                message=STOPPED_MESSAGE,
                driver_exit_code=self._attempts[-1].exit_code,
            )
        if time_left_s is not None and time_left_s <= delay_s:
            return await self._record_timeout(
                self._attempts[-1].exit_code, "while it waited to retry"
            )
        return None

    async def _record_failure(self, exit_code: int, refusal: str) -> JobRecord:
        """FAILED with the last attempt's exit code and output."""
        count = len(self._attempts)
        why = "" if self._job.spec.max_retries == 0 else f" {attempts_ran(count)} ({refusal})"
        log_tail = read_log_tail(self._run.log_path, start_offset=self._attempts[-1].log_offset)
        if self._last_usage.oom_killed:
            # Never a bare 137: the kernel killed it for the limit it was given.
            return await self._record_end(
                status=JobStatus.FAILED,
                error_type=JobErrorType.JOB_OUT_OF_MEMORY,
                message=out_of_memory_message(
                    self._job.spec.limits, self._last_usage, exit_code, log_tail, why
                ),
                driver_exit_code=exit_code,
            )
        return await self._record_end(
            status=JobStatus.FAILED,
            error_type=JobErrorType.JOB_ENTRYPOINT_COMMAND_ERROR,
            message=failure_message(exit_code, log_tail, why),
            driver_exit_code=exit_code,
        )

    async def _record_timeout(self, exit_code: int | None, how: str) -> JobRecord:
        count = len(self._attempts)
        after = "" if self._job.spec.max_retries == 0 else f" ({attempts_ran(count)})"
        return await self._record_end(
            status=JobStatus.FAILED,
            error_type=JOB_TIMEOUT_ERROR_TYPE,
            message=f"Job exceeded its timeout of {self._job.spec.timeout_s:g} s {how}{after}.",
            driver_exit_code=exit_code,
        )

    async def _record_end(self, **changes: Any) -> JobRecord:
        """Write the job's terminal status (with its attempts), once the server has pulled a
        spooled log to its end: whoever sees the job end finds its whole log on the head."""
        run = self._run
        run.exited.set()
        if self._host.is_spooled(run):
            try:
                await asyncio.wait_for(run.log_drained.wait(), timeout=LOG_DRAIN_TIMEOUT_S)
            except TimeoutError:
                logger.warning(
                    "the server did not pull the log of job %s; it stays in %s",
                    self._job.submission_id,
                    run.log_path,
                )
        if self._attempts:
            # Ray's job table is the cluster's, and a restarted one has forgotten the driver:
            # written with the end, it is the job's for as long as the job is kept.
            driver = await self._host.ray_driver_of(self._job.submission_id)
            if driver is not None:
                changes["ray_driver"] = driver
        return await self._update(attempts=tuple(self._attempts), **changes)
