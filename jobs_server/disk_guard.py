"""The disk guard: no new work while the disk that holds the jobs' history and logs is nearly full.

Running jobs go on (their logs are appended to as long as the disk has room); what is refused is
what would add to the disk: a submit, a package upload. A write that fails anyway because the
disk filled up between the check and the write (SQLite's SQLITE_FULL, PostgreSQL's SQLSTATE
53100 `disk_full` on the database's disk, an OSError ENOSPC) is the same refusal
(`storage_errors_refused`), never a 500; the database rolls the transaction back, so the
archive stays whole.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import os
import sqlite3
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from jobs_server.errors import InsufficientStorageError

# A measurement that found at least this much more than the threshold free is reused for up to
# REUSE_S, and up to twice that while a new one is taken: nothing comes near writing that much
# in that time, and a write that finds the disk full all the same is refused as well
# (`storage_errors_refused`). Closer to the threshold, every check measures.
REUSE_HEADROOM_BYTES = 256 * 1024 * 1024
REUSE_S = 0.5
# The errno values that say "the disk (or the user's quota on it) is full".
_DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
# PostgreSQL's SQLSTATE for it (psycopg.errors.DiskFull), read from the error's `sqlstate`:
# psycopg is not imported by a server on SQLite.
POSTGRES_DISK_FULL_SQLSTATE = "53100"


@dataclass(frozen=True)
class DiskSpace:
    """The free space of the fullest of the guarded filesystems, and the threshold."""

    free_bytes: int
    min_free_bytes: int

    @property
    def is_low(self) -> bool:
        return self.free_bytes < self.min_free_bytes


class DiskGuard:
    """Measures the free space of the filesystems of `directories` (each counted once)."""

    def __init__(
        self,
        directories: Sequence[Path],
        min_free_bytes: int,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._directories = tuple(directories)
        self._min_free_bytes = min_free_bytes
        self._clock = clock
        self._measuring: asyncio.Task[int] | None = None
        self._last: tuple[float, int] | None = None  # (when, free bytes)

    async def space(self) -> DiskSpace:
        """The space now (statvfs is a syscall that can block on a network filesystem: off
        the event loop). Callers that arrive while a measurement runs share it: under a burst
        of submits, one thread hop serves them all, and none waits for a value older than
        its own arrival by more than one measurement. A measurement far above the threshold
        is reused for a moment (see REUSE_HEADROOM_BYTES): a thread hop per submit costs
        milliseconds on a busy server."""
        age_s, free_bytes = self._roomy_measurement()
        if free_bytes is not None and age_s <= REUSE_S:
            return DiskSpace(free_bytes=free_bytes, min_free_bytes=self._min_free_bytes)
        if self._measuring is None:
            self._measuring = asyncio.create_task(asyncio.to_thread(self._least_free_bytes))
            self._measuring.add_done_callback(
                functools.partial(self._measured, started_at=self._clock())
            )
        if free_bytes is None or age_s > 2 * REUSE_S:
            free_bytes = await asyncio.shield(self._measuring)
        # else: a roomy measurement a little older serves while the new one is taken.
        return DiskSpace(free_bytes=free_bytes, min_free_bytes=self._min_free_bytes)

    def _roomy_measurement(self) -> tuple[float, int | None]:
        """The age of the last measurement and what it found, if that was far above the
        threshold (else None)."""
        if self._last is None:
            return 0.0, None
        measured_at, free_bytes = self._last
        if free_bytes - self._min_free_bytes < REUSE_HEADROOM_BYTES:
            return 0.0, None
        return self._clock() - measured_at, free_bytes

    def _measured(self, task: asyncio.Task[int], *, started_at: float) -> None:
        self._measuring = None
        if not task.cancelled() and task.exception() is None:
            self._last = (started_at, task.result())

    async def ensure_space(self, action: str) -> None:
        """Raise InsufficientStorageError, saying why, when the disk is below the threshold."""
        space = await self.space()
        if space.is_low:
            raise InsufficientStorageError(
                f"The server's disk is nearly full: {space.free_bytes} bytes free, below the "
                f"{space.min_free_bytes} bytes it keeps free (--min-free-disk-bytes); {action} "
                "is refused until space is freed (running jobs go on)."
            )

    def _least_free_bytes(self) -> int:
        free_by_device: dict[int, int] = {}
        for directory in self._directories:
            existing = _nearest_existing(directory)
            device = existing.stat().st_dev
            if device not in free_by_device:
                stats = os.statvfs(existing)
                # f_bavail, not f_bfree: what a process without root's reserve may still write.
                free_by_device[device] = stats.f_bavail * stats.f_frsize
        return min(free_by_device.values())


def _nearest_existing(path: Path) -> Path:
    """`path`, or its closest ancestor that exists (a directory the server creates later is on
    the filesystem of its parent)."""
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def is_disk_full(error: BaseException) -> bool:
    """Whether `error` is a write that failed for want of disk space (here, or on the
    PostgreSQL server's disk), or an error raised while handling one (SQLite rolls a
    transaction back itself on SQLITE_FULL, so the caller's own ROLLBACK then fails with "no
    transaction is active")."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, sqlite3.Error):
            if getattr(current, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL:
                return True
        elif isinstance(current, OSError):
            if current.errno in _DISK_FULL_ERRNOS:
                return True
        elif getattr(current, "sqlstate", None) == POSTGRES_DISK_FULL_SQLSTATE:
            return True
        current = current.__cause__ or current.__context__
    return False


@contextlib.contextmanager
def storage_errors_refused(action: str) -> Iterator[None]:
    """Turn a write that failed on a full disk into InsufficientStorageError (a 507)."""
    try:
        yield
    except Exception as error:
        if not is_disk_full(error):
            raise
        raise InsufficientStorageError(
            f"The server's disk is full; {action} is refused until space is freed: {error}"
        ) from error
