"""JobManager: submits, watches, stops, lists and deletes jobs. It knows nothing of HTTP."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import string
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from ray import cloudpickle
from ray.exceptions import (
    ActorDiedError,
    ActorUnavailableError,
    ActorUnschedulableError,
    RuntimeEnvSetupError,
)
from ray.runtime_env import RuntimeEnv

import jobs_server
from jobs_server.errors import (
    InvalidJobOptionsError,
    InvalidRequestError,
    InvalidRuntimeEnvError,
    JobNotFoundError,
    JobNotTerminalError,
    PackageNotFoundError,
    SupervisorUnreachableError,
)
from jobs_server.manager.cluster_resources import ClusterResources, node_is_alive
from jobs_server.manager.kv import GcsKv
from jobs_server.manager.log_shipping import pull_spooled_log
from jobs_server.manager.logs import LogChunk, job_log_path, log_size, read_log_chunks
from jobs_server.manager.packages import PackageLookup
from jobs_server.manager.records import JobErrorType, JobRecord, JobSpec, JobStatus, now_ms
from jobs_server.manager.runtime_env_failures import describe_setup_failure, strip_ansi
from jobs_server.manager.runtime_envs import package_refs
from jobs_server.manager.store import JobStore
from jobs_server.manager.supervisor import SupervisedJob
from jobs_server.manager.supervisors import Supervisors, is_dedicated

logger = logging.getLogger(__name__)

# The supervisor's code travels with the actor, pickled by value, so a worker node needs nothing
# but Ray: no jobs_server installed, no runtime env to build before a job can start.
cloudpickle.register_pickle_by_value(jobs_server)

SUBMISSION_ID_PREFIX = "raysubmit_"
# How long a finished job's watcher waits for the last pull of its log from another node.
LOG_PULL_FINISH_S = 10.0
# How often a supervisor that cannot be reached is asked again, until Ray says it is dead.
SUPERVISOR_UNAVAILABLE_RETRY_S = 1.0
# How long a stop request waits for an unreachable supervisor before answering 503.
STOP_UNREACHABLE_WAIT_S = 5.0
_SUBMISSION_ID_ALPHABET = string.ascii_letters + string.digits


def new_submission_id() -> str:
    """A random id in Ray's format, e.g. raysubmit_4LamXRuQpYdSMg7J."""
    return SUBMISSION_ID_PREFIX + "".join(
        secrets.choice(_SUBMISSION_ID_ALPHABET) for _ in range(16)
    )


@dataclass(frozen=True)
class JobPage:
    """A page of jobs and the cursor (`after`) of the next one, None on the last page."""

    records: list[JobRecord]
    next_after: str | None


class JobManager:
    """Owns every job of one server: its record, its supervisor, and a task watching it."""

    def __init__(
        self,
        *,
        gcs_address: str,
        namespace: str,
        log_dir: Path,
        stop_grace_s: float,
        job_start_timeout_s: float,
        shared_supervisors: int = 1,
    ) -> None:
        self._log_dir = log_dir
        self._stop_grace_s = stop_grace_s
        self._job_start_timeout_s = job_start_timeout_s
        self._store = JobStore(GcsKv(gcs_address, namespace), cache_terminal=True)
        self._packages = PackageLookup(gcs_address)
        # The server's node: its log directory is where every job's log ends up.
        self._head_node_id: str = ray.get_runtime_context().get_node_id()
        self._supervisors = Supervisors(
            namespace=namespace,
            kv_namespace=namespace,
            shared_count=shared_supervisors,
            head_node_id=self._head_node_id,
        )
        self._cluster_resources = ClusterResources()
        self._watchers: dict[str, asyncio.Task[None]] = {}

    async def start(self) -> None:
        """Warm the shared supervisors, and pick up the jobs a previous server left."""
        self._log_dir.mkdir(parents=True, exist_ok=True)
        await self._supervisors.start()
        busy_supervisors = set()
        live_supervisors = await asyncio.to_thread(self._supervisors.live_names)
        for record in await self._store.list():
            if not record.status.is_terminal():
                await self._adopt(record)
                busy_supervisors.add(record.supervisor_name)
            elif record.supervisor_name in live_supervisors and is_dedicated(
                record.supervisor_name
            ):
                # It ended while no server watched: pull what is left of its log from its
                # node, then retire its supervisor.
                await self._adopt(record)
        for name in self._supervisors.stale_shared_names(live_supervisors):
            if name not in busy_supervisors:
                logger.info("retiring idle supervisor %s of an earlier server version", name)
                await asyncio.to_thread(self._supervisors.kill, name)
        logger.info("job manager ready; watching %d jobs", len(self._watchers))

    async def _adopt(self, record: JobRecord) -> None:
        name = record.supervisor_name or self._supervisors.name_for(record.spec)
        supervisor = await asyncio.to_thread(self._supervisors.find, name)
        if supervisor is None and record.status is JobStatus.PENDING:
            # The server died between recording the job and handing it over: it was accepted,
            # so it runs.
            logger.info(
                "job %s was never handed to a supervisor; starting it", record.submission_id
            )
            supervisor = await asyncio.to_thread(self._supervisors.create, name, record.spec)
        if supervisor is None:
            await self._store.update(
                record.submission_id,
                status=JobStatus.FAILED,
                error_type=JobErrorType.JOB_SUPERVISOR_ACTOR_DIED,
                message="The job's supervisor no longer exists; its processes are gone.",
            )
            return
        if record.status is JobStatus.PENDING:
            finished = supervisor.run_job.remote(self._supervised_job(record.spec))
        else:
            finished = supervisor.wait_job.remote(record.submission_id)
        self._watch(record, supervisor, finished)

    async def close(self) -> None:
        """Stop watching; the jobs themselves run on in their detached supervisors."""
        watchers = list(self._watchers.values())
        for watcher in watchers:
            watcher.cancel()
        await asyncio.gather(*watchers, return_exceptions=True)
        self._watchers.clear()

    async def submit_job(self, spec: JobSpec) -> JobRecord:
        """Record the job and hand it to a supervisor; return at once, the job PENDING."""
        await _validate_runtime_env(spec.runtime_env, self._packages)
        # Either the job exists and runs, or it does not exist: a client that goes away
        # half-way must not cancel the submission between the record and the supervisor.
        return await asyncio.shield(self._record_and_hand_over(spec))

    async def _record_and_hand_over(self, spec: JobSpec) -> JobRecord:
        name = self._supervisors.name_for(spec)
        record = JobRecord(
            spec=spec, start_time=now_ms(), message="Job is pending.", supervisor_name=name
        )
        await self._store.create(record)
        try:
            supervisor = await asyncio.to_thread(self._supervisors.create, name, spec)
            finished = supervisor.run_job.remote(self._supervised_job(spec))
        except Exception as error:
            await self._store.delete(spec.submission_id)
            if isinstance(error, ValueError | TypeError | ArithmeticError):
                raise InvalidJobOptionsError(f"Invalid job options: {error}") from error
            raise
        self._watch(record, supervisor, finished)
        return record

    async def get_job(self, submission_id: str) -> JobRecord:
        return await self._with_wait_message(await self._store.get(submission_id))

    async def list_jobs(
        self,
        *,
        statuses: frozenset[JobStatus] | None = None,
        after: str | None = None,
        limit: int | None = None,
    ) -> JobPage:
        """Jobs in submission order: those with one of `statuses`, after the job `after`, at
        most `limit` of them; `next_after` is the cursor of the next page, if there is one."""
        records = await self._store.list()
        if after is not None:
            position = next(
                (index for index, record in enumerate(records) if record.submission_id == after),
                None,
            )
            if position is None:
                raise InvalidRequestError(f"after: no job {after!r} to continue after.")
            records = records[position + 1 :]
        if statuses is not None:
            records = [record for record in records if record.status in statuses]
        next_after = None
        if limit is not None and len(records) > limit:
            records = records[:limit]
            next_after = records[-1].submission_id
        records = [await self._with_wait_message(record) for record in records]
        return JobPage(records=records, next_after=next_after)

    async def stop_job(self, submission_id: str, grace_period_s: float | None = None) -> bool:
        """Ask a job to stop; return False if it had already ended."""
        record = await self._store.get(submission_id)
        if record.status.is_terminal():
            return False
        name = record.supervisor_name or self._supervisors.name_for(record.spec)
        supervisor = await asyncio.to_thread(self._supervisors.find, name)
        if record.status is JobStatus.RUNNING and supervisor is not None:
            await self._ask_to_stop(record, supervisor, grace_period_s)
            return True
        # The command has not started: it never will. A supervisor that is starting it right
        # now finds the record terminal and stops it.
        await self._store.update(
            submission_id, status=JobStatus.STOPPED, message="Job was stopped before it started."
        )
        if supervisor is not None and is_dedicated(name):
            await asyncio.to_thread(ray.kill, supervisor, no_restart=True)
        elif supervisor is not None:
            await supervisor.stop_job.remote(submission_id, 0)
        return True

    async def _ask_to_stop(
        self, record: JobRecord, supervisor: Any, grace_period_s: float | None
    ) -> None:
        """Ask a running job's supervisor to stop it, waiting a little for one that cannot be
        reached (or does not answer); a supervisor that died took the job's processes with it."""
        deadline = time.monotonic() + STOP_UNREACHABLE_WAIT_S
        while True:
            try:
                await asyncio.wait_for(
                    supervisor.stop_job.remote(record.submission_id, grace_period_s),
                    timeout=max(0.0, deadline - time.monotonic()),
                )
                return
            except ActorDiedError:
                return  # its watcher records how the job ended
            except (ActorUnavailableError, TimeoutError) as error:
                if time.monotonic() >= deadline:
                    raise SupervisorUnreachableError(
                        f"The supervisor of job {record.submission_id!r} on node "
                        f"{record.driver_node_id} cannot be reached now (its node may be "
                        "failing); the job was not asked to stop. Try again."
                    ) from error
                await asyncio.sleep(SUPERVISOR_UNAVAILABLE_RETRY_S)

    async def delete_job(self, submission_id: str) -> None:
        """Forget a job that has ended: its record and its log file."""
        record = await self._store.get(submission_id)
        if not record.status.is_terminal():
            raise JobNotTerminalError(submission_id, record.status)
        await self._store.delete(submission_id)
        job_log_path(self._log_dir, submission_id).unlink(missing_ok=True)

    async def read_logs(
        self,
        submission_id: str,
        *,
        offset: int = 0,
        limit: int | None = None,
        follow: bool = False,
        idle_tick_s: float | None = None,
    ) -> AsyncGenerator[LogChunk, None]:
        """The job's log from `offset` (see `read_log_chunks`); raises JobNotFoundError now,
        before any chunk is read."""
        await self._store.get(submission_id)
        return read_log_chunks(
            job_log_path(self._log_dir, submission_id),
            offset=offset,
            limit=limit,
            follow=follow,
            job_is_terminal=lambda: self._job_has_ended(submission_id),
            idle_tick_s=idle_tick_s,
        )

    async def log_size(self, submission_id: str) -> int:
        """The job's log size in bytes now."""
        await self._store.get(submission_id)
        return await asyncio.to_thread(log_size, job_log_path(self._log_dir, submission_id))

    async def _job_has_ended(self, submission_id: str) -> bool:
        # A watched job has ended when its watcher has: in memory, so a hundred followers cost
        # no GCS reads. The watcher finishes only after the terminal status is written.
        watcher = self._watchers.get(submission_id)
        if watcher is not None:
            return watcher.done()
        try:
            return (await self._store.get(submission_id)).status.is_terminal()
        except JobNotFoundError:
            return True  # deleted while being read: nothing more will be written

    def _supervised_job(self, spec: JobSpec) -> dict[str, Any]:
        """What the supervisor needs, as the plain fields `run_job` takes."""
        return SupervisedJob(
            submission_id=spec.submission_id,
            entrypoint=spec.entrypoint,
            log_path=job_log_path(self._log_dir, spec.submission_id),
            runtime_env=spec.runtime_env,
            metadata=spec.metadata,
            stop_grace_s=self._stop_grace_s,
            timeout_s=spec.timeout_s,
            head_node_id=self._head_node_id,
        ).model_dump(mode="json")

    def _watch(self, record: JobRecord, supervisor: Any, finished: Any) -> None:
        submission_id = record.submission_id
        task = asyncio.create_task(self._watch_supervisor(record, supervisor, finished))
        self._watchers[submission_id] = task
        task.add_done_callback(lambda _: self._watchers.pop(submission_id, None))

    async def _watch_supervisor(self, record: JobRecord, supervisor: Any, finished: Any) -> None:
        """Wait for the job to end, pulling its log if it runs on another node; record the
        failures its supervisor cannot report."""
        submission_id = record.submission_id
        name = record.supervisor_name or ""
        error_type: JobErrorType | None = None
        message = ""
        log_pull: asyncio.Task[None] | None = None
        try:
            try:
                try:
                    log_pull = await self._wait_until_started(record, supervisor)
                    await self._wait_for_end(submission_id, supervisor, finished)
                except ActorDiedError:
                    if is_dedicated(name) or not await self._never_started(submission_id):
                        raise
                    # A warm supervisor that died before anyone noticed: the job never started,
                    # so it runs on the replacement instead of failing.
                    logger.info("job %s reached a dead shared supervisor; retrying", submission_id)
                    self._supervisors.forget(name)
                    supervisor = await asyncio.to_thread(
                        self._supervisors.create, name, record.spec
                    )
                    finished = supervisor.run_job.remote(self._supervised_job(record.spec))
                    log_pull = await self._wait_until_started(record, supervisor)
                    await self._wait_for_end(submission_id, supervisor, finished)
            except JobStartTimeoutError as error:
                error_type = JobErrorType.JOB_SUPERVISOR_ACTOR_START_TIMEOUT
                message = str(error)
            except RuntimeEnvSetupError as error:
                error_type = JobErrorType.RUNTIME_ENV_SETUP_FAILURE
                # Ray's text is the agent's whole traceback; the status says what and why.
                logger.info("job %s: Ray's runtime env error: %s", submission_id, error)
                message = describe_setup_failure(str(error), record.spec.runtime_env)
            except ActorUnschedulableError as error:
                error_type = JobErrorType.JOB_SUPERVISOR_ACTOR_UNSCHEDULABLE
                message = f"The job cannot be scheduled: {error}"
            except ActorDiedError as error:
                error_type = JobErrorType.JOB_SUPERVISOR_ACTOR_DIED
                message = await self._supervisor_died_message(submission_id, error)
            except Exception as error:
                logger.exception("watching job %s failed", submission_id)
                error_type = JobErrorType.JOB_SUPERVISOR_ACTOR_START_FAILURE
                message = f"The job's supervisor failed: {_first_line(error)}"
            if log_pull is not None:
                # Every byte pulled is on the head before anyone sees the job end.
                await asyncio.wait({log_pull}, timeout=LOG_PULL_FINISH_S)
        finally:
            if log_pull is not None:
                log_pull.cancel()
        if error_type is not None:
            logger.warning("job %s failed: %s", submission_id, message)
            with contextlib.suppress(JobNotFoundError):
                await self._store.update(
                    submission_id, status=JobStatus.FAILED, error_type=error_type, message=message
                )
        if is_dedicated(name):
            # The job has ended; its own supervisor has nothing left to do.
            await asyncio.to_thread(ray.kill, supervisor, no_restart=True)
        elif error_type is JobErrorType.JOB_SUPERVISOR_ACTOR_DIED:
            self._supervisors.forget(name)
        elif error_type is JobErrorType.JOB_SUPERVISOR_ACTOR_START_TIMEOUT:
            with contextlib.suppress(Exception):
                await supervisor.stop_job.remote(submission_id, 0)

    async def _wait_for_end(self, submission_id: str, supervisor: Any, finished: Any) -> None:
        """Await `finished`, asking the supervisor again while it cannot be reached."""
        await _while_unreachable(finished, lambda: supervisor.wait_job.remote(submission_id))

    async def _pull_log(self, submission_id: str, supervisor: Any) -> None:
        """Bring the log of a job on another node to the head, until all of it is here or its
        supervisor is gone (with its node: what was pulled until then stays)."""

        async def read_chunk(offset: int) -> tuple[bytes, bool]:
            def call() -> Any:
                return supervisor.read_spooled_log.remote(submission_id, offset)

            data, complete = await _while_unreachable(call(), call)
            return data, complete

        try:
            await pull_spooled_log(read_chunk, job_log_path(self._log_dir, submission_id))
        except ActorDiedError as error:
            logger.warning(
                "pulling the log of job %s stopped: %s", submission_id, _first_line(error)
            )

    async def _supervisor_died_message(self, submission_id: str, error: ActorDiedError) -> str:
        """Name the lost node when the supervisor died with it, else say what Ray says."""
        with contextlib.suppress(JobNotFoundError):
            record = await self._store.get(submission_id)
            if record.driver_node_id and not await asyncio.to_thread(
                node_is_alive, record.driver_node_id
            ):
                return (
                    f"The node the job ran on was lost (node id {record.driver_node_id}, "
                    f"address {record.driver_node_ip}); the job's processes ended with it. "
                    "Its output until then is in the log."
                )
        return f"The job's supervisor died: {_first_line(error)}"

    async def _never_started(self, submission_id: str) -> bool:
        try:
            return (await self._store.get(submission_id)).status is JobStatus.PENDING
        except JobNotFoundError:
            return False

    async def _wait_until_started(
        self, record: JobRecord, supervisor: Any
    ) -> asyncio.Task[None] | None:
        """Wait for the command to start, at most what is left of the start timeout; return the
        task pulling its log if it runs on another node."""
        started = supervisor.wait_started.remote(record.submission_id)
        if record.status is JobStatus.PENDING:
            waited_s = (now_ms() - (record.start_time or now_ms())) / 1000
            remaining_s = max(0.0, self._job_start_timeout_s - waited_s)
            try:
                log_is_spooled = await asyncio.wait_for(started, timeout=remaining_s)
            except TimeoutError:
                message = await self._start_timeout_message(record.spec)
                raise JobStartTimeoutError(message) from None
        else:
            log_is_spooled = await started
        if not log_is_spooled:
            return None
        return asyncio.create_task(self._pull_log(record.submission_id, supervisor))

    async def _start_timeout_message(self, spec: JobSpec) -> str:
        message = f"The job did not start within {self._job_start_timeout_s:g} s."
        requested = spec.requested_resources()
        waiting_for = await self._cluster_resources.describe_wait(requested)
        if waiting_for is not None:
            message += " " + waiting_for.replace("Waiting for", "It waited for", 1)
        elif requested:
            message += f" The resources it asks for ({requested}) were free at the end."
        if spec.runtime_env:
            message += " Its runtime env may still have been setting up."
        return message

    async def _with_wait_message(self, record: JobRecord) -> JobRecord:
        """A pending job that waits for resources says which, and what the cluster has."""
        if record.status is not JobStatus.PENDING:
            return record
        waiting_for = await self._cluster_resources.describe_wait(record.spec.requested_resources())
        return record if waiting_for is None else record.with_changes(message=waiting_for)


async def _while_unreachable(first_call: Any, call_again: Callable[[], Any]) -> Any:
    """The result of a supervisor call (`first_call`, an ObjectRef); while the supervisor cannot
    be reached (its node may be going), `call_again` every SUPERVISOR_UNAVAILABLE_RETRY_S until
    Ray knows it is alive (an answer) or dead (ActorDiedError)."""
    pending = first_call
    while True:
        try:
            return await pending
        except ActorUnavailableError:
            await asyncio.sleep(SUPERVISOR_UNAVAILABLE_RETRY_S)
            pending = call_again()


class JobStartTimeoutError(Exception):
    """The job's supervisor did not start its command within the start timeout."""


async def _validate_runtime_env(runtime_env: dict[str, Any], packages: PackageLookup) -> None:
    """A 400 for what Ray would reject, and for code packages no node could fetch."""
    refs = package_refs(runtime_env)
    try:
        RuntimeEnv(**runtime_env)
    except Exception as error:  # Ray raises ValueError, TypeError or its own errors
        raise InvalidRuntimeEnvError(f"Invalid runtime_env: {error}") from error
    for ref in refs:
        if ref.is_uploaded:
            try:
                await packages.ensure_exists(ref.uri)
            except PackageNotFoundError:
                raise InvalidRuntimeEnvError(
                    f"runtime_env.{ref.field}: package {ref.uri} was never uploaded to this "
                    "cluster, or has expired (Ray's clients upload a local directory first)."
                ) from None


def _first_line(error: BaseException) -> str:
    """Ray's actor errors carry colour codes and tracebacks; a status message wants one line."""
    text = strip_ansi(str(error)).strip()
    return text.splitlines()[0] if text else type(error).__name__
