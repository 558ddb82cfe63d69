"""The supervisor: a detached Ray actor that runs jobs' commands and records their status.

One supervisor runs any number of jobs at once: a warm, shared one runs the jobs that need no
runtime env or resources of their own (so they start in milliseconds), and a job that does gets a
supervisor of its own. A supervisor writes RUNNING and the terminal status itself (it knows
first); the manager writes only what a supervisor cannot report (it never started, it died). Its
jobs share its fate: a guardian process kills them if the supervisor dies.

This module is the actor's API and what its jobs share (the guardian, the spools, reaping); one
job's run, attempt after attempt, is attempts.py's.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import secrets
import subprocess
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ray

from jobs_server.manager.live.kv import GCS_OUTAGE_RETRY_S, GcsKv
from jobs_server.manager.live.store import JobStore
from jobs_server.manager.records import JobRecord, JobStatus, RayDriver
from jobs_server.manager.supervisor.attempts import JobAttempts
from jobs_server.manager.supervisor.cgroups import (
    NO_CGROUPS,
    AttemptCgroup,
    JobsCgroupTree,
    LimitsSupport,
    find_jobs_tree,
    make_supervisor_dirs,
    sweep_dead_supervisors,
)
from jobs_server.manager.supervisor.containment import Containment, detect_containment
from jobs_server.manager.supervisor.drivers import RayDrivers
from jobs_server.manager.supervisor.fork_server import ForkServer
from jobs_server.manager.supervisor.guardian import remove_when_supervisor_dies, start_guardian
from jobs_server.manager.supervisor.job_run import (
    NEVER_STARTED_MESSAGE,
    JobRun,
    SupervisedJob,
    end_grace_within,
)
from jobs_server.manager.supervisor.log_shipping import read_spool_chunk, spool_path
from jobs_server.manager.supervisor.process import become_child_subreaper, reap_orphans
from jobs_server.manager.supervisor.run_reports import (
    ENDED,
    STARTED,
    RunFailedError,
    RunReport,
    RunReports,
)

logger = logging.getLogger(__name__)

# The last retry of each of this many runs that ended, kept after the run is forgotten: the
# server asks for a run's retries once its start is archived, which on a loaded machine can be
# after every attempt has ended (`wait_attempt_ended`).
ENDED_RUNS_RETRIES_KEPT = 1024


class JobSupervisor:
    """Runs jobs to their end; every method is keyed by submission id and safe to call again."""

    def __init__(self, kv_namespace: str, jobs_nice: int = 0) -> None:
        self._kv_namespace = kv_namespace
        self._jobs_nice = jobs_nice
        self._runs: dict[str, JobRun] = {}
        # By (submission id, run id), the last retry written of runs that ended; oldest first.
        self._ended_runs_retries: OrderedDict[tuple[str, str], JobRecord] = OrderedDict()
        # Spooled logs the server has not pulled to the end yet, by submission id.
        self._spools: dict[str, Path] = {}
        # Jobs someone waits for that `run_job` has not brought yet: an async actor need not
        # run one caller's calls in the order they were made.
        self._arrivals: dict[str, asyncio.Event] = {}
        # Runs called off before `run_job` brought them (submission id: run id): never started.
        self._called_off: dict[str, str] = {}
        self._supervisor_token = secrets.token_hex(16)
        # The starts and ends of the runs handed over by `run_jobs`, until the server takes them.
        self._run_reports = RunReports(incarnation=self._supervisor_token)
        # The tasks reporting those runs' ends (a task nobody holds may be collected).
        self._reporting: set[asyncio.Task[None]] = set()
        self._guardian: subprocess.Popen[bytes] | None = None
        self._containment: Containment | None = None
        self._fork_server: ForkServer | None = None
        # This node's jobs cgroup by its name (--jobs-cgroup) and this supervisor's directories
        # in it (cgroups.py), made at the first job that names it.
        self._cgroups: dict[str, tuple[JobsCgroupTree, tuple[str, ...]]] = {}
        self._preparing = asyncio.Lock()
        self._store: JobStore | None = None
        self._drivers: RayDrivers | None = None
        # Commands being started: a child that exits before its run records its pid must not
        # be taken for an orphan and reaped, or asyncio never learns its exit code.
        self._starting = 0

    async def ping(self) -> None:
        """Answer once the actor is up (used to warm it)."""

    async def pid(self) -> int:
        """The supervisor's process id (for operators and tests)."""
        return os.getpid()

    async def actor_id(self) -> str:
        """This incarnation's Ray actor id: a new actor under the same name has another."""
        return str(ray.get_runtime_context().get_actor_id())

    async def run_job(self, job_fields: dict[str, Any]) -> dict[str, Any] | JobStatus:
        """Start the job (`SupervisedJob` fields) unless it has started, and return its record
        as it ended (`JobRecord` fields: the end that won in the store), or STOPPED if it was
        deleted before it could start."""
        # A plain dict crosses the actor boundary: pickling the model's class by value on every
        # call would cost more than the rest of the submission.
        return _answer(await self._run(SupervisedJob.model_validate(job_fields)))

    async def run_jobs(self, jobs_fields: list[dict[str, Any]]) -> None:
        """Start each job as `run_job` does, and return at once: their starts and ends are
        given by `run_reports` (run_reports.py: one call for many jobs, each way)."""
        for job_fields in jobs_fields:
            job = SupervisedJob.model_validate(job_fields)
            reporting = asyncio.create_task(self._run_and_report(job))
            self._reporting.add(reporting)
            reporting.add_done_callback(self._reporting.discard)

    async def run_reports(
        self, incarnation: str | None, after: int
    ) -> tuple[str, int, list[RunReport]]:
        """The starts and ends of runs handed over by `run_jobs` that the caller has not had:
        past `after` in this supervisor's numbering (`incarnation`, as the last answer gave it;
        None at first). Waits a while for one; see `RunReports.take`."""
        return await self._run_reports.take(incarnation, after)

    async def _run_and_report(self, job: SupervisedJob) -> None:
        try:
            answer: Any = _answer(await self._run(job, report_start=True))
        except Exception as error:  # the caller learns it as it would from `run_job`
            logger.exception("job %s failed in its supervisor", job.submission_id)
            answer = RunFailedError(f"{type(error).__name__}: {error}")
        self._run_reports.add((job.submission_id, job.run_id, ENDED, answer))

    def _report_start(self, record: JobRecord) -> None:
        self._run_reports.add(
            (record.submission_id, record.run_id, STARTED, record.model_dump(mode="json"))
        )

    async def _run(self, job: SupervisedJob, *, report_start: bool = False) -> JobRecord | None:
        """Start the job unless it has started; its record as it ended (None: deleted before
        it could start). `report_start`: its start, once written, goes to `run_reports`."""
        run = self._runs.get(job.submission_id)
        if run is not None and run.job.run_id != job.run_id and run.task is not None:
            # An earlier run of a deleted and resubmitted id is ending: this one starts after.
            await asyncio.wait({run.task})
            run = self._runs.get(job.submission_id)
        if run is None:
            run = JobRun(job=job, log_path=self._log_path_here(job))
            run.called_off = self._called_off.pop(job.submission_id, None) == job.run_id
            self._runs[job.submission_id] = run
            run.task = asyncio.create_task(JobAttempts(run, self).run())
            run.task.add_done_callback(functools.partial(self._forget_run, run))
            arrival = self._arrivals.pop(job.submission_id, None)
            if arrival is not None:
                arrival.set()
        if report_start and run.on_start_written is None:
            run.on_start_written = self._report_start
        assert run.task is not None
        # A caller that goes away (a restarting server) must not cancel the job itself.
        return await asyncio.shield(run.task)

    async def wait_job(self, submission_id: str, run_id: str | None = None) -> JobStatus | None:
        """The terminal status of a job this supervisor runs or ran (for a restarted server);
        None if the job has not ended and this supervisor does not run it (it was another
        incarnation's: the job's processes died with that one)."""
        run = self._runs.get(submission_id)
        if run is not None and run.task is not None and run_id in (None, run.job.run_id):
            ended = await asyncio.shield(run.task)
            return JobStatus.STOPPED if ended is None else ended.status
        status = (await self.job_store().get(submission_id, run_id)).status
        return status if status.is_terminal() else None

    async def wait_attempt_ended(
        self, submission_id: str, run_id: str, ended_attempts: int
    ) -> dict[str, Any] | None:
        """Return once the run has more than `ended_attempts` attempts ended before a retry
        (the job RUNNING still): its record as written then (`JobRecord` fields); None once it
        ended without one, or if this supervisor does not run it. The server's long poll for
        the retries of a job that may have them (live/watcher.py)."""
        run = self._runs.get(submission_id)
        if run is None or run.task is None or run.job.run_id != run_id:
            # Ended (and forgotten) before the server asked: its last retry, if it is news.
            last = self._ended_runs_retries.get((submission_id, run_id))
            if last is None or len(last.attempts) <= ended_attempts:
                return None
            return last.model_dump(mode="json")
        written = await run.wait_retry_beyond(ended_attempts)
        return None if written is None else written.model_dump(mode="json")

    async def wait_started(self, submission_id: str) -> bool:
        """Return once the job's command has started, or the job ended without starting; True if
        its log is spooled here for the server to pull (`read_spooled_log`)."""
        run = self._runs.get(submission_id)
        if run is None and (await self.job_store().get(submission_id)).status is JobStatus.PENDING:
            # Pending and not here: `run_job` is on its way (or arrived while the record was read).
            if submission_id not in self._runs:
                await self._arrivals.setdefault(submission_id, asyncio.Event()).wait()
            run = self._runs.get(submission_id)
        if run is not None:
            await run.started.wait()
        return submission_id in self._spools

    async def read_spooled_log(self, submission_id: str, offset: int) -> tuple[bytes, bool]:
        """The job's spooled log from `offset` (waiting a while for new bytes), and whether that
        was all of it; once it was, the spool is deleted and the job may record its end."""
        spool = self._spools.get(submission_id)
        if spool is None:
            return b"", True
        run = self._runs.get(submission_id)
        data, complete = await read_spool_chunk(
            spool, offset, lambda: run is None or run.exited.is_set()
        )
        if complete:
            del self._spools[submission_id]
            spool.unlink(missing_ok=True)
            if run is not None:
                run.log_drained.set()
        return data, complete

    async def knows_run(self, submission_id: str, run_id: str) -> bool:
        """Whether this supervisor was given the job's run and runs it (for a restarted server:
        a new supervisor under an old one's name never was)."""
        run = self._runs.get(submission_id)
        return run is not None and run.job.run_id == run_id

    async def stop_job(self, submission_id: str, grace_period_s: float | None = None) -> bool:
        """Ask a job to stop: SIGTERM now, SIGKILL after the grace period. Asked again while it
        stops, a shorter grace period ends the running one sooner."""
        run = self._runs.get(submission_id)
        if run is None:
            return False
        end_grace_within(run, run.job.stop_grace_s if grace_period_s is None else grace_period_s)
        run.stop_requested.set()
        return True

    async def call_off(
        self, submission_id: str, run_id: str, grace_period_s: float | None = None
    ) -> JobStatus:
        """Stop a job the server saw PENDING. Only this supervisor knows whether the command
        has started: if not, it never will (the job is STOPPED before it started), and its
        terminal status is returned once nothing of it runs. If it has (its start is not
        written yet: attempts.py), it is stopped as a running job is (SIGTERM, the grace
        period, SIGKILL) and RUNNING is returned at once: it ends as any stopped job."""
        run = self._runs.get(submission_id)
        if run is None or run.job.run_id != run_id:
            # `run_job` has not brought it yet (or waits behind an earlier run of the id).
            self._called_off[submission_id] = run_id
            return (
                await self.job_store().update(
                    submission_id, run_id, status=JobStatus.STOPPED, message=NEVER_STARTED_MESSAGE
                )
            ).status
        if run.start_began:
            await self.stop_job(submission_id, grace_period_s)
            return JobStatus.RUNNING
        run.called_off = True
        assert run.task is not None
        exited = asyncio.ensure_future(run.exited.wait())
        try:
            await asyncio.wait({run.task, exited}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            exited.cancel()
        return (await self.job_store().get(submission_id, run_id)).status

    def _forget_run(self, run: JobRun, _: object) -> None:
        if self._runs.get(run.job.submission_id) is run:
            del self._runs[run.job.submission_id]
        if run.retry_written is not None:
            self._ended_runs_retries[(run.job.submission_id, run.job.run_id)] = run.retry_written
            while len(self._ended_runs_retries) > ENDED_RUNS_RETRIES_KEPT:
                self._ended_runs_retries.popitem(last=False)

    def _log_path_here(self, job: SupervisedJob) -> Path:
        """The server's log file if it is on this node, else a spool file of this node's."""
        if job.head_node_id in (None, ray.get_runtime_context().get_node_id()):
            return job.log_path
        return spool_path(self._kv_namespace, job.log_path.name)

    # What the attempts of a job (attempts.py) need of their supervisor: `AttemptHost`.

    @property
    def supervisor_token(self) -> str:
        return self._supervisor_token

    def job_store(self) -> JobStore:
        if self._store is None:
            gcs_address = ray.get_runtime_context().gcs_address
            # A status must reach the store even across a GCS restart (fault tolerance).
            self._store = JobStore(
                GcsKv(gcs_address, self._kv_namespace, outage_retry_s=GCS_OUTAGE_RETRY_S)
            )
        return self._store

    async def ray_driver_of(self, submission_id: str) -> RayDriver | None:
        if self._drivers is None:
            self._drivers = RayDrivers(ray.get_runtime_context().gcs_address)
        return await self._drivers.last_driver_of(submission_id)

    async def prepare_processes(self, jobs_cgroup: str | None) -> Containment:
        """Before the first job: start the guardian, learn what contains a job on this node,
        then become a subreaper (in this order: see `start_guardian`, `detect_containment`),
        and start the fork server (on this, the event loop's thread: see `ForkServer.start`).
        Before the first job of `jobs_cgroup`: this supervisor's directories in it."""
        async with self._preparing:
            await self._prepare_processes()
            if jobs_cgroup is not None and jobs_cgroup not in self._cgroups:
                self._cgroups[jobs_cgroup] = await self._prepare_cgroups(jobs_cgroup)
            assert self._containment is not None
            return self._containment

    async def _prepare_cgroups(self, jobs_cgroup: str) -> tuple[JobsCgroupTree, tuple[str, ...]]:
        """The node's jobs cgroup, swept of dead supervisors' leftovers, and this supervisor's
        directories in it, which its guardian removes when it dies (after its jobs)."""

        def prepare() -> tuple[JobsCgroupTree, tuple[str, ...]]:
            tree = find_jobs_tree(jobs_cgroup)
            if tree.support is LimitsSupport.NONE:
                return tree, ()
            for removed in sweep_dead_supervisors(tree):
                logger.info("removed the cgroup %s: its supervisor is gone", removed)
            return tree, make_supervisor_dirs(tree)

        try:
            tree, directories = await asyncio.to_thread(prepare)
        except OSError as error:
            logger.warning("jobs run without limits: %s", error)
            return NO_CGROUPS, ()
        assert self._guardian is not None
        for directory in directories:
            remove_when_supervisor_dies(self._guardian, directory)
        return tree, directories

    def attempt_cgroup(self, run: JobRun, attempt: int) -> AttemptCgroup | None:
        """A new cgroup for the run's `attempt`-th attempt, with the job's limits; None where
        this node has none (OSError where the host refuses one)."""
        tree, directories = self._cgroups.get(run.job.jobs_cgroup or "", (NO_CGROUPS, ()))
        if tree.support is LimitsSupport.NONE:
            return None
        name = f"{run.job.run_id}-{attempt}"
        return AttemptCgroup.make(tree, directories, name, run.job.spec.limits)

    async def _prepare_processes(self) -> None:
        if self._containment is not None:
            return
        self._guardian = guardian = start_guardian(self._supervisor_token)
        self._containment = await asyncio.to_thread(detect_containment)
        become_child_subreaper()
        fork_server = ForkServer(self._supervisor_token, nice=self._jobs_nice)
        try:
            fork_server.start()
            self._fork_server = fork_server
            # Its close never runs: a supervisor ends killed (`ray.kill`).
            assert fork_server.ends_dir is not None
            remove_when_supervisor_dies(guardian, fork_server.ends_dir)
        except OSError as error:
            logger.warning("no fork server (a launcher is started per job): %s", error)

    def fork_server(self) -> ForkServer | None:
        return self._fork_server

    def spool(self, run: JobRun) -> None:
        self._spools[run.job.submission_id] = run.log_path

    def unspool(self, run: JobRun) -> None:
        self._spools.pop(run.job.submission_id, None)

    def is_spooled(self, run: JobRun) -> bool:
        return run.job.submission_id in self._spools

    @contextlib.contextmanager
    def command_starting(self) -> Iterator[None]:
        self._starting += 1
        try:
            yield
        finally:
            self._starting -= 1

    def other_roots(self, run: JobRun) -> frozenset[int]:
        """The commands of this supervisor's other jobs: not orphans of `run`'s."""
        return frozenset(self._running_pids() - {run.pid} if run.pid is not None else ())

    def reap_orphans(self) -> None:
        """Reap the orphans that have exited, unless a command is starting."""
        if not self._starting:
            reap_orphans(keep=self._running_pids())

    def _running_pids(self) -> set[int]:
        """Command pids that asyncio still waits for; reaping them here would steal their status."""
        return {run.pid for run in self._runs.values() if run.pid is not None}


def _answer(ended: JobRecord | None) -> dict[str, Any] | JobStatus:
    """A run's end for the server: plain fields (no model class pickled by value), or STOPPED
    if it was deleted before it could start."""
    return JobStatus.STOPPED if ended is None else ended.model_dump(mode="json")
