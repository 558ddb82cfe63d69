"""JobManager: submits, watches, stops, lists and deletes jobs. It knows nothing of HTTP."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import secrets
import string
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from ray import cloudpickle
from ray.exceptions import ActorDiedError, ActorUnavailableError
from ray.runtime_env import RuntimeEnv

import jobs_server
from jobs_server.disk_guard import storage_errors_refused
from jobs_server.errors import (
    InvalidJobOptionsError,
    InvalidRequestError,
    InvalidRuntimeEnvError,
    JobNotFoundError,
    JobNotTerminalError,
    PackageNotFoundError,
    SupervisorUnreachableError,
)
from jobs_server.manager.archive import Archive, JobQuery, UnknownCursorError
from jobs_server.manager.cluster_resources import ClusterResources
from jobs_server.manager.dispatcher import Dispatcher, set_aside_orphaned_log
from jobs_server.manager.event_feed import EventFeed, EventFilter, FeedReset
from jobs_server.manager.events import JobEvent
from jobs_server.manager.history import JobHistory
from jobs_server.manager.job_counts import count_jobs_by_tenant, total_by_status
from jobs_server.manager.job_queue import Admission, JobQueue
from jobs_server.manager.job_run import NEVER_STARTED_MESSAGE
from jobs_server.manager.kv import GcsKv
from jobs_server.manager.launcher import Launcher
from jobs_server.manager.log_watch import LogWatchers
from jobs_server.manager.logs import LogChunk, job_log_path, log_size, read_log_chunks
from jobs_server.manager.packages import PackageLookup
from jobs_server.manager.records import JobRecord, JobSpec, JobStatus, new_run_id, now_ms
from jobs_server.manager.recovery import Recovery
from jobs_server.manager.retention import Retention, RetentionPolicy
from jobs_server.manager.retries import DEFAULT_RETRY_BACKOFF_S
from jobs_server.manager.runtime_envs import package_refs
from jobs_server.manager.store import JobStore
from jobs_server.manager.supervisor_calls import SUPERVISOR_UNAVAILABLE_RETRY_S
from jobs_server.manager.supervisors import Supervisors, is_dedicated
from jobs_server.manager.tenancy import DEFAULT_TENANT, NO_LIMITS, TenantLimits
from jobs_server.manager.watcher import JobWatchers

logger = logging.getLogger(__name__)

# The supervisor's code travels with the actor, pickled by value, so a worker node needs nothing
# but Ray: no jobs_server installed, no runtime env to build before a job can start.
cloudpickle.register_pickle_by_value(jobs_server)

SUBMISSION_ID_PREFIX = "raysubmit_"
# How long a stop request waits for an unreachable supervisor before answering 503.
STOP_UNREACHABLE_WAIT_S = 5.0
# How long a stop of a PENDING job waits for its supervisor to call it off (a supervisor of the
# job's own may not be up yet: then the server records the end and kills the actor).
CALL_OFF_WAIT_S = 2.0
# A shared supervisor is up, only maybe busy: the server waits longer rather than record a
# "stopped before it started" that the supervisor may have made untrue meanwhile.
SHARED_CALL_OFF_WAIT_S = 30.0
_SUBMISSION_ID_ALPHABET = string.ascii_letters + string.digits


def new_submission_id() -> str:
    """A random id in Ray's format, e.g. raysubmit_4LamXRuQpYdSMg7J."""
    # One read of the system's randomness (not one per letter: 5% of a burst's event loop),
    # 112 bits read as 16 base-62 digits (95 bits): a bias of at most 62**16 / 2**112 (1e-5).
    number = int.from_bytes(secrets.token_bytes(14))
    letters = []
    for _ in range(16):
        number, digit = divmod(number, len(_SUBMISSION_ID_ALPHABET))
        letters.append(_SUBMISSION_ID_ALPHABET[digit])
    return SUBMISSION_ID_PREFIX + "".join(letters)


@dataclass(frozen=True)
class JobPage:
    """A page of jobs and the cursor (`after`) of the next one, None on the last page."""

    records: list[JobRecord]
    next_after: str | None


class JobManager:
    """Owns every job of one server: its record, its supervisor, and a task watching it."""

    def __init__(
        self,
        *,
        gcs_address: str,
        namespace: str,
        archive: Archive,
        event_feed: EventFeed,
        log_dir: Path,
        stop_grace_s: float,
        job_start_timeout_s: float,
        shared_supervisors: int = 1,
        stop_jobs_on_close_s: float | None = None,
        retention: RetentionPolicy | None = None,
        on_retention_deleted: Callable[[int], None] | None = None,
        max_running_jobs: int | None = None,
        max_queued_jobs: int | None = None,
        tenant_limits: Callable[[str], TenantLimits] = lambda _: NO_LIMITS,
        retry_backoff_s: float = DEFAULT_RETRY_BACKOFF_S,
    ) -> None:
        self._log_dir = log_dir
        self._log_watchers = LogWatchers()
        self._archive = archive
        # The archive's events, fanned out; the archive's `on_events` must be its `publish`.
        self._event_feed = event_feed
        self._store = JobStore(GcsKv(gcs_address, namespace))
        self._history = JobHistory(store=self._store, archive=archive)
        self._stop_grace_s = stop_grace_s
        # Embedded mode: the jobs cannot outlive the server (its Ray stops with it), so they are
        # stopped and recorded STOPPED within this many seconds at close.
        self._stop_jobs_on_close_s = stop_jobs_on_close_s
        self._packages = PackageLookup(gcs_address)
        # The server's node: its log directory is where every job's log ends up.
        self._head_node_id: str = ray.get_runtime_context().get_node_id()
        self._supervisors = Supervisors(
            namespace=namespace,
            kv_namespace=namespace,
            shared_count=shared_supervisors,
            head_node_id=self._head_node_id,
        )
        self._cluster_resources = ClusterResources()
        self._queue = JobQueue(
            max_running=max_running_jobs, max_queued=max_queued_jobs, tenant_limits=tenant_limits
        )
        self._launcher = Launcher(
            supervisors=self._supervisors,
            log_dir=log_dir,
            stop_grace_s=stop_grace_s,
            head_node_id=self._head_node_id,
            retry_backoff_s=retry_backoff_s,
        )
        self._watchers = JobWatchers(
            store=self._store,
            history=self._history,
            supervisors=self._supervisors,
            launcher=self._launcher,
            cluster_resources=self._cluster_resources,
            log_dir=log_dir,
            job_start_timeout_s=job_start_timeout_s,
            on_watch=self._queue.hold,
            on_end=lambda record: self._dispatcher.run_ended(record),
        )
        self._dispatcher = Dispatcher(
            queue=self._queue,
            store=self._store,
            history=self._history,
            launcher=self._launcher,
            watchers=self._watchers,
            supervisors=self._supervisors,
        )
        self._retention = (
            None
            if retention is None
            else Retention(
                archive=archive,
                delete_job=self._delete_expired,
                policy=retention,
                on_deleted=on_retention_deleted,
            )
        )

    async def start(self) -> None:
        """Warm the shared supervisors, and reconcile the jobs a previous server left."""
        self._log_dir.mkdir(parents=True, exist_ok=True)
        await self._supervisors.start()
        await Recovery(
            store=self._store,
            archive=self._archive,
            history=self._history,
            supervisors=self._supervisors,
            launcher=self._launcher,
            watchers=self._watchers,
            queue=self._queue,
        ).recover()
        self._dispatcher.start()
        logger.info("job manager ready; watching %d jobs", len(self._watchers))
        if self._retention is not None:
            self._retention.start()

    def limits_changed(self) -> None:
        """The tenants' caps may have changed (their file re-read): hand over what they allow."""
        self._dispatcher.fill()

    @property
    def archive(self) -> Archive:
        return self._archive

    async def close(self) -> None:
        """Stop watching; the jobs themselves run on in their detached supervisors (in embedded
        mode they are stopped first: the Ray they run on stops with the server)."""
        if self._retention is not None:
            await self._retention.close()
        await self._dispatcher.close()
        if self._stop_jobs_on_close_s is not None:
            await self._stop_all_jobs(self._stop_jobs_on_close_s)
        await self._watchers.close()

    async def _stop_all_jobs(self, timeout_s: float) -> None:
        """Record every live job STOPPED (the end key's put-if-absent: a job that ended first
        keeps its end), ask its supervisor to stop it (SIGTERM, grace, SIGKILL), and wait for
        the watchers, at most `timeout_s`."""
        message = (
            "The job was stopped because the server shut down (in embedded mode its Ray "
            "instance stops with it)."
        )
        # Queued jobs never started: they stay queued, for the next server to run.
        live = [r for r in await self._archive.unfinished() if r.submission_id not in self._queue]
        grace_s = max(0.0, min(self._stop_grace_s, timeout_s - 1.0))

        async def stop(record: JobRecord) -> None:
            try:
                ended = await self._store.update(
                    record.submission_id, record.run_id, status=JobStatus.STOPPED, message=message
                )
                await self._history.archive_end(ended)
                supervisor = await asyncio.to_thread(
                    self._supervisors.find, record.supervisor_name or ""
                )
                if supervisor is not None:
                    await supervisor.stop_job.remote(record.submission_id, grace_s)
            except Exception:
                logger.warning(
                    "stopping job %s at shutdown failed", record.submission_id, exc_info=True
                )

        if live:
            logger.info("stopping %d jobs: the embedded Ray stops with the server", len(live))
            deadline = time.monotonic() + timeout_s
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    asyncio.gather(*(stop(record) for record in live)), timeout=timeout_s
                )
            # Their supervisors end the processes (SIGTERM, grace, SIGKILL) before Ray stops.
            await self._watchers.wait(deadline - time.monotonic())
        # Whatever could not be told (a KV that is gone) is still recorded as stopped here.
        for record in await self._archive.unfinished():
            if record.submission_id in self._queue:
                continue
            await self._archive.update(
                record.with_changes(status=JobStatus.STOPPED, end_time=now_ms(), message=message)
            )

    async def submit_job(self, spec: JobSpec, *, tenant: str = DEFAULT_TENANT) -> JobRecord:
        """Record the job and hand it to a supervisor (or queue it, over a cap); return at
        once, the job PENDING. QueueFullError (nothing recorded) if the queue is full."""
        await _validate_runtime_env(spec.runtime_env, self._packages)
        # Either the job exists and runs, or it does not exist: a client that goes away
        # half-way must not cancel the submission between the record and the supervisor.
        return await asyncio.shield(self._record_and_hand_over(spec, tenant))

    async def _record_and_hand_over(self, spec: JobSpec, tenant: str) -> JobRecord:
        run_id = new_run_id()
        record = JobRecord(
            spec=spec,
            tenant=tenant,
            start_time=now_ms(),
            message="Job is pending.",
            supervisor_name=self._supervisors.name_for(spec, run_id),
            run_id=run_id,
        )
        # Its slot or its place in the queue, taken now (no await since the check: of two
        # submits racing for the last place one wins); a 429 here has recorded nothing.
        admission = self._queue.admit(record)
        # On disk before the answer: an accepted job is never lost. If the server dies before
        # the KV has it, the next one's recovery runs (or queues) it.
        try:
            with storage_errors_refused("a submit"):
                await self._archive.insert(record)
        except BaseException:
            self._queue.cancel(record, admission)
            self._dispatcher.fill()
            raise
        if admission is Admission.QUEUE:
            self._queue.enqueue(record)
            self._dispatcher.fill()
            return record
        try:
            await asyncio.to_thread(set_aside_orphaned_log, self._launcher.log_path(record))
            await self._store.create(record)
            launch = await self._launcher.launch(record)
        except Exception as error:
            with contextlib.suppress(Exception):
                await self._store.delete(record)
            await self._archive.delete(record.submission_id, record.run_id)
            self._dispatcher.run_ended(record)
            if isinstance(error, ValueError | TypeError | ArithmeticError):
                raise InvalidJobOptionsError(f"Invalid job options: {error}") from error
            raise
        self._watchers.watch(record, launch)
        return record

    async def get_job(self, submission_id: str, *, tenant: str | None = None) -> JobRecord:
        return await self._with_wait_message(await self._record(submission_id, tenant))

    async def _record(self, submission_id: str, tenant: str | None = None) -> JobRecord:
        """The job as it is: its archived row, or for a live one what the KV says now. A job
        of another tenant than `tenant` (None: any) is not found, as an unknown id is."""
        archived = await self._archive.get(submission_id)
        if archived is None or not _in_scope(archived, tenant):
            raise JobNotFoundError(submission_id)
        if archived.status.is_terminal():
            return archived
        return (await self._store.current([archived])).get(submission_id, archived)

    async def list_jobs(
        self,
        *,
        query: JobQuery | None = None,
        after: str | None = None,
        limit: int | None = None,
        tenant: str | None = None,
    ) -> JobPage:
        """Jobs in submission order (newest first with `query.descending`): those of `tenant`
        (None: every tenant) matching `query`, after the job `after`, at most `limit` of them;
        `next_after` is the cursor of the next page, if there is one."""
        query = _scoped(query, tenant)
        try:
            records, more = await self._archive.page(query, after=after, limit=limit)
        except UnknownCursorError:
            raise InvalidRequestError(f"after: no job {after!r} to continue after.") from None
        records = await self._as_they_are(records)
        next_after = records[-1].submission_id if more and records else None
        return JobPage(records=records, next_after=next_after)

    async def stream_jobs(
        self,
        query: JobQuery | None = None,
        *,
        after: str | None = None,
        tenant: str | None = None,
    ) -> AsyncIterator[list[JobRecord]]:
        """Every job (of `tenant`) matching `query` after the job `after`, in batches read from
        the archive one at a time; InvalidRequestError for an unknown `after`, before the first
        batch."""
        try:
            async for batch in self._archive.stream(_scoped(query, tenant), after=after):
                yield await self._as_they_are(batch)
        except UnknownCursorError:
            raise InvalidRequestError(f"after: no job {after!r} to continue after.") from None

    async def count_by_status(self, *, tenant: str | None = None) -> dict[JobStatus, int]:
        """How many jobs (of `tenant`; None: of every tenant) of each status."""
        return total_by_status(await self.count_by_tenant(tenant=tenant))

    async def count_by_tenant(
        self, *, tenant: str | None = None
    ) -> dict[str, dict[JobStatus, int]]:
        """How many jobs of each status by tenant (only `tenant`, if given); no finished
        record is read."""
        return await count_jobs_by_tenant(self._archive, self._store, tenant, queued=self._queue)

    async def _as_they_are(self, records: list[JobRecord]) -> list[JobRecord]:
        """Live rows overlaid with what the KV says now (the archive learns a status a moment
        after the KV): one KV round trip per batch, none for a batch of finished jobs."""
        if all(record.status.is_terminal() for record in records):
            return records
        # Queued jobs are not in the KV yet.
        live = [
            record
            for record in records
            if not record.status.is_terminal() and record.submission_id not in self._queue
        ]
        try:
            current = await self._store.current(live) if live else {}
        except Exception:
            logger.warning("reading live jobs from the KV failed", exc_info=True)
            current = {}
        return [
            await self._with_wait_message(current.get(record.submission_id, record))
            for record in records
        ]

    async def stop_job(
        self,
        submission_id: str,
        grace_period_s: float | None = None,
        *,
        tenant: str | None = None,
    ) -> bool:
        """Ask a job (of `tenant`) to stop; return False if it had already ended."""
        record = await self._record(submission_id, tenant)
        if record.status.is_terminal():
            return False
        if record.status is JobStatus.PENDING:
            # Queued (or being handed over): the queue stops it before its command starts.
            stopped = await self._dispatcher.stop_before_start(record)
            if stopped is not None:
                return stopped
            record = await self._record(submission_id)
            if record.status.is_terminal():
                return False
        name = record.supervisor_name or self._supervisors.name_for(record.spec, record.run_id)
        supervisor = await asyncio.to_thread(self._supervisors.find, name)
        if record.status is JobStatus.RUNNING and supervisor is not None:
            await self._ask_to_stop(record, supervisor, grace_period_s)
            return True
        # PENDING here, but the command may have started since: only its supervisor knows. It
        # calls the job off (the command never starts) or stops it, and answers once nothing
        # of the job runs; the end it recorded in the KV is archived now, so a read right after
        # the stop sees it.
        if supervisor is not None and await self._call_off(record, supervisor):
            await self._history.learn(record)
            return True
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
            stored = await self._record(submission_id)
            if stored.run_id != record.run_id or not stored.status.is_terminal():
                raise
            return stored.status is JobStatus.STOPPED
        await self._history.archive_end(ended)
        if supervisor is not None and is_dedicated(name):
            await asyncio.to_thread(ray.kill, supervisor, no_restart=True)
        elif supervisor is not None:
            await supervisor.stop_job.remote(submission_id, 0)
        return True

    async def _call_off(self, record: JobRecord, supervisor: Any) -> bool:
        """Have the supervisor call off a job it may be starting; True once it has recorded
        the end and nothing of the job runs, False if it did not answer in time."""
        name = record.supervisor_name or ""
        # Not cancelled when it takes too long (Ray asserts on a cancelled ObjectRef future):
        # it ends with its actor, and its outcome is then read and dropped.
        call = asyncio.ensure_future(
            supervisor.call_off.remote(record.submission_id, record.run_id)
        )
        call.add_done_callback(lambda done: done.cancelled() or done.exception())
        answered, _ = await asyncio.wait(
            {call}, timeout=CALL_OFF_WAIT_S if is_dedicated(name) else SHARED_CALL_OFF_WAIT_S
        )
        if not answered:
            return False
        try:
            call.result()
        except (ActorDiedError, ActorUnavailableError):
            return False
        return True

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

    async def delete_job(self, submission_id: str, *, tenant: str | None = None) -> None:
        """Forget a job (of `tenant`) that has ended: its record, in the archive and the KV,
        and its log."""
        record = await self._record(submission_id, tenant)
        if not record.status.is_terminal():
            raise JobNotTerminalError(submission_id, record.status)
        with storage_errors_refused("a delete"):
            await self._forget(record)

    async def _delete_expired(self, expired: JobRecord) -> bool:
        """Retention's delete: the run `expired` only, if it is still there and has ended."""
        record = await self._record(expired.submission_id)
        if record.run_id != expired.run_id or not record.status.is_terminal():
            return False
        await self._forget(record)
        return True

    async def _forget(self, record: JobRecord) -> None:
        """Delete an ended run: its archived row (and so its `deleted` event), KV and log."""
        submission_id = record.submission_id
        await self._history.archive_end(record)
        async with self._history.exclusive(submission_id):
            with contextlib.suppress(Exception):  # gone from the KV already, as it should be
                await self._store.delete(record)
            if not await self._archive.delete(submission_id, record.run_id):
                raise JobNotFoundError(submission_id)
        job_log_path(self._log_dir, submission_id).unlink(missing_ok=True)

    async def read_logs(
        self,
        submission_id: str,
        *,
        offset: int = 0,
        limit: int | None = None,
        follow: bool = False,
        idle_tick_s: float | None = None,
        stop_when: Callable[[], bool] | None = None,
        tenant: str | None = None,
    ) -> AsyncGenerator[LogChunk, None]:
        """The job's log from `offset` (see `read_log_chunks`); raises JobNotFoundError now,
        before any chunk is read (also for a job of another tenant than `tenant`)."""
        await self._ensure_exists(submission_id, tenant)
        return read_log_chunks(
            job_log_path(self._log_dir, submission_id),
            offset=offset,
            limit=limit,
            follow=follow,
            job_is_terminal=lambda: self._job_has_ended(submission_id),
            idle_tick_s=idle_tick_s,
            watchers=self._log_watchers,
            stop_when=stop_when,
        )

    async def log_size(self, submission_id: str, *, tenant: str | None = None) -> int:
        """The job's log size in bytes now."""
        await self._ensure_exists(submission_id, tenant)
        return await asyncio.to_thread(log_size, job_log_path(self._log_dir, submission_id))

    async def subscribe_events(
        self, *, after: int | None, event_filter: EventFilter, idle_tick_s: float | None = None
    ) -> AsyncGenerator[JobEvent | FeedReset | None, None]:
        """The job events after `after` that pass `event_filter` (see `EventFeed.subscribe`)."""
        return self._event_feed.subscribe(
            after=after, event_filter=event_filter, idle_tick_s=idle_tick_s
        )

    async def _ensure_exists(self, submission_id: str, tenant: str | None = None) -> None:
        """Raise JobNotFoundError for an unknown job (or one of another tenant). A job this
        server watches exists without asking the GCS, so its log is served while the GCS is
        away; its tenant is in the archive, on this disk."""
        if tenant is not None:
            archived = await self._archive.get(submission_id)
            if archived is None or not _in_scope(archived, tenant):
                raise JobNotFoundError(submission_id)
        elif self._watchers.has_ended(submission_id) is None:
            await self._record(submission_id)

    async def _job_has_ended(self, submission_id: str) -> bool:
        # A watched job has ended when its watcher has: in memory, so a hundred followers cost
        # no GCS reads. The watcher finishes only after the terminal status is written.
        watched_has_ended = self._watchers.has_ended(submission_id)
        if watched_has_ended is not None:
            return watched_has_ended
        try:
            return (await self._record(submission_id)).status.is_terminal()
        except JobNotFoundError:
            return True  # deleted while being read: nothing more will be written

    async def _with_wait_message(self, record: JobRecord) -> JobRecord:
        """A queued job says its place and the cap it waits behind; a pending job handed over
        that waits for resources says which, and what the cluster has."""
        if record.status is not JobStatus.PENDING:
            return record
        queued = self._queue.describe(record.submission_id)
        if queued is not None:
            return record.with_changes(message=queued)
        waiting_for = await self._cluster_resources.describe_wait(record.spec.requested_resources())
        return record if waiting_for is None else record.with_changes(message=waiting_for)


def _in_scope(record: JobRecord, tenant: str | None) -> bool:
    """Whether a caller that sees `tenant`'s jobs (None: every tenant's) may see `record`."""
    return tenant is None or record.tenant == tenant


def _scoped(query: JobQuery | None, tenant: str | None) -> JobQuery:
    """`query` narrowed to `tenant`'s jobs (None: as it is)."""
    query = query or JobQuery()
    return query if tenant is None else dataclasses.replace(query, tenant=tenant)


async def _validate_runtime_env(runtime_env: dict[str, Any], packages: PackageLookup) -> None:
    """A 400 for what Ray would reject, and for code packages no node could fetch."""
    refs = package_refs(runtime_env)
    try:
        RuntimeEnv(**runtime_env)
    except Exception as error:  # Ray raises ValueError, TypeError or its own errors
        raise InvalidRuntimeEnvError(f"Invalid runtime_env: {error}") from error
    for ref in refs:
        if ref.is_uploaded:
            try:
                await packages.ensure_exists(ref.uri)
            except PackageNotFoundError:
                raise InvalidRuntimeEnvError(
                    f"runtime_env.{ref.field}: package {ref.uri} was never uploaded to this "
                    "cluster, or has expired (Ray's clients upload a local directory first)."
                ) from None
