"""A bounded soak: many mixed jobs, concurrent lists, stops, deletes and resubmits, the server
killed -9 twice and its shared supervisor killed -9 once while the server is down; then checks
that every job's record is true.

    .venv/bin/python -m benchmarks.soak [--jobs 500] [--seed 1] [--deadline-s 600] [--no-faults]
                                        [--keep] [--output benchmarks/results-soak.md]

Starts a Ray head node (its own process group, 127.0.0.2, no dashboard) and `jobs_server serve`
joined to it, drives the jobs, kills and restarts the server on the same namespace and log
directory, and at the end checks: no job stuck non-terminal, none missing, every status and log
what the job did, no job process left. Prints a markdown summary (progress goes to stderr),
writes it to benchmarks/results-soak.md, and exits 1 if it found a violation.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

import aiohttp
import ray

from benchmarks.processes import NO_DRAIN, kill_survivors, surviving_processes
from benchmarks.stats import percentile
from tests.support.api import TERMINAL_STATUSES
from tests.support.processes import free_port, stop_process_group
from tests.support.ray_nodes import RAY_NODE_IP, start_ray_node
from tests.support.servers import start_jobs_server, wait_for_server

logger = logging.getLogger(__name__)

RESULTS_PATH = Path(__file__).parent / "results-soak.md"
DEFAULT_JOBS = 500
# The long and fixed-id jobs, and some regular ones of each kind.
MIN_JOBS = 100
DEFAULT_DEADLINE_S = 600.0
# Logical CPUs of the head node: room for the dedicated supervisors (0.1 CPU each) next to the
# shared one, whatever the machine has.
RAY_NUM_CPUS = 4
SERVER_READY_TIMEOUT_S = 90.0
STOP_GRACE_S = 1.0
# The share of the regular jobs accepted before each server kill.
FIRST_KILL_AT = 0.3
LONG_JOBS_AT = 0.4
SECOND_KILL_AT = 0.6
SUBMITTERS = 3
SUBMIT_INTERVAL_S = 0.1
SUBMIT_ATTEMPTS = 8
LIST_INTERVAL_S = 0.2
STOP_INTERVAL_S = 0.5
DELETE_INTERVAL_S = 0.6
# At most this share of the sleepy jobs is stopped, and of the quick ones deleted: the rest must
# end on their own, with their log.
STOPPED_SHARE = 0.5
DELETED_SHARE = 0.15
FIXED_IDS = 10
FIXED_GENERATIONS = 5
FIXED_CYCLERS = 2
LONG_JOBS = 20
# Long jobs sleep past the end of the soak: if one survives its supervisor, the scan finds it.
LONG_SLEEP_S = 300
LONG_RUNNING_TIMEOUT_S = 60.0
CONVERGE_TIMEOUT_S = 60.0
CONVERGE_POLL_INTERVAL_S = 0.25
JOB_TERMINAL_TIMEOUT_S = 60.0
JOB_POLL_INTERVAL_S = 0.2
# After everything stops, how long every job gets to reach a terminal status.
FINAL_WAIT_S = 60.0
FINAL_POLL_INTERVAL_S = 0.5
LOG_READERS = 16
REQUEST_TIMEOUT_S = 30.0
ACTOR_CALL_TIMEOUT_S = 30.0
SHARED_SUPERVISOR_PREFIX = "jobs_server_shared_supervisor:"
BODY_CHARS = 200
SHOWN_PER_KIND = 6
REQUEST_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError)


class Kind(StrEnum):
    """What a job does, and so what its record must say at the end."""

    ECHO = "echo"
    TRUE = "true"
    FAIL = "fail"
    SLEEPY = "sleepy"
    DEDICATED = "dedicated"
    LONG = "long"
    FIXED = "fixed"


# The share of each kind among the regular jobs (the long and fixed-id ones are counted apart).
REGULAR_MIX = {
    Kind.ECHO: 0.40,
    Kind.TRUE: 0.12,
    Kind.FAIL: 0.17,
    Kind.SLEEPY: 0.25,
    Kind.DEDICATED: 0.06,
}


class Violation(StrEnum):
    """What kind of wrong the soak found."""

    STUCK = "stuck non-terminal"
    MISSING = "accepted, not deleted, missing"
    NOT_GONE = "deleted, still there"
    WRONG = "status or log untrue"
    PROCESS_LEFT = "job process left"
    LIST_OMISSION = "left out of a list"
    REFUSED = "submission refused"
    SERVER_ERROR = "HTTP 5xx"
    SLOW = "not on time during the run"
    UNFINISHED = "the soak did not finish"


@dataclass
class Job:
    """One submission_id of the soak, and what was done to it."""

    submission_id: str
    kind: Kind
    entrypoint: str = ""
    expected_log: str = ""
    num_cpus: float | None = None
    accepted_at_s: float | None = None
    # A POST that got no answer: the job may or may not exist.
    maybe_accepted: bool = False
    stop_sent: bool = False
    delete_sent_at_s: float | None = None
    deleted: bool = False
    maybe_deleted: bool = False
    # Non-terminal when its shared supervisor was killed: it may end JOB_SUPERVISOR_ACTOR_DIED.
    in_killed_supervisor: bool = False
    # A fixed id between its DELETE and its next POST's answer: absent from lists is right.
    cycling: bool = False
    generation: int = 0
    seen_terminal: bool = False


@dataclass
class Restart:
    """One kill -9 of the server and its restart."""

    reason: str
    # From the kill until the new server answered.
    down_s: float = 0.0
    converged_s: float | None = None
    waited_for: int = 0


@dataclass
class Findings:
    """What the soak measured and what it found wrong."""

    violations: list[tuple[Violation, str]] = field(default_factory=list)
    list_latencies_s: list[float] = field(default_factory=list)
    list_omissions: Counter[str] = field(default_factory=Counter)
    lists_with_omissions: int = 0
    http_errors: Counter[str] = field(default_factory=Counter)
    refused_while_down: int = 0
    stops: int = 0
    deletes: int = 0
    resubmits: int = 0
    restarts: list[Restart] = field(default_factory=list)
    killed_supervisor_pid: int | None = None
    killed_supervisor_jobs: int = 0
    timings_s: dict[str, float] = field(default_factory=dict)
    final_statuses: Counter[str] = field(default_factory=Counter)

    def violation(self, kind: Violation, text: str) -> None:
        logger.warning("violation (%s): %s", kind, text)
        self.violations.append((kind, text))


class ApiError(Exception):
    """An HTTP error answer (the server was up and said no)."""

    def __init__(self, status: int, text: str) -> None:
        super().__init__(f"{status}: {text[:BODY_CHARS]}")
        self.status = status
        self.text = text


class Soak:
    """The run: the cluster's and server's processes, the jobs, and the activities on them."""

    def __init__(
        self, *, jobs: int, seed: int, work_dir: Path, gcs_address: str, faults: bool = True
    ) -> None:
        self.planned = jobs
        self.with_faults = faults
        self.rng = random.Random(seed)
        self.work_dir = work_dir
        self.gcs_address = gcs_address
        self.token = f"soak{uuid.uuid4().hex[:10]}"
        # Not the token: the server's command line names it, and the token marks job processes.
        self.namespace = f"soak_{uuid.uuid4().hex[:10]}"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_dir = work_dir / "jobs-server-logs"
        self.server_log = work_dir / "jobs-server.log"
        self.server: subprocess.Popen[bytes] | None = None
        self.up = asyncio.Event()
        self.done = asyncio.Event()
        self.findings = Findings()
        self.jobs: dict[str, Job] = {}
        long_jobs = LONG_JOBS if faults else 0
        self.regular = self._plan_regular(jobs - long_jobs - FIXED_IDS * FIXED_GENERATIONS)
        self.long = [self._job(f"{self.token}-long-{i:02d}", Kind.LONG) for i in range(long_jobs)]
        self.fixed = [
            self._job(f"{self.token}-fixed-{i:02d}", Kind.FIXED) for i in range(FIXED_IDS)
        ]
        self.accepted = 0
        self.accepted_more = asyncio.Event()
        self.session: aiohttp.ClientSession | None = None
        self.server_tracebacks = 0

    # The plan.

    def _plan_regular(self, count: int) -> list[Job]:
        kinds = [kind for kind, share in REGULAR_MIX.items() for _ in range(round(count * share))]
        kinds = (kinds + [Kind.ECHO] * count)[:count]
        self.rng.shuffle(kinds)
        return [self._job(f"{self.token}-{i:04d}", kind) for i, kind in enumerate(kinds)]

    def _job(self, submission_id: str, kind: Kind) -> Job:
        job = Job(submission_id, kind)
        self._write_entrypoint(job)
        self.jobs[submission_id] = job
        return job

    def _write_entrypoint(self, job: Job) -> None:
        """The job's command and its exact output. Every job exports the run's token, so its
        processes (the shell's command line, its children's environment) can be found later."""
        tag = f"{job.submission_id}-g{job.generation}"
        body, job.expected_log = {
            Kind.ECHO: (f"echo out-{tag}", f"out-{tag}\n"),
            Kind.TRUE: ("true", ""),
            Kind.FAIL: (f"echo fail-{tag}; exit 3", f"fail-{tag}\n"),
            Kind.SLEEPY: (f"echo a-{tag}; sleep 0.5; echo b-{tag}", f"a-{tag}\nb-{tag}\n"),
            Kind.DEDICATED: (f"echo d-{tag}; sleep 0.3; echo e-{tag}", f"d-{tag}\ne-{tag}\n"),
            Kind.LONG: (f"echo long-{tag}; sleep {LONG_SLEEP_S}; echo end-{tag}", f"long-{tag}\n"),
            Kind.FIXED: (f"echo fixed-{tag}", f"fixed-{tag}\n"),
        }[job.kind]
        job.entrypoint = f"export SOAK_TOKEN={self.token}-{job.submission_id}; {body}"
        dedicated = job.kind is Kind.DEDICATED or (
            job.kind is Kind.FIXED and int(job.submission_id[-2:]) % 2 == 0
        )
        job.num_cpus = 0.1 if dedicated else None

    # HTTP.

    async def request(self, method: str, path: str, body: object = None) -> Any:
        """One request while the server is up; ApiError for an error answer, the client's
        errors when the server is away."""
        await self.up.wait()
        assert self.session is not None
        try:
            async with self.session.request(method, self.url + path, json=body) as response:
                text = await response.text()
        except REQUEST_ERRORS:
            self.findings.refused_while_down += 1
            raise
        if response.status >= 400:
            self.findings.http_errors[f"{method} {_route(path)} -> {response.status}"] += 1
            if response.status >= 500:
                self.findings.violation(
                    Violation.SERVER_ERROR,
                    f"{method} {path} answered {response.status}: {text[:BODY_CHARS]!r}",
                )
            raise ApiError(response.status, text)
        return await response.json(content_type=None) if text else None

    async def submit(self, job: Job) -> bool:
        """POST the job until it is answered; True if it was accepted (or already existed
        from a POST whose answer was lost)."""
        body: dict[str, object] = {"entrypoint": job.entrypoint, "submission_id": job.submission_id}
        if job.num_cpus is not None:
            body["entrypoint_num_cpus"] = job.num_cpus
        for _ in range(SUBMIT_ATTEMPTS):
            try:
                await self.request("POST", "/api/jobs/", body)
            except REQUEST_ERRORS:
                job.maybe_accepted = True
                await asyncio.sleep(JOB_POLL_INTERVAL_S)
                continue
            except ApiError as error:
                if job.maybe_accepted and "already exists" in error.text:
                    break
                if job.kind is Kind.FIXED and error.status == 400:
                    self.findings.violation(
                        Violation.REFUSED,
                        f"resubmit of deleted {job.submission_id} (generation "
                        f"{job.generation}) refused: {error.text[:BODY_CHARS]!r}",
                    )
                    await asyncio.sleep(1.0)
                    continue
                self.findings.violation(
                    Violation.REFUSED, f"POST {job.submission_id} refused: {error}"
                )
                return False
            break
        else:
            return False
        job.accepted_at_s = time.monotonic()
        job.maybe_accepted = False
        self.accepted += 1
        self.accepted_more.set()
        return True

    async def list_jobs(self) -> dict[str, dict[str, Any]]:
        return {str(job["submission_id"]): job for job in await self.request("GET", "/api/jobs/")}

    # The server's process.

    def start_server(self) -> float:
        """Start `jobs_server serve` (same port, namespace and log directory each time); the
        seconds until it answered."""
        started_s = time.monotonic()
        self.server = start_jobs_server(
            [
                "--port",
                str(self.port),
                "--ray-address",
                self.gcs_address,
                "--log-dir",
                str(self.log_dir),
                "--state-dir",
                str(self.log_dir.parent / "state"),
                "--namespace",
                self.namespace,
                "--stop-grace-s",
                str(STOP_GRACE_S),
                "--shared-supervisors",
                "1",
            ],
            self.server_log,
        )
        wait_for_server(self.url, self.server, self.server_log, timeout_s=SERVER_READY_TIMEOUT_S)
        return time.monotonic() - started_s

    def count_tracebacks(self) -> None:
        with contextlib.suppress(OSError):
            self.server_tracebacks = self.server_log.read_text(errors="replace").count("Traceback")

    def kill_server(self) -> None:
        """SIGKILL the server, as a crash would, and reap it."""
        assert self.server is not None
        self.up.clear()
        os.kill(self.server.pid, signal.SIGKILL)
        self.server.wait()

    # The activities.

    async def submitter(self, queue: list[Job]) -> None:
        while queue and not self.done.is_set():
            job = queue.pop()
            await self.submit(job)
            await asyncio.sleep(SUBMIT_INTERVAL_S)

    async def lister(self) -> None:
        """Lists without a pause; every job answered before a list began must be in it."""
        while not self.done.is_set():
            started_s = time.monotonic()
            try:
                listed = await self.list_jobs()
            except (*REQUEST_ERRORS, ApiError):
                await asyncio.sleep(LIST_INTERVAL_S)
                continue
            ended_s = time.monotonic()
            self.findings.list_latencies_s.append(ended_s - started_s)
            omitted = [
                job.submission_id
                for job in self.jobs.values()
                if job.accepted_at_s is not None
                and job.accepted_at_s < started_s
                and not job.cycling
                and job.delete_sent_at_s is None
                and job.submission_id not in listed
            ]
            self.findings.list_omissions.update(omitted)
            self.findings.lists_with_omissions += bool(omitted)
            for submission_id, details in listed.items():
                if details["status"] in TERMINAL_STATUSES and submission_id in self.jobs:
                    self.jobs[submission_id].seen_terminal = True
            await asyncio.sleep(LIST_INTERVAL_S)

    async def stopper(self) -> None:
        """Stops sleepy jobs soon after their POST was answered."""
        while not self.done.is_set():
            await asyncio.sleep(STOP_INTERVAL_S)
            sleepy = [job for job in self.regular if job.kind is Kind.SLEEPY]
            candidates = [
                job for job in sleepy if job.accepted_at_s is not None and not job.stop_sent
            ]
            if not candidates or sum(job.stop_sent for job in sleepy) >= STOPPED_SHARE * len(
                sleepy
            ):
                continue
            job = max(candidates, key=lambda job: job.accepted_at_s or 0.0)
            job.stop_sent = True
            with contextlib.suppress(*REQUEST_ERRORS, ApiError):
                await self.request("POST", f"/api/jobs/{job.submission_id}/stop")
                self.findings.stops += 1

    async def deleter(self) -> None:
        """Deletes finished quick jobs."""
        deletable = {Kind.ECHO, Kind.TRUE, Kind.FAIL}
        while not self.done.is_set():
            await asyncio.sleep(DELETE_INTERVAL_S)
            quick = [job for job in self.regular if job.kind in deletable]
            candidates = [
                job for job in quick if job.seen_terminal and job.delete_sent_at_s is None
            ]
            sent = sum(job.delete_sent_at_s is not None for job in quick)
            if not candidates or sent >= DELETED_SHARE * len(quick):
                continue
            job = self.rng.choice(candidates)
            job.delete_sent_at_s = time.monotonic()
            try:
                await self.request("DELETE", f"/api/jobs/{job.submission_id}")
            except REQUEST_ERRORS:
                job.maybe_deleted = True
                continue
            except ApiError:
                continue
            job.deleted = True
            self.findings.deletes += 1

    async def cycler(self, queue: list[Job]) -> None:
        """Fixed ids: run, wait for the end, delete, resubmit at once, a few generations each."""
        while queue and not self.done.is_set():
            job = queue.pop()
            if not await self.submit(job):
                continue
            for generation in range(1, FIXED_GENERATIONS):
                if not await self.wait_terminal(job.submission_id):
                    break
                job.cycling = True
                await self._delete_now(job)
                job.generation = generation
                self._write_entrypoint(job)
                self.findings.resubmits += 1
                accepted = await self.submit(job)
                job.cycling = False
                if not accepted:
                    break

    async def wait_terminal(self, submission_id: str) -> bool:
        deadline_s = time.monotonic() + JOB_TERMINAL_TIMEOUT_S
        while time.monotonic() < deadline_s:
            with contextlib.suppress(*REQUEST_ERRORS, ApiError):
                details = await self.request("GET", f"/api/jobs/{submission_id}")
                if details["status"] in TERMINAL_STATUSES:
                    return True
            await asyncio.sleep(JOB_POLL_INTERVAL_S)
        self.findings.violation(
            Violation.SLOW, f"{submission_id} not terminal {JOB_TERMINAL_TIMEOUT_S:.0f} s on"
        )
        return False

    async def _delete_now(self, job: Job) -> None:
        """DELETE a terminal job, again if the server was away."""
        for _ in range(SUBMIT_ATTEMPTS):
            try:
                await self.request("DELETE", f"/api/jobs/{job.submission_id}")
            except REQUEST_ERRORS:
                await asyncio.sleep(JOB_POLL_INTERVAL_S)
                continue
            except ApiError:
                pass
            return

    # The faults.

    async def faults(self) -> None:
        """Kill -9 the server twice mid-run, the second time its shared supervisor too."""
        if not self.with_faults:
            return
        regular = len(self.regular)
        await self._until_accepted(FIRST_KILL_AT * regular)
        before = self._accepted_ids()
        await self.restart("kill -9 mid-run", before, kill_supervisor=False)

        await self._until_accepted(LONG_JOBS_AT * regular)
        await asyncio.gather(*(self.submit(job) for job in self.long))
        await self._wait_long_running()
        await self._until_accepted(SECOND_KILL_AT * regular)
        before = self._accepted_ids()
        await self.restart("kill -9, shared supervisor kill -9 while down", before, True)

    async def _until_accepted(self, count: float) -> None:
        while self.accepted < count:
            self.accepted_more.clear()
            await self.accepted_more.wait()

    def _accepted_ids(self) -> set[str]:
        return {job.submission_id for job in self.jobs.values() if job.accepted_at_s is not None}

    async def _wait_long_running(self) -> None:
        """Until every long job is RUNNING on the shared supervisor (asked one by one: a list
        may leave a job out)."""
        deadline_s = time.monotonic() + LONG_RUNNING_TIMEOUT_S
        waiting = {job.submission_id for job in self.long if job.accepted_at_s is not None}
        while waiting and time.monotonic() < deadline_s:
            for submission_id in list(waiting):
                with contextlib.suppress(*REQUEST_ERRORS, ApiError):
                    details = await self.request("GET", f"/api/jobs/{submission_id}")
                    if details["status"] == "RUNNING":
                        waiting.discard(submission_id)
            await asyncio.sleep(JOB_POLL_INTERVAL_S)
        if waiting:
            self.findings.violation(
                Violation.SLOW,
                f"{len(waiting)} long jobs not RUNNING {LONG_RUNNING_TIMEOUT_S:.0f} s on",
            )

    async def restart(self, reason: str, before: set[str], kill_supervisor: bool) -> None:
        """Kill -9 the server (and the shared supervisor while it is down), start it again, and
        time until every job accepted before the kill is terminal again."""
        restart = Restart(reason)
        self.findings.restarts.append(restart)
        supervisor_pid = None
        ended: set[str] = set()
        if kill_supervisor:
            supervisor_pid = await asyncio.to_thread(self.shared_supervisor_pid)
            ended = await self._terminal_jobs()
        logger.info("%s", reason)
        killed_s = time.monotonic()
        await asyncio.to_thread(self.kill_server)
        if supervisor_pid is not None:
            os.kill(supervisor_pid, signal.SIGKILL)
            self.findings.killed_supervisor_pid = supervisor_pid
            # Every job on the shared supervisor that had not ended by the last list may have
            # been on it when it died.
            for job in self.jobs.values():
                if (
                    job.num_cpus is None
                    and (job.accepted_at_s is not None or job.maybe_accepted)
                    and job.submission_id not in ended
                ):
                    job.in_killed_supervisor = True
                    self.findings.killed_supervisor_jobs += 1
        await asyncio.to_thread(self.start_server)
        ready_at_s = time.monotonic()
        restart.down_s = ready_at_s - killed_s
        self.up.set()
        restart.waited_for = len(before)
        restart.converged_s = await self._converge(before, ready_at_s)

    def shared_supervisor_pid(self) -> int:
        """The pid of the (one) shared supervisor's worker process, asked of the actor."""
        names = [
            actor["name"]
            for actor in ray.util.list_named_actors(all_namespaces=True)
            if actor["namespace"] == self.namespace
            and str(actor["name"]).startswith(SHARED_SUPERVISOR_PREFIX)
        ]
        assert len(names) == 1, names
        actor = ray.get_actor(names[0], namespace=self.namespace)
        return int(ray.get(actor.pid.remote(), timeout=ACTOR_CALL_TIMEOUT_S))

    async def _terminal_jobs(self) -> set[str]:
        listed = await self.list_jobs()
        return {sid for sid, details in listed.items() if details["status"] in TERMINAL_STATUSES}

    async def _converge(self, before: set[str], ready_at_s: float) -> float | None:
        deadline_s = ready_at_s + CONVERGE_TIMEOUT_S
        while time.monotonic() < deadline_s:
            with contextlib.suppress(*REQUEST_ERRORS, ApiError):
                listed = await self.list_jobs()
                if all(
                    listed[submission_id]["status"] in TERMINAL_STATUSES
                    for submission_id in before & listed.keys()
                ):
                    return time.monotonic() - ready_at_s
            await asyncio.sleep(CONVERGE_POLL_INTERVAL_S)
        return None

    # The run.

    async def run(self) -> None:
        async with aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
        ) as self.session:
            self.findings.timings_s["server start (s)"] = await asyncio.to_thread(self.start_server)
            self.up.set()
            started_s = time.monotonic()
            queue = list(reversed(self.regular))
            fixed = list(reversed(self.fixed))
            background = [
                asyncio.create_task(activity)
                for activity in (self.lister(), self.stopper(), self.deleter())
            ]
            foreground = [
                *(self.submitter(queue) for _ in range(SUBMITTERS)),
                *(self.cycler(fixed) for _ in range(FIXED_CYCLERS)),
                self.faults(),
            ]
            await asyncio.gather(*foreground)
            submitted_s = time.monotonic() - started_s
            self.findings.timings_s["submitting, both restarts included (s)"] = submitted_s
            self.done.set()
            await asyncio.gather(*background)
            settled_s = await self.settle()
            self.findings.timings_s["all terminal after the last POST (s)"] = settled_s
            self.findings.timings_s["jobs accepted per second"] = self.accepted / submitted_s
            await self.check()

    async def settle(self) -> float:
        """Wait (bounded) until no listed job is non-terminal; the seconds it took."""
        started_s = time.monotonic()
        while time.monotonic() - started_s < FINAL_WAIT_S:
            with contextlib.suppress(*REQUEST_ERRORS, ApiError):
                listed = await self.list_jobs()
                if all(
                    details["status"] in TERMINAL_STATUSES
                    for submission_id, details in listed.items()
                    if submission_id in self.jobs
                ):
                    break
            await asyncio.sleep(FINAL_POLL_INTERVAL_S)
        return time.monotonic() - started_s

    # The checks.

    async def check(self) -> None:
        listed = await self.list_jobs()
        readers = asyncio.Semaphore(LOG_READERS)

        async def read_log(submission_id: str) -> tuple[str, str | None]:
            async with readers:
                with contextlib.suppress(ApiError):
                    body = await self.request("GET", f"/api/jobs/{submission_id}/logs")
                    return submission_id, str(body["logs"])
                return submission_id, None

        present = [sid for sid in listed if sid in self.jobs]
        logs = dict(await asyncio.gather(*(read_log(sid) for sid in present)))
        for job in self.jobs.values():
            details = listed.get(job.submission_id)
            if details is not None:
                self.findings.final_statuses[f"{job.kind} {details['status']}"] += 1
            self.check_job(job, details, logs.get(job.submission_id))
        assert self.session is not None
        for submission_id in (job.submission_id for job in self.jobs.values() if job.deleted):
            async with self.session.get(f"{self.url}/api/jobs/{submission_id}") as response:
                if response.status != 404:
                    self.findings.violation(
                        Violation.NOT_GONE,
                        f"{submission_id}: deleted, but GET answers {response.status}",
                    )
        for pid, what in surviving_processes(self.token):
            self.findings.violation(Violation.PROCESS_LEFT, f"pid {pid}: {what}")
        omitted = self.findings.list_omissions
        if omitted:
            self.findings.violation(
                Violation.LIST_OMISSION,
                f"{len(omitted)} accepted jobs were left out of"
                f" {self.findings.lists_with_omissions} of {len(self.findings.list_latencies_s)}"
                f" lists that began after their POST was"
                f" answered (e.g. {', '.join(sorted(omitted)[:3])})",
            )

    def check_job(self, job: Job, details: dict[str, Any] | None, log: str | None) -> None:
        sid = job.submission_id
        if job.accepted_at_s is None and not job.maybe_accepted:
            if details is not None:
                self.findings.violation(Violation.NOT_GONE, f"{sid}: never accepted, but listed")
            return
        if job.deleted or job.maybe_deleted:
            if details is not None and job.deleted:
                self.findings.violation(
                    Violation.NOT_GONE, f"{sid}: deleted, but still listed ({details['status']})"
                )
            return
        if details is None:
            if job.accepted_at_s is not None:
                self.findings.violation(Violation.MISSING, f"{sid} ({job.kind}): not listed")
            return
        status = details["status"]
        if status not in TERMINAL_STATUSES:
            self.findings.violation(
                Violation.STUCK, f"{sid} ({job.kind}): {status} {FINAL_WAIT_S:.0f} s on"
            )
            return
        error = expected_error(job, details, log)
        if error:
            self.findings.violation(Violation.WRONG, f"{sid} ({job.kind}): {error}")


def expected_error(job: Job, details: dict[str, Any], log: str | None) -> str | None:
    """What is wrong with a terminal job's status and log, or None."""
    status, exit_code, error_type = (
        details["status"],
        details.get("driver_exit_code"),
        details.get("error_type"),
    )
    said = f"{status} (exit {exit_code}, {error_type}, {details.get('message')!r}), log {log!r}"
    if log is None:
        return f"{status}, its log unreadable"
    if (
        job.in_killed_supervisor
        and status == "FAILED"
        and error_type == "JOB_SUPERVISOR_ACTOR_DIED"
    ):
        return None if job.expected_log.startswith(log) else f"log not its output: {said}"
    if job.kind is Kind.LONG:
        return f"expected FAILED JOB_SUPERVISOR_ACTOR_DIED, got {said}"
    if job.kind is Kind.FAIL:
        right = status == "FAILED" and exit_code == 3 and log == job.expected_log
        return None if right else f"expected FAILED exit 3 with its log, got {said}"
    if job.stop_sent and status == "STOPPED":
        if "before it started" in (details.get("message") or "") and log:
            return f"said to have never started, yet wrote: {said}"
        # Stopped in its sleep: its first line at most, nothing after the stop.
        return None if log in ("", job.expected_log.split("\n")[0] + "\n") else f"stopped, {said}"
    if status != "SUCCEEDED" or log != job.expected_log:
        return f"expected SUCCEEDED with log {job.expected_log!r}, got {said}"
    return None


def _route(path: str) -> str:
    """A path with its job id replaced, so errors count by route."""
    parts = path.split("/")
    return "/".join(
        "{id}" if i == 3 and len(parts) > 3 and parts[3] else p for i, p in enumerate(parts)
    )


# The report.


def summary(soak: Soak, total_s: float, error: str | None) -> str:
    findings = soak.findings
    latencies = findings.list_latencies_s
    lines = [
        "# Soak",
        "",
        f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, `python -m benchmarks.soak"
        f" --jobs {soak.planned}{'' if soak.with_faults else ' --no-faults'}`, {os.cpu_count()}"
        f" cores, Ray {ray.__version__}, {total_s:.0f} s in all.",
        "",
        "| what | value |",
        "| --- | --- |",
        f"| submissions accepted | {soak.accepted} |",
        f"| stops / deletes / delete+resubmit cycles | {findings.stops} / {findings.deletes} /"
        f" {findings.resubmits} |",
        f"| lists during the soak | {len(latencies)} |",
    ]
    if latencies:
        lines.append(
            f"| list p50 / p99 | {percentile(latencies, 50) * 1000:.0f} ms /"
            f" {percentile(latencies, 99) * 1000:.0f} ms |"
        )
    lines += [f"| {what} | {value:.1f} |" for what, value in findings.timings_s.items()]
    for number, restart in enumerate(findings.restarts, 1):
        converged = (
            f"{restart.converged_s:.1f} s"
            if restart.converged_s is not None
            else f"not in {CONVERGE_TIMEOUT_S:.0f} s"
        )
        lines.append(
            f"| restart {number} ({restart.reason}) | answering {restart.down_s:.1f} s after the"
            f" kill; the {restart.waited_for} jobs accepted before it all terminal {converged}"
            f" after that |"
        )
    lines += [
        f"| shared supervisor killed | pid {findings.killed_supervisor_pid}; jobs on it not seen"
        f" terminal before: {findings.killed_supervisor_jobs} |",
        f"| requests refused while the server was down | {findings.refused_while_down} |",
        f"| HTTP error answers | {dict(findings.http_errors) or 'none'} |",
        f"| tracebacks in the server's log | {soak.server_tracebacks} |",
        f"| final statuses | {dict(sorted(findings.final_statuses.items()))} |",
        "",
    ]
    violations = findings.violations + ([(Violation.UNFINISHED, error)] if error else [])
    lines.append(f"## Violations: {len(violations)}")
    lines.append("")
    if not violations:
        lines.append("None: no job stuck or missing, every status and log true, no process left.")
    by_kind: dict[Violation, list[str]] = {}
    for kind, text in violations:
        by_kind.setdefault(kind, []).append(text)
    for kind, texts in by_kind.items():
        lines.append(f"- **{kind}**: {len(texts)}")
        lines += [f"  - {text}" for text in texts[:SHOWN_PER_KIND]]
        if len(texts) > SHOWN_PER_KIND:
            lines.append(f"  - … and {len(texts) - SHOWN_PER_KIND} more")
    return "\n".join(lines) + "\n"


@contextlib.contextmanager
def ray_head(work_dir: Path) -> Iterator[str]:
    """A Ray head node of its own on loopback, without a dashboard, stopped by its group."""
    port = free_port(RAY_NODE_IP)
    node = start_ray_node(
        [
            "--head",
            f"--port={port}",
            "--include-dashboard=false",
            f"--num-cpus={RAY_NUM_CPUS}",
            f"--temp-dir={work_dir / 'ray'}",
        ],
        RAY_NODE_IP,
        work_dir / "ray-start.log",
        env={**os.environ, **NO_DRAIN},
    )
    try:
        node.wait_until_started()
        yield f"{RAY_NODE_IP}:{port}"
    finally:
        stop_process_group(node.process)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__)
    parser.add_argument(
        "--jobs", type=int, default=DEFAULT_JOBS, help=f"submissions in all (at least {MIN_JOBS})"
    )
    parser.add_argument("--seed", type=int, default=1, help="of the job mix's order")
    parser.add_argument(
        "--deadline-s",
        type=float,
        default=DEFAULT_DEADLINE_S,
        help="hard deadline of the run (then everything is stopped and it fails)",
    )
    parser.add_argument(
        "--faults",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="kill the server and its shared supervisor mid-run (--no-faults: a baseline)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the work dir (logs)")
    parser.add_argument(
        "--output", type=Path, default=RESULTS_PATH, help="where the summary is written"
    )
    args = parser.parse_args(argv)
    if args.jobs < MIN_JOBS:
        parser.error(f"--jobs must be at least {MIN_JOBS}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    started_s = time.monotonic()
    # Short: Ray's socket paths under it must fit in 107 bytes.
    work_dir = Path(tempfile.mkdtemp(prefix="soak", dir="/tmp"))
    error: str | None = None
    soak: Soak | None = None
    try:
        with ray_head(work_dir) as gcs_address:
            ray.init(address=gcs_address, logging_level="WARNING", log_to_driver=False)
            soak = Soak(
                jobs=args.jobs,
                seed=args.seed,
                work_dir=work_dir,
                gcs_address=gcs_address,
                faults=args.faults,
            )
            remaining_s = args.deadline_s - (time.monotonic() - started_s)
            try:
                asyncio.run(asyncio.wait_for(soak.run(), timeout=remaining_s))
            except TimeoutError:
                error = f"the soak's deadline ({args.deadline_s:.0f} s) passed before it ended"
            except (Exception, AssertionError) as failure:
                logger.exception("the soak itself failed")
                error = f"the soak itself failed: {failure!r}"
            finally:
                if soak.server is not None:
                    stop_process_group(soak.server)
                    soak.count_tracebacks()
                ray.shutdown()
    finally:
        if soak is not None:
            kill_survivors(soak.token)
        if args.keep:
            logger.info("work dir kept: %s", work_dir)
        else:
            shutil.rmtree(work_dir, ignore_errors=True)
    assert soak is not None
    text = summary(soak, time.monotonic() - started_s, error)
    print(text)
    args.output.write_text(text)
    return 1 if soak.findings.violations or error else 0


if __name__ == "__main__":
    sys.exit(main())
