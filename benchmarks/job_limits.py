"""Job limits (issue 35): what a cgroup per job attempt costs a job's start and the queue's burst.

    .venv/bin/python -m benchmarks.job_limits [--quick] [--jobs 200] [--ray-jobs 20]
                                              [--cgroup-ops 1000] [--burst-jobs 10000]

Our server in three ways: `--no-job-cgroups` (jobs without a cgroup: the path before issue 35),
a cgroup per attempt without limits, and a cgroup per attempt with `limits: {memory_bytes:
256 MiB, cpu_cores: 1, max_processes: 256}` in every submit. Ray's own job server on the same
head node is the reference for the start.

In this order:
1. The cgroup operations themselves, in this process (the supervisor's work on the start path):
   `AttemptCgroup.make` + `usage` + `remove` of an empty cgroup, `--cgroup-ops` times each
   without and with limits; and a forked child joining its cgroup (its writes to the
   join files (v1: `tasks`): what a job's first process does before anything of the job runs).
2. Job starts: the three servers on one Ray head, each warmed up, then `--jobs` sequential
   `true` jobs each, in interleaved blocks (the machine's load drifts alike for all three), each
   job polled until it ended.
3. The queue's burst (benchmarks/queue.py's, its default sizes): a fresh server per run, with
   and without cgroups, in the order ABBA.
4. `--ray-jobs` sequential jobs on Ray's server, as in 2.

Prints the tables (progress on stderr), with the load average at each phase, and writes them
to benchmarks/results-job-limits.md (not with `--quick`). Needs root and a writable cgroup
hierarchy (v1 or v2): its cgroups are under a `jobs-server-bench-<hex>` of its own, removed at
the end.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import enum
import errno
import importlib.metadata
import logging
import os
import platform
import resource
import shlex
import shutil
import struct
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from benchmarks.client import (
    JobsApi,
    Submitted,
    has_started,
    is_terminal,
    new_session,
    submit_with_workers,
)
from benchmarks.job_starts import cpu_s, machine_busy_s, own_cpu_s
from benchmarks.processes import (
    RayHead,
    jobs_server,
    kill_survivors,
    ray_head,
    set_up_benchmark_process,
    supervisor_processes,
)
from benchmarks.queue import (
    DEFAULT_IN_FLIGHT,
    DEFAULT_JOBS,
    DEFAULT_MAX_RUNNING,
    burst,
    wait_until_all_ended,
)
from benchmarks.scenarios import SINGLE_JOB_POLL_INTERVAL_S, SINGLE_JOB_TIMEOUT_S
from benchmarks.stats import percentile
from jobs_server.manager.limits import JobLimits
from jobs_server.manager.supervisor.cgroups import (
    AttemptCgroup,
    JobsCgroupTree,
    LimitsSupport,
    find_jobs_tree,
    make_supervisor_dirs,
)
from jobs_server.manager.supervisor.containment import LAUNCH_SOURCE

logger = logging.getLogger("benchmarks.job_limits")

RESULTS_PATH = Path(__file__).with_name("results-job-limits.md")
MIB = 2**20
LIMITS = JobLimits(memory_bytes=256 * MIB, cpu_cores=1.0, max_processes=256)
WARM_UP_JOBS = 20
WARM_UP_TIMEOUT_S = 120.0
# The targets: the start's p50 cost of a cgroup with limits, and the burst's rate.
TARGET_START_COST_S = 0.002
TARGET_BURST_RATIO = 0.9
# Removing the benchmark's cgroups: a guardian may still be removing a supervisor's directory.
CLEANUP_TIMEOUT_S = 10.0
CLEANUP_RETRY_S = 0.1
US_PER_S = 1e6
# Between two joins in the spaced measure: about a sequential job's round trip.
JOIN_SPACING_S = 0.025


class Variant(enum.StrEnum):
    """How our server runs a job."""

    NO_CGROUPS = "--no-job-cgroups"
    CGROUPS = "cgroups, no limits"
    LIMITS = "cgroups + limits"

    @property
    def slug(self) -> str:
        """Its short name, in job ids and directory names."""
        return {"NO_CGROUPS": "none", "CGROUPS": "cgroups", "LIMITS": "limits"}[self.name]

    def server_flags(self, jobs_cgroup: str, *, limits_by_default: bool) -> list[str]:
        """The server's flags; with `limits_by_default`, LIMITS as the server's defaults (for
        the queue's burst, whose POSTs carry no limits)."""
        if self is Variant.NO_CGROUPS:
            return ["--no-job-cgroups"]
        flags = ["--jobs-cgroup", jobs_cgroup]
        if self is Variant.LIMITS and limits_by_default:
            flags += [
                "--job-memory-max-bytes",
                str(LIMITS.memory_bytes),
                "--job-cpu-max-cores",
                str(LIMITS.cpu_cores),
                "--job-max-processes",
                str(LIMITS.max_processes),
            ]
        return flags

    def submit_limits(self) -> dict[str, Any] | None:
        """The `limits` of its submits in the start phase."""
        return LIMITS.model_dump() if self is Variant.LIMITS else None


@dataclass(frozen=True)
class Sizes:
    jobs: int
    block: int
    ray_jobs: int
    cgroup_ops: int
    joins: int
    burst_jobs: int

    def describe(self) -> str:
        return (
            f"{self.jobs} sequential jobs per server in blocks of {self.block}, {self.ray_jobs} on"
            f" Ray's; {self.cgroup_ops} cgroup operations, {self.joins} joins; bursts of"
            f" {self.burst_jobs:,} jobs"
        )


FULL = Sizes(jobs=200, block=20, ray_jobs=20, cgroup_ops=1000, joins=200, burst_jobs=DEFAULT_JOBS)
QUICK = Sizes(jobs=40, block=10, ray_jobs=5, cgroup_ops=1000, joins=100, burst_jobs=1000)
BURST_ORDER = (Variant.NO_CGROUPS, Variant.LIMITS, Variant.LIMITS, Variant.NO_CGROUPS)


@dataclass(frozen=True)
class StartTiming:
    """One sequential job, from sending its POST (client) or its submit (server, unix ms)."""

    post_s: float
    started_s: float | None
    """Until first seen RUNNING or ended (a `true` job is never seen RUNNING: its start is
    written with its end)."""
    server_start_ms: int | None
    """The server's submit → its attempt's start (the command runs, in its cgroup)."""
    server_end_ms: int | None
    """The server's submit → its end (the cgroup read and removed)."""
    status: str


@dataclass
class StartFigures:
    """One server's sequential jobs, and the CPU its processes spent on them."""

    timings: list[StartTiming] = field(default_factory=list)
    supervisor_cpu_s: float = 0.0
    server_cpu_s: float = 0.0
    limits_seen: object = None

    def values(self, name: str) -> list[float]:
        found = (getattr(timing, name) for timing in self.timings)
        return [float(value) for value in found if value is not None]


@dataclass(frozen=True)
class OurServer:
    """A started server of ours: its variant, URL, pid and supervisors (found after warm-up)."""

    variant: Variant
    url: str
    pid: int
    supervisors: tuple[psutil.Process, ...]


# Phase 2: the cgroup operations in this process.


@dataclass
class CgroupOps:
    """Microseconds per operation."""

    make_plain_us: list[float] = field(default_factory=list)
    make_limits_us: list[float] = field(default_factory=list)
    usage_us: list[float] = field(default_factory=list)
    remove_us: list[float] = field(default_factory=list)
    cycle_plain_us: list[float] = field(default_factory=list)
    cycle_limits_us: list[float] = field(default_factory=list)
    cycle_cpu_us: float | None = None
    """This process's CPU (user + system) per make + usage + remove, both kinds together."""
    join_back_to_back_us: list[float] = field(default_factory=list)
    join_spaced_us: list[float] = field(default_factory=list)


def measure_cgroup_ops(tree: JobsCgroupTree, operations: int, joins: int) -> CgroupOps:
    """Time make, usage and remove of empty attempt cgroups, alternately without and with
    limits, and a forked child's join, back to back and spaced as sequential jobs. Call it
    before any thread starts (it forks)."""
    supervisor_dirs = make_supervisor_dirs(tree)
    ops = CgroupOps()
    asyncio.run(_make_use_remove(tree, supervisor_dirs, operations, ops))
    for spacing_s, found in ((0.0, ops.join_back_to_back_us), (JOIN_SPACING_S, ops.join_spaced_us)):
        for number in range(joins):
            time.sleep(spacing_s)
            cgroup = AttemptCgroup.make(tree, supervisor_dirs, f"join-{number}", LIMITS)
            try:
                found.append(_timed_join_us(cgroup.join_files))
            finally:
                _remove(cgroup)
    for directory in supervisor_dirs:
        os.rmdir(directory)
    return ops


async def _make_use_remove(
    tree: JobsCgroupTree, supervisor_dirs: tuple[str, ...], operations: int, ops: CgroupOps
) -> None:
    # As the supervisor does it: make, then (the attempt over) usage and remove, on its loop.
    before = resource.getrusage(resource.RUSAGE_SELF)
    for number in range(2 * operations):
        limits = LIMITS if number % 2 else None
        started_ns = time.perf_counter_ns()
        cgroup = AttemptCgroup.make(tree, supervisor_dirs, f"op-{number}", limits)
        made_ns = time.perf_counter_ns()
        cgroup.usage()
        used_ns = time.perf_counter_ns()
        await cgroup.remove()
        removed_ns = time.perf_counter_ns()
        (ops.make_limits_us if limits else ops.make_plain_us).append((made_ns - started_ns) / 1e3)
        (ops.cycle_limits_us if limits else ops.cycle_plain_us).append(
            (removed_ns - started_ns) / 1e3
        )
        ops.usage_us.append((used_ns - made_ns) / 1e3)
        ops.remove_us.append((removed_ns - used_ns) / 1e3)
        if _is_left(cgroup):
            raise RuntimeError(f"{cgroup.directories} still there after remove()")
    after = resource.getrusage(resource.RUSAGE_SELF)
    used_s = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    ops.cycle_cpu_us = used_s / (2 * operations) * US_PER_S


def _timed_join_us(join_files: tuple[str, ...]) -> float:
    """A forked child's join of the cgroup, timed in the child and sent back by a pipe."""
    join = _launch_join()  # before the clock starts
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            os.close(read_end)
            started_ns = time.perf_counter_ns()
            join(join_files)
            os.write(write_end, struct.pack("q", time.perf_counter_ns() - started_ns))
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    os.close(write_end)
    try:
        _, status = os.waitpid(pid, 0)
        answer = os.read(read_end, 8)
    finally:
        os.close(read_end)
    if os.waitstatus_to_exitcode(status) != 0 or len(answer) != 8:
        raise RuntimeError(f"the child could not join {join_files}")
    return float(struct.unpack("q", answer)[0]) / 1e3


def _launch_join() -> Callable[[Sequence[str]], None]:
    """A job's first process's own join (containment.py's `join_cgroups`, which lives in the
    launch's source: run here, it defines its functions and starts nothing)."""
    launch: dict[str, Any] = {}
    exec(LAUNCH_SOURCE, launch)  # our own source, as the fork server runs it
    join: Callable[[Sequence[str]], None] = launch["join_cgroups"]
    return join


def _is_left(cgroup: AttemptCgroup) -> bool:
    return any(os.path.exists(directory) for directory in cgroup.directories)


def _remove(cgroup: AttemptCgroup) -> None:
    cgroup.remove_now()
    if _is_left(cgroup):
        asyncio.run(cgroup.remove())


# Phase 1: job starts.


async def submit_job(
    api: JobsApi, entrypoint: str, submission_id: str, limits: dict[str, Any] | None
) -> Submitted:
    """POST a job, with `limits` if given (JobsApi.submit sends none); time the request."""
    body: dict[str, object] = {"entrypoint": entrypoint, "submission_id": submission_id}
    if limits is not None:
        body["limits"] = limits
    sent_at_s = time.monotonic()
    async with api.session.post(api.url("/api/jobs/"), json=body) as response:
        text = await response.text()
        if response.status != 200:
            raise RuntimeError(f"POST {submission_id} -> {response.status}: {text[:300]!r}")
    return Submitted(submission_id, sent_at_s, time.monotonic() - sent_at_s)


async def time_one_start(
    api: JobsApi, submission_id: str, limits: dict[str, Any] | None
) -> tuple[StartTiming, dict[str, Any]]:
    """Submit a `true` job and poll its details until it ended; its timing and last details."""
    job = await submit_job(api, "true", submission_id, limits)
    started_s: float | None = None
    details: dict[str, Any] = {}
    deadline_s = job.sent_at_s + SINGLE_JOB_TIMEOUT_S
    for _ in range(int(SINGLE_JOB_TIMEOUT_S / SINGLE_JOB_POLL_INTERVAL_S)):
        details = await api.job(submission_id)
        elapsed_s = time.monotonic() - job.sent_at_s
        if started_s is None and has_started(details["status"]):
            started_s = elapsed_s
        if is_terminal(details["status"]) or time.monotonic() > deadline_s:
            break
        await asyncio.sleep(SINGLE_JOB_POLL_INTERVAL_S)
    submitted_ms, attempts = details.get("start_time"), details.get("attempts") or []
    ended_ms = details.get("end_time")
    return StartTiming(
        post_s=job.latency_s,
        started_s=started_s,
        server_start_ms=attempts[0]["start_time"] - submitted_ms
        if attempts and submitted_ms
        else None,
        server_end_ms=ended_ms - submitted_ms if ended_ms and submitted_ms else None,
        status=str(details.get("status")),
    ), details


def supervisor_pids(head: RayHead) -> set[int]:
    return {process.pid for process in supervisor_processes(head.pid)}


def new_supervisors(head: RayHead, before: set[int]) -> tuple[psutil.Process, ...]:
    """The supervisors that appeared since `before`, without those under another of them."""
    found = [p for p in supervisor_processes(head.pid) if p.pid not in before]
    pids = {process.pid for process in found}
    return tuple(process for process in found if process.ppid() not in pids)


def supervisors_cpu_s(supervisors: Sequence[psutil.Process]) -> float:
    """Their CPU time with their children's (reaped, and live with what those reaped)."""
    total_s = 0.0
    for supervisor in supervisors:
        with contextlib.suppress(psutil.NoSuchProcess):
            total_s += cpu_s(supervisor, with_live_children=True)
    return total_s


async def warm_up(url: str, marker: str) -> None:
    async with new_session(max_connections=16) as session:
        api = JobsApi(session, url)
        ids = [f"{marker}-warm-{n}" for n in range(WARM_UP_JOBS)]
        deadline_s = time.monotonic() + WARM_UP_TIMEOUT_S
        _, errors = await submit_with_workers(api, "true", ids, 8, deadline_s)
        if errors:
            raise RuntimeError(f"warm-up POSTs failed: {errors[0]}")
        await wait_until_all_ended(api, deadline_s)


async def api_limits(url: str) -> str:
    """GET /api/version's `limits`: how the server enforces them."""
    async with (
        new_session(max_connections=2) as session,
        session.get(f"{url}/api/version") as response,
    ):
        return str((await response.json())["limits"])


async def measure_starts(
    servers: list[OurServer], sizes: Sizes, marker: str
) -> dict[Variant, StartFigures]:
    """Each server's sequential `true` jobs, in blocks whose order turns every round."""
    figures = {server.variant: StartFigures() for server in servers}
    rounds = -(-sizes.jobs // sizes.block)
    async with new_session(max_connections=8) as session:
        for round_number in range(rounds):
            turn = round_number % len(servers)
            for server in servers[turn:] + servers[:turn]:
                count = min(sizes.block, sizes.jobs - round_number * sizes.block)
                await _run_block(JobsApi(session, server.url), server, count, marker, figures)
            logger.info("  round %d of %d done", round_number + 1, rounds)
    return figures


async def _run_block(
    api: JobsApi, server: OurServer, count: int, marker: str, figures: dict[Variant, StartFigures]
) -> None:
    ours = figures[server.variant]
    server_process = psutil.Process(server.pid)
    supervisor_before = supervisors_cpu_s(server.supervisors)
    server_before = own_cpu_s(server_process)
    for _ in range(count):
        submission_id = f"{marker}-{server.variant.slug}-{len(ours.timings):04d}"
        timing, details = await time_one_start(api, submission_id, server.variant.submit_limits())
        ours.timings.append(timing)
        ours.limits_seen = details.get("limits")
    ours.supervisor_cpu_s += supervisors_cpu_s(server.supervisors) - supervisor_before
    ours.server_cpu_s += own_cpu_s(server_process) - server_before


async def measure_ray_starts(head: RayHead, jobs: int, marker: str) -> StartFigures:
    figures = StartFigures()
    async with new_session(max_connections=8) as session:
        api = JobsApi(session, head.dashboard_url)
        for number in range(jobs):
            timing, _ = await time_one_start(api, f"{marker}-ray-{number:04d}", None)
            figures.timings.append(timing)
    return figures


# Phase 3: the queue's burst.


@dataclass(frozen=True)
class BurstRun:
    variant: Variant
    figures: dict[str, float | str]
    supervisor_ms_per_job: float
    server_ms_per_job: float
    machine_ms_per_job: float
    limits_seen: object
    load_before: float


async def one_burst(
    head: RayHead, run_dir: Path, variant: Variant, jobs_cgroup: str, jobs: int, marker: str
) -> BurstRun:
    """benchmarks/queue.py's burst on a fresh server (in `run_dir`, made); the CPU its
    processes spent per job."""
    flags = variant.server_flags(jobs_cgroup, limits_by_default=True)
    flags += ["--max-running-jobs", str(DEFAULT_MAX_RUNNING), "--max-queued-jobs", str(jobs)]
    load_before = os.getloadavg()[0]
    before = supervisor_pids(head)
    with jobs_server(head.gcs_address, run_dir, flags) as ours:
        await warm_up(ours.url, marker)
        async with new_session(max_connections=2) as session:
            details = await JobsApi(session, ours.url).job(f"{marker}-warm-0")
        supervisors = new_supervisors(head, before)
        server = psutil.Process(ours.pid)
        supervisor_before, server_before = supervisors_cpu_s(supervisors), own_cpu_s(server)
        machine_before = machine_busy_s()
        args = argparse.Namespace(jobs=jobs, in_flight=DEFAULT_IN_FLIGHT)
        figures = await burst(ours.url, ours.pid, head.pid, args)
        # burst() runs WARM_UP_JOBS of its own first.
        counted = jobs + WARM_UP_JOBS
        run = BurstRun(
            variant=variant,
            figures=figures,
            supervisor_ms_per_job=(supervisors_cpu_s(supervisors) - supervisor_before)
            / counted
            * 1000,
            server_ms_per_job=(own_cpu_s(server) - server_before) / counted * 1000,
            machine_ms_per_job=(machine_busy_s() - machine_before) / counted * 1000,
            limits_seen=details.get("limits"),
            load_before=load_before,
        )
    logger.info("burst %s: %s", variant, figures)
    return run


# The run.


@dataclass
class Outcome:
    """Everything a run measured, and what it noticed."""

    supports: dict[Variant, str] = field(default_factory=dict)
    starts: dict[Variant, StartFigures] = field(default_factory=dict)
    ray_starts: StartFigures | None = None
    ops: CgroupOps | None = None
    bursts: list[BurstRun] = field(default_factory=list)
    loads: dict[str, tuple[float, float, float]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


async def run_servers(
    work_dir: Path, cgroup_root: str, sizes: Sizes, marker: str, outcome: Outcome
) -> None:
    with ray_head(work_dir) as head:
        outcome.loads["job starts"] = os.getloadavg()
        with contextlib.ExitStack() as stack:
            servers = []
            for variant in Variant:
                run_dir = work_dir / f"starts-{variant.slug}"
                flags = variant.server_flags(
                    f"{cgroup_root}/starts-{variant.slug}", limits_by_default=False
                )
                before = supervisor_pids(head)
                ours = stack.enter_context(jobs_server(head.gcs_address, run_dir, flags))
                await warm_up(ours.url, f"{marker}-{variant.slug}")
                outcome.supports[variant] = await api_limits(ours.url)
                supervisors = new_supervisors(head, before)
                if not supervisors:
                    outcome.notes.append(f"{variant}: no supervisor of its own found")
                servers.append(OurServer(variant, ours.url, ours.pid, supervisors))
            logger.info("job starts: %d per server, interleaved", sizes.jobs)
            outcome.starts = await measure_starts(servers, sizes, marker)
        outcome.loads["burst"] = os.getloadavg()
        for number, variant in enumerate(BURST_ORDER):
            logger.info("burst %d of %d: %s", number + 1, len(BURST_ORDER), variant)
            outcome.bursts.append(
                await one_burst(
                    head,
                    work_dir / f"burst-{number}",
                    variant,
                    f"{cgroup_root}/burst-{number}",
                    sizes.burst_jobs,
                    f"{marker}-b{number}",
                )
            )
        # Last: what Ray does after its jobs (their workers' exits) would load a burst.
        outcome.loads["job starts on Ray's"] = os.getloadavg()
        logger.info("job starts: %d on Ray's job server", sizes.ray_jobs)
        outcome.ray_starts = await measure_ray_starts(head, sizes.ray_jobs, marker)


def remove_cgroup_tree(tree: JobsCgroupTree) -> list[str]:
    """Remove the benchmark's cgroups, children first; the directories that stay."""
    deadline_s = time.monotonic() + CLEANUP_TIMEOUT_S
    left: list[str] = []
    for _ in range(int(CLEANUP_TIMEOUT_S / CLEANUP_RETRY_S) + 1):
        left = []
        for top in tree.directories:
            if not os.path.isdir(top):
                continue
            for directory, _, _ in os.walk(top, topdown=False):
                try:
                    os.rmdir(directory)
                except FileNotFoundError:
                    pass
                except OSError as error:
                    if error.errno not in (errno.EBUSY, errno.ENOTEMPTY):
                        raise
                    left.append(directory)
        if not left or time.monotonic() > deadline_s:
            break
        time.sleep(CLEANUP_RETRY_S)
    return left


def run(sizes: Sizes) -> Outcome:
    outcome = Outcome()
    outcome.loads["start"] = os.getloadavg()
    marker = f"jl{uuid.uuid4().hex[:8]}"
    cgroup_root = f"jobs-server-bench-{uuid.uuid4().hex[:8]}"
    tree = find_jobs_tree(cgroup_root)
    if tree.support is LimitsSupport.NONE:
        raise SystemExit("no writable cgroup hierarchy: nothing to measure (see the log)")
    # Short path: Ray's session directory holds Unix sockets, whose paths are length-limited.
    work_dir = Path(tempfile.mkdtemp(prefix="jobs-limits-", dir="/tmp"))
    logger.info("cgroups %s (%s); work dir %s", cgroup_root, tree.support, work_dir)
    try:
        # First, before any thread: it forks.
        in_process = find_jobs_tree(f"{cgroup_root}/in-process")
        logger.info("cgroup operations: %d of each, %d joins", sizes.cgroup_ops, sizes.joins)
        outcome.ops = measure_cgroup_ops(in_process, sizes.cgroup_ops, sizes.joins)
        for variant in Variant:
            (work_dir / f"starts-{variant.slug}").mkdir()
        for number in range(len(BURST_ORDER)):
            (work_dir / f"burst-{number}").mkdir()
        asyncio.run(run_servers(work_dir, cgroup_root, sizes, marker, outcome))
    finally:
        for pid, cmdline in kill_survivors(str(work_dir)) + kill_survivors(marker):
            outcome.notes.append(f"process {pid} outlived its process group (killed): {cmdline}")
        shutil.rmtree(work_dir, ignore_errors=True)
        for directory in remove_cgroup_tree(tree):
            outcome.notes.append(f"the cgroup {directory} could not be removed")
    outcome.loads["end"] = os.getloadavg()
    return outcome


# The report.


def fmt_ms(value_s: float | None) -> str:
    if value_s is None or value_s != value_s:
        return "—"
    return f"{value_s * 1000:.2f} ms" if abs(value_s) < 0.1 else f"{value_s * 1000:.0f} ms"


def pct_s(values: list[float], q: float, scale: float = 1.0) -> float | None:
    return percentile(values, q) * scale if values else None


def diff(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def verdict(met: bool | None) -> str:
    return {None: "not measured", True: "**met**", False: "**not met**"}[met]


def start_rows(outcome: Outcome) -> list[str]:
    """The job start table: Ray's, our three, and limits minus no cgroups."""
    ray = outcome.ray_starts or StartFigures()
    columns = [ray, *(outcome.starts.get(variant, StartFigures()) for variant in Variant)]
    jobs = [len(figures.timings) for figures in columns]

    def row(label: str, measure: Callable[[StartFigures], float | None], ray_too: bool) -> str:
        values = [measure(figures) for figures in columns]
        if not ray_too:
            values[0] = None
        cost = diff(values[3], values[1])
        cells = [fmt_ms(value) for value in values] + [fmt_ms(cost)]
        if not ray_too:
            cells[0] = "n/a"
        return f"| {label} | {' | '.join(cells)} |"

    def per_job(name: str) -> Callable[[StartFigures], float | None]:
        return lambda f: getattr(f, name) / len(f.timings) if f.timings else None

    rows = [
        f"| | Ray's job server | ours, {' | ours, '.join(Variant)} "
        "| cost: limits minus no cgroups |",
        "|---|---:|---:|---:|---:|---:|",
        f"| jobs (sequential `true`) | {' | '.join(str(n) for n in jobs)} | |",
        row("submit → started p50 (client)", lambda f: pct_s(f.values("started_s"), 50), True),
        row("submit → started p99 (client)", lambda f: pct_s(f.values("started_s"), 99), True),
        row("submit → started mean (client)", lambda f: mean(f.values("started_s")), True),
        row("POST p50", lambda f: pct_s(f.values("post_s"), 50), True),
        row(
            "server: submit → attempt start p50",
            lambda f: pct_s(f.values("server_start_ms"), 50, 1e-3),
            False,
        ),
        row(
            "server: submit → attempt start p99",
            lambda f: pct_s(f.values("server_start_ms"), 99, 1e-3),
            False,
        ),
        row(
            "server: submit → attempt start mean",
            lambda f: m * 1e-3 if (m := mean(f.values("server_start_ms"))) is not None else None,
            False,
        ),
        row(
            "server: submit → end p50",
            lambda f: pct_s(f.values("server_end_ms"), 50, 1e-3),
            True,
        ),
        row("supervisor + children CPU per job", per_job("supervisor_cpu_s"), False),
        row("server CPU per job (with its 5 ms polls)", per_job("server_cpu_s"), False),
    ]
    ray_p50 = pct_s(ray.values("started_s"), 50)
    ratios = []
    for variant in Variant:
        ours_p50 = pct_s(outcome.starts.get(variant, StartFigures()).values("started_s"), 50)
        ratio = ours_p50 / ray_p50 if ours_p50 is not None and ray_p50 else None
        ratios.append("—" if ratio is None else f"{ratio:.3g}")
    rows.append(f"| ratio ours/Ray's, submit → started p50 | — | {' | '.join(ratios)} | |")
    return rows


def ops_rows(ops: CgroupOps) -> list[str]:
    def cells(values: list[float]) -> str:
        if not values:
            return "— | —"
        return f"{percentile(values, 50):.0f} | {percentile(values, 99):.0f}"

    return [
        "| operation (in this process) | p50 µs | p99 µs |",
        "|---|---:|---:|",
        f"| `AttemptCgroup.make`, no limits ({len(ops.make_plain_us)}) | "
        f"{cells(ops.make_plain_us)} |",
        f"| `AttemptCgroup.make`, limits ({len(ops.make_limits_us)}) | "
        f"{cells(ops.make_limits_us)} |",
        f"| `usage()` ({len(ops.usage_us)}) | {cells(ops.usage_us)} |",
        f"| `await remove()`, empty ({len(ops.remove_us)}) | {cells(ops.remove_us)} |",
        f"| make + usage + remove, no limits | {cells(ops.cycle_plain_us)} |",
        f"| make + usage + remove, limits | {cells(ops.cycle_limits_us)} |",
        f"| CPU (user + system) per make + usage + remove, mean | "
        f"{'—' if ops.cycle_cpu_us is None else f'{ops.cycle_cpu_us:.0f}'} | |",
        f"| a child's join (its writes to the join files, v1 `tasks`), back to back "
        f"({len(ops.join_back_to_back_us)}) | {cells(ops.join_back_to_back_us)} |",
        f"| a child's join, one every {JOIN_SPACING_S * 1000:.0f} ms "
        f"({len(ops.join_spaced_us)}) | {cells(ops.join_spaced_us)} |",
    ]


def burst_rows(bursts: list[BurstRun]) -> list[str]:
    rows = [
        "| run | server | load (1 min) | succeeded | jobs completed/s | POST p50 | POST p99 "
        "| supervisor + children CPU ms/job | server CPU ms/job | machine CPU ms/job |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for number, run in enumerate(bursts, 1):
        figures = run.figures

        def num(key: str, figures: dict[str, float | str] = figures) -> float:
            value = figures.get(key)
            return float(value) if isinstance(value, int | float) else float("nan")

        rows.append(
            f"| {number} | {run.variant} | {run.load_before:.2f} | {num('succeeded'):,.0f} "
            f"| {num('completed_per_s'):.1f} | {fmt_ms(num('post_p50'))} "
            f"| {fmt_ms(num('post_p99'))} | {run.supervisor_ms_per_job:.2f} "
            f"| {run.server_ms_per_job:.2f} | {run.machine_ms_per_job:.2f} |"
        )
    return rows


def burst_rate(bursts: list[BurstRun], variant: Variant) -> float | None:
    rates = [
        float(run.figures["completed_per_s"])
        for run in bursts
        if run.variant is variant and isinstance(run.figures.get("completed_per_s"), float)
    ]
    return mean(rates)


def start_cost_s(outcome: Outcome) -> float | None:
    """The target's figure: submit → started p50, limits minus no cgroups."""
    with_limits = outcome.starts.get(Variant.LIMITS, StartFigures()).values("started_s")
    without = outcome.starts.get(Variant.NO_CGROUPS, StartFigures()).values("started_s")
    return diff(pct_s(with_limits, 50), pct_s(without, 50))


def checks(outcome: Outcome, sizes: Sizes) -> list[str]:
    """What must hold for the figures to mean anything; a line per failure."""
    problems = list(outcome.notes)
    for variant, support in outcome.supports.items():
        if (support == "none") != (variant is Variant.NO_CGROUPS):
            problems.append(f"{variant}: GET /api/version says limits {support}")
    for variant, figures in outcome.starts.items():
        failed = [t.status for t in figures.timings if t.status != "SUCCEEDED"]
        if failed:
            problems.append(f"{variant}: {len(failed)} sequential jobs ended {failed[0]}")
    limited = outcome.starts.get(Variant.LIMITS)
    if limited is not None and limited.limits_seen != LIMITS.model_dump():
        problems.append(f"a limited job's details say limits {limited.limits_seen}")
    for run in outcome.bursts:
        if run.figures.get("succeeded") != sizes.burst_jobs:
            problems.append(f"burst {run.variant}: {run.figures.get('succeeded')} SUCCEEDED")
        if run.variant is Variant.LIMITS and run.limits_seen != LIMITS.model_dump():
            problems.append(f"burst {run.variant}: a job's details say limits {run.limits_seen}")
    return problems


def render(outcome: Outcome, sizes: Sizes, started: datetime.datetime) -> str:
    cost = start_cost_s(outcome)
    plain_rate = burst_rate(outcome.bursts, Variant.NO_CGROUPS)
    limits_rate = burst_rate(outcome.bursts, Variant.LIMITS)
    ratio = limits_rate / plain_rate if limits_rate and plain_rate else None
    support = outcome.supports.get(Variant.LIMITS, "not run")
    loads = "; ".join(
        f"{name}: {', '.join(f'{x:.2f}' for x in load)}" for name, load in outcome.loads.items()
    )
    problems = checks(outcome, sizes)
    lines = [
        "# Job limits: what a cgroup per job costs (issue 35)",
        "",
        f"- date: {started.isoformat(timespec='seconds')}",
        f"- machine: {os.cpu_count()} cores, kernel {platform.release()}, limits {support}; "
        f"load average (1, 5, 15 min) at {loads}",
        f"- command: `{shlex.join(sys.orig_argv)}` (from the repository root)",
        f"- Ray {importlib.metadata.version('ray')}; sizes: {sizes.describe()}",
        f"- limits: `{LIMITS.model_dump()}`",
        "",
        "## Targets",
        "",
        "| target | figure | |",
        "|---|---:|---|",
        f"| a job's start with limits vs `--no-job-cgroups`: p50 cost ≤ 2 ms | {fmt_ms(cost)} "
        f"| {verdict(None if cost is None else cost <= TARGET_START_COST_S)} |",
        f"| the burst's jobs/s with limits within 10 % of `--no-job-cgroups`'s | "
        f"{'—' if ratio is None else f'{ratio:.3f}'} "
        f"({'—' if limits_rate is None else f'{limits_rate:.1f}'} / "
        f"{'—' if plain_rate is None else f'{plain_rate:.1f}'} jobs/s) "
        f"| {verdict(None if ratio is None else ratio >= TARGET_BURST_RATIO)} |",
        "",
        "## Job starts",
        "",
        *start_rows(outcome),
        "",
        "## The cgroup operations",
        "",
        *(ops_rows(outcome.ops) if outcome.ops else ["not run"]),
        "",
        f"## The queue's burst ({sizes.burst_jobs:,} `true`, {DEFAULT_IN_FLIGHT} in flight, "
        f"cap {DEFAULT_MAX_RUNNING})",
        "",
        *burst_rows(outcome.bursts),
        "",
        "## How it measures",
        "",
        *[f"- {text}" for text in METHOD_NOTES],
    ]
    if problems:
        lines += ["", "## Checks that failed", "", *[f"- {text}" for text in problems]]
    return "\n".join(lines) + "\n"


METHOD_NOTES = [
    "Job starts: three of our servers on one Ray head node, each warmed up with "
    f"{WARM_UP_JOBS} jobs, then sequential `true` jobs in blocks, the order of the servers "
    "turning every round. A job: its POST, then `GET /api/jobs/{id}` every "
    f"{SINGLE_JOB_POLL_INTERVAL_S * 1000:.0f} ms until it ended. Submit → started: from "
    "sending the POST until first seen RUNNING or ended (a `true` job is never seen RUNNING: "
    "its start is written with its end; so this is its whole run, the cgroup's removal "
    "included). The limited server's jobs carry `limits` in their submit.",
    "Server: from the job's `start_time` (its submit) to its first attempt's `start_time` "
    "(the command runs, in its cgroup: made and joined) and to its `end_time` (the cgroup read "
    "and removed); milliseconds of the wall clock, as the API has them.",
    "CPU per job: the user + system time of the server's supervisor actor with its children "
    "(reaped, and the live fork server with what it reaped), and of the server process, over "
    "the blocks; CPU time, not wall time, so another load on the machine does not count.",
    "Ray's job server (its dashboard, on the same head) runs the same jobs the same way, after "
    "the bursts: the reference for the start.",
    "The cgroup operations: in this process, on a jobs cgroup of its own under its own cgroup "
    "(as a supervisor's), `AttemptCgroup.make` then `usage()` then `await remove()` on an "
    "empty cgroup, alternately without and with the limits. The join: a forked child writes "
    "`0` to the cgroup's join files (v1: `tasks`; containment.py's `join_cgroups`, as a "
    "job's first process does) and times that, back to back and one every "
    f"{JOIN_SPACING_S * 1000:.0f} ms (as the sequential jobs above come).",
    "The burst: `benchmarks/queue.py`'s, on a fresh server per run in the order ABBA; "
    "completed per second is its figure (jobs / from the first POST until the archive has no "
    "unfinished job). Its POSTs carry no `limits` (queue.py's client), so the limited server "
    "gives every job the same limits as its defaults (`--job-memory-max-bytes`, "
    "`--job-cpu-max-cores`, `--job-max-processes`): the same cgroup work per job; a warm-up "
    "job's details are checked to carry them. CPU per job: over the burst (its own warm-up "
    "jobs counted); the machine's is every CPU second of the machine, other work included.",
]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.job_limits",
        description="What a cgroup per job attempt costs (issue 35).",
    )
    parser.add_argument("--quick", action="store_true", help="small sizes (under 3 minutes)")
    parser.add_argument("--jobs", type=int, metavar="N", help="sequential jobs per our server")
    parser.add_argument("--ray-jobs", type=int, metavar="N", help="sequential jobs on Ray's")
    parser.add_argument("--cgroup-ops", type=int, metavar="N", help="make+remove of each kind")
    parser.add_argument("--burst-jobs", type=int, metavar="N", help="jobs per burst")
    return parser.parse_args(argv)


def sizes_for(args: argparse.Namespace) -> Sizes:
    base = QUICK if args.quick else FULL
    return Sizes(
        jobs=args.jobs or base.jobs,
        block=base.block,
        ray_jobs=args.ray_jobs or base.ray_jobs,
        cgroup_ops=args.cgroup_ops or base.cgroup_ops,
        joins=base.joins,
        burst_jobs=args.burst_jobs or base.burst_jobs,
    )


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    set_up_benchmark_process()
    sizes = sizes_for(args)
    started = datetime.datetime.now().astimezone()
    outcome = run(sizes)
    report = render(outcome, sizes, started)
    sys.stdout.write(report)
    # A quick run does not replace the full run's table (which docs/performance.md quotes).
    if not args.quick:
        RESULTS_PATH.write_text(report)
        logger.info("written to %s", RESULTS_PATH)


if __name__ == "__main__":
    main()
