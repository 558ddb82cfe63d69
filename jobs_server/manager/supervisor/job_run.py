"""One run of one command in a supervisor: what it is given, its state, its environment, and
what its end says. The supervisor (actor.py) owns the runs and the actor's API."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
from pydantic import BaseModel, ConfigDict

from jobs_server.manager.cluster.ray_metrics import job_env_without_plumbing_setting
from jobs_server.manager.limits import JobLimits, ResourceUsage
from jobs_server.manager.queue.retries import DEFAULT_RETRY_BACKOFF_S, describe_exit
from jobs_server.manager.records import JobRecord, JobSpec
from jobs_server.manager.supervisor.cgroups import DEFAULT_JOBS_CGROUP
from jobs_server.manager.supervisor.drivers import driver_job_metadata
from jobs_server.manager.supervisor.guardian import SUPERVISOR_TOKEN_ENV_VAR
from jobs_server.manager.supervisor.process import JOB_TOKEN_ENV_VAR, StopDeadline
from jobs_server.manager.tenancy import RunAs

# Ray's driver reads its job config (runtime_env, metadata) from this variable, so tasks and
# actors that the entrypoint starts inherit the job's runtime env.
RAY_JOB_CONFIG_ENV_VAR = "RAY_JOB_CONFIG_JSON_ENV_VAR"
SUBMISSION_ID_ENV_VAR = "JOBS_SERVER_SUBMISSION_ID"
JOB_TIMEOUT_ERROR_TYPE = "JOB_TIMEOUT"
NEVER_STARTED_MESSAGE = "Job was stopped before it started."


class SupervisedJob(BaseModel):
    """What a supervisor needs to run one job: the job as its client asked for it (`spec`,
    whose options the supervisor reads there), and what the server decides for this run."""

    model_config = ConfigDict(frozen=True)

    spec: JobSpec
    run_id: str
    """The run of the job this is (see `JobRecord.run_id`)."""
    log_path: Path
    ray_runtime_env: dict[str, Any] | None = None
    """The job's runtime env as Ray is given it, where it is not the spec's (its uploaded
    packages name the tenant's copies: runtime_envs.py); None: the spec's."""
    stop_grace_s: float
    head_node_id: str | None = None
    """The node whose disk holds `log_path` (the server's); a supervisor elsewhere spools the
    log on its own node for the server to pull. None: this node."""
    retry_backoff_s: float = DEFAULT_RETRY_BACKOFF_S
    """The wait before the first retry (doubled for each further one; see retries.py)."""
    start_record_delay_s: float = 0.0
    """How long an attempt runs before its start is written (see attempts.py); 0: at once."""
    run_as: RunAs | None = None
    """The user the command runs as (command_start.py); None: the supervisor's."""
    jobs_cgroup: str | None = DEFAULT_JOBS_CGROUP
    """The cgroup this node's jobs run under (cgroups.py), as the server was told; None: no
    cgroups (--no-job-cgroups)."""

    @property
    def submission_id(self) -> str:
        return self.spec.submission_id


@dataclass
class JobRun:
    """One job in this supervisor: its task and the events the manager can wait for or set."""

    job: SupervisedJob
    log_path: Path
    """Where the command writes: the server's log file, or this node's spool of it."""
    started: asyncio.Event = field(default_factory=asyncio.Event)
    exited: asyncio.Event = field(default_factory=asyncio.Event)
    log_drained: asyncio.Event = field(default_factory=asyncio.Event)
    stop_requested: asyncio.Event = field(default_factory=asyncio.Event)
    stop_deadline: StopDeadline | None = None
    """Set by the first stop (or the timeout); a later stop may bring it forward."""
    task: asyncio.Task[JobRecord | None] | None = None
    pid: int | None = None
    start_began: bool = False
    """The command is being started, or was: from then on, calling the job off stops it."""
    called_off: bool = False
    """Stopped before its start began: the command never starts."""
    on_start_written: Callable[[JobRecord], None] | None = None
    """Told the record once the job's start (RUNNING) is written, if it is before its end."""
    retry_written: JobRecord | None = None
    """The record as last written with an attempt's end that another attempt follows (RUNNING
    still, every attempt in it ended): what the server's long poll for retries is given
    (actor.py `wait_attempt_ended`)."""
    retry_changed: asyncio.Event = field(default_factory=asyncio.Event)
    """Set (and replaced) each time `retry_written` changes."""

    def retry_was_written(self, record: JobRecord) -> None:
        """`record`, with an attempt's end before a retry, is written: wake the polls."""
        self.retry_written = record
        changed, self.retry_changed = self.retry_changed, asyncio.Event()
        changed.set()

    async def wait_retry_beyond(self, ended_attempts: int) -> JobRecord | None:
        """The record as written with more than `ended_attempts` attempts ended before a retry,
        once there is one; None once the run has ended without one."""
        assert self.task is not None
        while True:
            written = self.retry_written
            if written is not None and len(written.attempts) > ended_attempts:
                return written
            if self.task.done():
                return None
            changed = asyncio.ensure_future(self.retry_changed.wait())
            try:
                await asyncio.wait({self.task, changed}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                changed.cancel()


@dataclass(frozen=True)
class CommandEnd:
    """How a command ended: on its own, or stopped (by a stop, or by its timeout)."""

    exit_code: int
    stopped: bool


def driver_env(job: SupervisedJob, job_token: str, supervisor_token: str) -> dict[str, str]:
    """The environment of a job's command: the node's, less the server's settings, with the
    job's env_vars, its Ray job config and the markers its processes are found by."""
    # The server's settings (its token among them) are not the job's, even on a node that
    # was started with them in its environment.
    env = {
        name: value
        for name, value in os.environ.items()
        if not name.upper().startswith("JOBS_SERVER_")
    }
    job_env_without_plumbing_setting(env)
    # A shared supervisor runs jobs with different env_vars: each process gets its own.
    env.update(job.spec.runtime_env.get("env_vars") or {})
    # `python` in an entrypoint is the interpreter that runs Ray here (the runtime env's
    # virtualenv, if it has one), not whatever comes first on the node's PATH.
    python_bin_dir = os.path.dirname(sys.executable)
    env["PATH"] = os.pathsep.join([python_bin_dir, env.get("PATH", os.defpath)])
    env.update(
        {
            "RAY_ADDRESS": ray.get_runtime_context().gcs_address,
            RAY_JOB_CONFIG_ENV_VAR: json.dumps(
                {
                    "runtime_env": (
                        job.spec.runtime_env if job.ray_runtime_env is None else job.ray_runtime_env
                    ),
                    # As Ray's supervisor: the driver's job names its submission.
                    "metadata": driver_job_metadata(job.submission_id, job.spec.metadata),
                }
            ),
            # Python drivers stream their output instead of flushing it at exit.
            "PYTHONUNBUFFERED": "1",
            SUBMISSION_ID_ENV_VAR: job.submission_id,
            JOB_TOKEN_ENV_VAR: job_token,
            SUPERVISOR_TOKEN_ENV_VAR: supervisor_token,
        }
    )
    if job.run_as is not None:
        env.update(HOME=job.run_as.home, USER=job.run_as.name, LOGNAME=job.run_as.name)
    return env


def end_grace_within(run: JobRun, grace_period_s: float) -> StopDeadline:
    """Start the job's grace period, or bring a running one forward to end within
    `grace_period_s` from now."""
    if run.stop_deadline is None:
        run.stop_deadline = StopDeadline.after(grace_period_s)
    else:
        run.stop_deadline.shorten_to(grace_period_s)
    return run.stop_deadline


# The share of its own memory limit a job killed for it has reached (its cgroup's peak reaches
# the limit, give or take a page).
OWN_LIMIT_REACHED = 0.99


def out_of_memory_message(
    limits: JobLimits | None,
    usage: ResourceUsage,
    exit_code: int,
    log_tail: str,
    why_it_ended: str = "",
) -> str:
    """What a job the kernel killed for memory says: its limit (the job's own, else the
    head's ceiling for all the jobs there), its peak, and its last output."""
    limit = limits.memory_bytes if limits is not None else None
    peak = usage.peak_memory_bytes
    # A cgroup killed at its own limit peaked at it; below it, the ceiling of all the node's
    # jobs was reached first.
    at_its_own = limit is not None and (peak is None or peak >= limit * OWN_LIMIT_REACHED)
    which = (
        f"its memory limit of {format_bytes(limit)}"
        if at_its_own and limit is not None
        else "the memory ceiling of the node's jobs (--head-jobs-memory-max-bytes on the head)"
    )
    message = (
        f"Job ran out of memory: the kernel killed it at {which}"
        f"{'' if peak is None else f' (peak {format_bytes(peak)})'}"
        f"; its command {describe_exit(exit_code)}{why_it_ended}."
    )
    if log_tail:
        message += f" Last output:\n{log_tail}"
    return message


def format_bytes(count: int) -> str:
    """`count` bytes in binary units, as a person reads them (100 MiB)."""
    value, unit = float(count), "bytes"
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            break
        value /= 1024
    return f"{count} bytes" if unit == "bytes" else f"{value:.4g} {unit}"


def failure_message(exit_code: int, log_tail: str, why_it_ended: str = "") -> str:
    """What a failed job's status says: how its command ended (`why_it_ended` adds to it, e.g.
    ' after 3 attempts (no retries left)'), and its last output."""
    message = f"Job entrypoint command {describe_exit(exit_code)}{why_it_ended}."
    if log_tail:
        message += f" Last output:\n{log_tail}"
    return message
