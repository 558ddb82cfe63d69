"""Stopping jobs: one on request (a queued one, or one waiting for others, before it starts; a
pending one called off by its supervisor; a running one asked to stop), and every live one when
an embedded server closes (the queued and the waiting stay for the next server)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError

from jobs_server.disk_guard import is_disk_full
from jobs_server.errors import JobNotFoundError, SupervisorUnreachableError
from jobs_server.manager.archive.interface import JobArchive
from jobs_server.manager.cluster.leaving import ClusterAtShutdown
from jobs_server.manager.live.deferred_ends import DeferredEnds
from jobs_server.manager.live.history import JobHistory
from jobs_server.manager.live.kv import RETRYABLE_GCS_ERRORS
from jobs_server.manager.live.store import JobStore
from jobs_server.manager.live.watcher import JobWatchers
from jobs_server.manager.queue.admission import JobQueue
from jobs_server.manager.queue.dependency_waits import needs_wait
from jobs_server.manager.queue.dispatcher import Dispatcher
from jobs_server.manager.records import JobErrorType, JobRecord, JobStatus, now_ms
from jobs_server.manager.supervisor.job_run import NEVER_STARTED_MESSAGE
from jobs_server.manager.supervisor_calls import SUPERVISOR_UNAVAILABLE_RETRY_S, first_line
from jobs_server.manager.supervisors import Supervisors, is_dedicated

logger = logging.getLogger(__name__)

# How long a stop request waits for an unreachable supervisor before answering 503.
STOP_UNREACHABLE_WAIT_S = 5.0
# How long a stop of a PENDING job waits for its supervisor to call it off (a supervisor of the
# job's own may not be up yet: then the server records the end and kills the actor).
CALL_OFF_WAIT_S = 2.0
# A shared supervisor is up, only maybe busy: the server waits longer rather than record a
# "stopped before it started" that the supervisor may have made untrue meanwhile.
SHARED_CALL_OFF_WAIT_S = 30.0


class JobStopper:
    """Stops the jobs of one server (JobManager's `stop_job`, and its close in embedded mode)."""

    def __init__(
        self,
        *,
        store: JobStore,
        history: JobHistory,
        archive: JobArchive,
        supervisors: Supervisors,
        dispatcher: Dispatcher,
        ends: DeferredEnds,
        queue: JobQueue,
        watchers: JobWatchers,
        stop_grace_s: float,
        read_record: Callable[[str, str | None], Awaitable[JobRecord]],
    ) -> None:
        self._store = store
        self._history = history
        self._archive = archive
        self._supervisors = supervisors
        self._dispatcher = dispatcher
        self._ends = ends
        self._queue = queue
        self._watchers = watchers
        self._stop_grace_s = stop_grace_s
        # The job as it is now, of a tenant (None: any); JobNotFoundError if there is none.
        self._read_record = read_record

    async def stop_job(
        self, submission_id: str, grace_period_s: float | None, tenant: str | None
    ) -> bool:
        """Ask a job (of `tenant`) to stop; return False if it had already ended."""
        record = await self._read_record(submission_id, tenant)
        if record.status.is_terminal():
            return False
        if record.status is JobStatus.PENDING:
            # Queued (or being handed over): the queue stops it before its command starts.
            stopped = await self._dispatcher.stop_before_start(record)
            if stopped is not None:
                return stopped
            record = await self._read_record(submission_id, None)
            if record.status.is_terminal():
                return False
        name = record.supervisor_name or self._supervisors.name_for(record.spec, record.run_id)
        supervisor = await asyncio.to_thread(self._supervisors.find, name)
        if record.status is JobStatus.RUNNING:
            if supervisor is None:
                # Its supervisor died (and its processes with it) as the stop came, before
                # its watcher recorded the end: the job FAILED, it did not stop.
                return await self._end_with_its_supervisor(record, name)
            await self._ask_to_stop(record, supervisor, grace_period_s)
            return True
        # PENDING here, but the command may have started since (its start is written a moment
        # later: attempts.py): only its supervisor knows. It calls the job off (the command
        # never starts) and answers once nothing of the job runs, and the end it recorded in
        # the KV is archived now, so a read right after the stop sees it; or it stops the
        # started command as a running job's, with the grace period asked for.
        if supervisor is not None:
            try:
                answer = await self._call_off(record, supervisor, grace_period_s)
            except ActorDiedError:
                answer, supervisor = None, None
            if answer is JobStatus.RUNNING:
                return True  # it had started: it is being stopped as a running job is
            if answer is not None:
                await self._learn_end(record)
                return True
        if supervisor is None and await self._watchers.command_began(record):
            # Its command began (its log is there) under a supervisor that is gone, which
            # died before it recorded the start: it did not stop before it started.
            return await self._end_with_its_supervisor(record, name)
        # No supervisor answered (its own one is not up yet, or it is gone): the command has
        # not started. Compare-and-set: if the job ended (or started and was stopped) first,
        # that stays; a supervisor that starts it right now finds the record terminal and
        # stops it.
        try:
            ended = await self._store.update(
                submission_id,
                record.run_id,
                status=JobStatus.STOPPED,
                message=NEVER_STARTED_MESSAGE,
            )
        except JobNotFoundError:
            # The run left the KV meanwhile: it ended (a late call-off, or its command), its end
            # was archived and its KV entries forgotten. The archive says how it ended.
            stored = await self._read_record(submission_id, None)
            if stored.run_id != record.run_id or not stored.status.is_terminal():
                raise
            return stored.status is JobStatus.STOPPED
        await self._ends.archive(ended)
        if supervisor is not None and is_dedicated(name):
            await asyncio.to_thread(ray.kill, supervisor, no_restart=True)
        elif supervisor is not None:
            await supervisor.stop_job.remote(submission_id, 0)
        return True

    async def _end_with_its_supervisor(self, record: JobRecord, name: str) -> bool:
        """Record a job whose command began under a supervisor that is gone FAILED
        (compare-and-set: an end recorded first, its watcher's, stays); False: it had ended
        before the stop."""
        try:
            ended = await self._store.update(
                record.submission_id,
                record.run_id,
                status=JobStatus.FAILED,
                error_type=JobErrorType.JOB_SUPERVISOR_ACTOR_DIED,
                message=(
                    f"The job's supervisor ({name}) died; its processes ended with it. Its "
                    "output until then is in the log."
                ),
            )
        except JobNotFoundError:
            # Its end was archived and forgotten here meanwhile: the archive says how it ended.
            stored = await self._read_record(record.submission_id, None)
            if stored.run_id != record.run_id or not stored.status.is_terminal():
                raise
            return False
        logger.warning("job %s: %s", record.submission_id, ended.message)
        await self._ends.archive(ended)
        return False

    async def _learn_end(self, record: JobRecord) -> None:
        """Archive the end a supervisor recorded in the KV; on a full disk its watcher does,
        once the disk takes it (or the next server's recovery does)."""
        try:
            await self._history.learn(record)
        except Exception as error:
            if not is_disk_full(error):
                raise
            logger.warning("the disk is full: job %s's end is archived later", record.submission_id)

    async def _call_off(
        self, record: JobRecord, supervisor: Any, grace_period_s: float | None
    ) -> JobStatus | None:
        """Have the supervisor call off a job it may be starting: its terminal status once the
        supervisor has recorded the end and nothing of the job runs, RUNNING if its command
        had started (it is being stopped), None if the supervisor did not answer in time;
        ActorDiedError if it is dead."""
        name = record.supervisor_name or ""
        # Not cancelled when it takes too long (Ray asserts on a cancelled ObjectRef future):
        # it ends with its actor, and its outcome is then read and dropped.
        try:
            ref = supervisor.call_off.remote(record.submission_id, record.run_id, grace_period_s)
        except TypeError:
            # A supervisor of an earlier version (its call_off takes no grace period).
            ref = supervisor.call_off.remote(record.submission_id, record.run_id)
        call = asyncio.ensure_future(ref)
        call.add_done_callback(lambda done: done.cancelled() or done.exception())
        answered, _ = await asyncio.wait(
            {call}, timeout=CALL_OFF_WAIT_S if is_dedicated(name) else SHARED_CALL_OFF_WAIT_S
        )
        if not answered:
            return None
        try:
            return JobStatus(call.result())
        except ActorUnavailableError:
            return None

    async def _ask_to_stop(
        self, record: JobRecord, supervisor: Any, grace_period_s: float | None
    ) -> None:
        """Ask a running job's supervisor to stop it, waiting a little for one that cannot be
        reached (or does not answer); a supervisor that died took the job's processes with it."""
        deadline = time.monotonic() + STOP_UNREACHABLE_WAIT_S
        while True:
            try:
                await asyncio.wait_for(
                    supervisor.stop_job.remote(record.submission_id, grace_period_s),
                    timeout=max(0.0, deadline - time.monotonic()),
                )
                return
            except ActorDiedError:
                return  # its watcher records how the job ended
            except (ActorUnavailableError, TimeoutError) as error:
                if time.monotonic() >= deadline:
                    raise SupervisorUnreachableError(
                        f"The supervisor of job {record.submission_id!r} on node "
                        f"{record.driver_node_id} cannot be reached now (its node may be "
                        "failing); the job was not asked to stop. Try again."
                    ) from error
                await asyncio.sleep(SUPERVISOR_UNAVAILABLE_RETRY_S)

    async def stop_all_jobs(self, timeout_s: float, cluster: ClusterAtShutdown) -> None:
        """Record every live job STOPPED (the end key's put-if-absent: a job that ended first
        keeps its end), ask its supervisor to stop it (SIGTERM, grace, SIGKILL), and wait for
        the watchers, at most `timeout_s`. A job whose supervisor cannot be told because the
        cluster is gone (`cluster`) is left unfinished: it ends with the cluster, without its
        grace, and the next start's recovery records it so, as after any lost cluster."""
        message = (
            "The job was stopped because the server shut down (in embedded mode its Ray "
            "instance stops with it)."
        )
        # Queued jobs (and those waiting for others) never started: they stay queued (or
        # waiting), for the next server to run.
        live = [r for r in await self._archive.unfinished() if not self._never_handed_over(r)]
        grace_s = max(0.0, min(self._stop_grace_s, timeout_s - 1.0))
        # The jobs whose supervisor got the stop: STOPPED is true of them whatever follows.
        told: set[str] = set()

        async def stop(record: JobRecord) -> None:
            # Each step whatever became of the one before: a KV that is gone or a full disk
            # must not keep the job from its grace period (SIGTERM first) before Ray stops.
            ended = None
            with _logged_failure("recording the stop of job %s", record, cluster):
                ended = await self._store.update(
                    record.submission_id, record.run_id, status=JobStatus.STOPPED, message=message
                )
            if cluster.gone:
                return  # nobody to tell: the job goes with the cluster
            with _logged_failure("asking the supervisor of job %s to stop it", record, cluster):
                supervisor = await asyncio.to_thread(
                    self._supervisors.find, record.supervisor_name or ""
                )
                if supervisor is not None:
                    await supervisor.stop_job.remote(record.submission_id, grace_s)
                    told.add(record.submission_id)
            if ended is not None and (record.submission_id in told or not cluster.gone):
                with _logged_failure("archiving the stop of job %s", record, cluster):
                    await self._history.archive_end(ended)

        if live and not cluster.gone:
            logger.info("stopping %d jobs: the embedded Ray stops with the server", len(live))
            deadline = time.monotonic() + timeout_s
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    asyncio.gather(*(stop(record) for record in live)), timeout=timeout_s
                )
            # Their supervisors end the processes (SIGTERM, grace, SIGKILL) before Ray stops.
            if not cluster.gone:
                await self._watchers.wait(deadline - time.monotonic())
        # Whatever could not be told (a KV that is gone) is still recorded as stopped here,
        # unless the cluster is gone: then the job was not stopped, it ends with the cluster.
        left = 0
        for record in await self._archive.unfinished():
            if self._never_handed_over(record):
                continue
            if cluster.gone and record.submission_id not in told:
                left += 1
                continue
            try:
                await self._archive.update(
                    record.with_changes(
                        status=JobStatus.STOPPED, end_time=now_ms(), message=message
                    )
                )
            except Exception as error:
                if not is_disk_full(error):
                    raise
                # The next start finds them unfinished with their cluster gone, and ends them.
                logger.warning("the disk is full: the stops of the jobs left are not archived")
                return
        if left:
            logger.info(
                "jobs left to the next start's recovery (they end with the Ray cluster that is "
                "gone): %d",
                left,
            )

    def _never_handed_over(self, record: JobRecord) -> bool:
        return record.submission_id in self._queue or needs_wait(record)


@contextlib.contextmanager
def _logged_failure(what: str, record: JobRecord, cluster: ClusterAtShutdown) -> Iterator[None]:
    """Log an error of a shutdown step (a full disk in one line) instead of raising it; a GCS
    that does not answer is the cluster gone (`cluster` says so, once)."""
    try:
        yield
    except RETRYABLE_GCS_ERRORS as error:
        cluster.note_gone(f"{what % record.submission_id}: {first_line(error)}")
    except Exception as error:
        full = is_disk_full(error)
        logger.warning(
            what + " at shutdown failed%s",
            record.submission_id,
            ": the disk is full" if full else "",
            exc_info=not full,
        )
