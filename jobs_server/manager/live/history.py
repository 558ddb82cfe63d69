"""What the server learns of a job's run (it started, it ended) goes to the archive; once the
end is archived, the KV forgets the run, so the KV holds only live jobs.

The end key's put-if-absent still decides who ended a run (server or supervisor); the archive
copies whichever end won, and a terminal row never changes again (the first terminal wins
there too), so a writer that is late cannot rewrite the history.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from jobs_server.disk_guard import is_disk_full
from jobs_server.errors import JobNotFoundError
from jobs_server.manager.archive.interface import JobArchive
from jobs_server.manager.archive.outage import first_line, is_database_unavailable
from jobs_server.manager.live.store import JobStore
from jobs_server.manager.records import JobRecord

logger = logging.getLogger(__name__)

# After an error of the KV or the disk, try again after this long, doubled up to the maximum.
RETRY_INITIAL_S = 0.5
RETRY_MAX_S = 10.0


class JobHistory:
    """Copies what the KV says of a run into the archive."""

    def __init__(self, *, store: JobStore, archive: JobArchive) -> None:
        self._store = store
        self._archive = archive
        # Per id: removing a run from the KV checks the archive, then deletes; a delete of the
        # job and its resubmission must not come in between (the KV cannot delete if-equal).
        self._locks: dict[str, asyncio.Lock] = {}

    @contextlib.asynccontextmanager
    async def exclusive(self, submission_id: str) -> AsyncIterator[None]:
        """No other removal of this id's KV entries meanwhile."""
        lock = self._locks.setdefault(submission_id, asyncio.Lock())
        try:
            async with lock:
                yield
        finally:
            if not lock.locked() and self._locks.get(submission_id) is lock:
                del self._locks[submission_id]

    async def learn(self, record: JobRecord) -> JobRecord | None:
        """Archive the run `record` as the KV has it now; the record as archived (None: the run
        is gone from the KV or the archive)."""
        try:
            current = await self._store.get(record.submission_id, record.run_id)
        except JobNotFoundError:
            return None
        if current.run_id != record.run_id:
            return None
        return await self._archive.update(current)

    async def learn_started(self, record: JobRecord, *, written: JobRecord | None = None) -> None:
        """The command began (RUNNING): archive it, best effort (its end will be archived in
        any case, and the end is what matters). `written`: the start as its supervisor wrote
        it, if it said (archived without reading the KV)."""
        await self._learn_running(record, written, "the start")

    async def learn_retry(self, record: JobRecord, *, written: JobRecord) -> None:
        """An attempt ended and another follows (the job RUNNING still): archive the record as
        its supervisor wrote it then (no read of the KV: queued for the archive at once, so
        before the run's end), best effort as a start is."""
        await self._learn_running(record, written, "a retry")

    async def _learn_running(self, record: JobRecord, written: JobRecord | None, what: str) -> None:
        try:
            if written is not None and written.run_id == record.run_id:
                await self._archive.update(written)
            else:
                await self.learn(record)
        except Exception as error:
            away = is_database_unavailable(error)
            logger.warning(
                "archiving %s of job %s failed%s",
                what,
                record.submission_id,
                f": the database does not answer ({first_line(error)})" if away else "",
                exc_info=not away,
            )

    async def learn_end(
        self, record: JobRecord, *, ended: JobRecord | None = None
    ) -> JobRecord | None:
        """The run has ended: archive its end, retrying until the KV and the disk take it.
        `ended`: the end as its supervisor returned it (the one that won in the KV), if it
        did; it is archived without reading the KV again."""
        if ended is not None and (ended.run_id != record.run_id or not ended.status.is_terminal()):
            ended = None  # not this run's end: the KV says what became of the run
        delay_s = RETRY_INITIAL_S
        while True:
            try:
                if ended is not None:
                    return await self._archive.update(ended)
                return await self.learn(record)
            except Exception as error:
                # A full disk or a database away is said in a line (it may last); anything
                # else with its traceback.
                reason = ""
                if is_disk_full(error):
                    reason = ": the disk is full"
                elif is_database_unavailable(error):
                    reason = f": the database does not answer ({first_line(error)})"
                logger.warning(
                    "archiving the end of job %s failed%s; trying again in %.1f s",
                    record.submission_id,
                    reason,
                    delay_s,
                    exc_info=not reason,
                )
            await asyncio.sleep(delay_s)
            delay_s = min(delay_s * 2, RETRY_MAX_S)

    async def archive_end(self, ended: JobRecord) -> JobRecord | None:
        """Archive a terminal record the caller has just written to the KV (or read)."""
        return await self._archive.update(ended)

    async def forget(self, record: JobRecord, archived: JobRecord | None = None) -> None:
        """Drop the ended run from the KV once its end is archived (best effort: what is left
        is forgotten by the next server's recovery). `archived`: what the caller has just
        archived of the run, if it knows (saves reading it back)."""
        stored = archived
        if stored is None or stored.run_id != record.run_id:
            stored = await self._archive.get(record.submission_id)
        if (
            stored is not None
            and stored.run_id == record.run_id
            and not stored.status.is_terminal()
        ):
            return  # not archived as ended: the KV still holds the truth
        try:
            await self._store.delete(record)
        except Exception:
            logger.warning(
                "forgetting job %s in the KV failed", record.submission_id, exc_info=True
            )
