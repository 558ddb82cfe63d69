"""Filling a small real disk (the `small_disk` fixture: a tmpfs of its own), for the full-disk
tests."""

from __future__ import annotations

import errno
import os
from pathlib import Path


def fill(disk: Path, leave_free_bytes: int) -> Path:
    """A file that takes all of `disk`'s free space but `leave_free_bytes`. A server may write
    to the disk meanwhile: what it took between reading the free space and taking it is left
    out on the next try."""
    filler = disk / "filler"
    with filler.open("ab") as file:
        for _ in range(FILL_TRIES):
            stats = os.statvfs(disk)
            size = stats.f_bavail * stats.f_frsize - leave_free_bytes
            if size <= 0:
                return filler
            try:
                os.posix_fallocate(file.fileno(), os.fstat(file.fileno()).st_size, size)
            except OSError as error:
                if error.errno != errno.ENOSPC:
                    raise
                continue
            return filler
    raise AssertionError(f"{disk} kept changing: could not take its free space")


SMALL_DISK_BYTES = 16 * 1024 * 1024

FILL_TRIES = 50
