"""Job records as stored in the GCS KV store: immutable, one model per record."""

from __future__ import annotations

import functools
import random
import time
from collections.abc import Callable
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from jobs_server.manager.limits import JobLimits
from jobs_server.manager.tenancy import DEFAULT_TENANT
from jobs_server.manager.webhook_events import NotifyTarget

# Parses a server's caching_record_parser keeps: a couple of thousand live jobs (~4 KiB each).
PARSED_RECORDS_KEPT = 2048

# A queued job's priority: higher first (queue/admission.py), within these bounds.
MIN_PRIORITY = -1000
MAX_PRIORITY = 1000


class JobStatus(StrEnum):
    """Ray's job statuses; Ray's SDK rejects any other value."""

    PENDING = "PENDING"
    RUNNING = "RUNNING"
    STOPPED = "STOPPED"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"

    def is_terminal(self) -> bool:
        """A terminal status is final: nothing may change it afterwards."""
        return self in _TERMINAL_STATUSES


_TERMINAL_STATUSES = frozenset({JobStatus.STOPPED, JobStatus.SUCCEEDED, JobStatus.FAILED})


class JobErrorType(StrEnum):
    """Why a job failed; the values are Ray's, so its clients can match on them."""

    RUNTIME_ENV_SETUP_FAILURE = "RUNTIME_ENV_SETUP_FAILURE"
    JOB_SUPERVISOR_ACTOR_START_TIMEOUT = "JOB_SUPERVISOR_ACTOR_START_TIMEOUT"
    JOB_SUPERVISOR_ACTOR_START_FAILURE = "JOB_SUPERVISOR_ACTOR_START_FAILURE"
    JOB_SUPERVISOR_ACTOR_UNSCHEDULABLE = "JOB_SUPERVISOR_ACTOR_UNSCHEDULABLE"
    JOB_SUPERVISOR_ACTOR_DIED = "JOB_SUPERVISOR_ACTOR_DIED"
    JOB_ENTRYPOINT_COMMAND_START_ERROR = "JOB_ENTRYPOINT_COMMAND_START_ERROR"
    JOB_ENTRYPOINT_COMMAND_ERROR = "JOB_ENTRYPOINT_COMMAND_ERROR"
    JOB_OUT_OF_MEMORY = "JOB_OUT_OF_MEMORY"
    """Ours: the kernel killed the command's processes for its memory limit."""
    DEPENDENCY_NEVER_SATISFIED = "DEPENDENCY_NEVER_SATISFIED"
    """Ours: a job it depends on ended otherwise than its condition asks (or was deleted), so
    its command never ran."""


class DependencyCondition(StrEnum):
    """What a job waits for of a job it depends on (Slurm's afterok, afternotok, afterany)."""

    SUCCEEDED = "succeeded"
    FAILED = "failed"
    """It ended FAILED or STOPPED: anything but success (Slurm's afternotok)."""
    ENDED = "ended"

    def holds(self, status: JobStatus) -> bool:
        """Whether a job with `status` satisfies the condition (only a terminal one can)."""
        if not status.is_terminal():
            return False
        if self is DependencyCondition.SUCCEEDED:
            return status is JobStatus.SUCCEEDED
        if self is DependencyCondition.FAILED:
            return status is not JobStatus.SUCCEEDED
        return True

    def can_still_hold(self, status: JobStatus | None) -> bool:
        """Whether the condition holds or may yet (None: the job was deleted, so it never
        will unless it already held)."""
        return status is not None and (not status.is_terminal() or self.holds(status))


class JobDependency(BaseModel):
    """A job this one waits for, and what it waits for of it."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    submission_id: str
    condition: DependencyCondition = DependencyCondition.SUCCEEDED


def new_run_id() -> str:
    """A new run's id: unique per submission, short enough for actor names and KV keys."""
    # 64 random bits from `random` (seeded from the system's randomness, and again in a forked
    # child): it need not be secret, and a read of the system's randomness per job (uuid4) was
    # 1.6 % of a burst's event loop.
    return f"{random.getrandbits(64):016x}"


def now_ms() -> int:
    """Wall-clock time in unix milliseconds, the unit of Ray's start_time and end_time."""
    return int(time.time() * 1000)


class JobSpec(BaseModel):
    """What a client asked for: validated once at the boundary, then never changed."""

    # The boundary (api_models) refuses unknown fields; here a field that a newer server added
    # is ignored, so a supervisor that runs an older server's code can still read the record.
    model_config = ConfigDict(frozen=True, extra="ignore")

    entrypoint: str
    submission_id: str
    runtime_env: dict[str, Any] = Field(default_factory=dict)
    metadata: dict[str, str] = Field(default_factory=dict)
    entrypoint_num_cpus: float | None = None
    entrypoint_num_gpus: float | None = None
    entrypoint_memory: int | None = None
    entrypoint_resources: dict[str, float] = Field(default_factory=dict)
    entrypoint_label_selector: dict[str, str] = Field(default_factory=dict)
    timeout_s: float | None = None
    priority: int = Field(0, ge=MIN_PRIORITY, le=MAX_PRIORITY)
    max_retries: int = 0
    """Failed attempts retried after the first (see manager/queue/retries.py)."""
    retry_on_exit_codes: tuple[int, ...] | None = None
    """The exit codes that are retried; None: any non-zero one."""
    limits: JobLimits | None = None
    """The limits each attempt runs under: the effective ones (limits.py), defaults filled in
    at submit; None: none."""
    depends_on: tuple[JobDependency, ...] = ()
    """Jobs that must end as their conditions say before this one enters the queue (each of
    the same tenant, and in the archive at its submit: no cycle can form)."""
    notify: tuple[NotifyTarget, ...] = ()
    """Webhooks of this job's own, beside its tenant's (webhook_events.py)."""

    def needs_own_supervisor(self) -> bool:
        """A runtime env beyond env_vars, or resources, need an actor of the job's own; any other
        job can run in a warm, shared supervisor (env_vars are set per process there)."""
        return bool(
            set(self.runtime_env) - {"env_vars"}
            or self.requested_resources()
            or self.entrypoint_label_selector
        )

    def requested_resources(self) -> dict[str, float]:
        """The resources the job's supervisor asks Ray for, by Ray's resource names."""
        requested = dict(self.entrypoint_resources)
        for name, amount in (
            ("CPU", self.entrypoint_num_cpus),
            ("GPU", self.entrypoint_num_gpus),
            ("memory", self.entrypoint_memory),
        ):
            if amount:
                requested[name] = float(amount)
        return requested


class JobAttempt(BaseModel):
    """One run of the job's command: when it ran, how it ended, and where its output begins in
    the job's log (its byte offset), so that a reader can split the log by attempt."""

    model_config = ConfigDict(frozen=True)

    start_time: int
    end_time: int | None = None
    exit_code: int | None = None
    log_offset: int
    # What it used (limits.py `ResourceUsage`), written with its end; None while it runs, where
    # it could not be measured, and in a record an earlier server wrote.
    peak_memory_bytes: int | None = None
    cpu_user_s: float | None = None
    cpu_system_s: float | None = None
    cpu_throttled_s: float | None = None


class RayDriver(BaseModel):
    """A Ray driver: its job id (hex) and where it runs, as in Ray's `DriverInfo`."""

    model_config = ConfigDict(frozen=True)

    job_id: str
    node_ip_address: str
    pid: int


class JobRecord(BaseModel):
    """A job's spec and its current state; a new record replaces the old on every change."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    spec: JobSpec
    status: JobStatus = JobStatus.PENDING
    message: str | None = None
    error_type: str | None = None
    start_time: int | None = None
    end_time: int | None = None
    driver_exit_code: int | None = None
    driver_pid: int | None = None
    driver_node_id: str | None = None
    driver_node_ip: str | None = None
    ray_driver: RayDriver | None = None
    """The (last) Ray driver the job's command started, as Ray's job table had it when the job
    ended: kept with the run, since the job table is the cluster's and a restarted one has
    forgotten it. None while the job runs (drivers.py looks it up then), and for a command
    that started none."""
    supervisor_name: str | None = None
    supervisor_actor_id: str | None = None
    """The incarnation of `supervisor_name` that runs the job (its Ray actor id), written with
    RUNNING: a new actor under the same name never ran it."""
    run_id: str = ""
    """Unique per submission: a deleted and resubmitted id is another run, and nothing of the
    old run (its end, its supervisor) applies to the new one."""
    attempts: tuple[JobAttempt, ...] = ()
    """The command's attempts so far, in order; written by the supervisor as each begins and
    ends."""
    tenant: str = DEFAULT_TENANT
    """Whose job it is: the tenant of the key that submitted it."""
    handed_over_time: int | None = None
    """When the job was handed to its supervisor (unix ms): its start timeout counts from here,
    not from its submit (`start_time`), so time spent in the queue is not time spent starting.
    None in a record an earlier server wrote: the start timeout counts from `start_time`."""
    dependencies_held: tuple[str, ...] = ()
    """Jobs it depends on whose condition held and that were deleted while it still waited
    for others: written before such a deletion, so a recovery that finds them gone knows they
    held."""
    dependencies_met_time: int | None = None
    """When every job it depends on had ended as its condition asks (unix ms): it entered the
    queue then. None while it waits, and for a job without dependencies."""
    log_dir_id: str | None = None
    """The id of the log directory the job's log is written to (logs.py `log_dir_id`), set at
    its hand-over: a server on another log directory answers its log reads 503 rather than an
    empty log. None before the hand-over, and in a record an earlier server wrote."""

    @property
    def submission_id(self) -> str:
        return self.spec.submission_id

    def with_changes(self, **changes: Any) -> JobRecord:
        """Return a copy with `changes` applied and validated."""
        return JobRecord.model_validate({**self.model_dump(), **changes})


RecordParser = Callable[[str | bytes], JobRecord]


def parse_record(text: str | bytes) -> JobRecord:
    """The record stored as `text` (the KV's bytes, or the archive's str of the same JSON)."""
    return JobRecord.model_validate_json(text)


def caching_record_parser(kept: int = PARSED_RECORDS_KEPT) -> RecordParser:
    """`parse_record` that keeps its last `kept` parses by text, for the server's reads.

    A list filtered by status reads every live job, and a dashboard polls it: the same texts
    come back again and again, and parsing them was most of such a list's CPU (with 1,000 jobs
    running, 75-105 ms of server CPU per poll before, 27-44 ms after). A record is immutable
    (`with_changes` copies), so one parse of a text can serve every reader; a live job's
    archived text is its KV text, so one parse serves both. Made per owner, never at import:
    this package is pickled by value into the supervisors, and a module-level cache would be
    imported there by reference, with its own classes."""

    @functools.lru_cache(maxsize=kept)
    def parse_text(text: str) -> JobRecord:
        return JobRecord.model_validate_json(text)

    def parse(text: str | bytes) -> JobRecord:
        return parse_text(text.decode() if isinstance(text, bytes) else text)

    return parse
