"""Append-only job log files: where they live, and one async reader of `(offset, bytes)` chunks.

Every log endpoint frames the chunks this module yields; none reads a log file another way.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

LOG_CHUNK_BYTES = 64 * 1024
# How often a follower looks for new bytes once it has read everything; the tail's lag.
LOG_POLL_INTERVAL_S = 0.05
# The last bytes of output quoted in a failed job's message.
LOG_TAIL_FOR_MESSAGE_BYTES = 2048


def job_log_path(log_dir: Path, submission_id: str) -> Path:
    """The log file of a job; the name holds the submission id."""
    return log_dir / f"job-driver-{submission_id}.log"


@dataclass(frozen=True)
class LogChunk:
    """`data` is the bytes of the log file starting at byte `offset`."""

    offset: int
    data: bytes

    @property
    def end(self) -> int:
        return self.offset + len(self.data)


def _open_at(path: Path, offset: int) -> BinaryIO | None:
    try:
        log_file = path.open("rb")
    except FileNotFoundError:
        return None
    log_file.seek(offset)
    return log_file


async def read_log_chunks(
    path: Path,
    *,
    offset: int = 0,
    follow: bool = False,
    job_is_terminal: Callable[[], Awaitable[bool]] | None = None,
) -> AsyncGenerator[LogChunk, None]:
    """Yield the log from `offset` in chunks.

    Without `follow`, stop at the current end of the file. With it, keep reading as the file
    grows until `job_is_terminal()` says the job ended *and* everything written before that has
    been read, so the last lines are never dropped. A missing file is an empty log (the job has
    not started yet).
    """
    log_file: BinaryIO | None = None
    job_ended = False
    try:
        while True:
            if log_file is None:
                log_file = await asyncio.to_thread(_open_at, path, offset)
            data = await asyncio.to_thread(log_file.read, LOG_CHUNK_BYTES) if log_file else b""
            if data:
                yield LogChunk(offset, data)
                offset += len(data)
                continue
            if not follow or job_ended:
                return
            # The job's status is checked only at EOF, and one more read follows a terminal
            # status: bytes written before the job ended are always delivered.
            if job_is_terminal is not None and await job_is_terminal():
                job_ended = True
                continue
            await asyncio.sleep(LOG_POLL_INTERVAL_S)
    finally:
        if log_file is not None:
            log_file.close()


def read_log_tail(path: Path, max_bytes: int = LOG_TAIL_FOR_MESSAGE_BYTES) -> str:
    """The last `max_bytes` of a log as text, starting at a line boundary when there is one."""
    try:
        with path.open("rb") as log_file:
            size = log_file.seek(0, os.SEEK_END)
            start = max(0, size - max_bytes)
            log_file.seek(start)
            data = log_file.read()
    except FileNotFoundError:
        return ""
    if start > 0 and b"\n" in data[:-1]:
        data = data[data.index(b"\n") + 1 :]
    return data.decode("utf-8", errors="replace")
