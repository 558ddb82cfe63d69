"""Percentiles and memory (the machine's, and a few processes' peak), shared by the scenarios."""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from types import TracebackType

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


def percentile_or_nan(values: Sequence[float], q: float) -> float:
    """The q-th percentile of `values`, or NaN if there are none (a figure not measured)."""
    return percentile(values, q) if values else float("nan")


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


def summed_rss_bytes(processes: Sequence[psutil.Process]) -> int:
    """Sum of RSS over `processes`; those that exited or deny access count as nothing."""
    total_bytes = 0
    for process in processes:
        try:
            total_bytes += process.memory_info().rss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return total_bytes


class PeakRssGrowth:
    """While entered, samples the summed RSS of `processes` every `interval_s` in a thread.

    `growth_bytes` is the highest sample minus the one taken on entering. A thread, not an
    asyncio task, so a sample is not late while the event loop is busy reading the response.
    """

    def __init__(
        self, processes: Sequence[psutil.Process], *, interval_s: float, max_duration_s: float
    ) -> None:
        self._processes = list(processes)
        self._interval_s = interval_s
        self._max_samples = int(max_duration_s / interval_s) + 1
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="rss-sampler", daemon=True)
        self.before_bytes = 0
        self.peak_bytes = 0
        self.samples = 0

    @property
    def growth_bytes(self) -> int:
        """Peak minus the value before."""
        return self.peak_bytes - self.before_bytes

    def __enter__(self) -> PeakRssGrowth:
        self.before_bytes = self.peak_bytes = summed_rss_bytes(self._processes)
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._stop.set()
        self._thread.join()
        self._take_sample()

    def _sample(self) -> None:
        for _ in range(self._max_samples):
            if self._stop.wait(self._interval_s):
                return
            self._take_sample()

    def _take_sample(self) -> None:
        self.peak_bytes = max(self.peak_bytes, summed_rss_bytes(self._processes))
        self.samples += 1
