"""Submits whose archive insert is in doubt: the connection to the database broke after the
COMMIT was sent and before its answer came, so the job's row may be in the database, PENDING,
though the submit was answered 503 and the job was not handed over. Nothing else would run it
before the next server's recovery, and a retry of the submit finds its submission_id taken (409).

Each such run is kept here, in memory, and read back once the database answers again: a row of
that run, still PENDING, was accepted after all and goes to the queue as recovery puts it there
(the queue hands it a slot within its caps); no row, or another run's, and it is forgotten. A
server that stops meanwhile leaves the row to the next one's recovery, which queues it too.
An insert answered at the archive's timeout (PostgreSQL's --database-timeout-s) is not over:
its call, abandoned, may still commit (its COMMIT on its way: the cancel psycopg sends finds
the backend idle and is ignored), so "no row" is concluded only once the calls abandoned by
then have ended (`JobArchive.abandoned_calls_ended`); a row found before is queued at once.
On SQLite no insert is in doubt (a file on this disk: it commits or raises): nothing comes here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from jobs_server.errors import DatabaseUnavailableError
from jobs_server.manager.archive.interface import JobArchive
from jobs_server.manager.archive.outage import first_line, is_database_unavailable
from jobs_server.manager.records import JobRecord, JobStatus

logger = logging.getLogger(__name__)

# Between two read-backs while the database does not answer: what the pool takes to reconnect
# to a database that is back, so a job in doubt starts within about this long of its return.
READ_BACK_INTERVAL_S = 1.0
# A read-back that takes longer is given up and tried again (a database that hangs).
READ_BACK_TIMEOUT_S = 5.0

SUBMIT_IN_DOUBT_MESSAGE = (
    "The job database stopped answering while it recorded the job: it may have recorded it or "
    "not. If it did, the job runs once the database answers again, and a retry with the same "
    "submission_id answers 409 (already exists); if it did not, the retry submits it."
)


def insert_may_have_committed(error: BaseException) -> bool:
    """Whether an insert that raised `error` may still have committed: the database went away
    (or did not answer) while it ran. Any other error is the database's answer: nothing was."""
    return isinstance(error, DatabaseUnavailableError) or is_database_unavailable(error)


class InDoubtSubmits:
    """The runs whose insert is in doubt, and the task that reads them back."""

    def __init__(self, *, archive: JobArchive, on_recorded: Callable[[JobRecord], None]) -> None:
        self._archive = archive
        # Called with each run found recorded (its row as archived): queue it.
        self._on_recorded = on_recorded
        # By submission_id and run: a retry in doubt too is another run of the same id.
        self._runs: dict[tuple[str, str], JobRecord] = {}
        # The runs whose insert, if abandoned, has ended since: no row is then final.
        self._calls_ended: set[tuple[str, str]] = set()
        self._reading_back: asyncio.Task[None] | None = None
        self._closed = False

    def __len__(self) -> int:
        return len(self._runs)

    def add(self, record: JobRecord) -> None:
        """Keep the run `record`, whose insert is in doubt, until the database says."""
        if self._closed:
            return  # the next server's recovery finds its row, if there is one
        self._runs[record.submission_id, record.run_id] = record
        if self._reading_back is None:
            self._reading_back = asyncio.create_task(self._read_back(), name="in-doubt-submits")

    async def close(self) -> None:
        """Stop reading back (what is left is the next server's recovery's)."""
        self._closed = True
        task = self._reading_back
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _read_back(self) -> None:
        try:
            while self._runs:
                await self._read_back_each()
                if self._runs:
                    await asyncio.sleep(READ_BACK_INTERVAL_S)
        finally:
            self._reading_back = None

    async def _read_back_each(self) -> None:
        """Settle each run the database answers for; stop at the first it does not."""
        for key, record in list(self._runs.items()):
            try:
                row = await self._get(record)
                if row is None and key not in self._calls_ended:
                    # Its insert may still commit (abandoned at its timeout, on its way):
                    # absent only once the calls abandoned by now have ended.
                    await self._archive.abandoned_calls_ended()
                    self._calls_ended.add(key)
                    row = await self._get(record)
            except _NoAnswer:
                return
            del self._runs[key]
            self._calls_ended.discard(key)
            if row is None or row.run_id != record.run_id or row.status is not JobStatus.PENDING:
                # Not recorded (the retry may submit it), another run's, or stopped meanwhile.
                logger.info(
                    "job %s: its run %s in doubt is not in the archive as PENDING; forgotten",
                    record.submission_id,
                    record.run_id,
                )
                continue
            logger.info(
                "job %s: its submit was recorded though its answer was lost; queued",
                record.submission_id,
            )
            self._on_recorded(row)

    async def _get(self, record: JobRecord) -> JobRecord | None:
        """The job's row as archived; _NoAnswer if the database does not say."""
        try:
            return await asyncio.wait_for(
                self._archive.get(record.submission_id), READ_BACK_TIMEOUT_S
            )
        except TimeoutError:
            raise _NoAnswer from None
        except Exception as error:
            if not insert_may_have_committed(error):
                logger.warning(
                    "reading back job %s failed: %s", record.submission_id, first_line(error)
                )
            raise _NoAnswer from error


class _NoAnswer(Exception):
    """A read-back the database did not answer (or answered with an error): tried again."""
