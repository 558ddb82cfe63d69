"""Handing jobs to a shared supervisor in batches, and learning their starts and ends in
batches.

Each Ray actor call costs about a millisecond of CPU on each side: more than the rest of a short
job's hand-over (run_reports.py). So the jobs handed to a shared supervisor while a hand-over
call is on its way go together in the next one (`run_jobs`), and one long-poll (`run_reports`)
brings the starts and ends of all its runs since the last. A lone job goes at once: batches form
only under load, where they save the most. Each job gets two futures of its own: its end, which
answers as `run_job`'s ObjectRef would (its end, or the error Ray raised), and its start, the
record as the supervisor wrote it RUNNING (None if the job ended, or its supervisor died,
before its start was written: a short job's never is).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from dataclasses import dataclass
from typing import Any

from ray.exceptions import ActorDiedError, ActorUnavailableError

from jobs_server.manager.supervisor.run_reports import STARTED
from jobs_server.manager.supervisor_calls import SUPERVISOR_UNAVAILABLE_RETRY_S, while_unreachable

logger = logging.getLogger(__name__)

# After an unexpected error of a poll, the next one waits this long.
POLL_ERROR_RETRY_S = 1.0

_RunKey = tuple[str, str]  # (submission id, run id)


@dataclass(frozen=True)
class BatchedRun:
    """A run handed over in a batch: its start (the record written RUNNING, or None) and its
    end to come."""

    started: asyncio.Future[dict[str, Any] | None]
    finished: asyncio.Future[Any]


class SupervisorRuns:
    """The runs handed to one shared supervisor (one actor handle) and not ended yet."""

    def __init__(self, supervisor: Any) -> None:
        self._supervisor = supervisor
        self._waiting: dict[_RunKey, list[BatchedRun]] = {}
        self._unsent: list[dict[str, Any]] = []
        self._sender: asyncio.Task[None] | None = None
        self._poller: asyncio.Task[None] | None = None
        # Where the supervisor's numbering of reports stands for this server (run_reports.py).
        self._incarnation: str | None = None
        self._after = 0
        self.dead = False

    def run(self, job_fields: dict[str, Any]) -> BatchedRun:
        """Hand the job (`run_job`'s fields) over; the futures of its start and end."""
        loop = asyncio.get_running_loop()
        run = BatchedRun(started=loop.create_future(), finished=loop.create_future())
        key = _run_key(job_fields)
        self._waiting.setdefault(key, []).append(run)
        run.finished.add_done_callback(lambda _: self._drop_if_cancelled(key, run))
        if self.dead:
            self._fail(key, ActorDiedError())
            return run
        self._unsent.append(job_fields)
        # Started on the loop's next turn: the hand-overs of this turn go with it.
        if self._sender is None or self._sender.done():
            self._sender = asyncio.create_task(self._send())
        if self._poller is None or self._poller.done():
            self._poller = asyncio.create_task(self._poll())
        return run

    async def close(self) -> None:
        for task in (self._sender, self._poller):
            if task is not None:
                task.cancel()
        for task in (self._sender, self._poller):
            if task is not None:
                await asyncio.gather(task, return_exceptions=True)

    async def _send(self) -> None:
        """Send what is unsent, one call at a time: what comes while one is on its way goes
        with the next."""
        while self._unsent:
            batch, self._unsent = self._unsent, []
            try:
                # `run_jobs` is idempotent: a batch sent twice (the supervisor was out of reach
                # as it got it) starts each job once.
                await while_unreachable(
                    self._send_batch(batch), functools.partial(self._send_batch, batch)
                )
            except Exception as error:
                # As `run_job`'s ObjectRef would: the jobs' watchers decide (a job that never
                # started goes to a replacement supervisor).
                for job_fields in batch:
                    self._fail(_run_key(job_fields), error)
                if isinstance(error, ActorDiedError):
                    self._died(error)

    def _send_batch(self, batch: list[dict[str, Any]]) -> Any:
        return self._supervisor.run_jobs.remote(batch)

    async def _poll(self) -> None:
        """Take the supervisor's reports while runs wait for theirs."""
        while self._waiting:
            try:
                self._incarnation, self._after, reports = await self._supervisor.run_reports.remote(
                    self._incarnation, self._after
                )
            except ActorUnavailableError:
                await asyncio.sleep(SUPERVISOR_UNAVAILABLE_RETRY_S)
                continue
            except ActorDiedError as error:
                self._died(error)
                return
            except Exception:
                logger.warning("asking a supervisor for its jobs' news failed", exc_info=True)
                await asyncio.sleep(POLL_ERROR_RETRY_S)
                continue
            for submission_id, run_id, kind, what in reports:
                # A report nobody here waits for is for a previous server's run (its recovery
                # waits for it another way), or a batch's that was sent twice.
                key = (submission_id, run_id)
                if kind == STARTED:
                    for run in self._waiting.get(key, ()):
                        _settle(run.started, what)
                    continue
                for run in self._waiting.pop(key, ()):
                    _settle(run.started, None)
                    if isinstance(what, BaseException):
                        _settle_with_error(run.finished, what)
                    else:
                        _settle(run.finished, what)

    def _died(self, error: ActorDiedError) -> None:
        """Every run waiting learns it, as each `run_job`'s ObjectRef would; later hand-overs
        fail at once (the supervisors' registry replaces a dead one)."""
        self.dead = True
        for key in list(self._waiting):
            self._fail(key, error)

    def _fail(self, key: _RunKey, error: BaseException) -> None:
        for run in self._waiting.pop(key, ()):
            _settle(run.started, None)
            _settle_with_error(run.finished, error)

    def _drop_if_cancelled(self, key: _RunKey, run: BatchedRun) -> None:
        """A watcher that was cancelled (the server closing) no longer waits."""
        if run.finished.cancelled() and run in self._waiting.get(key, ()):
            self._waiting[key].remove(run)
            if not self._waiting[key]:
                del self._waiting[key]


class RunBatches:
    """The `SupervisorRuns` of each shared supervisor this server hands jobs to."""

    def __init__(self) -> None:
        self._by_actor: dict[Any, SupervisorRuns] = {}

    def run(self, supervisor: Any, job_fields: dict[str, Any]) -> BatchedRun:
        """Hand the job to `supervisor` with the others of this moment."""
        actor_id = supervisor._actor_id
        runs = self._by_actor.get(actor_id)
        if runs is None or runs.dead:
            runs = self._by_actor[actor_id] = SupervisorRuns(supervisor)
        return runs.run(job_fields)

    async def close(self) -> None:
        await asyncio.gather(*(runs.close() for runs in self._by_actor.values()))
        self._by_actor.clear()


def _settle(future: asyncio.Future[Any], result: Any) -> None:
    if not future.done():
        future.set_result(result)


def _settle_with_error(future: asyncio.Future[Any], error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)


def _run_key(job_fields: dict[str, Any]) -> _RunKey:
    """The run a hand-over (`SupervisedJob` fields) is of."""
    return job_fields["spec"]["submission_id"], job_fields["run_id"]
