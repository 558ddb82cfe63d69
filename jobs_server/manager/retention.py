"""Retention: the oldest finished jobs are deleted in the background (record, KV entry, log),
so that the history on disk stays within an age and a count. A live job is never deleted."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from jobs_server.errors import JobNotFoundError, JobNotTerminalError
from jobs_server.manager.records import JobRecord, now_ms

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


class ExpiredJobs(Protocol):
    """What retention reads: the archive."""

    async def expired_jobs(
        self, *, older_than_ms: int | None, keep_newest: int | None, limit: int
    ) -> list[JobRecord]: ...


class Retention:
    """A background task that sweeps every `policy.interval_s`; started by its owner (the
    manager), cancelled and awaited by it on close.

    `delete_job(record)` forgets one finished job, that run of it only (a job deleted and
    submitted again under the same id in the meantime is not touched); `on_deleted(count)` is
    told how many each sweep deleted (the metric).
    """

    def __init__(
        self,
        *,
        archive: ExpiredJobs,
        delete_job: Callable[[JobRecord], Awaitable[bool]],
        policy: RetentionPolicy,
        on_deleted: Callable[[int], None] | None = None,
    ) -> None:
        self._archive = archive
        self._delete_job = delete_job
        self._policy = policy
        self._on_deleted = on_deleted
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
        deleted = 0
        while True:
            expired = await self._archive.expired_jobs(
                older_than_ms=now_ms() - round(self._policy.max_age_s * 1000),
                keep_newest=self._policy.max_jobs,
                limit=RETENTION_BATCH_JOBS,
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
