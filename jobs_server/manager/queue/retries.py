"""Retries of a failed command: whether an attempt is retried, after how long, and what the job's
status says meanwhile. No I/O here: the supervisor's attempt loop (attempts.py) applies it.

As a Kubernetes Job's backoff: the first retry waits the base (`--retry-backoff-s`), each further
one twice the one before, never more than five minutes. The job's `timeout_s` bounds all of its
attempts and the waits between them together (as a Job's `activeDeadlineSeconds`): a job that
must end within an hour does, however often it is retried.
"""

from __future__ import annotations

import signal

DEFAULT_RETRY_BACKOFF_S = 10.0
MAX_RETRY_BACKOFF_S = 300.0
# Each attempt is a record entry and a start of the command: bounded, like the rest of a record.
MAX_RETRIES = 100
# Exit codes as `driver_exit_code` reports them: 1-255, or -N for a command killed by signal N.
MIN_EXIT_CODE = -64
MAX_EXIT_CODE = 255
MAX_RETRY_EXIT_CODES = 256


def retry_backoff_s(base_s: float, retry: int) -> float:
    """The wait before retry number `retry` (1 for the first): `base_s`, doubled for each retry
    before it, at most MAX_RETRY_BACKOFF_S."""
    # Capped before it is raised: 2.0 ** 100 is finite, but nothing is gained by computing it.
    doublings = min(retry - 1, 32)
    return min(base_s * 2.0**doublings, MAX_RETRY_BACKOFF_S)


def why_not_retried(
    exit_code: int,
    attempts_ran: int,
    *,
    max_retries: int,
    retry_on_exit_codes: tuple[int, ...] | None,
) -> str | None:
    """Why a failed attempt (non-zero `exit_code`, the `attempts_ran`th) ends the job; None if it
    is retried."""
    if attempts_ran > max_retries:
        return "no retries left"
    if retry_on_exit_codes is not None and exit_code not in retry_on_exit_codes:
        return f"exit code {exit_code} is not in retry_on_exit_codes"
    return None


def describe_exit(exit_code: int) -> str:
    """How a command ended, as a status message says it: 'failed with exit code 3'."""
    if exit_code >= 0:
        return f"failed with exit code {exit_code}"
    try:
        signal_name = signal.Signals(-exit_code).name
    except ValueError:
        signal_name = str(-exit_code)
    return f"was killed by signal {signal_name}"


def running_message(attempt: int, max_retries: int) -> str:
    """A RUNNING job's message while attempt number `attempt` runs."""
    if not max_retries:
        return "Job is currently running."
    return f"Job is currently running (attempt {attempt} of {max_retries + 1})."


def backoff_message(attempt: int, max_retries: int, exit_code: int, delay_s: float) -> str:
    """A RUNNING job's message between attempt number `attempt` and the next."""
    return (
        f"Attempt {attempt} of {max_retries + 1} {describe_exit(exit_code)}; attempt"
        f" {attempt + 1} starts in {delay_s:g} s."
    )


def attempts_ran(count: int) -> str:
    """'after 1 attempt', 'after 3 attempts'."""
    return f"after {count} attempt{'' if count == 1 else 's'}"
