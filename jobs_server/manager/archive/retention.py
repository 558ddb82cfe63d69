"""Retention: the oldest finished jobs are deleted in the background (record, KV entry, log),
so that the history on disk stays within an age and a count. A live job is never deleted.

Each tenant's history is kept on its own: a tenant keeps its newest `max_jobs` jobs and its
finished jobs younger than `max_age_s`, its own caps (the tokens file's `[tenants.X]`) within
the server's, which are their ceiling. The server's count holds for all tenants together, and
is shared max-min fairly: a tenant with fewer jobs than an equal share keeps them all, and the
tenants over it are cut to one level. So one tenant's flood deletes its own oldest jobs, never
the history of a tenant that stays within its share.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from jobs_server.errors import JobNotFoundError, JobNotTerminalError
from jobs_server.manager.records import JobRecord, JobStatus, now_ms
from jobs_server.manager.tenancy import NO_LIMITS, TenantLimits

logger = logging.getLogger(__name__)

# Jobs read and deleted per batch of a sweep: one indexed query each, bounded memory.
RETENTION_BATCH_JOBS = 500


@dataclass(frozen=True)
class RetentionPolicy:
    """Keep finished jobs at most `max_age_s` after they ended, and at most the newest
    `max_jobs` jobs (live ones count among them); sweep every `interval_s`."""

    max_age_s: float
    max_jobs: int
    interval_s: float


@dataclass(frozen=True)
class TenantSweep:
    """What one sweep deletes of one tenant's history: its finished jobs that ended before
    `older_than_ms`, and those beyond its newest `keep_newest` jobs."""

    tenant: str
    older_than_ms: int
    keep_newest: int


class ExpiredJobs(Protocol):
    """What retention reads: the archive."""

    async def count_by_tenant(
        self, tenant: str | None = None
    ) -> dict[str, dict[JobStatus, int]]: ...

    async def expired_jobs(
        self,
        *,
        older_than_ms: int | None,
        keep_newest: int | None,
        limit: int,
        tenant: str | None = None,
    ) -> list[JobRecord]: ...


def fair_shares(jobs_by_tenant: Mapping[str, int], total: int) -> dict[str, int]:
    """How many jobs each tenant keeps so that together they keep at most `total` (or all they
    have, if that is less): max-min fair, so a tenant below the level all share keeps all of
    its jobs, and the tenants above it are cut to the level (the few left over by an uneven
    division go one each to the first tenants by name)."""
    if sum(jobs_by_tenant.values()) <= total:
        return dict(jobs_by_tenant)
    low, high = 0, max(jobs_by_tenant.values())
    while low < high:  # the highest level all tenants' jobs up to it fit under `total`
        middle = (low + high + 1) // 2
        if sum(min(count, middle) for count in jobs_by_tenant.values()) <= total:
            low = middle
        else:
            high = middle - 1
    shares = {tenant: min(count, low) for tenant, count in jobs_by_tenant.items()}
    spare = total - sum(shares.values())
    for tenant in sorted(tenant for tenant, count in jobs_by_tenant.items() if count > low):
        if spare == 0:
            break
        shares[tenant] += 1
        spare -= 1
    return shares


def plan_sweep(
    jobs_by_tenant: Mapping[str, int],
    policy: RetentionPolicy,
    tenant_limits: Callable[[str], TenantLimits],
    now: int,
) -> list[TenantSweep]:
    """What a sweep deletes of each tenant's history (the tenants of `jobs_by_tenant`, their
    jobs counted live ones too): its own caps within the server's, and its fair share of the
    server's count."""
    own_caps = {}
    ages_s = {}
    for tenant in jobs_by_tenant:
        limits = tenant_limits(tenant)
        own_caps[tenant] = (
            policy.max_jobs if limits.max_jobs is None else min(limits.max_jobs, policy.max_jobs)
        )
        ages_s[tenant] = (
            policy.max_age_s
            if limits.max_age_s is None
            else min(limits.max_age_s, policy.max_age_s)
        )
    within_own = {tenant: min(count, own_caps[tenant]) for tenant, count in jobs_by_tenant.items()}
    shares = fair_shares(within_own, policy.max_jobs)
    return [
        TenantSweep(
            tenant=tenant,
            older_than_ms=now - round(ages_s[tenant] * 1000),
            # A tenant within its share keeps up to its own cap (jobs come meanwhile).
            keep_newest=own_caps[tenant]
            if shares[tenant] == within_own[tenant]
            else shares[tenant],
        )
        for tenant in sorted(jobs_by_tenant)
    ]


class Retention:
    """A background task that sweeps every `policy.interval_s`; started by its owner (the
    manager), cancelled and awaited by it on close.

    `delete_job(record)` forgets one finished job, that run of it only (a job deleted and
    submitted again under the same id in the meantime is not touched); `on_deleted(count)` is
    told how many each sweep deleted (the metric); `tenant_limits(tenant)` are a tenant's caps
    as they are now (read at each sweep: a tokens file re-read on SIGHUP applies at the next).
    """

    def __init__(
        self,
        *,
        archive: ExpiredJobs,
        delete_job: Callable[[JobRecord], Awaitable[bool]],
        policy: RetentionPolicy,
        on_deleted: Callable[[int], None] | None = None,
        tenant_limits: Callable[[str], TenantLimits] = lambda _: NO_LIMITS,
    ) -> None:
        self._archive = archive
        self._delete_job = delete_job
        self._policy = policy
        self._on_deleted = on_deleted
        self._tenant_limits = tenant_limits
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._sweep_forever(), name="retention")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def sweep(self) -> int:
        """Delete every job the policy expires now; how many were deleted."""
        counts = await self._archive.count_by_tenant()
        jobs_by_tenant = {tenant: sum(by_status.values()) for tenant, by_status in counts.items()}
        deleted = 0
        for tenant_sweep in plan_sweep(jobs_by_tenant, self._policy, self._tenant_limits, now_ms()):
            deleted += await self._sweep_tenant(tenant_sweep)
        return deleted

    async def _sweep_tenant(self, tenant_sweep: TenantSweep) -> int:
        deleted = 0
        while True:
            expired = await self._archive.expired_jobs(
                older_than_ms=tenant_sweep.older_than_ms,
                keep_newest=tenant_sweep.keep_newest,
                limit=RETENTION_BATCH_JOBS,
                tenant=tenant_sweep.tenant,
            )
            deleted_in_batch = 0
            for record in expired:
                if await self._delete_one(record):
                    deleted_in_batch += 1
            deleted += deleted_in_batch
            if deleted_in_batch and self._on_deleted is not None:
                self._on_deleted(deleted_in_batch)
            # A batch that deleted nothing would come back the same: stop until the next sweep.
            if len(expired) < RETENTION_BATCH_JOBS or deleted_in_batch == 0:
                return deleted

    async def _delete_one(self, record: JobRecord) -> bool:
        try:
            return await self._delete_job(record)
        except (JobNotFoundError, JobNotTerminalError):
            return False  # deleted by a client meanwhile, or another run took its id

    async def _sweep_forever(self) -> None:
        while True:
            try:
                deleted = await self.sweep()
            except Exception:
                # The archive or the GCS failed this time (a full disk, a restarting GCS):
                # the next sweep tries again.
                logger.exception("retention sweep failed")
            else:
                if deleted:
                    logger.info("retention deleted %d finished jobs", deleted)
            await asyncio.sleep(self._policy.interval_s)
