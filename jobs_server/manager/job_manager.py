"""JobManager: submits, watches, stops, lists and deletes jobs. It knows nothing of HTTP."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import ray
from ray import cloudpickle

import jobs_server
from jobs_server.disk_guard import storage_errors_refused
from jobs_server.errors import (
    DatabaseUnavailableError,
    InvalidRequestError,
    JobNotFoundError,
    JobNotTerminalError,
    LeaderUnavailableError,
)
from jobs_server.manager.archive.event_feed import EventFeed, EventFilter, FeedReset
from jobs_server.manager.archive.events import JobEvent, JobEventType
from jobs_server.manager.archive.interface import JobArchive
from jobs_server.manager.archive.job_counts import count_jobs_by_tenant, total_by_status
from jobs_server.manager.archive.leadership import Leadership
from jobs_server.manager.archive.leases import new_replica_id
from jobs_server.manager.archive.outage import first_line, probe_database
from jobs_server.manager.archive.retention import Retention, RetentionPolicy
from jobs_server.manager.archive.sqlite import Archive as SqliteArchive
from jobs_server.manager.archive.sqlite import JobQuery, UnknownCursorError
from jobs_server.manager.cluster.leaving import ClusterAtShutdown
from jobs_server.manager.cluster.resources import ClusterResources
from jobs_server.manager.in_doubt_submits import (
    SUBMIT_IN_DOUBT_MESSAGE,
    InDoubtSubmits,
    insert_may_have_committed,
)
from jobs_server.manager.job_views import JobViews, in_scope, scoped
from jobs_server.manager.launcher import Launcher
from jobs_server.manager.limits import JobLimits, LimitRefusedError, effective_limits
from jobs_server.manager.live.deferred_ends import DeferredEnds
from jobs_server.manager.live.history import JobHistory
from jobs_server.manager.live.kv import GcsKv
from jobs_server.manager.live.recovery import Recovery
from jobs_server.manager.live.store import JobStore
from jobs_server.manager.live.watcher import JobWatchers
from jobs_server.manager.log_watch import LogWatchers
from jobs_server.manager.logs import (
    LogChunk,
    ensure_log_dir_is,
    job_log_path,
    log_size,
    read_log_chunks,
)
from jobs_server.manager.packages import PackageLookup
from jobs_server.manager.queue.admission import Admission, JobQueue
from jobs_server.manager.queue.dependency_waits import (
    DependencyWaits,
    needs_wait,
    waiting_message,
)
from jobs_server.manager.queue.dispatcher import PENDING_MESSAGE, Dispatcher
from jobs_server.manager.queue.retries import DEFAULT_RETRY_BACKOFF_S
from jobs_server.manager.records import JobRecord, JobSpec, JobStatus, new_run_id, now_ms
from jobs_server.manager.replica import ReplicaState
from jobs_server.manager.runtime_envs import validate_runtime_env
from jobs_server.manager.stopping import JobStopper
from jobs_server.manager.supervisor.cgroups import DEFAULT_JOBS_CGROUP
from jobs_server.manager.supervisors import SupervisorOccupancy, Supervisors
from jobs_server.manager.tenancy import DEFAULT_TENANT, NO_LIMITS, RunAs, TenantLimits

logger = logging.getLogger(__name__)

# How often a followed log asks the database whether its job (one this replica does not
# watch: another replica's, on a follower) has ended.
END_CHECK_INTERVAL_S = 0.25
# Past this many jobs remembered, those asked longer ago than the interval are forgotten.
_END_CHECKS_KEPT = 1024
# The archive's events are followed again this long after their reading failed (the database
# away), from the last one seen.
EVENTS_RETRY_S = 1.0

# The supervisor's code travels with the actor, pickled by value, so a worker node needs nothing
# but Ray: no jobs_server installed, no runtime env to build before a job can start.
cloudpickle.register_pickle_by_value(jobs_server)


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
        archive: JobArchive,
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
        jobs_nice: int = 0,
        jobs_user: RunAs | None = None,
        jobs_cgroup: str | None = DEFAULT_JOBS_CGROUP,
        default_job_limits: JobLimits | None = None,
        enforce_entrypoint_memory: bool = False,
        leadership: Leadership | None = None,
        validate_notify: Callable[[JobSpec, str], None] | None = None,
    ) -> None:
        self._log_dir = log_dir
        # Checks a submit's webhook targets (`notify`) for its tenant before anything is
        # recorded: InvalidRequestError for a refused URL.
        self._validate_notify = validate_notify
        # Its id (logs.py `log_dir_id`), learnt at start.
        self._log_dir_id: str | None = None
        # This replica's part among those sharing a database (leadership.py): the leader does
        # the work, the others forward job writes to it. None on SQLite: one server, the leader.
        self._leadership = leadership
        self._replica_id = new_replica_id() if leadership is None else leadership.leases.replica_id
        self._log_watchers = LogWatchers()
        # The server's limits of a job that gives none (--job-memory-max-bytes, ...), below the
        # tenant's defaults; `tenant_limits` is read at each submit (a tokens file re-read on
        # SIGHUP applies at once).
        self._default_job_limits = default_job_limits
        self._enforce_entrypoint_memory = enforce_entrypoint_memory
        self._tenant_limits = tenant_limits
        # When each followed job this replica does not watch was last found still running.
        self._end_checked_s: dict[str, float] = {}
        self._archive = archive
        # The archive's events, fanned out; the archive's `on_events` must be its `publish`.
        self._event_feed = event_feed
        self._store = JobStore(GcsKv(gcs_address, namespace), parse=archive.parse_record)
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
            jobs_nice=jobs_nice,
        )
        self._cluster_resources = ClusterResources()
        self._queue = JobQueue(
            max_running=max_running_jobs, max_queued=max_queued_jobs, tenant_limits=tenant_limits
        )
        # Jobs waiting for others to end before they enter the queue (the leader's), decided
        # by the archive's events, which a task of the leader's follows.
        self._waits = DependencyWaits()
        self._dependency_events: asyncio.Task[None] | None = None
        self._launcher = Launcher(
            supervisors=self._supervisors,
            log_dir=log_dir,
            stop_grace_s=stop_grace_s,
            head_node_id=self._head_node_id,
            retry_backoff_s=retry_backoff_s,
            tenant_limits=tenant_limits,
            jobs_user=jobs_user,
            jobs_cgroup=jobs_cgroup,
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
            confirm_lead=self._still_leading,
        )
        # Ends the server decides while the disk is full, archived once it takes them.
        self._ends = DeferredEnds(self._history)
        self._dispatcher = Dispatcher(
            queue=self._queue,
            store=self._store,
            history=self._history,
            archive=archive,
            ends=self._ends,
            launcher=self._launcher,
            watchers=self._watchers,
            supervisors=self._supervisors,
            confirm_lead=self._still_leading,
            waits=self._waits,
            dependency_statuses=lambda record: self._views.statuses_now(
                (dependency.submission_id for dependency in record.spec.depends_on),
                record.tenant,
            ),
        )
        # Submits whose insert may have committed though the database's answer was lost.
        self._in_doubt = InDoubtSubmits(archive=archive, on_recorded=self._queue_recorded)
        self._views = JobViews(
            archive=archive,
            store=self._store,
            queue=self._queue,
            cluster_resources=self._cluster_resources,
            live_ids=self._live_ids,
            waits=self._waits,
        )
        self._stopper = JobStopper(
            store=self._store,
            history=self._history,
            archive=archive,
            supervisors=self._supervisors,
            dispatcher=self._dispatcher,
            ends=self._ends,
            queue=self._queue,
            watchers=self._watchers,
            stop_grace_s=stop_grace_s,
            read_record=self._views.record,
        )
        self._retention = (
            None
            if retention is None
            else Retention(
                archive=archive,
                delete_job=self._delete_expired,
                policy=retention,
                on_deleted=on_retention_deleted,
                tenant_limits=tenant_limits,
            )
        )

    async def start(self) -> None:
        """Open the log directory, and lead (or, beside a replica that leads, follow until this
        one takes the lead over)."""
        self._log_dir_id = await self._launcher.open_log_dir()
        if self._leadership is None:
            await self._lead()
        else:
            await self._leadership.start(on_elected=self._lead, on_deposed=self._step_down)

    async def _lead(self) -> None:
        """Take the work over: warm the shared supervisors, reconcile the jobs a previous
        server (or leader) left, and begin dispatching and the retention."""
        # A replica that led before and stepped down may hold a submit's stale entry: the
        # recovery queues again what the archive says waits.
        self._queue.clear()
        self._waits.clear()
        await self._stop_following_events()
        await self._supervisors.start()
        # The events from here on decide the waiting jobs; recovery puts them back in the
        # waits after this, and reads the statuses of the jobs they wait for then.
        _, newest_event_id = await self._archive.event_id_range()
        self._dependency_events = asyncio.create_task(
            self._follow_dependency_events(newest_event_id), name="dependency-events"
        )
        await Recovery(
            store=self._store,
            archive=self._archive,
            history=self._history,
            supervisors=self._supervisors,
            launcher=self._launcher,
            watchers=self._watchers,
            queue=self._queue,
            on_waiting=self._dispatcher.wait_recovered,
        ).recover()
        self._dispatcher.start()
        logger.info("job manager ready; watching %d jobs", len(self._watchers))
        if self._retention is not None:
            self._retention.start()

    async def _step_down(self) -> None:
        """The lead was lost to another replica (this one was frozen, or its database away,
        past its lease): drop the work, writing nothing of it. The jobs run on in their
        supervisors, and the new leader's recovery watches them and queues the queued again."""
        if self._retention is not None:
            await self._retention.close()
        await self._stop_following_events()
        await self._dispatcher.close()
        await self._watchers.close()
        await self._ends.close()
        await self._in_doubt.close()
        self._in_doubt = InDoubtSubmits(archive=self._archive, on_recorded=self._queue_recorded)
        self._queue.clear()
        self._waits.clear()
        logger.info("stepped down: the jobs are another replica's to watch now")

    async def _follow_dependency_events(self, after_id: int) -> None:
        """Tell the waits of every end and deletion the archive records after event `after_id`
        (this replica's and, on PostgreSQL, every replica's), in order, each once."""
        while True:
            try:
                async for event in self._event_feed.subscribe(
                    after=after_id, event_filter=EventFilter()
                ):
                    if isinstance(event, FeedReset):
                        # The archive no longer keeps what this fell behind on: read again.
                        self._dispatcher.recheck_dependencies()
                        continue
                    if event is None:
                        continue
                    after_id = event.id
                    if event.type is JobEventType.DELETED:
                        self._dispatcher.dependency_ended(event.submission_id, None)
                    elif event.status is not None and event.status.is_terminal():
                        self._dispatcher.dependency_ended(event.submission_id, event.status)
            except asyncio.CancelledError:
                raise
            except Exception as error:
                logger.warning(
                    "following the job events failed (%s); again in %.0f s from event %d",
                    first_line(error),
                    EVENTS_RETRY_S,
                    after_id,
                )
                await asyncio.sleep(EVENTS_RETRY_S)

    async def _stop_following_events(self) -> None:
        task, self._dependency_events = self._dependency_events, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def leader_url(self) -> str | None:
        """Where a job write goes: None to handle it here (this replica leads), else the
        leading replica's URL; LeaderUnavailableError while none leads."""
        if self._leadership is None:
            return None
        return await self._leadership.leader_url()

    async def leads_at(self, url: str) -> bool:
        """Whether the replica at `url` still leads: its lease live, by the database's clock
        (True on SQLite: one server)."""
        if self._leadership is None:
            return True
        return await self._leadership.leads_at(url)

    async def _confirm_lead(self) -> None:
        """Return once this replica surely leads (at once on SQLite, or while its lease is
        fresh); LeaderUnavailableError if it does not lead, or is still taking the work over."""
        if self._leadership is None:
            return
        if not self._leadership.leading or not self._leadership.ready_to_write:
            raise LeaderUnavailableError(
                "This replica does not lead the jobs now: send the write to the one that does."
            )
        # A client waits for its answer: a database that does not answer is its 503.
        await self._leadership.confirmed(wait_for_the_database=False)

    async def _still_leading(self) -> None:
        """Return once this replica surely still leads: the hand-overs' and the watchers'
        confirmation before a step that cannot be undone (recovery's included)."""
        if self._leadership is not None:
            await self._leadership.confirmed()

    def limits_changed(self) -> None:
        """The tenants' caps may have changed (their file re-read): hand over what they allow."""
        self._dispatcher.fill()

    @property
    def archive(self) -> JobArchive:
        return self._archive

    async def close(self, cluster: ClusterAtShutdown | None = None) -> None:
        """Stop watching; the jobs themselves run on in their detached supervisors (in embedded
        mode they are stopped first: the Ray they run on stops with the server). `cluster`:
        what the shutdown found of the cluster so far (a gone one is not asked again)."""
        if self._retention is not None:
            await self._retention.close()
        await self._in_doubt.close()
        await self._stop_following_events()
        await self._dispatcher.close()
        if self._stop_jobs_on_close_s is not None:
            await self._stopper.stop_all_jobs(
                self._stop_jobs_on_close_s, cluster or ClusterAtShutdown()
            )
        await self._ends.close()
        await self._watchers.close()
        await self._launcher.close()

    async def check_database(self) -> None:
        """DatabaseUnavailableError unless the archive answers a trivial read (the events' id
        range: two index lookups) within a second: the probe's view of the database."""
        if isinstance(self._archive, SqliteArchive):
            # A file on this disk, read by one thread: no connection to lose, and a probe
            # would wait behind a long list.
            return
        await probe_database(self._archive.event_id_range())

    async def replica_state(self) -> ReplicaState:
        """This replica now: its id and leases, whether its database answers (the probe of
        `check_database`), and the live jobs it owns (watched or queued here)."""
        try:
            await self.check_database()
        except DatabaseUnavailableError:
            connected = False
        else:
            connected = True
        return ReplicaState.of(
            replica_id=self._replica_id,
            leases=None if self._leadership is None else self._leadership.leases,
            role="follower" if self._leadership and not self._leadership.leading else "leader",
            database_backend="sqlite" if isinstance(self._archive, SqliteArchive) else "postgresql",
            database_connected=connected,
            jobs_owned=len(self._watchers) + self._queue.queued + len(self._waits),
        )

    async def submit_job(self, spec: JobSpec, *, tenant: str = DEFAULT_TENANT) -> JobRecord:
        """Record the job and hand it to a supervisor (or queue it, over a cap; or hold it
        until the jobs it depends on ended as it needs); return at once, the job PENDING.
        `spec.limits` are what the client asked for: the job gets its effective ones
        (limits.py), decided here, by the leader. QueueFullError (nothing recorded) if the
        queue is full (for a job that depends on others: if too many jobs wait for others);
        InvalidRequestError if a limit is above the tenant's ceiling;
        JobNotFoundError (nothing recorded) for a job it depends on that is not there or is
        another tenant's."""
        await self._confirm_lead()
        spec = self._with_effective_limits(spec, tenant)
        if self._validate_notify is not None:
            self._validate_notify(spec, tenant)
        await validate_runtime_env(spec.runtime_env, self._packages, tenant=tenant)
        if spec.depends_on:
            await self._ensure_dependencies_exist(spec, tenant)
        # Either the job exists and runs, or it does not exist: a client that goes away
        # half-way must not cancel the submission between the record and the supervisor.
        return await asyncio.shield(self._record_and_hand_over(spec, tenant))

    def _with_effective_limits(self, spec: JobSpec, tenant: str) -> JobSpec:
        tenant_limits = self._tenant_limits(tenant)
        try:
            limits = effective_limits(
                spec.limits,
                entrypoint_memory=spec.entrypoint_memory,
                enforce_entrypoint_memory=self._enforce_entrypoint_memory,
                tenant_default=tenant_limits.default_limits,
                tenant_ceiling=tenant_limits.max_limits,
                server_default=self._default_job_limits,
            )
        except LimitRefusedError as error:
            raise InvalidRequestError(str(error)) from None
        return spec.model_copy(update={"limits": limits})

    async def _ensure_dependencies_exist(self, spec: JobSpec, tenant: str) -> None:
        """JobNotFoundError for the first job `spec` depends on that is not in the archive, or
        is another tenant's: the same answer as for a job that does not exist. As they exist
        before this job does, no cycle can form."""
        ids = [dependency.submission_id for dependency in spec.depends_on]
        rows = await asyncio.gather(*(self._archive.get(job_id) for job_id in ids))
        for job_id, row in zip(ids, rows, strict=True):
            if row is None or not in_scope(row, tenant):
                raise JobNotFoundError(job_id)

    async def _record_and_hand_over(self, spec: JobSpec, tenant: str) -> JobRecord:
        run_id = new_run_id()
        record = JobRecord(
            spec=spec,
            tenant=tenant,
            start_time=now_ms(),
            message=waiting_message(spec.depends_on) if spec.depends_on else PENDING_MESSAGE,
            supervisor_name=self._supervisors.name_for(spec, run_id),
            run_id=run_id,
        )
        # Its slot or its place in the queue, taken now (no await since the check: of two
        # submits racing for the last place one wins); a 429 here has recorded nothing. A job
        # that waits for others takes a place among the waiting jobs now, and no slot nor
        # place in the queue: those once its dependencies are met.
        admission: Admission | None = None
        if spec.depends_on:
            self._waits.reserve(record)
        else:
            admission = self._queue.admit(record)
        # On disk before the answer: an accepted job is never lost. If the server dies before
        # the KV has it, the next one's recovery runs (or queues) it.
        try:
            with storage_errors_refused("a submit"):
                await self._archive.insert(record)
        except BaseException as error:
            if admission is None:
                self._waits.release(record)
            else:
                self._queue.cancel(record, admission)
            self._dispatcher.fill()
            if not insert_may_have_committed(error):
                raise
            # The row may be in the database all the same: read back once it answers.
            logger.warning(
                "submit of job %s is in doubt: %s", record.submission_id, first_line(error)
            )
            self._in_doubt.add(record)
            raise DatabaseUnavailableError(SUBMIT_IN_DOUBT_MESSAGE) from error
        if admission is None:
            # Registered before the statuses of the jobs it waits for are read: an end in
            # between is learnt either way.
            self._waits.release(record)
            self._dispatcher.wait(record)
            return record
        if admission is Admission.QUEUE:
            self._queue.enqueue(record)
            self._dispatcher.fill()
            return record
        # The way a queued job goes (a stop that meets it calls it off), but a refusal of Ray's
        # withdraws it and is the answer.
        await self._dispatcher.hand_over_now(record)
        return record

    def _queue_recorded(self, record: JobRecord) -> None:
        """A submit in doubt was recorded after all: queued, as recovery queues a job never
        handed over (its slot comes from the queue, within its caps); or, if it depends on
        others, waits for them."""
        if needs_wait(record):
            self._dispatcher.wait_recovered(record)
            return
        self._queue.requeue(record)
        self._dispatcher.fill()

    async def get_job(self, submission_id: str, *, tenant: str | None = None) -> JobRecord:
        record = await self._views.record(submission_id, tenant)
        return await self._views.with_wait_message(record, tenant)

    async def dependencies_met(self, records: Sequence[JobRecord]) -> dict[str, dict[str, bool]]:
        """By job of `records` that depends on others: whether each of those has met its
        condition now (a deleted one, or another tenant's: False, unless it held before its
        deletion while the job waited). No read for jobs without
        dependencies."""
        wanted: dict[str, set[str]] = {}
        for record in records:
            for dependency in record.spec.depends_on:
                wanted.setdefault(record.tenant, set()).add(dependency.submission_id)
        if not wanted:
            return {}
        tenants = list(wanted)
        by_tenant = dict(
            zip(
                tenants,
                await asyncio.gather(
                    *(self._views.statuses_now(wanted[tenant], tenant) for tenant in tenants)
                ),
                strict=True,
            )
        )
        met: dict[str, dict[str, bool]] = {}
        for record in records:
            if not record.spec.depends_on:
                continue
            statuses = by_tenant[record.tenant]
            met[record.submission_id] = {
                dependency.submission_id: dependency.submission_id in record.dependencies_held
                or (
                    (status := statuses.get(dependency.submission_id)) is not None
                    and dependency.condition.holds(status)
                )
                for dependency in record.spec.depends_on
            }
        return met

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
        query = scoped(query, tenant)
        try:
            records, more = await self._views.page(query, after=after, limit=limit)
        except UnknownCursorError:
            raise InvalidRequestError(f"after: no job {after!r} to continue after.") from None
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
            async for batch in self._views.stream(scoped(query, tenant), after=after):
                yield batch
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
        return await count_jobs_by_tenant(
            self._archive, self._store, tenant, live_ids=self._live_ids()
        )

    def _live_ids(self) -> frozenset[str]:
        # Whose status the KV may know first: the watched, and the ends a full disk holds back.
        return self._watchers.watched_ids() | self._ends.waiting_ids()

    def queue_occupancy(self) -> dict[str, tuple[int, int]]:
        """(jobs queued, jobs holding a running slot) by tenant: the metrics' queue gauges."""
        return self._queue.occupancy()

    def supervisor_occupancy(self) -> SupervisorOccupancy:
        """How many jobs each shared supervisor holds, and how many have one of their own: the
        metrics' supervisor gauges."""
        return self._supervisors.occupancy(self._watchers.supervisor_names())

    async def stop_job(
        self,
        submission_id: str,
        grace_period_s: float | None = None,
        *,
        tenant: str | None = None,
    ) -> bool:
        """Ask a job (of `tenant`) to stop; return False if it had already ended."""
        await self._confirm_lead()
        return await self._stopper.stop_job(submission_id, grace_period_s, tenant)

    async def delete_job(self, submission_id: str, *, tenant: str | None = None) -> None:
        """Forget a job (of `tenant`) that has ended: its record, in the archive and the KV,
        and its log."""
        await self._confirm_lead()
        record = await self._views.record(submission_id, tenant)
        if not record.status.is_terminal():
            raise JobNotTerminalError(submission_id, record.status)
        with storage_errors_refused("a delete"):
            await self._forget(record)

    async def _delete_expired(self, expired: JobRecord) -> bool:
        """Retention's delete: the run `expired` only, if it is still there and has ended."""
        record = await self._views.record(expired.submission_id)
        if record.run_id != expired.run_id or not record.status.is_terminal():
            return False
        await self._forget(record)
        return True

    async def _forget(self, record: JobRecord) -> None:
        """Delete an ended run: its archived row (and so its `deleted` event), KV and log."""
        submission_id = record.submission_id
        await self._history.archive_end(record)
        await self._dispatcher.keep_held_dependencies(record)
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
        before any chunk is read (also for a job of another tenant than `tenant`), and
        LogUnavailableError for a log in a log directory this server does not see."""
        await self._ensure_log_here(submission_id, tenant)
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
        await self._ensure_log_here(submission_id, tenant)
        return await asyncio.to_thread(log_size, job_log_path(self._log_dir, submission_id))

    async def subscribe_events(
        self, *, after: int | None, event_filter: EventFilter, idle_tick_s: float | None = None
    ) -> AsyncGenerator[JobEvent | FeedReset | None, None]:
        """The job events after `after` that pass `event_filter` (see `EventFeed.subscribe`)."""
        return self._event_feed.subscribe(
            after=after, event_filter=event_filter, idle_tick_s=idle_tick_s
        )

    async def _ensure_log_here(self, submission_id: str, tenant: str | None) -> None:
        """`_ensure_exists`, and LogUnavailableError if the job's log is written to another log
        directory than this server's (its record names it; one of an earlier server does not):
        there, a missing file is not an empty log."""
        record = await self._ensure_exists(submission_id, tenant)
        # A job watched here (perhaps adopted from a server on another log directory): its
        # watcher knows, and its log is served without a read of the database.
        written_to = (
            self._watchers.log_dir_id_of(submission_id) if record is None else record.log_dir_id
        )
        ensure_log_dir_is(submission_id, written_to, self._log_dir_id)

    async def _ensure_exists(
        self, submission_id: str, tenant: str | None = None
    ) -> JobRecord | None:
        """Raise JobNotFoundError for an unknown job (or one of another tenant); its record, if
        read. A job this server watches exists without asking the GCS, so its log is served
        while the GCS is away; its tenant is in the archive, on this disk."""
        if tenant is not None:
            archived = await self._archive.get(submission_id)
            if archived is None or not in_scope(archived, tenant):
                raise JobNotFoundError(submission_id)
            return archived
        if self._watchers.has_ended(submission_id) is None:
            return await self._views.record(submission_id)
        return None

    async def _job_has_ended(self, submission_id: str) -> bool:
        # A watched job has ended when its watcher has: in memory, so a hundred followers cost
        # no GCS reads. The watcher finishes only after the terminal status is written.
        watched_has_ended = self._watchers.has_ended(submission_id)
        if watched_has_ended is not None:
            return watched_has_ended
        # A queued job waits in memory: its log's watcher asks 100 times a second while it
        # waits, and the archive's row says nothing the queue does not.
        if submission_id in self._queue or submission_id in self._waits:
            return False
        # Another replica's job (this one follows): its status is in the database and the KV,
        # asked at most every END_CHECK_INTERVAL_S per job rather than at each of the log
        # watcher's ticks (100 a second). The end is then seen that much later; its last bytes
        # are still all read (the watcher reads once more after the end).
        asked_s = self._end_checked_s.get(submission_id)
        if asked_s is not None and time.monotonic() - asked_s < END_CHECK_INTERVAL_S:
            return False
        try:
            ended = (await self._views.record(submission_id)).status.is_terminal()
        except JobNotFoundError:
            ended = True  # deleted while being read: nothing more will be written
        if ended:
            self._end_checked_s.pop(submission_id, None)
        else:
            now_s = time.monotonic()
            if len(self._end_checked_s) >= _END_CHECKS_KEPT:  # older than the interval: useless
                self._end_checked_s = {
                    job: at
                    for job, at in self._end_checked_s.items()
                    if now_s - at < END_CHECK_INTERVAL_S
                }
            self._end_checked_s[submission_id] = now_s
        return ended
