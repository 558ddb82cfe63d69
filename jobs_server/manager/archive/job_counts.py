"""How many jobs of each status, by tenant: what `/metrics` shows, counted without reading a
finished record."""

from __future__ import annotations

import logging

from jobs_server.manager.archive.interface import JobArchive
from jobs_server.manager.live.store import JobStore
from jobs_server.manager.records import JobRecord, JobStatus

logger = logging.getLogger(__name__)

Counts = dict[str, dict[JobStatus, int]]


async def count_jobs_by_tenant(
    archive: JobArchive, store: JobStore, tenant: str | None, *, live_ids: frozenset[str]
) -> Counts:
    """The archive's counts (of `tenant` only, if given), with the live jobs as the KV has them
    now (the archive learns a status a moment after the KV: this is what a list would show).
    Only the live jobs' records are read (those handed to a supervisor, and the ends a full
    disk keeps from the archive): a queued job is PENDING in both, and a deep queue holds
    thousands."""
    counts, unfinished = await archive.counts_and_unfinished_of(tenant, live_ids)
    if not unfinished:
        return counts
    try:
        current = await store.current(unfinished)
    except Exception:
        logger.warning("reading live jobs from the KV failed", exc_info=True)
        return counts
    for before in unfinished:
        now = current.get(before.submission_id)
        if now is None:
            # Ended, archived and forgotten in the KV since the counts were read: its row is
            # what it is now (None: deleted since, or the id is another run's: not counted).
            again = await archive.get(before.submission_id)
            now = again if again is not None and again.run_id == before.run_id else None
        if now is None or before.status is not now.status:
            _move(counts, before, now)
    return counts


def _move(counts: Counts, before: JobRecord, now: JobRecord | None) -> None:
    """Count the job by its status `now` (None: not at all) rather than `before`."""
    of_tenant = counts.setdefault(before.tenant, {})
    left = of_tenant.get(before.status, 0) - 1
    # As the archive's own counts: a status no job has is not there (not a 0).
    if left:
        of_tenant[before.status] = left
    else:
        of_tenant.pop(before.status, None)
    if now is not None:
        of_tenant[now.status] = of_tenant.get(now.status, 0) + 1
    elif not of_tenant:
        del counts[before.tenant]


def total_by_status(counts: Counts) -> dict[JobStatus, int]:
    """The counts of every tenant together."""
    totals: dict[JobStatus, int] = {}
    for of_tenant in counts.values():
        for status, count in of_tenant.items():
            totals[status] = totals.get(status, 0) + count
    return totals
