"""Percentiles and the machine's memory, the two measurements every scenario shares."""

from __future__ import annotations

import os
from collections.abc import Sequence

import psutil


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) of `values`, interpolated linearly between closest ranks."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be within 0..100, got {q}")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    lower = int(rank)
    upper = min(lower + 1, len(ordered) - 1)
    return ordered[lower] + (ordered[upper] - ordered[lower]) * (rank - lower)


def machine_pss_bytes(exclude_pid: int | None = None) -> int:
    """Sum of PSS over every process on the machine but `exclude_pid` (default: this process).

    PSS splits shared pages among the processes that map them, so the sum counts each page once.
    Processes that exit or deny access while we read them are skipped.
    """
    skipped_pid = os.getpid() if exclude_pid is None else exclude_pid
    total_bytes = 0
    for process in psutil.process_iter():
        if process.pid == skipped_pid:
            continue
        try:
            total_bytes += process.memory_full_info().pss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return total_bytes
