"""What a job used (issue 35), as the tests of its views build it: attempts with measurements,
and a fake manager's job that ends with them (the real supervisor measures its own)."""

from __future__ import annotations

from jobs_server.manager import JobRecord, JobStatus
from jobs_server.manager.records import JobAttempt, JobErrorType
from tests.support.fakes import FakeJobManager

MEBIBYTE = 1 << 20
GIBIBYTE = 1 << 30


def measured_attempt(
    peak_memory_bytes: int | None,
    cpu_user_s: float | None,
    cpu_system_s: float | None,
    cpu_throttled_s: float | None = None,
    *,
    exit_code: int = 0,
    log_offset: int = 0,
) -> JobAttempt:
    """An attempt that ended and what it used (None: not measured)."""
    return JobAttempt(
        start_time=1_700_000_000_000,
        end_time=1_700_000_001_000,
        exit_code=exit_code,
        log_offset=log_offset,
        peak_memory_bytes=peak_memory_bytes,
        cpu_user_s=cpu_user_s,
        cpu_system_s=cpu_system_s,
        cpu_throttled_s=cpu_throttled_s,
    )


def finish_measured(
    fake: FakeJobManager, submission_id: str, attempts: list[JobAttempt]
) -> JobRecord:
    """End the fake's job with these attempts, as its supervisor would: the last one's exit
    code decides SUCCEEDED or FAILED (one event, the terminal one, carries them all)."""
    exit_code = attempts[-1].exit_code
    status = JobStatus.SUCCEEDED if exit_code == 0 else JobStatus.FAILED
    return fake._update(
        submission_id,
        status=status,
        message=f"Job ended with exit code {exit_code}.",
        error_type=None if exit_code == 0 else JobErrorType.JOB_ENTRYPOINT_COMMAND_ERROR,
        driver_exit_code=exit_code,
        attempts=tuple(attempts),
    )
