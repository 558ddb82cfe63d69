"""Group commit for the archive: the writes that arrive while a transaction commits share the
next one, so a burst of submits costs one fsync per batch rather than one per job.

Each write is a function of the connection that runs inside the batch's transaction under a
savepoint of its own: a write that fails (a duplicate submission_id) is rolled back alone and
its caller gets its error; the others commit. Every caller is answered only after the commit
that made its write durable (synchronous=FULL), so an accepted job is still on disk before its
POST is answered. Writes commit in the order they were called, and their events are published
in that order after the commit.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from jobs_server.manager.events import JobEvent

logger = logging.getLogger(__name__)

# A write: (its result, the events it recorded), run in the batch's transaction.
Write = Callable[[sqlite3.Connection], tuple[Any, list[JobEvent]]]


@dataclass
class _Pending:
    write: Write
    answer: asyncio.Future[tuple[Any, list[JobEvent]]]


class GroupCommit:
    """Batches writes into transactions on the archive's thread (`run` runs a function there)."""

    def __init__(
        self,
        *,
        run: Callable[..., Awaitable[Any]],
        connection: Callable[[], sqlite3.Connection],
        after_each_batch: Callable[[sqlite3.Connection], None],
    ) -> None:
        self._run = run
        self._connection = connection
        self._after_each_batch = after_each_batch
        self._pending: list[_Pending] = []
        self._committer: asyncio.Task[None] | None = None

    async def write(self, write: Write) -> tuple[Any, list[JobEvent]]:
        """Run `write` in the next transaction; its result and events once it is committed."""
        answer: asyncio.Future[tuple[Any, list[JobEvent]]] = (
            asyncio.get_running_loop().create_future()
        )
        # Queued at once, in call order (no await before): the order of the rows is the order
        # of the calls.
        self._pending.append(_Pending(write, answer))
        if self._committer is None:
            self._committer = asyncio.create_task(self._commit_all(), name="archive-commit")
        return await answer

    async def close(self) -> None:
        """Wait for the writes already called to be committed."""
        if self._committer is not None:
            await asyncio.shield(self._committer)

    async def _commit_all(self) -> None:
        try:
            while self._pending:
                batch, self._pending = self._pending, []
                try:
                    outcomes = await self._run(self._commit, [item.write for item in batch])
                except BaseException as error:
                    for item in batch:
                        if not item.answer.done():
                            item.answer.set_exception(error)
                    if not isinstance(error, Exception):
                        raise
                    continue
                for item, (ok, value) in zip(batch, outcomes, strict=True):
                    if item.answer.done():
                        continue  # its caller went away; the write is committed all the same
                    if ok:
                        item.answer.set_result(value)
                    else:
                        item.answer.set_exception(value)
        finally:
            self._committer = None

    def _commit(self, writes: list[Write]) -> list[tuple[bool, Any]]:
        """One transaction (on the archive's thread): each write under a savepoint."""
        db = self._connection()
        outcomes: list[tuple[bool, Any]] = []
        db.execute("BEGIN IMMEDIATE")
        try:
            for write in writes:
                db.execute("SAVEPOINT write")
                try:
                    outcomes.append((True, write(db)))
                except Exception as error:
                    if not db.in_transaction:
                        raise  # SQLite rolled the whole transaction back (a full disk)
                    db.execute("ROLLBACK TO write")
                    outcomes.append((False, error))
                db.execute("RELEASE write")
            self._after_each_batch(db)
            db.execute("COMMIT")
        except BaseException:
            rollback(db)
            raise
        return outcomes


def rollback(db: sqlite3.Connection) -> None:
    """Roll back what is left of a failed transaction: SQLite has already rolled back one that
    met a full disk, and a second ROLLBACK would raise over the first error."""
    if db.in_transaction:
        db.execute("ROLLBACK")
