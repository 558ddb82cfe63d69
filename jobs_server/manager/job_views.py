"""What a job is now, as a client sees it: its archived row, for a live job overlaid with what
the KV says, and for a pending one the wait it is in (the queue, the jobs it depends on, or
resources). Scoped by tenant: another tenant's job is not found, as an unknown id is.

A list filtered by status keeps the jobs by the status they have now, the one their GET shows:
the archive learns a live job's status a moment after the KV, so the live jobs are read
whatever their archived status, and kept if what they are now matches."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator, Callable, Iterable

from jobs_server.errors import JobNotFoundError
from jobs_server.manager.archive.interface import JobArchive
from jobs_server.manager.archive.sqlite import JobQuery
from jobs_server.manager.cluster.resources import ClusterResources
from jobs_server.manager.live.store import JobStore
from jobs_server.manager.queue.admission import JobQueue
from jobs_server.manager.queue.dependency_waits import DependencyWaits, needs_wait
from jobs_server.manager.records import JobRecord, JobStatus

logger = logging.getLogger(__name__)


class JobViews:
    """Reads the jobs of one server as they are now (JobManager's gets and lists)."""

    def __init__(
        self,
        *,
        archive: JobArchive,
        store: JobStore,
        queue: JobQueue,
        cluster_resources: ClusterResources,
        live_ids: Callable[[], frozenset[str]] = frozenset,
        waits: DependencyWaits | None = None,
    ) -> None:
        self._archive = archive
        self._store = store
        self._queue = queue
        # The leader's waiting jobs (a follower's are empty: their archived message stands).
        self._waits = DependencyWaits() if waits is None else waits
        self._cluster_resources = cluster_resources
        # The jobs whose archived status may lag the KV's (watched ones, ends the disk refused).
        self._live_ids = live_ids

    async def record(self, submission_id: str, tenant: str | None = None) -> JobRecord:
        """The job as it is: its archived row, or for a live one what the KV says now. A job
        of another tenant than `tenant` (None: any) is not found, as an unknown id is."""
        archived = await self._archive.get(submission_id)
        if archived is None or not in_scope(archived, tenant):
            raise JobNotFoundError(submission_id)
        if not self._in_kv(archived):
            return archived
        (record,) = await self._now([archived])
        if record is None:  # deleted since, or submitted again: the row as it is now
            record = await self._archive.get(submission_id)
        if record is None or not in_scope(record, tenant):
            raise JobNotFoundError(submission_id)
        return record

    async def page(
        self, query: JobQuery, *, after: str | None, limit: int | None
    ) -> tuple[list[JobRecord], bool]:
        """Up to `limit` jobs matching `query` as they are now, after the job `after`, and
        whether more may follow (UnknownCursorError for an unknown `after`)."""
        query, wanted = self._by_status_now(query)
        if wanted is None or limit is None:
            rows, more = await self._archive.page(query, after=after, limit=limit)
            return _keep(await self.as_they_are(rows, query.tenant), wanted), more
        # Windows of rows until the page is full: a row is dropped when its job is no longer
        # what its row says (it moved on since), which a busy server's live jobs do by the
        # dozen between the two reads.
        position = None if after is None else await self._archive.seq_of(after, query.tenant)
        # One more than the page: a full first window also tells whether more follow.
        window = limit + 1 + len(query.live_ids)
        records: list[JobRecord] = []
        while True:
            rows, more, position = await self._archive.window(
                query, after_seq=position, limit=window
            )
            records += _keep(await self.as_they_are(rows, query.tenant), wanted)
            if len(records) > limit:
                return records[:limit], True
            if not more:
                return records, False

    async def stream(self, query: JobQuery, *, after: str | None) -> AsyncIterator[list[JobRecord]]:
        """Every job matching `query` as it is now, after the job `after`, in batches."""
        query, wanted = self._by_status_now(query)
        async for batch in self._archive.stream(query, after=after):
            records = _keep(await self.as_they_are(batch, query.tenant), wanted)
            if records:
                yield records

    def _by_status_now(self, query: JobQuery) -> tuple[JobQuery, frozenset[JobStatus] | None]:
        """The query that also reads the live jobs, and the statuses to keep them by."""
        if query.statuses is None:
            return query, None
        return dataclasses.replace(query, live_ids=self._live_ids()), query.statuses

    async def as_they_are(
        self, records: list[JobRecord], tenant: str | None = None
    ) -> list[JobRecord]:
        """Live rows overlaid with what the KV says now (the archive learns a status a moment
        after the KV): one KV round trip per batch, none for a batch of finished jobs. Their
        messages as a reader who sees `tenant`'s jobs (None: every tenant's) is told them."""
        if all(record.status.is_terminal() for record in records):
            return records
        live = [record for record in records if self._in_kv(record)]
        now: list[JobRecord | None]
        try:
            now = await self._now(records, live)
        except Exception:
            logger.warning("reading live jobs from the KV failed", exc_info=True)
            now = list(records)
        return [
            await self.with_wait_message(record, tenant) for record in now if record is not None
        ]

    def _in_kv(self, row: JobRecord) -> bool:
        """Whether the KV may know more of the job than its row: not of an ended one, nor of
        one queued or waiting for others (never handed over yet)."""
        return not (row.status.is_terminal() or row.submission_id in self._queue or needs_wait(row))

    async def statuses_now(
        self, submission_ids: Iterable[str], tenant: str | None
    ) -> dict[str, JobStatus | None]:
        """The status now of each job (of `tenant`; None: any), None for a job that is not
        there (or is another tenant's): the archive's rows, the live ones' from the KV in one
        round trip."""
        ids = list(dict.fromkeys(submission_ids))
        rows = await asyncio.gather(*(self._archive.get(job_id) for job_id in ids))
        found = [row for row in rows if row is not None and in_scope(row, tenant)]
        live = [row for row in found if self._in_kv(row)]
        now = await self._now(found, live) if live else list(found)
        statuses: dict[str, JobStatus | None] = dict.fromkeys(ids)
        for record in now:
            if record is not None and in_scope(record, tenant):
                statuses[record.submission_id] = record.status
        return statuses

    async def _now(
        self, rows: list[JobRecord], live: list[JobRecord] | None = None
    ) -> list[JobRecord | None]:
        """Each of the archive's `rows` as it is now: the KV's state of the `live` ones
        (default: all), over the row. A run the KV no longer has ended and was forgotten after
        its row was read: it is read again from the archive, which recorded its end before the
        KV forgot it (else a read could say RUNNING after it said STOPPED). None: the run is
        gone from the archive too (deleted since; the id may be another run's now, even
        another tenant's)."""
        live = rows if live is None else live
        current = await self._store.current(live) if live else {}
        forgotten = {record.submission_id for record in live} - current.keys()
        now: list[JobRecord | None] = []
        for row in rows:
            if row.submission_id not in forgotten:
                now.append(current.get(row.submission_id, row))
                continue
            again = await self._archive.get(row.submission_id)
            now.append(again if again is not None and again.run_id == row.run_id else None)
        return now

    async def with_wait_message(self, record: JobRecord, tenant: str | None = None) -> JobRecord:
        """A queued job says its place and the cap it waits behind; a pending job handed over
        that waits for resources says which, and what the cluster has. A reader who sees only
        `tenant`'s jobs (None: an admin) is told its own tenant's numbers only."""
        if record.status is not JobStatus.PENDING:
            return record
        if needs_wait(record):
            waiting_for = self._waits.describe(record.submission_id)
            return record if waiting_for is None else record.with_changes(message=waiting_for)
        queued = self._queue.describe(record.submission_id, own_tenant_only=tenant is not None)
        if queued is not None:
            return record.with_changes(message=queued)
        waiting_for = await self._cluster_resources.describe_wait(record.spec.requested_resources())
        return record if waiting_for is None else record.with_changes(message=waiting_for)


def _keep(records: list[JobRecord], statuses: frozenset[JobStatus] | None) -> list[JobRecord]:
    return records if statuses is None else [r for r in records if r.status in statuses]


def in_scope(record: JobRecord, tenant: str | None) -> bool:
    """Whether a caller that sees `tenant`'s jobs (None: every tenant's) may see `record`."""
    return tenant is None or record.tenant == tenant


def scoped(query: JobQuery | None, tenant: str | None) -> JobQuery:
    """`query` narrowed to `tenant`'s jobs (None: as it is)."""
    query = query or JobQuery()
    return query if tenant is None else dataclasses.replace(query, tenant=tenant)
