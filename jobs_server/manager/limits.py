"""A job's resource limits (what the kernel enforces on it, `supervisor/cgroups.py`) and its
accounting (what its attempt used), as the records and the API carry them.

The limits a record carries are the job's effective ones: what the submit asked for, with the
tenant's and the server's defaults filled in at the boundary (`effective_limits`), so a
supervisor (on any node, of any version) enforces exactly what `GET /api/jobs/{id}` shows.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

# Bounds of what can be asked for: a cgroup takes bytes up to 2**63 and a pids.max up to 2**31.
MAX_MEMORY_BYTES = 2**62
MIN_MEMORY_BYTES = 1 << 20  # below a MiB, not even a shell starts: a mistake, not a limit
MAX_CPU_CORES = 4096.0
MIN_CPU_CORES = 0.01  # a cgroup's quota is at least 1 ms of a 100 ms period
MAX_PROCESSES = 1 << 22

MemoryBytes = Annotated[int, Field(ge=MIN_MEMORY_BYTES, le=MAX_MEMORY_BYTES, strict=True)]
CpuCores = Annotated[
    float, Field(ge=MIN_CPU_CORES, le=MAX_CPU_CORES, allow_inf_nan=False, strict=True)
]
ProcessCount = Annotated[int, Field(ge=1, le=MAX_PROCESSES, strict=True)]


class JobLimits(BaseModel):
    """What one attempt of a job may use; None: no limit of that kind."""

    # A limit a newer server added is ignored by an older supervisor (the boundary's model,
    # api_models.JobLimitsRequest, and the tokens file's tables refuse unknown fields).
    model_config = ConfigDict(frozen=True, extra="ignore")

    memory_bytes: MemoryBytes | None = None
    """Its processes' memory together (RSS and page cache, as the memory cgroup counts it)."""
    cpu_cores: CpuCores | None = None
    """CPU time per wall-clock second (0.5: half a core), over all its processes."""
    max_processes: ProcessCount | None = None
    """Processes (and threads) alive at once."""

    def is_empty(self) -> bool:
        return self.memory_bytes is None and self.cpu_cores is None and self.max_processes is None


class ResourceUsage(BaseModel):
    """What one attempt used, measured at its end: from its cgroup where it had one, else from
    the kernel's accounting of its reaped processes (wait4's rusage)."""

    model_config = ConfigDict(frozen=True)

    peak_memory_bytes: int | None = None
    """The high-water mark of its memory: the cgroup's peak (memory.peak, v1's
    memory.max_usage_in_bytes), else the largest RSS of any one of its processes."""
    cpu_user_s: float | None = None
    cpu_system_s: float | None = None
    cpu_throttled_s: float | None = None
    """Time its CPU limit held it back (cgroups only)."""
    oom_killed: bool = False
    """The kernel killed one of its processes for its memory limit."""


LIMIT_FIELDS = tuple(JobLimits.model_fields)


class LimitRefusedError(ValueError):
    """A submit's limit that cannot be its job's: above its tenant's ceiling (or, enforced, an
    entrypoint_memory below the least memory limit). `field` is as the client wrote it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def effective_limits(
    requested: JobLimits | None,
    *,
    entrypoint_memory: int | None,
    enforce_entrypoint_memory: bool,
    tenant_default: JobLimits | None,
    tenant_ceiling: JobLimits | None,
    server_default: JobLimits | None,
) -> JobLimits | None:
    """The limits a job runs under; None if it has none of any kind. LimitRefusedError if the
    job asks above its tenant's ceiling.

    Per field: the request's value; else (memory, with --enforce-entrypoint-memory) its
    entrypoint_memory; else the tenant's default, else the server's, each capped by the
    tenant's ceiling; else the ceiling itself (a ceiling without a default caps every job).
    """
    values: dict[str, int | float | None] = {}
    for name in LIMIT_FIELDS:
        asked, field = _value(requested, name), f"limits.{name}"
        # An entrypoint_memory of 0 reserves nothing: no limit from it.
        if (
            asked is None
            and name == "memory_bytes"
            and enforce_entrypoint_memory
            and entrypoint_memory
        ):
            asked, field = entrypoint_memory, "entrypoint_memory"
            if asked < MIN_MEMORY_BYTES:
                raise LimitRefusedError(
                    field,
                    f"{asked} is below the least memory limit, {MIN_MEMORY_BYTES}"
                    " (--enforce-entrypoint-memory makes it the job's memory limit)",
                )
        ceiling = _value(tenant_ceiling, name)
        if asked is not None:
            if ceiling is not None and asked > ceiling:
                raise LimitRefusedError(field, f"{asked} is above its tenant's ceiling, {ceiling}")
            values[name] = asked
            continue
        default = _value(tenant_default, name)
        if default is None:
            default = _value(server_default, name)
        # The server's default may be above a tenant's ceiling (the tenant's own default never
        # is: the tokens file is checked): the tenant gets its ceiling, not a 400 for a value it
        # never asked for.
        values[name] = min((v for v in (default, ceiling) if v is not None), default=None)
    limits = JobLimits.model_validate(values)
    return None if limits.is_empty() else limits


def _value(limits: JobLimits | None, name: str) -> int | float | None:
    value: int | float | None = None if limits is None else getattr(limits, name)
    return value
