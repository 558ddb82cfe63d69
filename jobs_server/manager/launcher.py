"""Handing a job to its supervisor: what the submit, the recovery and the watcher share."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jobs_server.manager.logs import job_log_path, log_dir_id
from jobs_server.manager.queue.retries import DEFAULT_RETRY_BACKOFF_S
from jobs_server.manager.records import JobRecord
from jobs_server.manager.run_batches import RunBatches
from jobs_server.manager.runtime_envs import runtime_env_for_ray
from jobs_server.manager.supervisor.cgroups import DEFAULT_JOBS_CGROUP
from jobs_server.manager.supervisor.job_run import SupervisedJob
from jobs_server.manager.supervisors import Supervisors, is_dedicated
from jobs_server.manager.tenancy import NO_LIMITS, RunAs, TenantLimits

# A shared supervisor writes a job's start once its command has run this long, or with its end if
# that comes first: a short job costs one write to the GCS instead of two. Until then the job
# reads PENDING, and a stop still reaches the command (actor.py: `call_off`). A job with a
# supervisor of its own (a runtime env, resources: it waited, and its start timeout counts) has
# its start written at once.
SHARED_START_RECORD_DELAY_S = 0.1


@dataclass(frozen=True)
class Launch:
    """A supervisor that was handed a job, and the job's end to come: `run_job`'s ObjectRef,
    or a future that answers as it would (run_batches.py)."""

    supervisor: Any
    finished: Any
    started: asyncio.Future[dict[str, Any] | None] | None = None
    """Handed over in a batch: the job's start as its supervisor wrote it, or None if it ended
    first (then no `wait_started` call is needed)."""


class Launcher:
    """Starts a job's run in the supervisor its record names."""

    def __init__(
        self,
        *,
        supervisors: Supervisors,
        log_dir: Path,
        stop_grace_s: float,
        head_node_id: str,
        retry_backoff_s: float = DEFAULT_RETRY_BACKOFF_S,
        tenant_limits: Callable[[str], TenantLimits] = lambda _: NO_LIMITS,
        jobs_user: RunAs | None = None,
        jobs_cgroup: str | None = DEFAULT_JOBS_CGROUP,
    ) -> None:
        self._supervisors = supervisors
        self._jobs_cgroup = jobs_cgroup
        self._log_dir = log_dir
        self._stop_grace_s = stop_grace_s
        self._head_node_id = head_node_id
        self._retry_backoff_s = retry_backoff_s
        self._run_batches = RunBatches()
        self._tenant_limits = tenant_limits
        self._jobs_user = jobs_user
        # The id of the log directory (`open_log_dir`), recorded with each job handed over.
        self.log_dir_id: str | None = None

    async def open_log_dir(self) -> str:
        """Create the log directory if need be, and learn its id (`log_dir_id`)."""
        self._log_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir_id = await asyncio.to_thread(log_dir_id, self._log_dir)
        return self.log_dir_id

    async def close(self) -> None:
        """Stop asking the shared supervisors for ends (the jobs run on)."""
        await self._run_batches.close()

    async def launch(self, record: JobRecord) -> Launch:
        """Create (or find) the record's supervisor and ask it to run the job."""
        return self.start(record, await self.supervisor_for(record))

    async def supervisor_for(self, record: JobRecord) -> Any:
        """Create (or find) the supervisor the record names."""
        name = record.supervisor_name or self._supervisors.name_for(record.spec, record.run_id)
        # A warm shared supervisor's handle is at hand: no thread hop (milliseconds on a busy
        # server) for the common case.
        known = self._supervisors.known_shared(name)
        if known is not None:
            return known
        # The actor's runtime env names the tenant's own copies of its packages.
        spec = record.spec.model_copy(
            update={"runtime_env": runtime_env_for_ray(record.spec.runtime_env, record.tenant)}
        )
        return await asyncio.to_thread(self._supervisors.create, name, spec)

    def start(self, record: JobRecord, supervisor: Any) -> Launch:
        """Ask `supervisor` to run the job (no await: a caller can decide and start at once).
        A shared supervisor gets it with the others of this moment, in one call."""
        job_fields = self.supervised_job(record)
        if is_dedicated(record.supervisor_name or ""):
            return Launch(supervisor, supervisor.run_job.remote(job_fields))
        batched = self._run_batches.run(supervisor, job_fields)
        return Launch(supervisor, batched.finished, batched.started)

    def log_path(self, record: JobRecord) -> Path:
        """The job's log on the head; a command that began has created it."""
        return job_log_path(self._log_dir, record.submission_id)

    async def has_log(self, record: JobRecord) -> bool:
        """Whether the run's command may have begun: its log is on the head (a command on the
        head creates it as it starts, before its start is recorded), or the run was handed over
        on another log directory (a leader on another machine), whose logs this server cannot
        see: there, no log here says nothing, and a command that may have begun must not run
        twice."""
        if record.log_dir_id is not None and record.log_dir_id != self.log_dir_id:
            return True
        return await asyncio.to_thread(self.log_path(record).exists)

    def supervised_job(self, record: JobRecord) -> dict[str, Any]:
        """What the supervisor needs, as the plain fields `run_job` takes: the job's spec as it
        is, and what this server decides for the run."""
        spec = record.spec
        # The driver's job config too: its tasks and actors set up the tenant's packages.
        for_ray = runtime_env_for_ray(spec.runtime_env, record.tenant)
        return SupervisedJob(
            spec=spec,
            run_id=record.run_id,
            log_path=job_log_path(self._log_dir, spec.submission_id),
            ray_runtime_env=None if for_ray is spec.runtime_env else for_ray,
            stop_grace_s=self._stop_grace_s,
            head_node_id=self._head_node_id,
            retry_backoff_s=self._retry_backoff_s,
            start_record_delay_s=(
                0.0 if is_dedicated(record.supervisor_name or "") else SHARED_START_RECORD_DELAY_S
            ),
            run_as=self._tenant_limits(record.tenant).run_as or self._jobs_user,
            jobs_cgroup=self._jobs_cgroup,
        ).model_dump(mode="json")
