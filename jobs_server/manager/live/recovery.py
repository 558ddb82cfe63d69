"""What a starting server reconciles: it adopts the jobs a previous server left, queues again
those it accepted but never handed over (in submission order: the queue's order survives), and
fails those whose supervisor incarnation is gone (a new shared supervisor under the same name
never ran them: nothing may stay RUNNING without a process behind it).

It reads the archive's unfinished rows and the KV's records (both bounded by the live jobs),
never the whole history. A row the KV does not have is a job accepted but never handed over (it
is queued again, and runs when the queue hands it a slot) or a job whose cluster went away with
its KV (it failed); a KV record the archive does not have (the archive was lost, or written by
a server before it) is imported. A pending job with no supervisor running it is run only if its
command never began (no log): one handed over on another log directory, whose log this server
cannot see, fails instead (it must never run twice). A job that still waits for others to end
(`depends_on`, no `dependencies_met_time`) goes back to the waits (`on_waiting`), which read the
statuses of those now; one whose dependencies were met is queued as any other.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from jobs_server.errors import DuplicateJobError, JobNotFoundError
from jobs_server.manager.archive.interface import JobArchive
from jobs_server.manager.launcher import Launch, Launcher
from jobs_server.manager.live.history import JobHistory
from jobs_server.manager.live.kv import retried
from jobs_server.manager.live.store import JobStore
from jobs_server.manager.live.watcher import JobWatchers
from jobs_server.manager.queue.admission import JobQueue
from jobs_server.manager.queue.dependency_waits import needs_wait
from jobs_server.manager.records import JobErrorType, JobRecord, JobStatus, now_ms
from jobs_server.manager.supervisor_calls import first_line
from jobs_server.manager.supervisors import Supervisors, is_dedicated

logger = logging.getLogger(__name__)

# While the GCS does not answer, the start's reads of it are tried this often in all, and each
# job's recovery this often (a job still failing then ends FAILED, and the server starts), the
# first wait this long, doubled after each failure.
LISTING_ATTEMPTS = 6
JOB_ATTEMPTS = 4
RETRY_INITIAL_S = 0.5
# How long a job that could not be recovered waits for its supervisor to stop it.
STOP_WAIT_S = 5.0

_T = TypeVar("_T")


class Recovery:
    """Reconciles the stored jobs with the supervisors that are alive, once, at start."""

    def __init__(
        self,
        *,
        store: JobStore,
        archive: JobArchive,
        history: JobHistory,
        supervisors: Supervisors,
        launcher: Launcher,
        watchers: JobWatchers,
        queue: JobQueue,
        on_waiting: Callable[[JobRecord], None] | None = None,
    ) -> None:
        self._queue = queue
        self._on_waiting = on_waiting
        self._store = store
        self._archive = archive
        self._history = history
        self._supervisors = supervisors
        self._launcher = launcher
        self._watchers = watchers
        # The actor id of each live supervisor asked, by name (None: it did not answer).
        self._incarnations: dict[str, str | None] = {}

    async def recover(self) -> None:
        """Adopt, start or fail every job that has not ended; retire what nobody needs. One
        job that cannot be recovered ends FAILED with the reason; the others are recovered."""
        busy_supervisors: set[str | None] = set()
        live_supervisors = await retried(
            "listing the live supervisors",
            lambda: asyncio.to_thread(self._supervisors.live_names),
            attempts=LISTING_ATTEMPTS,
            initial_delay_s=RETRY_INITIAL_S,
        )
        in_kv = {
            record.submission_id: record
            for record in await retried(
                "reading the live jobs in the KV",
                self._store.live_records,
                attempts=LISTING_ATTEMPTS,
                initial_delay_s=RETRY_INITIAL_S,
            )
        }
        unfinished = {record.submission_id: record for record in await self._archive.unfinished()}
        for record in in_kv.values():
            if record.submission_id not in unfinished and not await self._each_job(
                record, functools.partial(self._import, record)
            ):
                continue
            unfinished.setdefault(record.submission_id, record)
        for row in unfinished.values():
            await self._each_job(
                row,
                functools.partial(self._reconcile, row, in_kv, live_supervisors, busy_supervisors),
            )
        for name in self._supervisors.stale_shared_names(live_supervisors):
            if name not in busy_supervisors:
                logger.info(
                    "retiring idle supervisor %s of an earlier server version or setting", name
                )
                try:
                    await asyncio.to_thread(self._supervisors.kill, name)
                except Exception:
                    logger.warning("retiring supervisor %s failed", name, exc_info=True)

    async def _reconcile(
        self,
        row: JobRecord,
        in_kv: dict[str, JobRecord],
        live_supervisors: set[str],
        busy_supervisors: set[str | None],
    ) -> None:
        """Adopt, start, queue, fail or forget the unfinished job `row` as the KV has it."""
        found = in_kv.get(row.submission_id)
        if found is None or found.run_id != row.run_id:
            await self._reconcile_without_kv(row)
            busy_supervisors.add(row.supervisor_name)
            return
        record = found
        await self._archive.update(record)
        if not record.status.is_terminal():
            await self._adopt(record)
            busy_supervisors.add(record.supervisor_name)
        elif record.supervisor_name in live_supervisors and is_dedicated(record.supervisor_name):
            # It ended while no server watched: pull what is left of its log from its node,
            # then retire its supervisor.
            await self._adopt(record)
        else:
            await self._history.forget(record)

    async def _each_job(self, record: JobRecord, step: Callable[[], Awaitable[_T]]) -> _T | None:
        """`step()` of the job `record`'s recovery, tried again while the GCS does not answer.
        If it still fails, or fails otherwise (a record Ray will not start a supervisor for),
        the job ends FAILED with the reason and None is returned: one job never keeps the
        server from starting."""
        try:
            return await retried(
                f"recovering job {record.submission_id}",
                step,
                attempts=JOB_ATTEMPTS,
                initial_delay_s=RETRY_INITIAL_S,
            )
        except Exception as error:
            logger.exception("job %s could not be recovered", record.submission_id)
            await self._give_up(record, error)
            return None

    async def _give_up(self, record: JobRecord, error: Exception) -> None:
        """End a job that could not be recovered FAILED, saying why: in the KV if it takes it
        (the first end wins there), in the archive in any case; what may still run of it is
        asked to stop."""
        changes: dict[str, Any] = {
            "status": JobStatus.FAILED,
            "error_type": (
                JobErrorType.JOB_SUPERVISOR_ACTOR_START_FAILURE
                if record.status is JobStatus.PENDING
                else JobErrorType.JOB_SUPERVISOR_ACTOR_DIED
            ),
            "message": (
                f"The job could not be recovered when the server started: {first_line(error)}"
            ),
        }
        ended: JobRecord | None = None
        try:
            ended = await self._store.update(record.submission_id, record.run_id, **changes)
        except Exception as kv_error:  # the KV may be what failed, or it lacks the run
            logger.warning(
                "the KV did not take job %s's end: %s", record.submission_id, first_line(kv_error)
            )
        if ended is None or ended.run_id != record.run_id:
            ended = record.with_changes(end_time=now_ms(), **changes)
        logger.warning("job %s failed: %s", record.submission_id, ended.message)
        await self._stop_what_runs(record)
        try:
            if await self._archive.update(ended) is None:
                # Its import was what failed: it is archived as it ended.
                with contextlib.suppress(DuplicateJobError):  # another run of the id is there
                    await self._archive.insert(ended)
        except Exception:
            # The KV has its end, if it took it: the next start archives it.
            logger.exception("archiving the end of job %s failed", record.submission_id)
            return
        await self._history.forget(ended)

    async def _stop_what_runs(self, record: JobRecord) -> None:
        """Ask the supervisor of a job ended here to stop what may still run of it (best
        effort, bounded: a supervisor that cannot be reached is as good as gone)."""
        if record.status is JobStatus.PENDING and record.supervisor_name is None:
            return
        name = record.supervisor_name or ""
        try:
            if is_dedicated(name):
                await asyncio.wait_for(asyncio.to_thread(self._supervisors.kill, name), STOP_WAIT_S)
                return
            supervisor = await asyncio.wait_for(
                asyncio.to_thread(self._supervisors.find, name), STOP_WAIT_S
            )
            if supervisor is not None:
                await asyncio.wait_for(
                    supervisor.stop_job.remote(record.submission_id, 0), STOP_WAIT_S
                )
        except Exception:
            logger.warning(
                "asking supervisor %s to stop job %s failed",
                name,
                record.submission_id,
                exc_info=True,
            )

    async def _import(self, record: JobRecord) -> bool:
        """Archive a KV record the archive does not list as unfinished: True if it is new here
        (imported) and needs reconciling; an ended row or another run is forgotten in the KV."""
        archived = await self._archive.get(record.submission_id)
        if archived is None and await self._archive.was_deleted(
            record.submission_id, record.run_id
        ):
            # Deleted (or its submit withdrawn) while the KV did not take the delete: it
            # never comes back.
            logger.info(
                "job %s was deleted; forgetting what the KV kept of it", record.submission_id
            )
            with contextlib.suppress(Exception):  # logged; the next start tries again
                await self._store.delete(record)
            return False
        if archived is None:
            logger.info("importing job %s from the KV into the archive", record.submission_id)
            try:
                await self._archive.insert(record)
            except DuplicateJobError:
                return False
            return True
        if archived.run_id == record.run_id and not archived.status.is_terminal():
            return True  # imported by an earlier try of this start, whose next step failed
        # Archived as ended (or another run of the id): what is left in the KV is stale.
        if archived.run_id == record.run_id:
            await self._archive.update(record)  # a terminal row stays as it is
        await self._history.forget(record)
        return False

    async def _reconcile_without_kv(self, row: JobRecord) -> None:
        """An unfinished job the KV does not have: never handed over, or its cluster's KV is
        gone (a restarted cluster)."""
        if row.status is JobStatus.PENDING and not await self._may_have_begun(row):
            # Queued when the server stopped, or it died between archiving the job and handing
            # it over (or the cluster went away before it began): it was accepted, so it runs
            # when the queue hands it a slot (once the jobs it waits for ended as it needs).
            if needs_wait(row) and self._on_waiting is not None:
                logger.info("job %s waits for its dependencies again", row.submission_id)
                self._on_waiting(row)
                return
            logger.info("job %s was never handed to a supervisor; queued", row.submission_id)
            self._queue.requeue(row)
            return
        if row.status is JobStatus.PENDING and self._logs_elsewhere(row):
            message = self._unseen_log_message(row)
        else:
            message = (
                "The Ray cluster the job ran on went away (its record in the cluster is gone: "
                "the cluster restarted); the job's processes ended with it. Its output until "
                "then is in the log."
            )
        ended = row.with_changes(
            status=JobStatus.FAILED,
            end_time=now_ms(),
            error_type=JobErrorType.JOB_SUPERVISOR_ACTOR_DIED,
            message=message,
        )
        logger.warning("job %s failed: %s", row.submission_id, ended.message)
        await self._archive.update(ended)

    async def _adopt(self, record: JobRecord) -> None:
        name = record.supervisor_name or self._supervisors.name_for(record.spec, record.run_id)
        supervisor = await asyncio.to_thread(self._supervisors.find, name)
        if record.status is JobStatus.PENDING and await self._began_elsewhere(record, supervisor):
            # Its command began (or may have, on another log directory) under a supervisor that
            # died before recording RUNNING: running it again would run a job twice (its log
            # twice over).
            await self._fail(
                record,
                self._unseen_log_message(record)
                if self._logs_elsewhere(record)
                else f"The job's supervisor ({name}) died after its command began and before "
                "it was recorded; its processes are gone. Its output until then is in the log.",
            )
            return
        if supervisor is None and record.status is JobStatus.PENDING:
            # The server died between recording the job and handing it over: it was accepted,
            # so it runs.
            logger.info(
                "job %s was never handed to a supervisor; starting it", record.submission_id
            )
            # Handed over now: its start timeout counts from here.
            record = await self._store.update(
                record.submission_id,
                record.run_id,
                handed_over_time=now_ms(),
                log_dir_id=self._launcher.log_dir_id,
            )
            self._watchers.watch(record, await self._launcher.launch(record))
            return
        if supervisor is None:
            await self._fail(
                record, f"The job's supervisor ({name}) no longer exists; its processes are gone."
            )
            return
        if record.status is JobStatus.RUNNING and record.supervisor_actor_id is not None:
            incarnation = await self._incarnation(name, supervisor)
            if incarnation != record.supervisor_actor_id:
                await self._fail(
                    record,
                    f"The job's supervisor (actor {record.supervisor_actor_id} named {name}) is "
                    "gone, and its processes with it; the supervisor of that name now is "
                    f"another actor ({incarnation or 'not answering'}) that never ran the job.",
                )
                return
        if record.status is JobStatus.PENDING:
            finished = supervisor.run_job.remote(self._launcher.supervised_job(record))
        else:
            finished = supervisor.wait_job.remote(record.submission_id, record.run_id)
        self._watchers.watch(record, Launch(supervisor, finished))

    async def _began_elsewhere(self, record: JobRecord, supervisor: Any | None) -> bool:
        """Whether a pending job's command began (or may have: `_may_have_begun`) under a
        supervisor that is not running it now."""
        if not await self._may_have_begun(record):
            return False
        if supervisor is None:
            return True
        try:
            return not await supervisor.knows_run.remote(record.submission_id, record.run_id)
        except Exception as error:
            logger.warning("supervisor of job %s does not answer: %s", record.submission_id, error)
            return True

    def _logs_elsewhere(self, record: JobRecord) -> bool:
        """Whether the job was handed over on another log directory than this server's (a
        record without one, of an earlier server, is taken as this server's)."""
        return record.log_dir_id is not None and record.log_dir_id != self._launcher.log_dir_id

    async def _may_have_begun(self, record: JobRecord) -> bool:
        """Whether a pending job's command may have begun: its log is here (a command creates
        it as it starts, before its start is recorded), or the job was handed over on another
        log directory, where this server cannot look: no log here says nothing of it there."""
        return self._logs_elsewhere(record) or await self._launcher.has_log(record)

    def _unseen_log_message(self, record: JobRecord) -> str:
        """Why a pending job handed over on another log directory is not run again here."""
        return (
            "The job was handed over by a server on another log directory (id "
            f"{record.log_dir_id}) than this server's --log-dir "
            f"({self._launcher.log_path(record).parent}, id {self._launcher.log_dir_id}), and "
            "no supervisor runs it now: this server cannot see the job's log, so it cannot tell "
            "whether its command began, and does not run it again (it could run twice). Its "
            "output until then, if any, is in that log directory: read it from a server on "
            "that log directory, or give every server the same shared log volume as its "
            "--log-dir."
        )

    async def _incarnation(self, name: str, supervisor: Any) -> str | None:
        """The actor id of the live supervisor `name`, None if it does not answer."""
        if name not in self._incarnations:
            try:
                self._incarnations[name] = str(await supervisor.actor_id.remote())
            except Exception as error:
                logger.warning("supervisor %s does not tell its actor id: %s", name, error)
                self._incarnations[name] = None
        return self._incarnations[name]

    async def _fail(self, record: JobRecord, message: str) -> None:
        logger.warning("job %s failed: %s", record.submission_id, message)
        with contextlib.suppress(JobNotFoundError):  # deleted meanwhile
            ended = await self._store.update(
                record.submission_id,
                record.run_id,
                status=JobStatus.FAILED,
                error_type=JobErrorType.JOB_SUPERVISOR_ACTOR_DIED,
                message=message,
            )
            await self._history.archive_end(ended)
            await self._history.forget(ended)
