"""One watcher per followed log file, fanning out to its followers.

A follower that has read everything waits here instead of polling the file itself: the file's
one watcher looks at it (one `stat`) every `LOG_POLL_INTERVAL_S` and wakes its waiting followers
only when it grew or the job ended; each follower then reads from its own offset. A thousand
quiet followers of one job cost one `stat` per tick, not a thousand. The watcher starts with the
first follower of a file and stops when the last one leaves.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

logger = logging.getLogger(__name__)

# How often a watcher looks for new bytes and for the job's end: the tail's lag.
LOG_POLL_INTERVAL_S = 0.01
# How often a watcher asks its idle followers whether they should stop (client gone, shutdown)
# and hands out idle ticks: a follower that left is noticed within this.
IDLE_SCAN_S = 0.1


class Wake(Enum):
    CHANGED = "changed"
    """The file grew, or the job ended (or its status could not be read): read again."""
    TICK = "tick"
    """Nothing new, but the follower asked to be woken (an idle tick, or its `stop_when`)."""


@dataclass(eq=False)
class _Waiter:
    future: asyncio.Future[Wake]
    stop_when: Callable[[], bool] | None
    idle_tick_s: float | None
    tick_at: float


@dataclass(eq=False)
class LogWatch:
    """The shared watcher of one file. `generation` changes whenever there may be more to read;
    `ended` is set once the job has ended (after that, one more read gets every last byte)."""

    path: Path
    job_is_terminal: Callable[[], Awaitable[bool]]
    generation: int = 0
    ended: bool = False
    followers: int = 0
    _size: int = -1
    _waiters: set[_Waiter] = field(default_factory=set)
    _task: asyncio.Task[None] | None = None

    async def wait(
        self,
        seen_generation: int,
        *,
        stop_when: Callable[[], bool] | None,
        idle_tick_s: float | None,
    ) -> Wake:
        """Wait until the generation moves past `seen_generation` (at once if it already has),
        or for a tick: every `idle_tick_s` without one, or when `stop_when()` turns true."""
        if self.generation != seen_generation or self.ended:
            return Wake.CHANGED
        future: asyncio.Future[Wake] = asyncio.get_running_loop().create_future()
        tick_at = time.monotonic() + (idle_tick_s if idle_tick_s is not None else 0.0)
        waiter = _Waiter(future, stop_when, idle_tick_s, tick_at)
        self._waiters.add(waiter)
        try:
            return await future
        finally:
            self._waiters.discard(waiter)

    def _wake_all(self, wake: Wake) -> None:
        for waiter in self._waiters:
            if not waiter.future.done():
                waiter.future.set_result(wake)
        self._waiters.clear()

    def _scan_idle(self, now: float) -> None:
        for waiter in list(self._waiters):
            if waiter.future.done():
                continue
            if waiter.stop_when is not None:
                due = waiter.stop_when()
            else:
                due = waiter.idle_tick_s is not None and now >= waiter.tick_at
            if due:
                waiter.future.set_result(Wake.TICK)
                self._waiters.discard(waiter)

    def _look(self) -> bool:
        try:
            size = os.stat(self.path).st_size
        except FileNotFoundError:
            size = 0
        grew, self._size = size != self._size, size
        return grew

    async def _run(self) -> None:
        next_scan = time.monotonic() + IDLE_SCAN_S
        while not self.ended:
            # The end is read before the size: bytes written before the job ended are seen by
            # the reads its wake-up causes.
            try:
                ended = await self.job_is_terminal()
            except Exception:
                logger.exception("could not tell whether the job of %s has ended", self.path)
                ended = True  # followers end, as at a deletion; a reconnect retries
            grew = self._look()
            if ended or grew:
                self.ended = ended
                self.generation += 1
                self._wake_all(Wake.CHANGED)
            now = time.monotonic()
            if now >= next_scan:
                self._scan_idle(now)
                next_scan = now + IDLE_SCAN_S
            await asyncio.sleep(LOG_POLL_INTERVAL_S)
        # Ended: every later wait returns at once; nothing to watch any more.


class LogWatchers:
    """The watchers of one server, by file."""

    def __init__(self) -> None:
        self._watches: dict[Path, LogWatch] = {}

    @contextlib.asynccontextmanager
    async def follow(
        self, path: Path, job_is_terminal: Callable[[], Awaitable[bool]]
    ) -> AsyncIterator[LogWatch]:
        """Join the watcher of `path` (starting it), for as long as the block runs."""
        watch = self._watches.get(path)
        if watch is None:
            watch = self._watches[path] = LogWatch(path, job_is_terminal)
            watch._task = asyncio.create_task(watch._run(), name=f"log watcher {path.name}")
        watch.followers += 1
        try:
            yield watch
        finally:
            watch.followers -= 1
            if watch.followers == 0:
                del self._watches[path]
                if watch._task is not None:
                    watch._task.cancel()

    def __len__(self) -> int:
        return len(self._watches)
