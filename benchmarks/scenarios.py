"""The scenarios: each measures one server through the jobs API and returns its figures.

A scenario only speaks HTTP to the server (the same client drives Ray's server and ours), and
leaves no job of its own running when it returns.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Collection, Iterable
from dataclasses import dataclass, field, replace
from urllib.parse import urlsplit

import aiohttp
import psutil

from benchmarks.client import (
    ApiError,
    JobsApi,
    Submitted,
    has_started,
    is_terminal,
    submit_all_at_once,
    submit_with_workers,
    watch_statuses,
)
from benchmarks.log_readers import LogReadError
from benchmarks.processes import WORKER_NODE_IP, RayHead
from benchmarks.report import Better, Figure, Metric, Results, Server, Target, Unit
from benchmarks.stats import machine_pss_bytes, percentile
from tests.support.ray_nodes import RAY_NODE_IP

logger = logging.getLogger(__name__)

# Transport and server errors a scenario survives: it records them and reports no figure.
REQUEST_ERRORS = (ApiError, LogReadError, aiohttp.ClientError, TimeoutError)

SINGLE_JOB_POLL_INTERVAL_S = 0.005
SINGLE_JOB_TIMEOUT_S = 120.0
BURST_POLL_INTERVAL_S = 0.05
BURST_TIMEOUT_S = 180.0
BURST_LEFTOVER_TIMEOUT_S = 120.0
SLEEPER_ENTRYPOINT = "sleep 60"
SLEEPER_POLL_INTERVAL_S = 0.01
SLEEPER_RUNNING_TIMEOUT_S = 120.0
STOP_POLL_INTERVAL_S = 0.01
STOP_TIMEOUT_S = 60.0
MEMORY_SAMPLE_INTERVAL_S = 1.0
MEMORY_STEADY_BYTES = 8 * 2**20
BASELINE_STEADY_TIMEOUT_S = 30.0
RUNNING_STEADY_TIMEOUT_S = 10.0
SETTLE_POLL_INTERVAL_S = 0.25
SETTLE_TIMEOUT_S = 600.0
FILL_WORKERS = 32
FILL_TIMEOUT_S = 600.0
FILL_ROUNDS = 3
LIST_REQUESTS = 50
LARGE_LIST_POLL_INTERVAL_S = 2.0
MAX_NOTED_ERRORS = 3


@dataclass
class RunContext:
    """What a scenario needs to measure one server: its API, its name, where notes go, the
    processes that serve its log requests (whose memory the log scenarios watch), and the
    cluster's head node (to which a scenario may join worker nodes of its own)."""

    api: JobsApi
    server: Server
    results: Results
    run_tag: str
    log_processes: Callable[[], list[psutil.Process]]
    head: RayHead
    _serial: itertools.count[int] = field(default_factory=itertools.count)

    def job_ids(self, slug: str, count: int) -> list[str]:
        """Fresh submission ids, unique within the run and telling which scenario sent them."""
        side = "ray" if self.server is Server.RAY else "ours"
        return [
            f"bench-{self.run_tag}-{side}-{slug}-{next(self._serial):05d}" for _ in range(count)
        ]

    def note(self, text: str) -> None:
        """A note about this server, printed under the table."""
        self.results.note(self.server, text)

    def note_errors(self, what: str, errors: list[str]) -> None:
        """Note how many requests failed and the first few errors."""
        if errors:
            shown = "; ".join(errors[:MAX_NOTED_ERRORS])
            self.note(f"{len(errors)} {what} failed, e.g. {shown}")


@dataclass(frozen=True)
class Placement:
    """Where a scenario's jobs run: on the head node (they ask for nothing), or on the one node
    that has the custom `resources` they ask for. It also names the scenario's rows and keys, and
    the group `--only` selects it by."""

    group: str
    node_ip: str
    resources: dict[str, float] | None = None
    row_prefix: str = ""
    key_prefix: str = ""

    def key(self, name: str) -> str:
        """A metric key (or job id slug) of this placement's; the head's are the plain names."""
        return self.key_prefix + name

    def label(self, text: str) -> str:
        """A row label or title that says where the job ran (nothing for the head)."""
        return self.row_prefix + text

    def rows(self, metrics: list[Metric]) -> list[Metric]:
        """A scenario's metrics, keyed and labelled for this placement."""
        return [replace(m, key=self.key(m.key), label=self.label(m.label)) for m in metrics]

    def figures(self, figures: dict[str, Figure]) -> dict[str, Figure]:
        """A scenario's figures, keyed for this placement."""
        return {self.key(key): figure for key, figure in figures.items()}


# The benchmark's worker node alone has this resource; its jobs ask for one of it.
WORKER_RESOURCE = "bench_worker"
WORKER_RESOURCE_AMOUNT = 4
ON_HEAD = Placement("logs", RAY_NODE_IP)
ON_WORKER = Placement(
    "remote", WORKER_NODE_IP, {WORKER_RESOURCE: 1}, "job on a worker node: ", "worker_"
)


async def note_if_ran_elsewhere(ctx: RunContext, submission_id: str, node_ip: str) -> None:
    """Note the job if GET /api/jobs/{id} says it ran on another node than `node_ip`.

    Ours says so in `driver_info.node_ip_address`; Ray's fills `driver_info` only for a job
    whose entrypoint connects to Ray as a driver, so for a shell command it is the host of
    `driver_agent_http_address` (the dashboard agent of the node the job ran on).
    """
    try:
        job = await ctx.api.job(submission_id)
    except REQUEST_ERRORS as error:
        ctx.note(f"could not tell where job {submission_id} ran: {error}")
        return
    ran_on = (job.get("driver_info") or {}).get("node_ip_address") or urlsplit(
        job.get("driver_agent_http_address") or ""
    ).hostname
    if ran_on != node_ip:
        ctx.note(f"job {submission_id} ran on {ran_on or 'an unknown node'}, not on {node_ip}")


class Scenario(ABC):
    """One section of the benchmark: its rows of the table and how to measure a server."""

    title: str
    servers: tuple[Server, ...] = (Server.RAY, Server.OURS)
    # What `--only` selects it by.
    group: str = "jobs"

    @abstractmethod
    def metrics(self) -> list[Metric]:
        """The rows this scenario fills."""

    @abstractmethod
    async def measure(self, ctx: RunContext) -> dict[str, Figure]:
        """Run the scenario against one server; figures by metric key."""


def p50(values: list[float]) -> Figure:
    """The median, or no figure for no values."""
    return Figure(percentile(values, 50)) if values else Figure(None, "no data")


async def timed(call: Callable[[], Awaitable[object]]) -> float:
    """Seconds one awaited call took."""
    started_s = time.monotonic()
    await call()
    return time.monotonic() - started_s


async def poll_until(
    check: Callable[[], Awaitable[bool]], *, timeout_s: float, interval_s: float
) -> bool:
    """Await `check` every `interval_s` until it is true (True) or `timeout_s` passes (False)."""
    deadline_s = time.monotonic() + timeout_s
    for _ in range(int(timeout_s / interval_s) + 1):
        if await check():
            return True
        if time.monotonic() > deadline_s:
            break
        await asyncio.sleep(interval_s)
    return False


async def settle(
    ctx: RunContext,
    submission_ids: Collection[str],
    *,
    what: str,
    timeout_s: float = SETTLE_TIMEOUT_S,
    interval_s: float = SETTLE_POLL_INTERVAL_S,
    stop_leftovers: bool = True,
) -> None:
    """Wait until the jobs are terminal; stop (and note) those that are not after `timeout_s`.

    A zero timeout looks once and stops whatever is still going.
    """
    if not submission_ids:
        return
    if timeout_s > 0:
        logger.info("    waiting for %d %s jobs to end", len(submission_ids), what)
    watch = await watch_statuses(
        ctx.api, submission_ids, is_terminal, interval_s=interval_s, timeout_s=timeout_s
    )
    failed = [job_id for job_id, status in watch.status.items() if status == "FAILED"]
    if failed:
        ctx.note(f"{len(failed)} of {len(submission_ids)} {what} jobs FAILED, e.g. {failed[0]}")
    pending = watch.missing(submission_ids)
    if not pending:
        return
    if timeout_s > 0:
        ctx.note(f"{len(pending)} {what} jobs not done {timeout_s:.0f} s after the measurement")
    if stop_leftovers:
        await stop_and_wait(ctx, pending, what=what)


async def stop_and_wait(ctx: RunContext, submission_ids: list[str], *, what: str) -> None:
    """Stop the jobs at once and wait until they are terminal; note any that are not."""
    results = await asyncio.gather(
        *(ctx.api.stop(job_id) for job_id in submission_ids), return_exceptions=True
    )
    ctx.note_errors(f"stop requests for {what} jobs", describe_errors(results))
    watch = await watch_statuses(
        ctx.api,
        submission_ids,
        is_terminal,
        interval_s=SETTLE_POLL_INTERVAL_S,
        timeout_s=STOP_TIMEOUT_S,
    )
    if left := watch.missing(submission_ids):
        ctx.note(f"{len(left)} {what} jobs still not terminal after being stopped: {left[:3]}")


def describe_errors(results: Iterable[object]) -> list[str]:
    """`gather(..., return_exceptions=True)` results that are errors, as text."""
    return [f"{type(r).__name__}: {r}" for r in results if isinstance(r, BaseException)]


async def list_latencies_s(api: JobsApi, requests: int) -> list[float]:
    """Latency of `requests` sequential GET /api/jobs/, to the body's last byte: the server's
    time, not the client's JSON parsing (which grows with the list for any server)."""
    return [await timed(api.list_jobs_body) for _ in range(requests)]


async def fill_to(
    ctx: RunContext, listed_jobs: int, *, slug: str, deadline_s: float
) -> tuple[list[str], int]:
    """Submit `true` jobs until the server lists `listed_jobs`; the ids sent and the count listed.

    Counts what is already listed (earlier scenarios' jobs, and Ray's driver jobs).
    """
    submitted: list[str] = []
    listed = len(await ctx.api.list_jobs())
    for _ in range(FILL_ROUNDS):
        missing = listed_jobs - listed
        if missing <= 0 or time.monotonic() > deadline_s:
            break
        logger.info("    %d jobs listed, submitting %d more", listed, missing)
        accepted, errors = await submit_with_workers(
            ctx.api, "true", ctx.job_ids(slug, missing), FILL_WORKERS, deadline_s
        )
        ctx.note_errors(f"POSTs filling the list to {listed_jobs}", errors)
        submitted += [job.submission_id for job in accepted]
        listed = len(await ctx.api.list_jobs())
    return submitted, listed


async def steady_machine_pss_bytes(ctx: RunContext, timeout_s: float, what: str) -> int:
    """The machine's PSS once two readings a second apart agree (or, noted, after `timeout_s`)."""
    previous_bytes = await asyncio.to_thread(machine_pss_bytes)
    deadline_s = time.monotonic() + timeout_s
    for _ in range(int(timeout_s / MEMORY_SAMPLE_INTERVAL_S) + 1):
        await asyncio.sleep(MEMORY_SAMPLE_INTERVAL_S)
        current_bytes = await asyncio.to_thread(machine_pss_bytes)
        if abs(current_bytes - previous_bytes) <= MEMORY_STEADY_BYTES:
            return current_bytes
        if time.monotonic() > deadline_s:
            break
        previous_bytes = current_bytes
    ctx.note(
        f"machine memory {what} still moving by {abs(current_bytes - previous_bytes) / 2**20:.0f}"
        f" MiB/s after {timeout_s:.0f} s"
    )
    return current_bytes


@dataclass(frozen=True)
class SingleJobTiming:
    """One sequential job: POST latency, submit → RUNNING, submit → terminal (None if unseen)."""

    post_s: float
    running_s: float | None
    done_s: float | None


class SequentialSubmit(Scenario):
    """N `echo hi` jobs one after another, each polled every 5 ms until it is done."""

    def __init__(self, jobs: int) -> None:
        self.jobs = jobs
        self.title = f"{jobs} sequential `echo hi` jobs"

    def metrics(self) -> list[Metric]:
        return [
            Metric(
                "submit_running_p50",
                f"submit → RUNNING p50 ({self.jobs} sequential `echo hi`)",
                Unit.SECONDS,
                Better.LOWER,
                Target("≤ 1/10 of Ray's", 0.1),
            ),
            Metric(
                "submit_done_p50",
                f"submit → done p50 ({self.jobs} sequential `echo hi`)",
                Unit.SECONDS,
                Better.LOWER,
            ),
            Metric(
                "post_p50",
                f"POST /api/jobs/ p50 ({self.jobs} sequential)",
                Unit.SECONDS,
                Better.LOWER,
            ),
        ]

    async def measure(self, ctx: RunContext) -> dict[str, Figure]:
        timings = [await self._one_job(ctx, job_id) for job_id in ctx.job_ids("seq", self.jobs)]
        running = [t.running_s for t in timings if t.running_s is not None]
        done = [t.done_s for t in timings if t.done_s is not None]
        if len(done) < len(timings):
            ctx.note(
                f"{len(timings) - len(done)} sequential jobs not done "
                f"in {SINGLE_JOB_TIMEOUT_S:.0f} s"
            )
        return {
            "submit_running_p50": p50(running),
            "submit_done_p50": p50(done),
            "post_p50": p50([t.post_s for t in timings]),
        }

    async def _one_job(self, ctx: RunContext, job_id: str) -> SingleJobTiming:
        job = await ctx.api.submit("echo hi", job_id)
        running_s: float | None = None
        deadline_s = job.sent_at_s + SINGLE_JOB_TIMEOUT_S
        for _ in range(int(SINGLE_JOB_TIMEOUT_S / SINGLE_JOB_POLL_INTERVAL_S)):
            status = await ctx.api.status(job.submission_id)
            elapsed_s = time.monotonic() - job.sent_at_s
            if running_s is None and has_started(status):
                running_s = elapsed_s
            if is_terminal(status):
                if status != "SUCCEEDED":
                    ctx.note(f"sequential job {job.submission_id} ended {status}")
                return SingleJobTiming(job.latency_s, running_s, elapsed_s)
            if time.monotonic() > deadline_s:
                break
            await asyncio.sleep(SINGLE_JOB_POLL_INTERVAL_S)
        await settle(ctx, [job.submission_id], what="sequential", timeout_s=0)
        return SingleJobTiming(job.latency_s, running_s, None)


class BurstOfTrivialJobs(Scenario):
    """N `true` jobs POSTed at the same moment: how fast they are accepted, how fast done."""

    def __init__(self, jobs: int) -> None:
        self.jobs = jobs
        self.title = f"{jobs} `true` jobs at once"

    def metrics(self) -> list[Metric]:
        return [
            Metric(
                "burst_completed_per_s",
                f"{self.jobs} trivial jobs at once: completed/s",
                Unit.PER_SECOND,
                Better.HIGHER,
                Target("≥ 20 times Ray's", 20.0),
            ),
            Metric(
                "burst_accepted_per_s",
                f"{self.jobs} trivial jobs at once: accepted/s (all POSTs answered)",
                Unit.PER_SECOND,
                Better.HIGHER,
            ),
        ]

    async def measure(self, ctx: RunContext) -> dict[str, Figure]:
        started_s = time.monotonic()
        accepted, errors = await submit_all_at_once(
            ctx.api, "true", ctx.job_ids("burst", self.jobs)
        )
        answered_s = time.monotonic() - started_s
        ctx.note_errors("burst POSTs", errors)
        ids = [job.submission_id for job in accepted]
        watch = await watch_statuses(
            ctx.api,
            ids,
            is_terminal,
            interval_s=BURST_POLL_INTERVAL_S,
            timeout_s=BURST_TIMEOUT_S - answered_s,
        )
        figures = {"burst_accepted_per_s": Figure(len(accepted) / answered_s)}
        if failed := [job_id for job_id, status in watch.status.items() if status == "FAILED"]:
            ctx.note(f"{len(failed)} of {len(ids)} burst jobs FAILED, e.g. {failed[0]}")
        pending = watch.missing(ids)
        if not ids:
            figures["burst_completed_per_s"] = Figure(None, "none accepted")
        elif pending:
            figures["burst_completed_per_s"] = Figure(
                None, f"timeout ({len(ids) - len(pending)}/{self.jobs} in {BURST_TIMEOUT_S:.0f} s)"
            )
        else:
            done_s = max(watch.seen_at_s.values()) - started_s
            figures["burst_completed_per_s"] = Figure(len(ids) / done_s)
        await settle(ctx, pending, what="burst", timeout_s=BURST_LEFTOVER_TIMEOUT_S)
        return figures


class ConcurrentSleepers(Scenario):
    """N `sleep 60` jobs at once: time to RUNNING, memory per running job, time to STOPPED."""

    # Ours first: Ray's run leaves fifty worker processes exiting for a while, which would sink
    # into our baseline and make our memory per job look smaller than it is.
    servers = (Server.OURS, Server.RAY)

    def __init__(self, jobs: int) -> None:
        self.jobs = jobs
        self.title = f"{jobs} concurrent `sleep 60` jobs"

    def metrics(self) -> list[Metric]:
        return [
            Metric(
                "sleepers_running_p50",
                f"{self.jobs} concurrent: submit → RUNNING p50",
                Unit.SECONDS,
                Better.LOWER,
                Target("≤ 1/20 of Ray's", 0.05),
            ),
            Metric(
                "sleepers_running_max",
                f"{self.jobs} concurrent: submit → RUNNING max",
                Unit.SECONDS,
                Better.LOWER,
            ),
            Metric(
                "memory_per_job",
                f"memory per running job (PSS, {self.jobs} running)",
                Unit.BYTES,
                Better.LOWER,
                Target("≤ 1/4 of Ray's", 0.25),
            ),
            Metric(
                "stop_p50",
                f"stop → STOPPED p50 ({self.jobs} stopped at once)",
                Unit.SECONDS,
                Better.LOWER,
                Target("≤ 1/10 of Ray's", 0.1),
            ),
        ]

    async def measure(self, ctx: RunContext) -> dict[str, Figure]:
        # The previous scenario's processes (Ray's supervisor workers) may still be exiting.
        baseline_bytes = await steady_machine_pss_bytes(ctx, BASELINE_STEADY_TIMEOUT_S, "baseline")
        accepted, errors = await submit_all_at_once(
            ctx.api, SLEEPER_ENTRYPOINT, ctx.job_ids("sleep", self.jobs)
        )
        ctx.note_errors("sleeper POSTs", errors)
        ids = [job.submission_id for job in accepted]
        try:
            figures = await self._time_to_running(ctx, accepted)
            figures["memory_per_job"] = await self._memory_per_running_job(ctx, ids, baseline_bytes)
            figures["stop_p50"] = await self._time_to_stopped(ctx, ids)
            return figures
        finally:
            # Whatever happened above, no sleeper outlives the scenario.
            await settle(ctx, ids, what="sleeper", timeout_s=0)

    async def _time_to_running(
        self, ctx: RunContext, accepted: list[Submitted]
    ) -> dict[str, Figure]:
        sent_at_s = {job.submission_id: job.sent_at_s for job in accepted}
        watch = await watch_statuses(
            ctx.api,
            sent_at_s,
            has_started,
            interval_s=SLEEPER_POLL_INTERVAL_S,
            timeout_s=SLEEPER_RUNNING_TIMEOUT_S,
        )
        if missing := watch.missing(sent_at_s):
            timeout = Figure(
                None,
                f"timeout ({len(sent_at_s) - len(missing)}/{self.jobs} in "
                f"{SLEEPER_RUNNING_TIMEOUT_S:.0f} s)",
            )
            return {"sleepers_running_p50": timeout, "sleepers_running_max": timeout}
        to_running_s = [watch.seen_at_s[job_id] - sent_at_s[job_id] for job_id in sent_at_s]
        if not to_running_s:
            return {}
        return {
            "sleepers_running_p50": p50(to_running_s),
            "sleepers_running_max": Figure(max(to_running_s)),
        }

    async def _memory_per_running_job(
        self, ctx: RunContext, ids: list[str], baseline_bytes: int
    ) -> Figure:
        running_bytes = await steady_machine_pss_bytes(
            ctx, RUNNING_STEADY_TIMEOUT_S, "with the sleepers running"
        )
        statuses = await ctx.api.list_statuses()
        running = sum(1 for job_id in ids if statuses.get(job_id) == "RUNNING")
        if running < self.jobs:
            ctx.note(f"only {running} of {self.jobs} sleepers RUNNING when memory was measured")
        if running == 0:
            return Figure(None, "none running")
        return Figure((running_bytes - baseline_bytes) / running)

    async def _time_to_stopped(self, ctx: RunContext, ids: list[str]) -> Figure:
        async def stop(job_id: str) -> float:
            sent_at_s = time.monotonic()
            await ctx.api.stop(job_id)
            return sent_at_s

        results = await asyncio.gather(*(stop(job_id) for job_id in ids), return_exceptions=True)
        stop_sent_at_s = {
            job_id: sent
            for job_id, sent in zip(ids, results, strict=True)
            if isinstance(sent, float)
        }
        ctx.note_errors("sleeper stop requests", describe_errors(results))
        watch = await watch_statuses(
            ctx.api,
            stop_sent_at_s,
            is_terminal,
            interval_s=STOP_POLL_INTERVAL_S,
            timeout_s=STOP_TIMEOUT_S,
        )
        stopped_s = [
            watch.seen_at_s[job_id] - sent
            for job_id, sent in stop_sent_at_s.items()
            if watch.status.get(job_id) == "STOPPED"
        ]
        others = {status for job_id, status in watch.status.items() if status != "STOPPED"}
        if len(stopped_s) < len(ids):
            ctx.note(
                f"{len(ids) - len(stopped_s)} of {len(ids)} stopped sleepers did not end STOPPED "
                f"within {STOP_TIMEOUT_S:.0f} s (other statuses: {sorted(others) or 'none'})"
            )
        return p50(stopped_s)


class ListWithJobs(Scenario):
    """GET /api/jobs/ latency once the server lists N jobs (all done)."""

    def __init__(self, listed_jobs: int, requests: int = LIST_REQUESTS) -> None:
        self.listed_jobs = listed_jobs
        self.requests = requests
        self.title = f"GET /api/jobs/ with {listed_jobs} jobs"

    def metrics(self) -> list[Metric]:
        return [
            Metric(
                "list_p50",
                f"GET /api/jobs/ p50 ({self.listed_jobs} jobs listed)",
                Unit.SECONDS,
                Better.LOWER,
                Target("≤ 1/5 of Ray's", 0.2),
            ),
            Metric(
                "list_p99",
                f"GET /api/jobs/ p99 ({self.listed_jobs} jobs listed)",
                Unit.SECONDS,
                Better.LOWER,
            ),
        ]

    async def measure(self, ctx: RunContext) -> dict[str, Figure]:
        ids, listed = await fill_to(
            ctx, self.listed_jobs, slug="fill", deadline_s=time.monotonic() + FILL_TIMEOUT_S
        )
        await settle(ctx, ids, what="list-filling")
        return await self._latencies(ctx, listed)

    async def _latencies(self, ctx: RunContext, listed: int) -> dict[str, Figure]:
        if listed != self.listed_jobs:
            ctx.note(f"listed {listed} jobs (not {self.listed_jobs}) when GET /api/jobs/ was timed")
        latencies_s = await list_latencies_s(ctx.api, self.requests)
        return {
            "list_p50": Figure(percentile(latencies_s, 50)),
            "list_p99": Figure(percentile(latencies_s, 99)),
        }


class ListAtScale(ListWithJobs):
    """Ours only: GET /api/jobs/ with N (10,000) jobs, against Ray's figure with 300."""

    servers = (Server.OURS,)

    def __init__(self, listed_jobs: int, ray_listed_jobs: int) -> None:
        super().__init__(listed_jobs)
        self.ray_listed_jobs = ray_listed_jobs
        self.title = f"GET /api/jobs/ with {listed_jobs} jobs (ours only)"

    def metrics(self) -> list[Metric]:
        versus = f"ours with {self.listed_jobs:,} jobs vs Ray's with {self.ray_listed_jobs:,}"
        return [
            Metric(
                "list_p50_at_scale",
                f"GET /api/jobs/ p50, {versus}",
                Unit.SECONDS,
                Better.LOWER,
                Target(
                    f"ours at {self.listed_jobs:,} below Ray's at {self.ray_listed_jobs:,}",
                    1.0,
                    strict=True,
                ),
                ray_key="list_p50",
            ),
            Metric(
                "list_p99_at_scale",
                f"GET /api/jobs/ p99, {versus}",
                Unit.SECONDS,
                Better.LOWER,
                ray_key="list_p99",
            ),
        ]

    async def measure(self, ctx: RunContext) -> dict[str, Figure]:
        ids, listed = await fill_to(
            ctx, self.listed_jobs, slug="scale", deadline_s=time.monotonic() + FILL_TIMEOUT_S
        )
        # Ten thousand jobs may not all be done in time; time the list anyway, and say so.
        await settle(
            ctx,
            ids,
            what="10k-filling",
            interval_s=LARGE_LIST_POLL_INTERVAL_S,
            stop_leftovers=False,
        )
        figures = await self._latencies(ctx, listed)
        return {"list_p50_at_scale": figures["list_p50"], "list_p99_at_scale": figures["list_p99"]}


class ConcurrentPosts(Scenario):
    """POST latency with W requests in flight (W workers submitting `true` jobs)."""

    def __init__(self, requests: int, workers: int) -> None:
        self.requests = requests
        self.workers = workers
        self.title = f"{requests} POSTs, {workers} in flight"

    def metrics(self) -> list[Metric]:
        return [
            Metric(
                "post_p50_concurrent",
                f"POST /api/jobs/ p50, {self.workers} in flight ({self.requests} requests)",
                Unit.SECONDS,
                Better.LOWER,
                Target("≤ 1/5 of Ray's", 0.2),
            ),
        ]

    async def measure(self, ctx: RunContext) -> dict[str, Figure]:
        accepted, errors = await submit_with_workers(
            ctx.api,
            "true",
            ctx.job_ids("post", self.requests),
            self.workers,
            time.monotonic() + FILL_TIMEOUT_S,
        )
        ctx.note_errors("concurrent POSTs", errors)
        await settle(ctx, [job.submission_id for job in accepted], what="concurrent-POST")
        return {"post_p50_concurrent": p50([job.latency_s for job in accepted])}
