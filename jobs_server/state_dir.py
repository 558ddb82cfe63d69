"""The state directory is the server's alone: private to its user, and one server's at a time.

A job runs as the server's user (or one of its own, `--jobs-user`), so it must not reach by
path what is not its own: the archive of every tenant's jobs and the other jobs' logs. The state
dir and the log dir are 0700 and the files the server makes there 0600, whatever the umask (the
archive through `make_private_file`; a job's log is created 0600 where its command starts:
zygote.py, command_start.py).

Two servers on one state dir would hand the same queued jobs over twice: `lock_state_dir` takes
an exclusive lock on `<state-dir>/lock` for the server's life, and names its holder to a second.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import socket
import stat
from pathlib import Path

logger = logging.getLogger(__name__)

PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600
LOCK_FILE_NAME = "lock"
# What of the lock file a second server reads to name the holder.
_HOLDER_READ_BYTES = 1024


class StateDirError(Exception):
    """The state dir cannot be made private, or another server holds it."""


def make_private_dir(path: Path) -> None:
    """Create `path` (and its missing parents) or take it as it is, then make it 0700."""
    try:
        path.mkdir(mode=PRIVATE_DIR_MODE, parents=True, exist_ok=True)
        info = path.stat()
        if not stat.S_ISDIR(info.st_mode):
            raise StateDirError(f"{path} is not a directory")
        if stat.S_IMODE(info.st_mode) != PRIVATE_DIR_MODE:
            path.chmod(PRIVATE_DIR_MODE)
    except OSError as error:
        raise StateDirError(f"cannot make {path} private (0700): {error}") from error


def prepare_state_dirs(state_dir: Path, log_dir: Path) -> None:
    """The state dir and the log dir exist and are 0700; the files the server keeps at the top
    of the state dir (an older server's may be 0644) are 0600."""
    make_private_dir(state_dir)
    make_private_dir(log_dir)
    for path in state_dir.iterdir():
        with contextlib.suppress(FileNotFoundError):
            info = path.lstat()
            if stat.S_ISREG(info.st_mode) and stat.S_IMODE(info.st_mode) != PRIVATE_FILE_MODE:
                try:
                    path.chmod(PRIVATE_FILE_MODE)
                except OSError as error:
                    raise StateDirError(f"cannot make {path} private (0600): {error}") from error


def make_private_file(path: Path) -> None:
    """Create `path` 0600 if it is missing, or make it 0600 (SQLite makes a database's -wal and
    -shm files with the database's mode, so creating the database first is enough for them)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, PRIVATE_FILE_MODE)
    try:
        os.fchmod(fd, PRIVATE_FILE_MODE)
    finally:
        os.close(fd)


class StateDirLock:
    """The exclusive lock on a state dir, held while this object's descriptor is open: for the
    process's life unless `release()`d. The descriptor is close-on-exec, so no child (an
    embedded Ray, a job) inherits the lock and keeps it past the server."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def lock_state_dir(state_dir: Path) -> StateDirLock:
    """Make the state dir private and take its lock, writing this process's pid and host into
    the lock file; StateDirError naming the holder if another process has it."""
    make_private_dir(state_dir)
    path = state_dir / LOCK_FILE_NAME
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, PRIVATE_FILE_MODE)
    except OSError as error:
        raise StateDirError(f"cannot open the lock {path}: {error}") from error
    try:
        os.fchmod(fd, PRIVATE_FILE_MODE)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            if error.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
            raise StateDirError(
                f"state dir {state_dir} is in use by {_holder(fd)}: one server per state dir"
            ) from None
        _write_holder(fd, path)
    except OSError as error:
        os.close(fd)
        raise StateDirError(f"cannot lock {path}: {error}") from error
    except BaseException:
        os.close(fd)
        raise
    return StateDirLock(path, fd)


def _write_holder(fd: int, path: Path) -> None:
    """This process's pid and host, for a second server to name; the lock is held without
    them where they cannot be written (a full disk)."""
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
    except OSError as error:
        logger.warning("holding %s without writing this server's pid into it: %s", path, error)


def _holder(fd: int) -> str:
    """Who holds the lock, as its holder wrote it (`<pid> <host>`)."""
    words = os.pread(fd, _HOLDER_READ_BYTES, 0).decode("utf-8", "replace").split()
    if len(words) != 2 or not words[0].isdigit():
        return "another server (it has not written its pid yet)"
    return f"pid {words[0]} on host {words[1]}"
