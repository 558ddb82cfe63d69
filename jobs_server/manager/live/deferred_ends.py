"""Ends the server decides itself (a stop before the start, a hand-over that Ray refused), archived
now or, when the archive's disk is full or its database away (outage.py), as soon as it takes
them.

Such an end is in the KV before it is archived (the caller wrote it there): a client reads it at
once (a live row is overlaid with what the KV says), and a server that stops before the disk
takes it leaves it to the next one, whose recovery archives what the KV holds. The KV forgets
the run only once the archive has its end (`JobHistory.forget`), so nothing is lost either way.
"""

from __future__ import annotations

import asyncio
import logging

from jobs_server.disk_guard import is_disk_full
from jobs_server.manager.archive.outage import is_database_unavailable
from jobs_server.manager.live.history import RETRY_INITIAL_S, JobHistory
from jobs_server.manager.records import JobRecord

logger = logging.getLogger(__name__)


class DeferredEnds:
    """Archives ends, retrying those the full disk refused; owns the retrying tasks."""

    def __init__(self, history: JobHistory) -> None:
        self._history = history
        self._tasks: set[asyncio.Task[None]] = set()
        # The jobs whose end waits for the disk (the archive still has them live).
        self._waiting: set[str] = set()

    def waiting_ids(self) -> frozenset[str]:
        return frozenset(self._waiting)

    async def archive(self, ended: JobRecord) -> bool:
        """Archive the end `ended` (already in the KV): True if it is archived now, False if
        the disk is full or the database away (it is archived, and forgotten in the KV, once
        the archive takes it). Any other error is raised."""
        try:
            await self._history.archive_end(ended)
        except Exception as error:
            full = is_disk_full(error)
            if not full and not is_database_unavailable(error):
                raise
            logger.warning(
                "%s: the end of job %s (%s) is archived once it takes it",
                "the disk is full" if full else "the database does not answer",
                ended.submission_id,
                ended.status,
            )
            task = asyncio.create_task(self._archive_later(ended))
            self._tasks.add(task)
            self._waiting.add(ended.submission_id)
            task.add_done_callback(self._tasks.discard)
            task.add_done_callback(lambda _: self._waiting.discard(ended.submission_id))
            return False
        return True

    async def _archive_later(self, ended: JobRecord) -> None:
        await asyncio.sleep(RETRY_INITIAL_S)  # the archive refused it a moment ago
        archived = await self._history.learn_end(ended, ended=ended)
        logger.info("the end of job %s is archived", ended.submission_id)
        await self._history.forget(ended, archived)

    async def close(self) -> None:
        """Stop retrying: what is not archived yet stays in the KV for the next server."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
