"""Append-only job log files: where they live, and one async reader of `(offset, bytes)` chunks.

Every log endpoint frames the chunks this module yields; none reads a log file another way.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from jobs_server.errors import LogUnavailableError
from jobs_server.manager.log_watch import LOG_POLL_INTERVAL_S, LogWatchers, Wake
from jobs_server.manager.records import now_ms

logger = logging.getLogger(__name__)

# Large enough that a full read of a big log is not dominated by per-chunk costs (a thread hop,
# a write); a follower of a live job reads only what is new, usually far less.
LOG_CHUNK_BYTES = 256 * 1024
# Up to this many new bytes are read on the event loop rather than in a thread.
SMALL_READ_BYTES = 16 * 1024
# The last bytes of output quoted in a failed job's message.
LOG_TAIL_FOR_MESSAGE_BYTES = 2048


def job_log_path(log_dir: Path, submission_id: str) -> Path:
    """The log file of a job; the name holds the submission id."""
    return log_dir / f"job-driver-{submission_id}.log"


# The marker file that names a log directory: a random id, written once, by the first server
# that uses the directory. A job's record keeps the id of the directory its log is written to.
LOG_DIR_ID_FILE = ".log-dir-id"


def log_dir_id(log_dir: Path) -> str:
    """The id of `log_dir` (an existing directory), created on first use.

    Replicas on the head share their log directory and may start together: the marker is
    written under a name of its own and then linked into place, which fails if another was
    first, so every server agrees on the one id that got there.
    """
    marker = log_dir / LOG_DIR_ID_FILE
    try:
        return marker.read_text().strip()
    except FileNotFoundError:
        pass
    candidate = log_dir / f"{LOG_DIR_ID_FILE}.{secrets.token_hex(8)}"
    # 0600, as every file of the server's directories (state_dir.py).
    fd = os.open(candidate, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as marker_file:
        marker_file.write(secrets.token_hex(16) + "\n")
    try:
        os.link(candidate, marker)
    except FileExistsError:
        pass
    finally:
        candidate.unlink()
    return marker.read_text().strip()


def ensure_log_dir_is(
    submission_id: str, written_to: str | None, this_log_dir_id: str | None
) -> None:
    """LogUnavailableError if the job's log is written to the log directory of id `written_to`
    (its record's `log_dir_id`) and that is not this one, `this_log_dir_id`: here its file is
    not (or is not this job's), and a missing file would read as an empty log. A job whose
    record names no directory (not handed over yet, or recorded by an earlier server) is read
    here, as before."""
    if written_to is not None and written_to != this_log_dir_id:
        raise LogUnavailableError(submission_id)


@dataclass(frozen=True)
class LogChunk:
    """`data` is the bytes of the log file starting at byte `offset` (empty: an idle tick)."""

    offset: int
    data: bytes

    @property
    def end(self) -> int:
        return self.offset + len(self.data)


def log_size(path: Path) -> int:
    """The log's current size in bytes (0 before the job wrote anything)."""
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _open_at(path: Path, offset: int) -> BinaryIO | None:
    try:
        log_file = path.open("rb")
    except FileNotFoundError:
        return None
    log_file.seek(offset)
    return log_file


def read_log_chunks(
    path: Path,
    *,
    offset: int = 0,
    limit: int | None = None,
    follow: bool = False,
    job_is_terminal: Callable[[], Awaitable[bool]] | None = None,
    idle_tick_s: float | None = None,
    chunk_bytes: int = LOG_CHUNK_BYTES,
    watchers: LogWatchers | None = None,
    stop_when: Callable[[], bool] | None = None,
) -> AsyncGenerator[LogChunk, None]:
    """Yield the log from `offset`, at most `limit` bytes, in chunks.

    Without `follow`, stop at the current end of the file. With it, keep reading as the file
    grows until `job_is_terminal()` says the job ended *and* everything written before that has
    been read, so the last lines are never dropped. While following, an empty chunk is yielded
    every `idle_tick_s` without new bytes, so a caller can send a heartbeat or notice that its
    client left. A missing file is an empty log (the job has not started yet). A chunk holds at
    most `chunk_bytes`.

    With `watchers`, a follower at the end of the file waits on the file's shared watcher
    instead of polling it; then `stop_when`, if given, replaces the idle ticks: one is yielded
    as soon as it turns true (checked by the watcher every `IDLE_SCAN_S`).
    """
    if follow and watchers is not None and job_is_terminal is not None:
        return _read_watched(
            path, watchers, job_is_terminal, offset, limit, idle_tick_s, chunk_bytes, stop_when
        )
    return _read_polled(path, offset, limit, follow, job_is_terminal, idle_tick_s, chunk_bytes)


async def _read_polled(
    path: Path,
    offset: int,
    limit: int | None,
    follow: bool,
    job_is_terminal: Callable[[], Awaitable[bool]] | None,
    idle_tick_s: float | None,
    chunk_bytes: int,
) -> AsyncGenerator[LogChunk, None]:
    """`read_log_chunks` without a watcher: at the end of the file, a follower polls it."""
    log_file: BinaryIO | None = None
    remaining = limit
    job_ended = False
    last_yield = time.monotonic()
    try:
        while remaining is None or remaining > 0:
            if log_file is None:
                log_file = await asyncio.to_thread(_open_at, path, offset)
            data = await _read_after(log_file, offset, remaining, chunk_bytes)
            if data:
                yield LogChunk(offset, data)
                offset += len(data)
                last_yield = time.monotonic()
                if remaining is not None:
                    remaining -= len(data)
                continue
            if not follow or job_ended:
                return
            # The job's status is checked only at the end of the file, and one more read
            # follows a terminal status: bytes written before the job ended are all delivered.
            if job_is_terminal is not None and await job_is_terminal():
                job_ended = True
                continue
            if idle_tick_s is not None and time.monotonic() - last_yield >= idle_tick_s:
                yield LogChunk(offset, b"")
                last_yield = time.monotonic()
            await asyncio.sleep(LOG_POLL_INTERVAL_S)
    finally:
        if log_file is not None:
            log_file.close()


async def _read_watched(
    path: Path,
    watchers: LogWatchers,
    job_is_terminal: Callable[[], Awaitable[bool]],
    offset: int,
    limit: int | None,
    idle_tick_s: float | None,
    chunk_bytes: int,
    stop_when: Callable[[], bool] | None,
) -> AsyncGenerator[LogChunk, None]:
    """`read_log_chunks`' follow mode, woken by the file's watcher (joined on the first read,
    left when this generator closes)."""
    log_file: BinaryIO | None = None
    remaining = limit
    async with watchers.follow(path, job_is_terminal) as watch:
        try:
            while remaining is None or remaining > 0:
                # Noted before reading: a change or an end during the read is not missed, and an
                # end seen here means the read below gets everything written before it.
                generation, ended = watch.generation, watch.ended
                if log_file is None:
                    log_file = await asyncio.to_thread(_open_at, path, offset)
                data = await _read_after(log_file, offset, remaining, chunk_bytes)
                if data:
                    yield LogChunk(offset, data)
                    offset += len(data)
                    if remaining is not None:
                        remaining -= len(data)
                    continue
                if ended:
                    return
                wake = await watch.wait(generation, stop_when=stop_when, idle_tick_s=idle_tick_s)
                if wake is Wake.TICK:
                    yield LogChunk(offset, b"")
        finally:
            if log_file is not None:
                log_file.close()


async def _read_after(
    log_file: BinaryIO | None, offset: int, remaining: int | None, chunk_bytes: int
) -> bytes:
    """The bytes after `offset` (none if there are none or no file). A little is read on the
    loop (a live follower's new lines, in the page cache: cheaper than a thread hop for each of
    a thousand followers); more in a thread."""
    if log_file is None:
        return b""
    available = os.fstat(log_file.fileno()).st_size - offset
    if available <= 0:
        return b""
    size = chunk_bytes if remaining is None else min(chunk_bytes, remaining)
    if available <= SMALL_READ_BYTES:
        return log_file.read(min(size, available))
    return await asyncio.to_thread(log_file.read, size)


def complete_utf8_length(data: bytes) -> int:
    """The length of the longest prefix of `data` that does not end inside a UTF-8 character.

    Streams hold back an incomplete trailing character until its other bytes arrive, so a
    character split across two reads is never turned into replacement characters.
    """
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte < 0x80:  # ASCII: complete
            return len(data)
        if byte in (0xC0, 0xC1) or byte >= 0xF5:  # never valid UTF-8: nothing to wait for
            return len(data)
        if byte >= 0xC0:  # a lead byte: is its sequence complete?
            needed = 2 if byte < 0xE0 else 3 if byte < 0xF0 else 4
            return len(data) if back >= needed else len(data) - back
    return len(data)  # only continuation bytes: invalid anyway, nothing to wait for


def read_log_tail(
    path: Path, max_bytes: int = LOG_TAIL_FOR_MESSAGE_BYTES, *, start_offset: int = 0
) -> str:
    """The last `max_bytes` of a log (none before `start_offset`) as text, starting at a line
    boundary when there is one."""
    try:
        with path.open("rb") as log_file:
            size = log_file.seek(0, os.SEEK_END)
            start = max(start_offset, size - max_bytes)
            log_file.seek(start)
            data = log_file.read()
    except FileNotFoundError:
        return ""
    if start > start_offset and b"\n" in data[:-1]:
        data = data[data.index(b"\n") + 1 :]
    return data.decode("utf-8", errors="replace")


def set_aside_orphaned_log(path: Path) -> None:
    """A log file of an id the archive does not have belongs to no record (the archive was
    lost, or a delete could not remove it): the new job must not append to it, and its bytes
    are not ours to destroy, so it is renamed `<name>.orphaned-<ms>`."""
    if path.exists():
        orphan = path.with_name(f"{path.name}.orphaned-{now_ms()}")
        logger.warning("log %s belongs to no job; moved to %s", path, orphan)
        path.rename(orphan)
