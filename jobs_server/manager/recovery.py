"""What a starting server reconciles: it adopts the jobs a previous server left, queues again
those it accepted but never handed over (in submission order: the queue's order survives), and
fails those whose supervisor incarnation is gone (a new shared supervisor under the same name
never ran them: nothing may stay RUNNING without a process behind it).

It reads the archive's unfinished rows and the KV's records (both bounded by the live jobs),
never the whole history. A row the KV does not have is a job accepted but never handed over (it
is queued again, and runs when the queue hands it a slot) or a job whose cluster went away with
its KV (it failed); a KV record the archive does not have (the archive was lost, or written by
a server before it) is imported.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from jobs_server.errors import DuplicateJobError, JobNotFoundError
from jobs_server.manager.archive import Archive
from jobs_server.manager.history import JobHistory
from jobs_server.manager.job_queue import JobQueue
from jobs_server.manager.launcher import Launch, Launcher
from jobs_server.manager.records import JobErrorType, JobRecord, JobStatus, now_ms
from jobs_server.manager.store import JobStore
from jobs_server.manager.supervisors import Supervisors, is_dedicated
from jobs_server.manager.watcher import JobWatchers

logger = logging.getLogger(__name__)


class Recovery:
    """Reconciles the stored jobs with the supervisors that are alive, once, at start."""

    def __init__(
        self,
        *,
        store: JobStore,
        archive: Archive,
        history: JobHistory,
        supervisors: Supervisors,
        launcher: Launcher,
        watchers: JobWatchers,
        queue: JobQueue,
    ) -> None:
        self._queue = queue
        self._store = store
        self._archive = archive
        self._history = history
        self._supervisors = supervisors
        self._launcher = launcher
        self._watchers = watchers
        # The actor id of each live supervisor asked, by name (None: it did not answer).
        self._incarnations: dict[str, str | None] = {}

    async def recover(self) -> None:
        """Adopt, start or fail every job that has not ended; retire what nobody needs."""
        busy_supervisors = set()
        live_supervisors = await asyncio.to_thread(self._supervisors.live_names)
        in_kv = {record.submission_id: record for record in await self._store.live_records()}
        unfinished = {record.submission_id: record for record in await self._archive.unfinished()}
        for record in in_kv.values():
            if record.submission_id not in unfinished and not await self._import(record):
                continue
            unfinished.setdefault(record.submission_id, record)
        for job_id, row in unfinished.items():
            found = in_kv.get(job_id)
            if found is None or found.run_id != row.run_id:
                await self._reconcile_without_kv(row)
                busy_supervisors.add(row.supervisor_name)
                continue
            record = found
            await self._archive.update(record)
            if not record.status.is_terminal():
                await self._adopt(record)
                busy_supervisors.add(record.supervisor_name)
            elif record.supervisor_name in live_supervisors and is_dedicated(
                record.supervisor_name
            ):
                # It ended while no server watched: pull what is left of its log from its
                # node, then retire its supervisor.
                await self._adopt(record)
            else:
                await self._history.forget(record)
        for name in self._supervisors.stale_shared_names(live_supervisors):
            if name not in busy_supervisors:
                logger.info(
                    "retiring idle supervisor %s of an earlier server version or setting", name
                )
                await asyncio.to_thread(self._supervisors.kill, name)

    async def _import(self, record: JobRecord) -> bool:
        """Archive a KV record the archive does not list as unfinished: True if it is new here
        (imported) and needs reconciling; an ended row or another run is forgotten in the KV."""
        archived = await self._archive.get(record.submission_id)
        if archived is None:
            logger.info("importing job %s from the KV into the archive", record.submission_id)
            try:
                await self._archive.insert(record)
            except DuplicateJobError:
                return False
            return True
        # Archived as ended (or another run of the id): what is left in the KV is stale.
        if archived.run_id == record.run_id:
            await self._archive.update(record)  # a terminal row stays as it is
        await self._history.forget(record)
        return False

    async def _reconcile_without_kv(self, row: JobRecord) -> None:
        """An unfinished job the KV does not have: never handed over, or its cluster's KV is
        gone (a restarted cluster)."""
        if row.status is JobStatus.PENDING and not await self._launcher.has_log(row):
            # Queued when the server stopped, or it died between archiving the job and handing
            # it over (or the cluster went away before it began): it was accepted, so it runs
            # when the queue hands it a slot.
            logger.info("job %s was never handed to a supervisor; queued", row.submission_id)
            self._queue.requeue(row)
            return
        ended = row.with_changes(
            status=JobStatus.FAILED,
            end_time=now_ms(),
            error_type=JobErrorType.JOB_SUPERVISOR_ACTOR_DIED,
            message=(
                "The Ray cluster the job ran on went away (its record in the cluster is gone: "
                "the cluster restarted); the job's processes ended with it. Its output until "
                "then is in the log."
            ),
        )
        logger.warning("job %s failed: %s", row.submission_id, ended.message)
        await self._archive.update(ended)

    async def _adopt(self, record: JobRecord) -> None:
        name = record.supervisor_name or self._supervisors.name_for(record.spec, record.run_id)
        supervisor = await asyncio.to_thread(self._supervisors.find, name)
        if record.status is JobStatus.PENDING and await self._began_elsewhere(record, supervisor):
            # Its command began under a supervisor that died before recording RUNNING: running
            # it again would run a job twice (its log twice over).
            await self._fail(
                record,
                f"The job's supervisor ({name}) died after its command began and before it was "
                "recorded; its processes are gone. Its output until then is in the log.",
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
                record.submission_id, record.run_id, handed_over_time=now_ms()
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
        """Whether a pending job's command began (its log exists) under a supervisor that is
        not running it now."""
        if not await self._launcher.has_log(record):
            return False
        if supervisor is None:
            return True
        try:
            return not await supervisor.knows_run.remote(record.submission_id, record.run_id)
        except Exception as error:
            logger.warning("supervisor of job %s does not answer: %s", record.submission_id, error)
            return True

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
