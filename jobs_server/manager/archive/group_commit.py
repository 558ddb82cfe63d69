"""Group commit for the archive: the writes that arrive while a transaction commits share the
next one, so a burst of submits costs one fsync per batch rather than one per job.

Each write is a function of the connection that runs inside the batch's transaction under a
savepoint of its own: a write that fails (a duplicate submission_id) is rolled back alone and
its caller gets its error; the others commit. A new job's row is not a function but a NewRow:
the new rows next to each other in a batch are added together (new_rows.py), each still
answered with its own outcome. Every caller is answered only after the commit that made its
write durable (synchronous=FULL), so an accepted job is still on disk before its POST is
answered. Writes commit in the order they were called, and their events are published in that
order after the commit.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import threading
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from jobs_server.manager.archive.events import JobEvent

logger = logging.getLogger(__name__)

# Batches the archive's thread commits in a row before other work queued behind it (a bulk
# import) gets a turn.
BATCHES_PER_TURN = 8
_CLOSE_POLL_S = 0.005

_W = TypeVar("_W")
# A write: (its result, the events it recorded), run in the batch's transaction.
Write = Callable[[sqlite3.Connection], tuple[Any, list[JobEvent]]]


@dataclass(frozen=True)
class NewRow:
    """A write that only adds a row (a new job): the new rows next to each other in a batch are
    added together, by the GroupCommit's `add_rows`."""

    row: Any


# Adds new rows together: each one's outcome, (True, (result, events)) or (False, its error);
# it raises only if the whole transaction failed.
AddRows = Callable[[sqlite3.Connection, list[Any]], list[tuple[bool, Any]]]


@dataclass
class _Pending:
    write: Write | NewRow
    answer: asyncio.Future[tuple[Any, list[JobEvent]]]


class GroupCommit:
    """Batches writes into transactions on the archive's thread (`run` runs a function there).

    The thread commits batch after batch without waiting for the event loop in between (a
    busy loop takes milliseconds to come back to a finished commit): it takes what was queued
    meanwhile, commits it, hands the answers to the loop, and goes on, for up to
    BATCHES_PER_TURN batches before it lets other work queued on the thread run."""

    def __init__(
        self,
        *,
        run: Callable[..., Awaitable[Any]],
        connection: Callable[[], sqlite3.Connection],
        after_each_batch: Callable[[sqlite3.Connection], None],
        add_rows: AddRows,
    ) -> None:
        self._run = run
        self._connection = connection
        self._after_each_batch = after_each_batch
        self._add_rows = add_rows
        # Shared with the archive's thread: under the lock.
        self._lock = threading.Lock()
        self._pending: list[_Pending] = []
        self._draining = False
        self._turns: set[asyncio.Future[None]] = set()

    async def write(self, write: Write | NewRow) -> tuple[Any, list[JobEvent]]:
        """Run `write` in the next transaction; its result and events once it is committed."""
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[tuple[Any, list[JobEvent]]] = loop.create_future()
        # Queued at once, in call order (no await before): the order of the rows is the order
        # of the calls.
        with self._lock:
            self._pending.append(_Pending(write, answer))
            start = not self._draining
            self._draining = True
        if start:
            self._take_turn(loop)
        return await answer

    async def close(self) -> None:
        """Wait for the writes already called to be committed."""
        while True:
            with self._lock:
                if not self._draining:
                    break
            await asyncio.sleep(_CLOSE_POLL_S)
        if self._turns:
            await asyncio.gather(*self._turns, return_exceptions=True)

    def _take_turn(self, loop: asyncio.AbstractEventLoop) -> None:
        turn = asyncio.ensure_future(self._run(self._drain, loop))
        self._turns.add(turn)
        turn.add_done_callback(self._turns.discard)

    def _drain(self, loop: asyncio.AbstractEventLoop) -> None:
        """On the archive's thread: commit what is queued, batch after batch."""
        for _ in range(BATCHES_PER_TURN):
            with self._lock:
                batch, self._pending = self._pending, []
                if not batch:
                    self._draining = False
                    return
            try:
                outcomes: list[tuple[bool, Any]] | BaseException = self._commit(
                    [item.write for item in batch]
                )
            except BaseException as error:  # the whole transaction failed: each caller's error
                outcomes = error
            loop.call_soon_threadsafe(answer_batch, [item.answer for item in batch], outcomes)
        # Other work waits on this thread too (a bulk import): let it in, then go on.
        loop.call_soon_threadsafe(self._take_turn, loop)

    def _commit(self, writes: list[Write | NewRow]) -> list[tuple[bool, Any]]:
        """One transaction (on the archive's thread). The writes run one after another; if one
        fails (a duplicate id: rare), the transaction is rolled back and run again with each
        write under a savepoint, so that the failing one is rolled back alone. Not a savepoint
        for every write: that is two more statements per write, and each statement is a moment
        where the commit may wait for the event loop's thread to give back the GIL."""
        try:
            return self._transaction(writes, savepoints=False)
        except _WriteFailed:
            return self._transaction(writes, savepoints=True)

    def _transaction(
        self, writes: list[Write | NewRow], *, savepoints: bool
    ) -> list[tuple[bool, Any]]:
        db = self._connection()
        outcomes: list[tuple[bool, Any]] = []
        db.execute("BEGIN IMMEDIATE")
        try:
            for write in new_rows_together(writes):
                if isinstance(write, list):  # new rows: add_rows answers for each
                    outcomes += self._add_rows(db, [new.row for new in write])
                    continue
                if savepoints:
                    db.execute("SAVEPOINT write")
                try:
                    outcomes.append((True, write(db)))
                except Exception as error:
                    if not db.in_transaction:
                        raise  # SQLite rolled the whole transaction back (a full disk)
                    if not savepoints:
                        raise _WriteFailed from error
                    db.execute("ROLLBACK TO write")
                    outcomes.append((False, error))
                if savepoints:
                    db.execute("RELEASE write")
            self._after_each_batch(db)
            db.execute("COMMIT")
        except BaseException:
            rollback(db)
            raise
        return outcomes


def answer_batch(
    answers: list[asyncio.Future[Any]], outcomes: list[tuple[bool, Any]] | BaseException
) -> None:
    """On the loop: answer a committed batch's callers, in call order (both stores)."""
    for index, answer in enumerate(answers):
        if answer.done():
            continue  # its caller went away; the write is committed all the same
        if isinstance(outcomes, BaseException):
            answer.set_exception(outcomes)
            continue
        ok, value = outcomes[index]
        if ok:
            answer.set_result(value)
        else:
            answer.set_exception(value)


def new_rows_together(writes: Sequence[_W | NewRow]) -> list[_W | list[NewRow]]:
    """The writes in order, each run of NewRows next to each other as one list (both stores
    add a batch's new rows together)."""
    grouped: list[_W | list[NewRow]] = []
    for write in writes:
        if not isinstance(write, NewRow):
            grouped.append(write)
        elif grouped and isinstance(grouped[-1], list):
            grouped[-1].append(write)
        else:
            grouped.append([write])
    return grouped


class _WriteFailed(Exception):
    """A write of a batch run without savepoints failed: the batch runs again with them."""


def rollback(db: sqlite3.Connection) -> None:
    """Roll back what is left of a failed transaction: SQLite has already rolled back one that
    met a full disk, and a second ROLLBACK would raise over the first error."""
    if db.in_transaction:
        db.execute("ROLLBACK")
