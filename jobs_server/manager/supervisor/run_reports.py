"""What a shared supervisor tells the server of the runs it was handed in batches: the start of
each that runs long enough for its start to be written, and the end of each, kept until the
server has them.

A Ray actor call costs about a millisecond of CPU on each side, more than the rest of a short
job's hand-over: so a shared supervisor takes jobs in batches (`run_jobs`), and the server learns
their starts and ends in batches too, with one long-poll call (`run_reports`) answered as soon as
any report is here. Each report gets a number; the server's next poll says the last it got, and
what it got is forgotten here. Until then every report stays, so an answer lost on the way (the
server restarting, a call cut off) is given again to the next poll.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, Literal

# How long a poll waits for a report before it answers with none (the caller asks again).
POLL_WAIT_S = 30.0

STARTED: Literal["started"] = "started"
ENDED: Literal["ended"] = "ended"

# A report as the server gets it: (submission id, run id, STARTED or ENDED, what). A start
# carries the record as written (RUNNING: `JobRecord` fields); an end, what `run_job` would
# have answered or raised (the ended record's fields, STOPPED for a run deleted before it could
# start, or a `RunFailedError`).
RunReport = tuple[str, str, str, Any]


class RunFailedError(Exception):
    """A run that `run_jobs` was given failed in its supervisor (a bug, or its host failing):
    what `run_job` would have raised to its caller."""


class RunReports:
    """The reports not yet taken by the server, in the order they were made."""

    def __init__(self, incarnation: str) -> None:
        # Names this supervisor's numbering: a poll that names another (a previous supervisor
        # under the same name) starts from the beginning.
        self._incarnation = incarnation
        self._reports: list[tuple[int, RunReport]] = []
        self._last = 0
        self._arrived = asyncio.Event()

    def add(self, report: RunReport) -> None:
        self._last += 1
        self._reports.append((self._last, report))
        self._arrived.set()

    async def take(
        self, incarnation: str | None, after: int, wait_s: float = POLL_WAIT_S
    ) -> tuple[str, int, list[RunReport]]:
        """The reports numbered past `after` (in `incarnation`'s numbering; another's, or None:
        all of them), waiting up to `wait_s` for one; those up to `after` are forgotten (the
        caller has them). Returns this incarnation, the last number given and the reports."""
        if incarnation != self._incarnation:
            after = 0
        self._reports = [(number, report) for number, report in self._reports if number > after]
        if not self._reports:
            self._arrived.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._arrived.wait(), timeout=wait_s)
        return self._incarnation, self._last, [report for _, report in self._reports]
