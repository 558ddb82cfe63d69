"""What a job's watcher (watcher.py) learns of a run's end, and the helpers it waits with: how a
job failed when its supervisor could not record it, why it never started, the supervisor's
answer as a future, and the backoff between retries."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from ray.exceptions import ActorUnschedulableError, RuntimeEnvSetupError

from jobs_server.manager.records import JobErrorType, JobRecord
from jobs_server.manager.runtime_env_failures import describe_setup_failure
from jobs_server.manager.supervisors import is_dedicated

logger = logging.getLogger(__name__)

# A job of a shared supervisor that ends within this long of its hand-over is archived ended
# without its start being asked for and archived first (see `ends_at_once`).
ENDS_AT_ONCE_S = 0.2
# After an unexpected error from Ray or the KV, a watcher tries again after this long, doubled
# after each further error up to the maximum (a GCS that restarts takes seconds).
WATCH_RETRY_INITIAL_S = 0.5
WATCH_RETRY_MAX_S = 10.0


@dataclass(frozen=True)
class JobFailure:
    """How a job failed, when its supervisor could not record it."""

    error_type: JobErrorType
    message: str


class JobStartTimeoutError(Exception):
    """The job's supervisor did not start its command within the start timeout."""


class Backoff:
    """Exponential waits between retries, WATCH_RETRY_INITIAL_S up to WATCH_RETRY_MAX_S."""

    def __init__(self) -> None:
        self.delay_s = WATCH_RETRY_INITIAL_S

    async def wait(self) -> None:
        await asyncio.sleep(self.delay_s)
        self.delay_s = min(self.delay_s * 2, WATCH_RETRY_MAX_S)


def future_of(answer: Any) -> asyncio.Future[Any]:
    """The answer of a supervisor call (an ObjectRef, or already a future: run_batches.py) as
    a future of this loop (awaited, and checked for being done, without asking Ray again)."""
    if isinstance(answer, asyncio.Future):
        return answer
    future = asyncio.wrap_future(answer.future())
    # A call nobody waits for any more (its job stopped while it waited for resources, the
    # server closing) fails when its supervisor is killed: its error is seen here, not left
    # to asyncio's "Future exception was never retrieved". An awaiter still gets it.
    future.add_done_callback(_seen)
    return future


def _seen(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


async def ends_at_once(record: JobRecord, finished: asyncio.Future[Any]) -> bool:
    """Whether a job of a shared supervisor (on the head node: no log to pull, no runtime env
    to set up) ends within ENDS_AT_ONCE_S of its hand-over. Such a job needs no question of
    when it started: one call to its supervisor instead of two, and one write of the archive.
    A longer job is archived RUNNING that much later (its KV record says RUNNING at once)."""
    if is_dedicated(record.supervisor_name or ""):
        return False
    done, _ = await asyncio.wait({finished}, timeout=ENDS_AT_ONCE_S)
    return bool(done)


def start_failure(
    record: JobRecord,
    error: JobStartTimeoutError | RuntimeEnvSetupError | ActorUnschedulableError,
) -> JobFailure:
    """Why the job never started, in Ray's terms."""
    if isinstance(error, JobStartTimeoutError):
        return JobFailure(JobErrorType.JOB_SUPERVISOR_ACTOR_START_TIMEOUT, str(error))
    if isinstance(error, RuntimeEnvSetupError):
        # Ray's text is the agent's whole traceback; the status says what and why.
        logger.info("job %s: Ray's runtime env error: %s", record.submission_id, error)
        return JobFailure(
            JobErrorType.RUNTIME_ENV_SETUP_FAILURE,
            describe_setup_failure(str(error), record.spec.runtime_env),
        )
    return JobFailure(
        JobErrorType.JOB_SUPERVISOR_ACTOR_UNSCHEDULABLE, f"The job cannot be scheduled: {error}"
    )
