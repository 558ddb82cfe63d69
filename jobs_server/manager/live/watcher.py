"""One task per live job: waits for its end, records what its supervisor cannot report (it never
started, it died), and retires a supervisor of the job's own once the job has ended.

No error ends a watcher silently: whatever Ray or the KV raises while it watches is logged and
retried with backoff, so a job always reaches a true terminal status.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from ray.exceptions import (
    ActorDiedError,
    ActorUnschedulableError,
    RuntimeEnvSetupError,
)

from jobs_server.errors import JobNotFoundError
from jobs_server.manager.archive.outbox import ended_attempts
from jobs_server.manager.cluster.resources import ClusterResources, node_is_alive
from jobs_server.manager.launcher import Launch, Launcher
from jobs_server.manager.live.history import JobHistory
from jobs_server.manager.live.run_outcomes import (
    Backoff,
    JobFailure,
    JobStartTimeoutError,
    ends_at_once,
    future_of,
    start_failure,
)
from jobs_server.manager.live.store import JobStore
from jobs_server.manager.logs import job_log_path
from jobs_server.manager.records import JobErrorType, JobRecord, JobSpec, JobStatus, now_ms
from jobs_server.manager.supervisor.log_shipping import pull_log_from_supervisor
from jobs_server.manager.supervisor_calls import first_line, while_unreachable
from jobs_server.manager.supervisors import Supervisors, is_dedicated

logger = logging.getLogger(__name__)

# How long a finished job's watcher waits for the last pull of its log from another node.
LOG_PULL_FINISH_S = 10.0
# How long a run's end waits for the poll of its retries to end (one round trip to the
# supervisor, which answers it at once once the run has ended): a retry's answer on its way
# is archived before the end.
RETRIES_SETTLE_S = 5.0


class JobWatchers:
    """The watcher tasks of one server: one per job run, cancelled (not the jobs) on close."""

    def __init__(
        self,
        *,
        store: JobStore,
        history: JobHistory,
        supervisors: Supervisors,
        launcher: Launcher,
        cluster_resources: ClusterResources,
        log_dir: Path,
        job_start_timeout_s: float,
        on_watch: Callable[[JobRecord], None] = lambda _: None,
        on_end: Callable[[JobRecord], None] = lambda _: None,
        confirm_lead: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        # Awaited before a failure this server decides (leadership.py): a leader frozen past
        # its lease (a start timeout passed meanwhile) must not end a job its successor runs.
        self._confirm_lead = confirm_lead
        # Told of each run watched, and of each whose end is archived (not at close): the
        # queue's slots.
        self._on_watch = on_watch
        self._on_end = on_end
        self._store = store
        self._history = history
        self._supervisors = supervisors
        self._launcher = launcher
        self._cluster_resources = cluster_resources
        self._log_dir = log_dir
        self._job_start_timeout_s = job_start_timeout_s
        # The watcher of each job's current run; an old run's (its id deleted and submitted
        # again) may still be retiring its supervisor, so `close` awaits every task.
        self._current: dict[str, asyncio.Task[None]] = {}
        # The supervisor of each job's current run: the metrics' jobs per supervisor.
        self._supervisor_of: dict[str, str] = {}
        # The id of the log directory each job watched now logs to (its record's).
        self._log_dir_of: dict[str, str | None] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def __len__(self) -> int:
        return len(self._current)

    def watch(self, record: JobRecord, launch: Launch) -> None:
        """Watch the run `record` that `launch` started (or adopted) until it ends."""
        self._on_watch(record)
        task = asyncio.create_task(self._watch(record, launch))
        self._current[record.submission_id] = task
        self._supervisor_of[record.submission_id] = record.supervisor_name or ""
        self._log_dir_of[record.submission_id] = record.log_dir_id
        self._tasks.add(task)
        task.add_done_callback(lambda _: self._forget(record.submission_id, task))

    def _forget(self, submission_id: str, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if self._current.get(submission_id) is task:
            del self._current[submission_id]
            del self._supervisor_of[submission_id]
            del self._log_dir_of[submission_id]

    def watched_ids(self) -> frozenset[str]:
        """The jobs watched now (live: the archive may lag the KV on their status)."""
        return frozenset(self._current)

    def supervisor_names(self) -> list[str]:
        """The supervisor name of each job watched now (held until its end is archived)."""
        return list(self._supervisor_of.values())

    def log_dir_id_of(self, submission_id: str) -> str | None:
        """The id of the log directory the watched job logs to (None: unknown, or unwatched)."""
        return self._log_dir_of.get(submission_id)

    def has_ended(self, submission_id: str) -> bool | None:
        """Whether the watched job has ended (its end is recorded); None if none watches it."""
        task = self._current.get(submission_id)
        return None if task is None else task.done()

    async def command_began(self, record: JobRecord) -> bool:
        """Whether the run's command began: its log is on the head (a command there creates
        it as it starts, before its start is recorded)."""
        return await self._launcher.has_log(record)

    async def wait(self, timeout_s: float) -> None:
        """Wait at most `timeout_s` for every watched job to end (and its end to be archived)."""
        tasks = list(self._current.values())
        if tasks and timeout_s > 0:
            await asyncio.wait(tasks, timeout=timeout_s)

    async def close(self) -> None:
        """Stop watching; the jobs themselves run on in their detached supervisors."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _watch(self, record: JobRecord, launch: Launch) -> None:
        failure: JobFailure | None = None
        archived: JobRecord | None = None
        ended = False
        try:
            outcome = await self._outcome(record, launch)
            if isinstance(outcome, JobFailure) and self._confirm_lead is not None:
                await self._confirm_lead()
            ended = True
            if isinstance(outcome, JobFailure):
                failure = outcome
                await self._record_failure(record, failure)
            # The end is in the archive before anyone sees this watcher done.
            archived = await self._history.learn_end(
                record, ended=outcome if isinstance(outcome, JobRecord) else None
            )
            self._on_end(record)
        finally:
            # Once the job has ended (not when the server shuts down: its jobs run on).
            if ended:
                await self._retire_supervisor(record, launch.supervisor, failure)
                await self._history.forget(record, archived)

    async def _outcome(self, record: JobRecord, launch: Launch) -> JobFailure | JobRecord | None:
        """Wait for the run to end: its supervisor recorded the end (the record it ended with,
        if the supervisor said; else None), or the failure to record. Errors are logged and
        retried; only cancellation ends it early."""
        supervisor, finished, started = launch.supervisor, launch.finished, launch.started
        backoff = Backoff()
        while True:
            try:
                return await self._follow_run(record, supervisor, finished, started)
            except Exception:
                logger.warning(
                    "watching job %s failed; trying again in %.1f s",
                    record.submission_id,
                    backoff.delay_s,
                    exc_info=True,
                )
            await backoff.wait()
            try:
                reattached = await self._reattach(record)
            except Exception:
                logger.warning("finding job %s again failed", record.submission_id, exc_info=True)
                continue
            if not isinstance(reattached, tuple):
                return reattached
            record, supervisor = reattached
            finished = started = None

    async def _reattach(self, record: JobRecord) -> tuple[JobRecord, Any] | JobFailure | None:
        """After an error: the run's record and supervisor now, or how it ended (None: it has
        recorded its end, or was deleted)."""
        try:
            current = await self._store.get(record.submission_id, record.run_id)
        except JobNotFoundError:
            return None
        if current.status.is_terminal() or current.run_id != record.run_id:
            return None
        record = current
        name = record.supervisor_name or ""
        supervisor = await asyncio.to_thread(self._supervisors.find, name)
        if supervisor is None:
            return JobFailure(
                JobErrorType.JOB_SUPERVISOR_ACTOR_DIED,
                f"The job's supervisor ({name}) is gone; its processes ended with it.",
            )
        return record, supervisor

    async def _follow_run(
        self,
        record: JobRecord,
        supervisor: Any,
        finished: Any | None,
        started: asyncio.Future[dict[str, Any] | None] | None = None,
    ) -> JobFailure | JobRecord | None:
        """Wait for the command to start and end, pulling its log if it runs on another node;
        the failure its supervisor cannot report, if any. `started`: the start its supervisor
        reports, for a job handed over in a batch (run_batches.py)."""
        log_pull: asyncio.Task[None] | None = None
        retries: asyncio.Task[None] | None = None
        try:
            try:
                if finished is not None:
                    finished = future_of(finished)
                # The run as its start was written, if its supervisor said.
                written_start: JobRecord | None = None
                if finished is not None and started is not None:
                    written_start = await self._learn_reported_start(record, started, finished)
                elif finished is None or not await ends_at_once(record, finished):
                    log_pull = await self._wait_until_started(record, supervisor)
                    if finished is None:
                        finished = future_of(
                            supervisor.wait_job.remote(record.submission_id, record.run_id)
                        )
                    if not finished.done():
                        await self._history.learn_started(record)
                if record.spec.max_retries > 0:
                    # Started: its supervisor tells each retry, and the last one once the run
                    # has ended too (it may have, while the start was archived).
                    retries = asyncio.create_task(
                        self._follow_retries(written_start or record, supervisor)
                    )
                # A job that ended before the server learnt that it started goes to the
                # archive once, ended (no RUNNING event: its RUNNING was never seen there).
                answer = await self._wait_for_end(record, supervisor, finished)
            except ActorDiedError as error:
                if not is_dedicated(record.supervisor_name or "") and await self._never_started(
                    record
                ):
                    return await self._run_on_replacement(record)
                return JobFailure(
                    JobErrorType.JOB_SUPERVISOR_ACTOR_DIED, await self._died_message(record, error)
                )
            except (JobStartTimeoutError, RuntimeEnvSetupError, ActorUnschedulableError) as error:
                return start_failure(record, error)
            if retries is not None:
                await asyncio.wait({retries}, timeout=RETRIES_SETTLE_S)
            if log_pull is not None:
                # Every byte pulled is on the head before anyone sees the job end.
                await asyncio.wait({log_pull}, timeout=LOG_PULL_FINISH_S)
            if isinstance(answer, dict):
                return JobRecord.model_validate(answer)  # `run_job`: the record it ended with
            if answer is None:
                return JobFailure(
                    JobErrorType.JOB_SUPERVISOR_ACTOR_DIED,
                    f"The job's supervisor ({record.supervisor_name}) does not know the job: it "
                    "is a later incarnation, and the job's processes ended with the one that "
                    "ran them.",
                )
            return None
        finally:
            if log_pull is not None:
                log_pull.cancel()
            if retries is not None:
                # A retry's archiving that has begun is queued before the end's (the archive
                # writes in call order): only a wait for the supervisor is cut.
                retries.cancel()

    async def _follow_retries(self, record: JobRecord, supervisor: Any) -> None:
        """Archive each attempt's end that a retry follows, as its supervisor wrote it (the
        archive makes it an event: `job.retrying`), until the run ends. A long poll, and only
        for a job that may retry: the others cost no call.

        Its supervisor answers as soon as a retry is written, and once the run has ended (the
        last retry, or None): the run's end waits for this to end (RETRIES_SETTLE_S), so a
        retry is archived before the end even when the end came sooner (no back-off)."""
        submission_id, run_id = record.submission_id, record.run_id
        ended = ended_attempts(record)
        while True:
            try:
                ask = functools.partial(
                    supervisor.wait_attempt_ended.remote, submission_id, run_id, ended
                )
                answer = await while_unreachable(ask(), ask)
            except ActorDiedError:
                return  # the run's wait for its end says what became of it
            except Exception:
                # The end is archived all the same; only the retries' events would be missed.
                logger.warning(
                    "following the retries of job %s failed", submission_id, exc_info=True
                )
                return
            if answer is None:
                return  # ended (or not this supervisor's run): the end says the rest
            written = JobRecord.model_validate(answer)
            ended = ended_attempts(written)
            await self._history.learn_retry(record, written=written)

    async def _run_on_replacement(self, record: JobRecord) -> JobFailure | JobRecord | None:
        """A warm supervisor that died before anyone noticed: the job never started, so it
        runs on the replacement instead of failing."""
        logger.info("job %s reached a dead shared supervisor; retrying", record.submission_id)
        self._supervisors.forget(record.supervisor_name or "")
        launch = await self._launcher.launch(record)
        return await self._follow_run(record, launch.supervisor, launch.finished, launch.started)

    async def _learn_reported_start(
        self,
        record: JobRecord,
        started: asyncio.Future[dict[str, Any] | None],
        finished: asyncio.Future[Any],
    ) -> JobRecord | None:
        """Wait for the start its supervisor reports (once written: a short job has none) or
        the run's end, at most what is left of the start timeout; archive the start if it
        came first, and return it. No call to the supervisor, no read of the KV."""
        waits: set[asyncio.Future[Any]] = {started, finished}
        done, _ = await asyncio.wait(
            waits, timeout=self._start_time_left_s(record), return_when=asyncio.FIRST_COMPLETED
        )
        if not done:
            raise JobStartTimeoutError(await self._start_timeout_message(record.spec))
        written = started.result() if started.done() else None
        if written is None or finished.done():
            return None
        start = JobRecord.model_validate(written)
        await self._history.learn_started(record, written=start)
        return start

    def _start_time_left_s(self, record: JobRecord) -> float | None:
        """What is left of a PENDING run's start timeout, counted from its hand-over (None:
        it has started)."""
        if record.status is not JobStatus.PENDING:
            return None
        since_ms = record.handed_over_time or record.start_time or now_ms()
        waited_s = (now_ms() - since_ms) / 1000
        return max(0.0, self._job_start_timeout_s - waited_s)

    async def _wait_until_started(
        self, record: JobRecord, supervisor: Any
    ) -> asyncio.Task[None] | None:
        """Wait for the command to start, at most what is left of the start timeout; return the
        task pulling its log if it runs on another node."""
        started = supervisor.wait_started.remote(record.submission_id)
        remaining_s = self._start_time_left_s(record)
        if remaining_s is not None:
            try:
                log_is_spooled = await asyncio.wait_for(started, timeout=remaining_s)
            except TimeoutError:
                message = await self._start_timeout_message(record.spec)
                raise JobStartTimeoutError(message) from None
        else:
            log_is_spooled = await started
        if not log_is_spooled:
            return None
        return asyncio.create_task(
            pull_log_from_supervisor(
                supervisor, record.submission_id, job_log_path(self._log_dir, record.submission_id)
            )
        )

    async def _wait_for_end(
        self, record: JobRecord, supervisor: Any, finished: Any
    ) -> dict[str, Any] | JobStatus | None:
        """Await `finished` (`run_job`'s answer, or `wait_job`'s), asking the supervisor again
        while it cannot be reached."""
        answer: dict[str, Any] | JobStatus | None = await while_unreachable(
            finished, lambda: supervisor.wait_job.remote(record.submission_id, record.run_id)
        )
        return answer

    async def _never_started(self, record: JobRecord) -> bool:
        """Whether the run's command never began: PENDING, and no log (a command's start
        creates it before its start is recorded: a command that began must not run twice)."""
        try:
            current = await self._store.get(record.submission_id, record.run_id)
        except JobNotFoundError:
            return False
        return current.status is JobStatus.PENDING and not await self._launcher.has_log(record)

    async def _died_message(self, record: JobRecord, error: ActorDiedError) -> str:
        """Name the lost node when the supervisor died with it, else say what Ray says."""
        try:
            current = await self._store.get(record.submission_id, record.run_id)
            if current.driver_node_id and not await asyncio.to_thread(
                node_is_alive, current.driver_node_id
            ):
                return (
                    f"The node the job ran on was lost (node id {current.driver_node_id}, "
                    f"address {current.driver_node_ip}); the job's processes ended with it. "
                    "Its output until then is in the log."
                )
        except JobNotFoundError:
            pass
        except Exception:
            # What Ray says is true too; a node that may be lost is no reason to wait.
            logger.warning(
                "could not tell whether the node of job %s is alive",
                record.submission_id,
                exc_info=True,
            )
        return f"The job's supervisor died: {first_line(error)}"

    async def _start_timeout_message(self, spec: JobSpec) -> str:
        message = f"The job did not start within {self._job_start_timeout_s:g} s."
        requested = spec.requested_resources()
        waiting_for = await self._cluster_resources.describe_wait(requested)
        if waiting_for is not None:
            message += " " + waiting_for.replace("Waiting for", "It waited for", 1)
        elif requested:
            message += f" The resources it asks for ({requested}) were free at the end."
        if spec.runtime_env:
            message += " Its runtime env may still have been setting up."
        return message

    async def _record_failure(self, record: JobRecord, failure: JobFailure) -> None:
        """Write the failure (unless the job has already ended), retrying the KV until it
        takes it."""
        logger.warning("job %s failed: %s", record.submission_id, failure.message)
        backoff = Backoff()
        while True:
            try:
                await self._store.update(
                    record.submission_id,
                    record.run_id,
                    status=JobStatus.FAILED,
                    error_type=failure.error_type,
                    message=failure.message,
                )
                return
            except JobNotFoundError:
                return  # deleted, or submitted again: not this run's record any more
            except Exception:
                logger.warning(
                    "recording the end of job %s failed; trying again in %.1f s",
                    record.submission_id,
                    backoff.delay_s,
                    exc_info=True,
                )
            await backoff.wait()

    async def _retire_supervisor(
        self, record: JobRecord, supervisor: Any, failure: JobFailure | None
    ) -> None:
        """The job has ended: its own supervisor has nothing left to do (killed, retried until
        Ray takes it); a dead shared one is replaced; a late start is called off."""
        name = record.supervisor_name or ""
        if is_dedicated(name):
            backoff = Backoff()
            while True:
                try:
                    await asyncio.to_thread(self._supervisors.kill, name)
                    return
                except Exception:
                    logger.warning(
                        "killing supervisor %s of job %s failed; trying again in %.1f s",
                        name,
                        record.submission_id,
                        backoff.delay_s,
                        exc_info=True,
                    )
                await backoff.wait()
        if failure is None:
            return
        if failure.error_type is JobErrorType.JOB_SUPERVISOR_ACTOR_DIED:
            self._supervisors.forget(name)
        elif failure.error_type is JobErrorType.JOB_SUPERVISOR_ACTOR_START_TIMEOUT:
            try:
                await supervisor.stop_job.remote(record.submission_id, 0)
            except Exception:
                logger.warning("calling off job %s failed", record.submission_id, exc_info=True)
