"""Logs of jobs on other nodes: the supervisor spools the log on its node, the server pulls it.

The server reads only files under its own log directory, on the head node. A job whose
supervisor Ray placed on a worker node writes its output to a spool file there; the server pulls
the spool from the supervisor in chunks, long-polling, and appends them to the head's log file, so
every reader of the log sees one file that grows the same way for local and remote jobs. The
supervisor writes the job's terminal status only once the server has pulled the whole spool, so a
reader who sees the job end finds every byte in the head's file.

The spool is in the node's shared temp dir, where every user of the node may create names: it is
in a directory of this user's alone (`<tmp>/jobs_server_spool-<uid>`, 0700, checked without
following symlinks), or, if another user holds that name, in a fresh private one; its files are
0600 and opened with O_NOFOLLOW (command_start.py, zygote.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import stat
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, BinaryIO

from ray.exceptions import ActorDiedError

from jobs_server.manager.logs import log_size, read_log_chunks
from jobs_server.manager.supervisor_calls import first_line, while_unreachable

logger = logging.getLogger(__name__)

# One pull's most bytes: large enough that a burst of many MB crosses in few actor calls.
LOG_SHIP_CHUNK_BYTES = 4 * 1024 * 1024
# How long one pull waits on the worker for new bytes before it answers empty (a long poll).
SPOOL_WAIT_S = 5.0
# How long a supervisor holds a job's terminal status back waiting for the server to pull the
# last bytes; a server that is down for longer finds the rest in the spool when it comes back.
LOG_DRAIN_TIMEOUT_S = 30.0


SPOOL_DIR_PREFIX = "jobs_server_spool-"
_PRIVATE_DIR_MODE = 0o700


class UnsafeDirectoryError(OSError):
    """A directory name is held by a symlink, a non-directory or another user."""


def spool_path(namespace: str, log_name: str) -> Path:
    """Where a supervisor on a worker node spools a job's log: a private directory of this
    user's on that node (made, or checked, each time: a temp cleaner may have removed it)."""
    try:
        root = private_directory(Path(tempfile.gettempdir()) / f"{SPOOL_DIR_PREFIX}{os.getuid()}")
    except UnsafeDirectoryError as error:
        root = _fallback_spool_root(error)
    return private_directory(root / namespace) / log_name


# Made once per process, where another user squats the spool's name (a supervisor's lifetime).
_fallback_roots: dict[str, Path] = {}


def _fallback_spool_root(error: UnsafeDirectoryError) -> Path:
    temp_dir = tempfile.gettempdir()
    root = _fallback_roots.get(temp_dir)
    if root is not None:
        try:
            return private_directory(root)
        except UnsafeDirectoryError:
            pass  # removed and squatted meanwhile: another one
    root = Path(tempfile.mkdtemp(prefix=SPOOL_DIR_PREFIX))  # 0700, a name nobody can guess
    logger.warning("spooling job logs in %s: %s", root, error)
    _fallback_roots[temp_dir] = root
    return root


def private_directory(path: Path) -> Path:
    """`path`, a directory of this user's that nobody else may enter: made 0700 if missing,
    closed to 0700 if it is ours with a looser mode. Raises UnsafeDirectoryError if the name
    is a symlink, not a directory, or another user's."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, _PRIVATE_DIR_MODE)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except (NotADirectoryError, FileNotFoundError) as error:
        raise UnsafeDirectoryError(f"{path} is not a directory") from error
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise UnsafeDirectoryError(f"{path} is a symlink") from error
        raise
    try:
        info = os.fstat(fd)
        if info.st_uid != os.getuid():
            raise UnsafeDirectoryError(f"{path} belongs to uid {info.st_uid}")
        if stat.S_IMODE(info.st_mode) != _PRIVATE_DIR_MODE:
            os.fchmod(fd, _PRIVATE_DIR_MODE)  # ours, left open (a umask, an older version)
    finally:
        os.close(fd)
    return path


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

    async def ended() -> bool:
        return command_ended()

    # The log reader's follow mode, stopped at its first chunk: bytes, an idle tick (nothing new
    # within `wait_s`), or the end, which it reports only after one more read past the command's.
    chunks = read_log_chunks(
        path,
        offset=offset,
        follow=True,
        job_is_terminal=ended,
        idle_tick_s=wait_s,
        chunk_bytes=max_bytes,
    )
    async with contextlib.aclosing(chunks):
        async for chunk in chunks:
            return chunk.data, False
    return b"", True


async def pull_spooled_log(
    read_chunk: Callable[[int], Awaitable[tuple[bytes, bool]]], log_path: Path
) -> None:
    """Append the spool to `log_path` until all of it is there, calling `read_chunk(offset)`.

    The head's file is append-only and only this pull writes it, so its size is where the next
    chunk goes: a restarted server resumes where the last one stopped, without gaps or repeats.
    """
    offset = await asyncio.to_thread(log_size, log_path)
    log_file = await asyncio.to_thread(_open_for_append, log_path)
    try:
        while True:
            data, complete = await read_chunk(offset)
            if data:
                await asyncio.to_thread(_append, log_file, data)
                offset += len(data)
            if complete:
                return
    finally:
        log_file.close()


async def pull_log_from_supervisor(supervisor: Any, submission_id: str, log_path: Path) -> None:
    """Bring the log of a job on another node to the head, until all of it is here or its
    supervisor is gone (with its node: what was pulled until then stays)."""

    async def read_chunk(offset: int) -> tuple[bytes, bool]:
        def call() -> Any:
            return supervisor.read_spooled_log.remote(submission_id, offset)

        data, complete = await while_unreachable(call(), call)
        return data, complete

    try:
        await pull_spooled_log(read_chunk, log_path)
    except ActorDiedError as error:
        logger.warning("pulling the log of job %s stopped: %s", submission_id, first_line(error))


def _open_for_append(path: Path) -> BinaryIO:
    """The head's copy of the log, made 0600 like every log (the log dir is 0700: state_dir.py)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC | os.O_NOFOLLOW
    return os.fdopen(os.open(path, flags, 0o600), "ab")


def _append(log_file: BinaryIO, data: bytes) -> None:
    log_file.write(data)
    log_file.flush()  # readers of the head's file see each chunk as it arrives
