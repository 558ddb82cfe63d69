"""The archive as the manager sees it: one interface, two stores (SQLite in the state dir,
the embedded default; PostgreSQL at `--database-url`), chosen by `create_archive`'s URL.

Both keep the same schema, answer the same queries with the same results, and write a job's
events in the same transaction as its change; their ids increase in commit order, which the
event stream (event_feed.py) relies on to resume "after id N" without a gap."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Protocol

from jobs_server.manager.archive.events import EventLog, JobEvent
from jobs_server.manager.archive.leases import Fence, LeaseStore
from jobs_server.manager.archive.outbox import DeliveryPlanner, Outbox, no_deliveries
from jobs_server.manager.archive.queries import JobQuery
from jobs_server.manager.records import JobRecord, JobStatus, RecordParser, parse_record

POSTGRES_URL_SCHEMES = ("postgresql://", "postgres://")


class JobArchive(EventLog, LeaseStore, Outbox, Protocol):
    """The job history: every accepted job, its final record, its numbered events; the
    leases of the replicas that share it (leases.py); the webhooks' deliveries its changes
    cause (outbox.py)."""

    parse_record: RecordParser

    async def open(self) -> None:
        """Connect, and migrate the schema to this server's version (refused if newer)."""
        ...

    async def close(self) -> None:
        """Wait for the writes already called, then disconnect."""
        ...

    async def abandoned_calls_ended(self) -> None:
        """Return once every call abandoned so far (its caller answered at the store's timeout,
        the call left to end on its own) has ended: a write among them committed or not. At
        once where no call is ever abandoned (SQLite)."""
        ...

    # -- writes: each answered once durable, its events in the same transaction --

    async def insert(self, record: JobRecord) -> None:
        """Record a new job; DuplicateJobError if its submission_id is in the archive."""
        ...

    async def insert_many(self, records: list[JobRecord]) -> None:
        """Record many new jobs in one transaction; all or none (DuplicateJobError)."""
        ...

    async def update(self, record: JobRecord, *, fence: Fence | None = None) -> JobRecord | None:
        """Store what the server learned of the run `record` (a terminal row never changes);
        the row as stored, None if that run is not in the archive. With a `fence`, only while
        its lease is still held so (LeaseLostError: nothing written)."""
        ...

    async def delete(self, submission_id: str, run_id: str | None = None) -> bool:
        """Forget a job (its run `run_id`, if given); whether there was one."""
        ...

    # -- reads --

    async def get(self, submission_id: str) -> JobRecord | None: ...

    async def count_by_status(self) -> dict[JobStatus, int]: ...

    async def count_by_tenant(
        self, tenant: str | None = None
    ) -> dict[str, dict[JobStatus, int]]: ...

    async def counts_and_unfinished_of(
        self, tenant: str | None, ids: frozenset[str]
    ) -> tuple[dict[str, dict[JobStatus, int]], list[JobRecord]]:
        """`count_by_tenant`, and the unfinished records of the jobs `ids`, from one snapshot."""
        ...

    async def was_deleted(self, submission_id: str, run_id: str) -> bool: ...

    async def unfinished(self) -> list[JobRecord]:
        """Every job not yet terminal, in submission order."""
        ...

    async def page(
        self, query: JobQuery, *, after: str | None = None, limit: int | None = None
    ) -> tuple[list[JobRecord], bool]: ...

    async def window(
        self, query: JobQuery, *, after_seq: int | None, limit: int
    ) -> tuple[list[JobRecord], bool, int | None]: ...

    async def seq_of(self, after: str, tenant: str | None) -> int: ...

    def stream(
        self, query: JobQuery, *, after: str | None = None
    ) -> AsyncIterator[list[JobRecord]]: ...

    async def expired_jobs(
        self,
        *,
        older_than_ms: int | None,
        keep_newest: int | None,
        limit: int,
        tenant: str | None = None,
    ) -> list[JobRecord]: ...


def is_postgres_url(url: str) -> bool:
    return url.startswith(POSTGRES_URL_SCHEMES)


def create_archive(
    database_url: str | None,
    state_dir: Path,
    *,
    on_events: Callable[[list[JobEvent]], None] | None = None,
    parse: RecordParser = parse_record,
    database_timeout_s: float | None = None,
    plan_deliveries: DeliveryPlanner = no_deliveries,
) -> JobArchive:
    """The archive of `database_url` (PostgreSQL), or without one SQLite at
    `<state_dir>/jobs.db`; not yet open (`await archive.open()`). `plan_deliveries` says
    where each webhook event a change is goes (outbox.py)."""
    if database_url is None:
        from jobs_server.manager.archive.sqlite import Archive, archive_path

        return Archive(
            archive_path(state_dir),
            on_events=on_events,
            parse=parse,
            plan_deliveries=plan_deliveries,
        )
    if not is_postgres_url(database_url):
        raise ValueError("the database URL must start with postgresql:// (or postgres://)")
    # Imported here: psycopg is loaded only by a server that uses it.
    from jobs_server.manager.archive.postgres import PostgresArchive

    if database_timeout_s is None:
        return PostgresArchive(
            database_url, on_events=on_events, parse=parse, plan_deliveries=plan_deliveries
        )
    return PostgresArchive(
        database_url,
        on_events=on_events,
        parse=parse,
        timeout_s=database_timeout_s,
        plan_deliveries=plan_deliveries,
    )
