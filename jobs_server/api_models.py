"""Request and response bodies of the HTTP API: Ray's Jobs API shapes plus our extensions."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Mapping
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from jobs_server.manager import JobRecord, JobSpec, JobStatus, RayDriver
from jobs_server.manager import limits as stored_limits
from jobs_server.manager.archive.events import JobEvent
from jobs_server.manager.archive.outbox import DeliveryState, WebhookDelivery
from jobs_server.manager.queue.dependency_waits import (
    met_by_record,
    needs_wait,
    waiting_message,
)
from jobs_server.manager.queue.retries import (
    MAX_EXIT_CODE,
    MAX_RETRIES,
    MAX_RETRY_EXIT_CODES,
    MIN_EXIT_CODE,
)
from jobs_server.manager.records import (
    MAX_PRIORITY,
    MIN_PRIORITY,
    DependencyCondition,
    JobAttempt,
)
from jobs_server.manager.replica import ReplicaState
from jobs_server.manager.webhook_events import (
    ALL_WEBHOOK_EVENTS,
    MAX_NOTIFY_TARGETS,
    NotifyTarget,
    WebhookEventType,
    WebhookUrl,
)

SUBMISSION_ID_PATTERN = r"^[A-Za-z0-9._-]{1,255}$"
# Records live in the GCS and are listed whole: keep each one small.
MAX_METADATA_BYTES = 64 * 1024
MAX_RUNTIME_ENV_BYTES = 256 * 1024


def _not_dot_path(value: str) -> str:
    if value in {".", ".."}:
        raise ValueError("must not be '.' or '..'")
    return value


def _command(value: str) -> str:
    if "\x00" in value:
        raise ValueError("must not contain NUL characters")
    if not value.strip():
        raise ValueError("must not be blank")
    return value


def _env_var_problem(name: str, value: object) -> str | None:
    """Why a process environment cannot hold `name=value` (None: it can)."""
    if not name:
        return "runtime_env.env_vars: a name must not be empty"
    if "\x00" in name or "=" in name:
        return f"runtime_env.env_vars: the name {name!r} must not contain NUL or '='"
    if isinstance(value, str) and "\x00" in value:
        return f"runtime_env.env_vars.{name} must not contain NUL characters"
    return None


@functools.cache
def shared_fields(source: type[BaseModel], target: type[BaseModel]) -> tuple[str, ...]:
    """The fields `target` declares that `source` declares too (by name): a job's options pass
    from the request to the spec, and from the spec to its details, by these names. Computed once
    per pair of models: from_record runs for every job of a list."""
    return tuple(name for name in target.model_fields if name in source.model_fields)


def _retried_exit_codes(codes: list[int]) -> list[int]:
    if 0 in codes:
        raise ValueError("0 is success, never retried: list non-zero exit codes")
    return codes


SubmissionId = Annotated[str, Field(pattern=SUBMISSION_ID_PATTERN), AfterValidator(_not_dot_path)]
# Ray counts resources in units of 1/10000 and refuses finer fractions.
RESOURCE_PRECISION = 10_000
MAX_RESOURCE_QUANTITY = 1e12


def _resource_quantity(value: float) -> float:
    # Checked here rather than with multiple_of, whose float division refuses 0.3.
    scaled = value * RESOURCE_PRECISION
    if abs(scaled - round(scaled)) > 1e-6 * max(1.0, scaled):
        raise ValueError("must be a multiple of 0.0001 (Ray's resource precision)")
    return value


# Strict: `true` is not a number of CPUs, nor "1" (Ray's clients send real numbers).
NonNegativeNumber = Annotated[float, Field(ge=0, allow_inf_nan=False, strict=True)]
ResourceQuantity = Annotated[
    float,
    Field(
        ge=0,
        le=MAX_RESOURCE_QUANTITY,
        allow_inf_nan=False,
        strict=True,
        json_schema_extra={"multipleOf": 1 / RESOURCE_PRECISION},
    ),
    AfterValidator(_resource_quantity),
]


class JobLimitsRequest(stored_limits.JobLimits):
    """Extension: `limits` in a submit (limits.py); unknown fields are a client's mistake."""

    model_config = ConfigDict(frozen=True, extra="forbid")


class JobLimits(stored_limits.JobLimits):
    """Extension: the limits a job runs under, in its details (every field, null for none)."""


# A job waits for at most this many others (a fan-in; a chain is one each).
MAX_DEPENDENCIES = 100


class JobDependencyRequest(BaseModel):
    """Extension: a job the submitted one waits for (`depends_on`), and what it waits for."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    submission_id: SubmissionId
    condition: DependencyCondition = DependencyCondition.SUCCEEDED


class NotifyRequest(BaseModel):
    """Extension: a webhook of the job's own (`notify`), signed with its tenant's secret."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    url: WebhookUrl
    events: Annotated[list[WebhookEventType], Field(min_length=1)] = Field(
        default_factory=lambda: list(ALL_WEBHOOK_EVENTS)
    )


def _distinct_dependencies(
    dependencies: list[JobDependencyRequest],
) -> list[JobDependencyRequest]:
    seen: set[str] = set()
    for dependency in dependencies:
        if dependency.submission_id in seen:
            raise ValueError(f"{dependency.submission_id!r} is listed more than once")
        seen.add(dependency.submission_id)
    return dependencies


class SubmitJobRequest(BaseModel):
    """`POST /api/jobs/`: what Ray's `JobSubmissionClient.submit_job` sends."""

    model_config = ConfigDict(extra="forbid", strict=False)

    entrypoint: Annotated[str, Field(min_length=1, max_length=128 * 1024), AfterValidator(_command)]
    submission_id: SubmissionId | None = None
    job_id: SubmissionId | None = Field(None, description="Deprecated alias of submission_id.")
    runtime_env: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    entrypoint_num_cpus: ResourceQuantity | None = None
    entrypoint_num_gpus: ResourceQuantity | None = None
    entrypoint_memory: Annotated[int, Field(ge=0, le=2**62, strict=True)] | None = None
    entrypoint_resources: dict[str, ResourceQuantity] | None = None
    entrypoint_label_selector: dict[str, str] | None = None
    timeout_s: Annotated[float, Field(gt=0, allow_inf_nan=False, strict=True)] | None = Field(
        None, description="Extension: stop the job and fail it when it runs longer than this."
    )
    priority: Annotated[int, Field(ge=MIN_PRIORITY, le=MAX_PRIORITY, strict=True)] = Field(
        0, description="Extension: a queued job's priority, higher first."
    )
    max_retries: Annotated[int, Field(ge=0, le=MAX_RETRIES, strict=True)] | None = Field(
        None, description="Extension: failed attempts retried after the first (null: 0)."
    )
    retry_on_exit_codes: (
        Annotated[
            list[Annotated[int, Field(ge=MIN_EXIT_CODE, le=MAX_EXIT_CODE, strict=True)]],
            Field(min_length=1, max_length=MAX_RETRY_EXIT_CODES),
            AfterValidator(_retried_exit_codes),
        ]
        | None
    ) = Field(None, description="Extension: the exit codes retried (null: any non-zero).")
    limits: JobLimitsRequest | None = Field(
        None, description="Extension: memory, CPU and processes the job may use (enforced)."
    )
    depends_on: (
        Annotated[
            list[JobDependencyRequest],
            Field(max_length=MAX_DEPENDENCIES),
            AfterValidator(_distinct_dependencies),
        ]
        | None
    ) = Field(None, description="Extension: jobs that must end first, and how.")
    notify: Annotated[list[NotifyRequest], Field(max_length=MAX_NOTIFY_TARGETS)] | None = Field(
        None, description="Extension: webhooks of the job's own."
    )

    @model_validator(mode="after")
    def _bounded_sizes(self) -> SubmitJobRequest:
        env_vars = (self.runtime_env or {}).get("env_vars")
        if isinstance(env_vars, dict):
            for name, value in env_vars.items():
                problem = _env_var_problem(str(name), value)
                if problem is not None:
                    raise ValueError(problem)
        for name, limit in (
            ("metadata", MAX_METADATA_BYTES),
            ("runtime_env", MAX_RUNTIME_ENV_BYTES),
        ):
            value = getattr(self, name)
            if value is not None and len(json.dumps(value)) > limit:
                raise ValueError(f"{name} is larger than {limit} bytes of JSON")
        return self

    def to_spec(self, new_submission_id: Callable[[], str]) -> JobSpec:
        """The job to run; `new_submission_id()` names it if the request did not. Every option
        the spec declares under the same name is taken as it is (pydantic converts a list to
        the spec's tuple, and a nested model's fields to the spec's model: `limits`), a null
        one as the spec's default: a new option is declared here and in `JobSpec`, and copied
        nowhere."""
        options = {
            name: _plain(value)
            for name in shared_fields(type(self), JobSpec)
            if (value := getattr(self, name)) is not None
        }
        options["submission_id"] = self.submission_id or self.job_id or new_submission_id()
        return JobSpec(**options)


def _plain(value: Any) -> Any:
    """A request's option as the spec takes it: models (alone or in a list) as their fields."""
    if isinstance(value, BaseModel):
        return value.model_dump()
    if isinstance(value, list):
        return [_plain(item) for item in value]
    return value


class SubmitJobResponse(BaseModel):
    job_id: str = Field(description="Same as submission_id (Ray keeps it for old clients).")
    submission_id: str


class StopJobRequest(BaseModel):
    """Optional body of `POST /api/jobs/{id}/stop` (an extension; Ray's clients send none)."""

    model_config = ConfigDict(extra="forbid")

    grace_period_s: NonNegativeNumber | None = None


class StopJobResponse(BaseModel):
    stopped: bool


class DeleteJobResponse(BaseModel):
    deleted: bool


class JobLogsResponse(BaseModel):
    logs: str


class JobLogsRangeResponse(BaseModel):
    """`GET .../logs?offset=&limit=`: a byte range as text, and where the next read starts."""

    offset: int
    logs: str
    next_offset: int = Field(description="Byte offset after the returned text.")
    size: int = Field(description="The log's size in bytes when the read ended.")


class VersionResponse(BaseModel):
    version: str
    ray_version: str
    ray_commit: str
    session_name: str | None
    containment: Literal["pid_namespace", "cgroup", "marker"] = Field(
        description="Extension: what holds each job's processes together on the head node."
    )
    limits: Literal["cgroup2", "cgroup1", "none"] = Field(
        description="Extension: how the head node enforces and measures jobs' limits."
    )


class DiskHealth(BaseModel):
    """Extension: the free space of the disk that holds the jobs' history and logs."""

    free_bytes: int = Field(description="Free bytes on the fullest of the server's disks.")
    min_free_bytes: int = Field(description="The threshold, --min-free-disk-bytes.")
    low: bool = Field(description="Below the threshold: submits and uploads are refused (507).")


class DatabaseHealth(BaseModel):
    """Extension: the database that holds this replica's history."""

    backend: Literal["sqlite", "postgresql"] = Field(
        description="SQLite in the state dir (the default), or PostgreSQL (--database-url)."
    )
    connected: bool = Field(
        description="Whether it answered a trivial read within 1 s just now (SQLite: always)."
    )


class ReplicaHealth(BaseModel):
    """Extension: this replica (server process), as it knows itself."""

    id: str = Field(
        description="host:pid:random; on PostgreSQL the holder its leases name.",
        examples=["head-0:4242:9f2c1a7be310"],
    )
    role: Literal["leader", "follower"] = Field(
        description="`leader`: it does the work of every replica on its database (watches the"
        " live jobs, runs the queue); `follower`: it answers reads and forwards job writes to"
        " the leader. On SQLite: leader."
    )
    database: DatabaseHealth
    jobs_owned: int | None = Field(
        description="The live jobs it answers for: watched (handed to a supervisor, not yet"
        " ended) or waiting in its queue. They count every tenant's jobs: null unless the"
        " caller may see every tenant's (an admin key, or a server without keys)."
    )
    leases_held: list[str] = Field(
        description="The leases it holds on its PostgreSQL database (`server`: held by the"
        " leader); none on SQLite."
    )

    @classmethod
    def from_state(cls, state: ReplicaState, *, sees_every_tenant: bool) -> ReplicaHealth:
        return cls(
            id=state.replica_id,
            role=state.role,
            database=DatabaseHealth(
                backend=state.database_backend, connected=state.database_connected
            ),
            jobs_owned=state.jobs_owned if sees_every_tenant else None,
            leases_held=list(state.leases_held),
        )


class HealthResponse(BaseModel):
    status: Literal["ok"] = "ok"
    disk: DiskHealth
    replica: ReplicaHealth


class PackageResponse(BaseModel):
    uri: str


class JobAttemptDetails(BaseModel):
    """Extension: one run of a job's command (a job with retries has several)."""

    start_time: int
    end_time: int | None
    exit_code: int | None
    log_offset: int = Field(description="Byte offset in the job's log where its output begins.")
    peak_memory_bytes: int | None = Field(description="Its memory's high-water mark.")
    cpu_user_s: float | None
    cpu_system_s: float | None
    cpu_throttled_s: float | None = Field(description="Time its CPU limit held it back.")

    @classmethod
    def from_attempt(cls, attempt: JobAttempt) -> JobAttemptDetails:
        return cls(**{name: getattr(attempt, name) for name in cls.model_fields})


class JobDependencyDetails(BaseModel):
    """Extension: a job this one depends on, its condition, and whether it is met now."""

    submission_id: str
    condition: DependencyCondition
    met: bool | None = Field(
        description="Whether that job has ended as the condition asks (null: not known here)."
    )


class NotifyTargetDetails(BaseModel):
    """Extension: a webhook of the job's own."""

    url: str
    events: list[WebhookEventType]

    @classmethod
    def from_target(cls, target: NotifyTarget) -> NotifyTargetDetails:
        return cls(url=target.url, events=list(target.events))


class JobDetails(BaseModel):
    """Ray's `JobDetails`: every field present, null where unknown."""

    type: Literal["SUBMISSION"] = "SUBMISSION"
    job_id: str | None
    submission_id: str
    driver_info: dict[str, str] | None
    status: JobStatus
    entrypoint: str
    message: str | None
    error_type: str | None
    start_time: int | None
    end_time: int | None
    metadata: dict[str, str]
    runtime_env: dict[str, Any]
    driver_agent_http_address: str | None
    driver_node_id: str | None
    driver_exit_code: int | None
    entrypoint_num_cpus: float | None
    entrypoint_num_gpus: float | None
    entrypoint_memory: int | None
    entrypoint_resources: dict[str, float] | None
    timeout_s: float | None
    max_retries: int
    retry_on_exit_codes: list[int] | None
    attempts: list[JobAttemptDetails]
    tenant: str = Field(description="Extension: the tenant whose key submitted the job.")
    priority: int
    limits: JobLimits | None = Field(description="Extension: the limits it runs under.")
    peak_memory_bytes: int | None = Field(description="Extension: its last attempt's.")
    cpu_user_s: float | None = Field(description="Extension: its last attempt's.")
    cpu_system_s: float | None = Field(description="Extension: its last attempt's.")
    depends_on: list[JobDependencyDetails] = Field(
        description="Extension: the jobs it waits for (or waited for), and which are met."
    )
    notify: list[NotifyTargetDetails] = Field(description="Extension: its own webhooks.")

    @classmethod
    def from_record(
        cls,
        record: JobRecord,
        driver: RayDriver | None = None,
        *,
        dependencies_met: Mapping[str, bool] | None = None,
    ) -> JobDetails:
        """The job's details; `driver` is the Ray driver its command started, if it did (by
        default the one written with the job's end); `dependencies_met`: by submission id,
        whether each job it depends on has met its condition now (None: what the record
        alone tells, the rest not known); a job still waiting for some of them names those in
        its message (every replica says the same; the record's was written when it was)."""
        spec = record.spec
        if driver is None:
            driver = record.ray_driver
        driver_info = None
        if driver is not None:
            # As Ray's server: the driver's job id, and where the driver runs.
            driver_info = {
                "id": driver.job_id,
                "node_ip_address": driver.node_ip_address,
                "pid": str(driver.pid),
            }
        elif record.driver_pid is not None:
            driver_info = {
                "id": spec.submission_id,
                "node_ip_address": record.driver_node_ip or "",
                "pid": str(record.driver_pid),
            }
        # The job's options as the spec has them: every one these details declare.
        options = {name: getattr(spec, name) for name in shared_fields(type(spec), cls)}
        # Ray's: null when the job asked for none.
        options["entrypoint_resources"] = spec.entrypoint_resources or None
        if spec.limits is not None:
            options["limits"] = JobLimits(**spec.limits.model_dump())
        met = met_by_record(record) if dependencies_met is None else dependencies_met
        options["depends_on"] = [
            JobDependencyDetails(
                submission_id=dependency.submission_id,
                condition=dependency.condition,
                met=met.get(dependency.submission_id),
            )
            for dependency in spec.depends_on
        ]
        options["notify"] = [NotifyTargetDetails.from_target(target) for target in spec.notify]
        message = record.message
        if dependencies_met is not None and needs_wait(record):
            unmet = [d for d in spec.depends_on if dependencies_met.get(d.submission_id) is False]
            if unmet and record.status is JobStatus.PENDING:
                message = waiting_message(unmet, len(spec.depends_on))
        last_attempt = record.attempts[-1] if record.attempts else None
        return cls(
            **options,
            # Ray's job_id names a Ray driver; a shell command may never start one.
            job_id=driver.job_id if driver is not None else None,
            driver_info=driver_info,
            status=record.status,
            message=message,
            error_type=record.error_type,
            start_time=record.start_time,
            end_time=record.end_time,
            driver_agent_http_address=None,
            driver_node_id=record.driver_node_id,
            driver_exit_code=record.driver_exit_code,
            attempts=[JobAttemptDetails.from_attempt(attempt) for attempt in record.attempts],
            tenant=record.tenant,
            peak_memory_bytes=last_attempt.peak_memory_bytes if last_attempt else None,
            cpu_user_s=last_attempt.cpu_user_s if last_attempt else None,
            cpu_system_s=last_attempt.cpu_system_s if last_attempt else None,
        )


class WebhookDeliveryDetails(BaseModel):
    """Extension: one webhook delivery of a job's event, and its attempts so far."""

    id: str = Field(description="Its `webhook-id` header: the same at every attempt.")
    event_id: int = Field(description="The event (`GET /api/events`) that caused it.")
    event_type: WebhookEventType
    url: str
    state: DeliveryState
    attempts: int
    created_at: int
    last_attempt_at: int | None
    next_attempt_at: int | None = Field(description="When it is tried again (pending only).")
    last_status_code: int | None
    last_error: str | None
    delivered_at: int | None

    @classmethod
    def from_delivery(cls, delivery: WebhookDelivery) -> WebhookDeliveryDetails:
        pending = delivery.state is DeliveryState.PENDING
        return cls(
            id=delivery.id,
            event_id=delivery.event_id,
            event_type=delivery.event_type,
            url=delivery.url,
            state=delivery.state,
            attempts=delivery.attempts,
            created_at=delivery.created_ms,
            last_attempt_at=delivery.last_attempt_ms,
            next_attempt_at=delivery.next_attempt_ms if pending else None,
            last_status_code=delivery.last_status_code,
            last_error=delivery.last_error,
            delivered_at=delivery.delivered_ms,
        )


class JobDeliveriesResponse(BaseModel):
    """Extension: `GET /api/jobs/{id}/deliveries`, oldest first."""

    deliveries: list[WebhookDeliveryDetails]


class WebhookPayload(BaseModel):
    """Extension: the body of a webhook POST (Standard Webhooks' envelope): the event's type,
    when it happened, its id in the event stream, and the job's details as they were then. An
    envelope, not the details with fields added: the details have a `type` of their own."""

    type: WebhookEventType
    timestamp: str = Field(description="When the event happened (ISO 8601, UTC).")
    event_id: int
    data: JobDetails


class StreamedJobEvent(BaseModel):
    """A job event as `GET /api/events` sends it: the job's details under `job`."""

    id: int
    type: Literal["submitted", "status", "deleted"]
    submission_id: str
    tenant: str | None
    status: JobStatus | None
    message: str | None
    time: int
    job: JobDetails | None

    @classmethod
    def from_event(cls, event: JobEvent) -> StreamedJobEvent:
        return cls(
            id=event.id,
            type=event.type.value,
            submission_id=event.submission_id,
            tenant=event.tenant,
            status=event.status,
            message=event.message,
            time=event.time,
            job=None if event.record is None else JobDetails.from_record(event.record),
        )


class EventStreamReset(BaseModel):
    """The resume point is no longer kept: list again, then follow from now."""

    type: Literal["reset"] = "reset"
    reason: str
    oldest_id: int


class EventStreamHeartbeat(BaseModel):
    type: Literal["heartbeat"] = "heartbeat"
    time: int


class ErrorDetail(BaseModel):
    code: str
    message: str


class ErrorResponse(BaseModel):
    error: ErrorDetail


class HealthUnavailableResponse(ErrorResponse):
    """The probe's 503 `database_unavailable`: the error, and what this replica knows of itself."""

    replica: ReplicaHealth
