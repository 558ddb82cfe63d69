"""Logs of jobs on other nodes: the supervisor spools the log on its node, the server pulls it.

The server reads only files under its own log directory, on the head node. A job whose
supervisor Ray placed on a worker node writes its output to a spool file there; the server pulls
the spool from the supervisor in chunks, long-polling, and appends them to the head's log file, so
every reader of the log sees one file that grows the same way for local and remote jobs. The
supervisor writes the job's terminal status only once the server has pulled the whole spool, so a
reader who sees the job end finds every byte in the head's file.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from jobs_server.manager.logs import LOG_POLL_INTERVAL_S, log_size

# One pull's most bytes: large enough that a burst of many MB crosses in few actor calls.
LOG_SHIP_CHUNK_BYTES = 4 * 1024 * 1024
# How long one pull waits on the worker for new bytes before it answers empty (a long poll).
SPOOL_WAIT_S = 5.0
# How long a supervisor holds a job's terminal status back waiting for the server to pull the
# last bytes; a server that is down for longer finds the rest in the spool when it comes back.
LOG_DRAIN_TIMEOUT_S = 30.0


def spool_path(namespace: str, log_name: str) -> Path:
    """Where a supervisor on a worker node spools a job's log: a local directory of that node."""
    return Path(tempfile.gettempdir()) / "jobs_server_spool" / namespace / log_name


def _read_at(path: Path, offset: int, max_bytes: int) -> bytes:
    try:
        with path.open("rb") as spool:
            spool.seek(offset)
            return spool.read(max_bytes)
    except FileNotFoundError:
        return b""


async def read_spool_chunk(
    path: Path,
    offset: int,
    command_ended: Callable[[], bool],
    *,
    max_bytes: int = LOG_SHIP_CHUNK_BYTES,
    wait_s: float = SPOOL_WAIT_S,
) -> tuple[bytes, bool]:
    """The spool's bytes from `offset` (waiting up to `wait_s` for some), and whether that is
    all there will ever be: the command had ended and nothing is left after `offset`."""
    deadline = time.monotonic() + wait_s
    while True:
        # Asked before looking: bytes written before the command ended are all seen after it.
        ended = command_ended()
        if log_size(path) > offset:
            return await asyncio.to_thread(_read_at, path, offset, max_bytes), False
        if ended:
            return b"", True
        if time.monotonic() >= deadline:
            return b"", False
        await asyncio.sleep(LOG_POLL_INTERVAL_S)


async def pull_spooled_log(
    read_chunk: Callable[[int], Awaitable[tuple[bytes, bool]]], log_path: Path
) -> None:
    """Append the spool to `log_path` until all of it is there, calling `read_chunk(offset)`.

    The head's file is append-only and only this pull writes it, so its size is where the next
    chunk goes: a restarted server resumes where the last one stopped, without gaps or repeats.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    offset = await asyncio.to_thread(log_size, log_path)
    log_fd = await asyncio.to_thread(
        os.open, log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644
    )
    try:
        while True:
            data, complete = await read_chunk(offset)
            if data:
                await asyncio.to_thread(_write_all, log_fd, data)
                offset += len(data)
            if complete:
                return
    finally:
        os.close(log_fd)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
