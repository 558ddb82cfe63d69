"""The supervisor: a detached Ray actor that runs a job's command and records its status.

It writes RUNNING and the terminal status itself (it knows first); the manager writes only what a
supervisor cannot report (it never started, it died). Its jobs share its fate: a guardian process
kills them if the supervisor dies.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import ray
from pydantic import BaseModel, ConfigDict

from jobs_server.manager.guardian import SUPERVISOR_TOKEN_ENV_VAR, start_guardian
from jobs_server.manager.kv import GcsKv
from jobs_server.manager.logs import read_log_tail
from jobs_server.manager.process import (
    JOB_TOKEN_ENV_VAR,
    become_child_subreaper,
    kill_job_processes,
    reap_orphans,
    start_entrypoint,
    stop_job_processes,
)
from jobs_server.manager.records import JobErrorType, JobRecord, JobStatus
from jobs_server.manager.store import JobStore

logger = logging.getLogger(__name__)

# Ray's driver reads its job config (runtime_env, metadata) from this variable, so tasks and
# actors that the entrypoint starts inherit the job's runtime env.
RAY_JOB_CONFIG_ENV_VAR = "RAY_JOB_CONFIG_JSON_ENV_VAR"
SUBMISSION_ID_ENV_VAR = "JOBS_SERVER_SUBMISSION_ID"
JOB_TIMEOUT_ERROR_TYPE = "JOB_TIMEOUT"


class SupervisedJob(BaseModel):
    """What a supervisor needs to run one job."""

    model_config = ConfigDict(frozen=True)

    submission_id: str
    entrypoint: str
    log_path: Path
    runtime_env: dict[str, Any]
    metadata: dict[str, str]
    kv_namespace: str
    stop_grace_s: float
    timeout_s: float | None = None


class JobSupervisor:
    """Runs one job's entrypoint to the end; `run` may be awaited by any number of callers."""

    def __init__(self, job: SupervisedJob) -> None:
        self._job = job
        self._stop_requested = asyncio.Event()
        self._started = asyncio.Event()
        self._stop_grace_s = job.stop_grace_s
        self._run_task: asyncio.Task[JobStatus] | None = None
        self._supervisor_token = secrets.token_hex(16)
        self._guardian: subprocess.Popen[bytes] | None = None

    async def run(self) -> JobStatus:
        """Start the job if it has not started, and return its terminal status when it ends."""
        if self._run_task is None:
            self._run_task = asyncio.create_task(self._run_job())
        # A caller that goes away (a restarting server) must not cancel the job itself.
        return await asyncio.shield(self._run_task)

    async def wait_started(self) -> None:
        """Return once the command has started, or the job ended without starting."""
        await self._started.wait()

    async def stop(self, grace_period_s: float | None = None) -> None:
        """Ask the job to stop: SIGTERM now, SIGKILL after the grace period."""
        if grace_period_s is not None:
            self._stop_grace_s = grace_period_s
        self._stop_requested.set()

    async def _run_job(self) -> JobStatus:
        try:
            return await self._start_and_wait()
        finally:
            self._started.set()

    async def _start_and_wait(self) -> JobStatus:
        job = self._job
        gcs_address = ray.get_runtime_context().gcs_address
        store = JobStore(GcsKv(gcs_address, job.kv_namespace))
        record = await store.get(job.submission_id)
        if record.status.is_terminal():
            return record.status
        self._ensure_guardian()
        job_token = secrets.token_hex(16)
        try:
            process = await start_entrypoint(
                job.entrypoint, log_path=job.log_path, env=self._driver_env(gcs_address, job_token)
            )
        except OSError as error:
            failed = await store.update(
                job.submission_id,
                status=JobStatus.FAILED,
                error_type=JobErrorType.JOB_ENTRYPOINT_COMMAND_START_ERROR,
                message=f"Job entrypoint command could not start: {error}",
            )
            return failed.status
        try:
            record = await store.update(
                job.submission_id,
                status=JobStatus.RUNNING,
                message="Job is currently running.",
                driver_pid=process.pid,
                driver_node_id=ray.get_runtime_context().get_node_id(),
                driver_node_ip=ray.util.get_node_ip_address(),
            )
            self._started.set()
            if record.status.is_terminal():
                # Stopped while the command was starting: it must not run on.
                await stop_job_processes(process, job_token=job_token, grace_period_s=0)
                return record.status
            return (await self._wait_for_end(store, process, job_token)).status
        finally:
            # Whatever the command left behind ends with it.
            await kill_job_processes(job_token)
            reap_orphans(keep={process.pid})

    def _ensure_guardian(self) -> None:
        if self._guardian is None:
            become_child_subreaper()
            self._guardian = start_guardian(self._supervisor_token)

    async def _wait_for_end(
        self, store: JobStore, process: asyncio.subprocess.Process, job_token: str
    ) -> JobRecord:
        exited = asyncio.ensure_future(process.wait())
        stop_requested = asyncio.ensure_future(self._stop_requested.wait())
        await asyncio.wait(
            {exited, stop_requested},
            timeout=self._job.timeout_s,
            return_when=asyncio.FIRST_COMPLETED,
        )
        stop_requested.cancel()
        if exited.done():
            return await self._record_exit(store, exited.result())
        exit_code = await stop_job_processes(
            process, job_token=job_token, grace_period_s=self._stop_grace_s
        )
        if self._stop_requested.is_set():
            return await store.update(
                self._job.submission_id,
                status=JobStatus.STOPPED,
                message="Job was intentionally stopped.",
                driver_exit_code=exit_code,
            )
        return await store.update(
            self._job.submission_id,
            status=JobStatus.FAILED,
            error_type=JOB_TIMEOUT_ERROR_TYPE,
            message=f"Job exceeded its timeout of {self._job.timeout_s:g} s and was stopped.",
            driver_exit_code=exit_code,
        )

    async def _record_exit(self, store: JobStore, exit_code: int) -> JobRecord:
        if exit_code == 0:
            return await store.update(
                self._job.submission_id,
                status=JobStatus.SUCCEEDED,
                message="Job finished successfully.",
                driver_exit_code=0,
            )
        return await store.update(
            self._job.submission_id,
            status=JobStatus.FAILED,
            error_type=JobErrorType.JOB_ENTRYPOINT_COMMAND_ERROR,
            message=_failure_message(exit_code, read_log_tail(self._job.log_path)),
            driver_exit_code=exit_code,
        )

    def _driver_env(self, gcs_address: str, job_token: str) -> dict[str, str]:
        env = dict(os.environ)  # already holds the runtime env's env_vars
        # `python` in an entrypoint is the interpreter that runs Ray here (the runtime env's
        # virtualenv, if it has one), not whatever comes first on the node's PATH.
        python_bin_dir = os.path.dirname(sys.executable)
        env["PATH"] = os.pathsep.join([python_bin_dir, env.get("PATH", os.defpath)])
        env.update(
            {
                "RAY_ADDRESS": gcs_address,
                RAY_JOB_CONFIG_ENV_VAR: json.dumps(
                    {"runtime_env": self._job.runtime_env, "metadata": self._job.metadata}
                ),
                # Python drivers stream their output instead of flushing it at exit.
                "PYTHONUNBUFFERED": "1",
                SUBMISSION_ID_ENV_VAR: self._job.submission_id,
                JOB_TOKEN_ENV_VAR: job_token,
                SUPERVISOR_TOKEN_ENV_VAR: self._supervisor_token,
            }
        )
        return env


def _failure_message(exit_code: int, log_tail: str) -> str:
    if exit_code < 0:
        try:
            signal_name = signal.Signals(-exit_code).name
        except ValueError:
            signal_name = str(-exit_code)
        how = f"was killed by signal {signal_name}"
    else:
        how = f"failed with exit code {exit_code}"
    message = f"Job entrypoint command {how}."
    if log_tail:
        message += f" Last output:\n{log_tail}"
    return message
