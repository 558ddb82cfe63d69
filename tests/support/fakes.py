"""In-memory stand-ins for the Ray-backed parts of the app, for tests that never need a job to run.

`FakeJobManager(...).backend()` gives `create_app` a backend that touches no Ray: the manager
keeps records in memory under the real manager's rules and raises its domain errors
(tests/test_fake_manager.py runs the same checks on both), logs that are real files read by the
real chunk reader, and the real PackageStore over an in-memory KV. A fake job runs nothing: it
stays PENDING until the test moves it on (`start`, `write_log`, `finish`).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import ray

from jobs_server.errors import (
    DuplicateJobError,
    InvalidRequestError,
    JobNotFoundError,
    JobNotTerminalError,
)
from jobs_server.manager import (
    Backend,
    ClusterInfo,
    JobErrorType,
    JobPage,
    JobQuery,
    JobRecord,
    JobSpec,
    JobStatus,
    LogChunk,
    PackageStore,
    RayDriver,
)
from jobs_server.manager.archive.event_feed import EventFeed, EventFilter, FeedReset
from jobs_server.manager.archive.events import JobEvent, JobEventType
from jobs_server.manager.live.kv import GcsKv
from jobs_server.manager.log_watch import LogWatchers
from jobs_server.manager.logs import job_log_path, log_size, read_log_chunks
from jobs_server.manager.records import now_ms
from jobs_server.manager.replica import ReplicaState
from jobs_server.manager.runtime_envs import validate_runtime_env
from jobs_server.manager.supervisors import SupervisorOccupancy
from jobs_server.manager.tenancy import DEFAULT_TENANT

FAKE_CLUSTER_INFO = ClusterInfo(
    ray_version=ray.__version__,
    ray_commit=ray.__commit__,
    session_name="session_fake",
    containment="marker",
)
# What a stopped command's shell reports: killed by SIGTERM.
STOPPED_EXIT_CODE = -15


class InMemoryKv(GcsKv):
    """A GCS KV namespace in a dict, so the real PackageStore runs without a cluster."""

    def __init__(self) -> None:  # no GcsClient: nothing to connect to
        self.values: dict[str, bytes] = {}
        self.pins: dict[str, int] = {}

    async def create(self, key: str, value: bytes) -> bool:
        if key in self.values:
            return False
        self.values[key] = value
        return True

    async def put(self, key: str, value: bytes) -> None:
        self.values[key] = value

    async def get(self, key: str) -> bytes | None:
        return self.values.get(key)

    async def exists(self, key: str) -> bool:
        return key in self.values

    async def delete(self, key: str) -> None:
        self.values.pop(key, None)

    async def keys_with_prefix(self, prefix: str) -> list[str]:
        return [key for key in self.values if key.startswith(prefix)]

    async def get_many(self, keys: list[str]) -> dict[str, bytes]:
        return {key: self.values[key] for key in keys if key in self.values}

    def pin_uri(self, uri: str, expiration_s: int) -> None:
        self.pins[uri] = expiration_s


class FakePackageStore(PackageStore):
    """The real PackageStore (its checks, its errors) over an in-memory KV."""

    def __init__(self, max_package_bytes: int) -> None:  # no GCS address: nothing to join
        self.kv = InMemoryKv()
        self._kv = self.kv
        self._max_package_bytes = max_package_bytes


class InMemoryEventLog:
    """The archive's `EventLog` in a list (tests only): numbered events, the oldest dropped past
    `keep`, and `on_events` called with each new batch, as the archive does after its commit."""

    def __init__(
        self, *, keep: int = 10_000, on_events: Callable[[list[JobEvent]], None] | None = None
    ) -> None:
        self.events: list[JobEvent] = []
        self.keep = keep
        self.on_events = on_events
        self._next_id = 1

    def record(
        self,
        type: JobEventType,
        record: JobRecord | None,
        submission_id: str,
        tenant: str = DEFAULT_TENANT,
    ) -> JobEvent:
        event = JobEvent(
            id=self._next_id,
            type=type,
            submission_id=submission_id,
            tenant=tenant,
            status=None if record is None else record.status,
            message=None if record is None else record.message,
            time=now_ms(),
            record=record,
        )
        self._next_id += 1
        self.events.append(event)
        del self.events[: max(0, len(self.events) - self.keep)]
        if self.on_events is not None:
            self.on_events([event])
        return event

    async def events_after(self, after_id: int, limit: int) -> list[JobEvent]:
        return [event for event in self.events if event.id > after_id][:limit]

    async def event_id_range(self) -> tuple[int, int]:
        if not self.events:
            return (self._next_id - 1, self._next_id - 1) if self._next_id > 1 else (0, 0)
        return self.events[0].id, self.events[-1].id


class FakeJobManager:
    """A JobManager without Ray: the same rules and errors, jobs that move only when told.

    Records live in a dict in submission order; a terminal status is final, as in the real
    store. Stopping a RUNNING job ends it STOPPED at once (the real one asks its supervisor, and
    the job ends a little later); every stop request is kept in `stop_requests`.
    """

    def __init__(self, log_dir: Path, *, max_package_bytes: int) -> None:
        self.log_dir = log_dir
        self._log_watchers = LogWatchers()
        self.packages = FakePackageStore(max_package_bytes)
        self._records: dict[str, JobRecord] = {}
        self.stop_requests: list[tuple[str, float | None]] = []
        self.event_log = InMemoryEventLog()
        self.event_feed = EventFeed(self.event_log)
        self.event_log.on_events = self.event_feed.publish

    # The manager's API (jobs_server.manager.JobManagerApi).

    async def submit_job(self, spec: JobSpec, *, tenant: str = DEFAULT_TENANT) -> JobRecord:
        """Check the runtime env as the real manager does, then record the job PENDING."""
        await validate_runtime_env(spec.runtime_env, self.packages, tenant=tenant)
        for dependency in spec.depends_on:
            parent = self._records.get(dependency.submission_id)
            if parent is None or parent.tenant != tenant:
                raise JobNotFoundError(dependency.submission_id)
        if spec.submission_id in self._records:
            raise DuplicateJobError(spec.submission_id)
        record = JobRecord(spec=spec, start_time=now_ms(), message="Job is pending.", tenant=tenant)
        self._records[spec.submission_id] = record
        self.event_log.record(JobEventType.SUBMITTED, record, spec.submission_id, tenant)
        return record

    async def get_job(self, submission_id: str, *, tenant: str | None = None) -> JobRecord:
        return self._get(submission_id, tenant)

    async def dependencies_met(self, records: Sequence[JobRecord]) -> dict[str, dict[str, bool]]:
        """As the real one: each dependency's condition against its job's status now (a job
        gone, or of another tenant: False)."""
        met: dict[str, dict[str, bool]] = {}
        for record in records:
            if not record.spec.depends_on:
                continue
            met[record.submission_id] = {}
            for dependency in record.spec.depends_on:
                parent = self._records.get(dependency.submission_id)
                met[record.submission_id][dependency.submission_id] = (
                    parent is not None
                    and parent.tenant == record.tenant
                    and dependency.condition.holds(parent.status)
                )
        return met

    async def list_jobs(
        self,
        *,
        query: JobQuery | None = None,
        after: str | None = None,
        limit: int | None = None,
        tenant: str | None = None,
    ) -> JobPage:
        records = self._matching(query or JobQuery(), after, tenant)
        next_after = None
        if limit is not None and len(records) > limit:
            records = records[:limit]
            next_after = records[-1].submission_id
        return JobPage(records=records, next_after=next_after)

    async def stream_jobs(
        self,
        query: JobQuery | None = None,
        *,
        after: str | None = None,
        tenant: str | None = None,
    ) -> AsyncIterator[list[JobRecord]]:
        records = self._matching(query or JobQuery(), after, tenant)
        for start in range(0, len(records), 2):  # small batches, to exercise the joins
            yield records[start : start + 2]

    def _matching(self, query: JobQuery, after: str | None, tenant: str | None) -> list[JobRecord]:
        """The archive's query, over the dict."""
        tenant = tenant if tenant is not None else query.tenant
        records = [r for r in self._records.values() if tenant is None or r.tenant == tenant]
        if query.descending:
            records.reverse()
        if after is not None:
            ids = [r.submission_id for r in records]
            if after not in ids:  # unknown, or another tenant's
                raise InvalidRequestError(f"after: no job {after!r} to continue after.")
            records = records[ids.index(after) + 1 :]
        return [
            record
            for record in records
            if (query.statuses is None or record.status in query.statuses)
            and (query.submitted_after is None or (record.start_time or 0) > query.submitted_after)
            and (
                query.submitted_before is None or (record.start_time or 0) < query.submitted_before
            )
            and all(record.spec.metadata.get(key) == value for key, value in query.metadata)
        ]

    async def count_by_status(self, *, tenant: str | None = None) -> dict[JobStatus, int]:
        return dict(
            Counter(
                record.status
                for record in self._records.values()
                if tenant is None or record.tenant == tenant
            )
        )

    async def check_database(self) -> None:
        """Its records are in memory: always there."""

    async def leader_url(self) -> str | None:
        """One server, the leader: every write is handled here."""
        return None

    async def leads_at(self, url: str) -> bool:
        """One server: it leads."""
        return True

    async def replica_state(self) -> ReplicaState:
        """A replica on the default store (its records in memory: always there), no leases;
        it owns its jobs that have not ended."""
        return ReplicaState.of(
            replica_id="fake:1:replica",
            leases=None,
            role="leader",
            database_backend="sqlite",
            database_connected=True,
            jobs_owned=sum(not r.status.is_terminal() for r in self._records.values()),
        )

    async def count_by_tenant(
        self, *, tenant: str | None = None
    ) -> dict[str, dict[JobStatus, int]]:
        counts: dict[str, dict[JobStatus, int]] = {}
        for record in self._records.values():
            if tenant is None or record.tenant == tenant:
                of_tenant = counts.setdefault(record.tenant, {})
                of_tenant[record.status] = of_tenant.get(record.status, 0) + 1
        return counts

    def queue_occupancy(self) -> dict[str, tuple[int, int]]:
        return {}  # no caps: nothing queued, and no slots are counted

    def supervisor_occupancy(self) -> SupervisorOccupancy:
        return SupervisorOccupancy(shared={}, own=0)  # no supervisors: nothing runs

    async def stop_job(
        self,
        submission_id: str,
        grace_period_s: float | None = None,
        *,
        tenant: str | None = None,
    ) -> bool:
        record = self._get(submission_id, tenant)
        self.stop_requests.append((submission_id, grace_period_s))
        if record.status.is_terminal():
            return False
        if record.status is JobStatus.PENDING:
            self._update(
                submission_id,
                status=JobStatus.STOPPED,
                message="Job was stopped before it started.",
            )
        else:
            self._update(
                submission_id,
                status=JobStatus.STOPPED,
                message="Job was intentionally stopped.",
                driver_exit_code=STOPPED_EXIT_CODE,
            )
        return True

    async def delete_job(self, submission_id: str, *, tenant: str | None = None) -> None:
        record = self._get(submission_id, tenant)
        if not record.status.is_terminal():
            raise JobNotTerminalError(submission_id, record.status)
        del self._records[submission_id]
        job_log_path(self.log_dir, submission_id).unlink(missing_ok=True)
        self.event_log.record(JobEventType.DELETED, None, submission_id, record.tenant)

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
        self._get(submission_id, tenant)

        async def job_is_terminal() -> bool:
            record = self._records.get(submission_id)
            return record is None or record.status.is_terminal()

        return read_log_chunks(
            job_log_path(self.log_dir, submission_id),
            offset=offset,
            limit=limit,
            follow=follow,
            job_is_terminal=job_is_terminal,
            idle_tick_s=idle_tick_s,
            watchers=self._log_watchers,
            stop_when=stop_when,
        )

    async def log_size(self, submission_id: str, *, tenant: str | None = None) -> int:
        self._get(submission_id, tenant)
        return await asyncio.to_thread(log_size, job_log_path(self.log_dir, submission_id))

    async def subscribe_events(
        self, *, after: int | None, event_filter: EventFilter, idle_tick_s: float | None = None
    ) -> AsyncGenerator[JobEvent | FeedReset | None, None]:
        return self.event_feed.subscribe(
            after=after, event_filter=event_filter, idle_tick_s=idle_tick_s
        )

    def backend(self) -> Backend:
        """What `create_app(settings, backend=...)` takes: this manager, its packages."""
        return Backend(
            manager=self,
            package_store=self.packages,
            cluster_info=FAKE_CLUSTER_INFO,
            drivers=NoRayDrivers(),
        )

    # What a test does in place of a supervisor.

    def start(self, submission_id: str, *, pid: int = 4242) -> JobRecord:
        """The job's command started: RUNNING."""
        return self._update(
            submission_id,
            status=JobStatus.RUNNING,
            message="Job is currently running.",
            driver_pid=pid,
            driver_node_ip="127.0.0.1",
        )

    def write_log(self, submission_id: str, data: bytes) -> None:
        """Append the job's output to its log file, as its command would."""
        self._get(submission_id)
        path = job_log_path(self.log_dir, submission_id)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("ab") as log_file:
            log_file.write(data)

    def finish(self, submission_id: str, *, exit_code: int = 0) -> JobRecord:
        """The job's command exited: SUCCEEDED with 0, else FAILED."""
        if exit_code == 0:
            return self._update(
                submission_id,
                status=JobStatus.SUCCEEDED,
                message="Job finished successfully.",
                driver_exit_code=0,
            )
        return self._update(
            submission_id,
            status=JobStatus.FAILED,
            error_type=JobErrorType.JOB_ENTRYPOINT_COMMAND_ERROR,
            message=f"Job failed with exit code {exit_code}.",
            driver_exit_code=exit_code,
        )

    def _get(self, submission_id: str, tenant: str | None = None) -> JobRecord:
        record = self._records.get(submission_id)
        if record is None or (tenant is not None and record.tenant != tenant):
            raise JobNotFoundError(submission_id)
        return record

    def _update(self, submission_id: str, **changes: Any) -> JobRecord:
        """Apply `changes` unless the job has ended (a terminal status is final)."""
        current = self._get(submission_id)
        if current.status.is_terminal():
            return current
        if JobStatus(changes.get("status", current.status)).is_terminal():
            changes.setdefault("end_time", now_ms())
        updated = current.with_changes(**changes)
        self._records[submission_id] = updated
        if updated.status is not current.status:
            self.event_log.record(JobEventType.STATUS, updated, submission_id, updated.tenant)
        return updated


class NoRayDrivers:
    """The fake's jobs run no command, so none of them started a Ray driver."""

    async def find(self, records: Sequence[JobRecord]) -> dict[str, RayDriver]:
        return {}
