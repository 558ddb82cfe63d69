"""What the HTTP layer calls, as Protocols: the real manager and package store satisfy them, and
so do the tests' in-memory fakes (tests/support/fakes.py), which serve an app that never touches
Ray."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from jobs_server.manager.archive.event_feed import EventFilter, FeedReset
from jobs_server.manager.archive.events import JobEvent
from jobs_server.manager.archive.sqlite import JobQuery
from jobs_server.manager.cluster.ray_cluster import ClusterInfo
from jobs_server.manager.job_manager import JobPage
from jobs_server.manager.logs import LogChunk
from jobs_server.manager.records import JobRecord, JobSpec, JobStatus
from jobs_server.manager.replica import ReplicaState
from jobs_server.manager.supervisor.drivers import RayDriver
from jobs_server.manager.supervisors import SupervisorOccupancy
from jobs_server.manager.tenancy import DEFAULT_TENANT


class JobManagerApi(Protocol):
    """The manager's public methods; each raises the domain errors of `jobs_server.errors`.

    `tenant` scopes a call to one tenant's jobs (None: every tenant's, an admin's view): a job
    of another tenant raises the same JobNotFoundError as an unknown id, so ids do not leak.
    """

    async def check_database(self) -> None:
        """DatabaseUnavailableError unless the archive's database answers a trivial read now."""
        ...

    async def replica_state(self) -> ReplicaState:
        """This replica: its id, database (and whether it answers now), live jobs and leases."""
        ...

    async def leader_url(self) -> str | None:
        """Where a job write (submit, stop, delete) goes: None to handle it here (this replica
        leads), else the leading replica's URL; LeaderUnavailableError while none leads."""
        ...

    async def leads_at(self, url: str) -> bool:
        """Whether the replica at `url` still leads (its lease live, by the database's clock):
        a follower waiting for that replica's answer to a forwarded write asks it."""
        ...

    async def submit_job(self, spec: JobSpec, *, tenant: str = DEFAULT_TENANT) -> JobRecord:
        """Record the job (PENDING) of `tenant` and start it, or queue it over a cap, or hold
        it until the jobs it depends on ended as it needs; DuplicateJobError if its id is taken
        (by any tenant), QueueFullError (nothing recorded) if the queue is full,
        JobNotFoundError (nothing recorded) for a job it depends on that does not exist or is
        another tenant's."""
        ...

    async def get_job(self, submission_id: str, *, tenant: str | None = None) -> JobRecord:
        """The job's record; JobNotFoundError if there is none."""
        ...

    async def dependencies_met(self, records: Sequence[JobRecord]) -> dict[str, dict[str, bool]]:
        """By job of `records` that depends on others (`depends_on`), whether each of those
        has met its condition now (one deleted, or of another tenant: False); jobs without
        dependencies are left out, at no cost."""
        ...

    async def list_jobs(
        self,
        *,
        query: JobQuery | None = None,
        after: str | None = None,
        limit: int | None = None,
        tenant: str | None = None,
    ) -> JobPage:
        """Jobs in submission order, filtered and paged; InvalidRequestError for an unknown
        `after`."""
        ...

    def stream_jobs(
        self,
        query: JobQuery | None = None,
        *,
        after: str | None = None,
        tenant: str | None = None,
    ) -> AsyncIterator[list[JobRecord]]:
        """Every job matching `query` after `after`, in batches (an async generator);
        InvalidRequestError for an unknown `after`, before the first batch."""
        ...

    async def count_by_status(self, *, tenant: str | None = None) -> dict[JobStatus, int]:
        """How many jobs of each status (the statuses with none may be left out)."""
        ...

    async def count_by_tenant(
        self, *, tenant: str | None = None
    ) -> dict[str, dict[JobStatus, int]]:
        """How many jobs of each status, by tenant (the metrics' `tenant` label)."""
        ...

    def queue_occupancy(self) -> dict[str, tuple[int, int]]:
        """(jobs queued, jobs holding a running slot) by tenant, of the tenants with either."""
        ...

    def supervisor_occupancy(self) -> SupervisorOccupancy:
        """How many jobs each shared supervisor holds (all tenants'), and how many have a
        supervisor of their own."""
        ...

    async def stop_job(
        self,
        submission_id: str,
        grace_period_s: float | None = None,
        *,
        tenant: str | None = None,
    ) -> bool:
        """Ask the job to stop; False if it had already ended."""
        ...

    async def delete_job(self, submission_id: str, *, tenant: str | None = None) -> None:
        """Forget an ended job and its log; JobNotTerminalError if it has not ended."""
        ...

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
        """The job's log chunks from `offset`; JobNotFoundError before any chunk is read. A
        follower at the end of the log gets an idle (empty) chunk every `idle_tick_s`, or, with
        `stop_when`, as soon as `stop_when()` turns true."""
        ...

    async def log_size(self, submission_id: str, *, tenant: str | None = None) -> int:
        """The job's log size in bytes now."""
        ...

    async def subscribe_events(
        self, *, after: int | None, event_filter: EventFilter, idle_tick_s: float | None = None
    ) -> AsyncGenerator[JobEvent | FeedReset | None, None]:
        """The job events after id `after` (from now when None) that pass `event_filter` (its
        `tenant` scopes them), in order and endless (see `EventFeed.subscribe`)."""
        ...


class PackageStoreApi(Protocol):
    """Uploaded `working_dir` and `py_modules` packages, by URI, each its tenant's."""

    async def ensure_exists(self, uri: str, *, tenant: str) -> None:
        """PackageNotFoundError unless `tenant` uploaded the package (and it has not expired)."""
        ...

    async def upload(self, uri: str, data: bytes, *, tenant: str) -> None:
        """Store a whole, checked package as `tenant`'s, or nothing; PackageExistsError if the
        tenant has other bytes under its name."""
        ...


class DriverFinderApi(Protocol):
    """Finds the Ray driver that a job's command started, if it started one."""

    async def find(self, records: Sequence[JobRecord]) -> dict[str, RayDriver]:
        """The Ray driver of each of `records` that has one, by submission id."""
        ...


@dataclass(frozen=True)
class Backend:
    """Everything the routes call. Given to `create_app`, it is used as it is: no Ray is joined,
    nothing is started or closed (its owner does that)."""

    manager: JobManagerApi
    package_store: PackageStoreApi
    cluster_info: ClusterInfo
    drivers: DriverFinderApi
