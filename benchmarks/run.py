"""Benchmark jobs-server against Ray's own job server, side by side on one Ray cluster.

    .venv/bin/python -m benchmarks.run [--quick] [--list-jobs N] [--keep-logs]

Starts a Ray head node with its dashboard (which serves Ray's jobs API) and jobs-server on the same
cluster, drives both through the same HTTP client, prints a markdown table (progress goes to
stderr) and writes it to benchmarks/results.md.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import importlib.metadata
import logging
import os
import shlex
import shutil
import signal
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from benchmarks.client import JobsApi, is_terminal, new_session, watch_statuses
from benchmarks.processes import RAY_NUM_CPUS, jobs_server, kill_survivors, ray_head
from benchmarks.report import Figure, Metric, Results, Server, format_value, markdown_table
from benchmarks.scenarios import (
    REQUEST_ERRORS,
    BurstOfTrivialJobs,
    ConcurrentPosts,
    ConcurrentSleepers,
    ListAtScale,
    ListWithJobs,
    RunContext,
    Scenario,
    SequentialSubmit,
)

logger = logging.getLogger("benchmarks")

RESULTS_PATH = Path(__file__).with_name("results.md")
WARM_UP_TIMEOUT_S = 120.0
WARM_UP_POLL_INTERVAL_S = 0.1
LISTED_JOBS = 300
POST_WORKERS = 16
DEFAULT_LIST_AT_SCALE = 10_000

METHOD_NOTES = [
    f"Both servers run on the same Ray head node ({RAY_NUM_CPUS} CPUs) and are driven by the "
    "same aiohttp client; each scenario runs against Ray's server, then ours, and its jobs end "
    "before the next scenario starts.",
    "Sequential jobs are polled with GET /api/jobs/{id} every 5 ms. Many jobs at once are "
    "watched with GET /api/jobs/ (one request per poll: every 50 ms for the burst, every 10 ms "
    "for the concurrent `sleep 60` jobs and their stop); a job is timed when the first response "
    "showing the wanted status arrives.",
    "Memory per running job: (sum of PSS over every process on the machine but the benchmark's, "
    "with all jobs RUNNING) minus (the same sum just before submitting), divided by the jobs "
    "RUNNING; anything else running on the machine adds noise.",
]


@dataclass(frozen=True)
class Sizes:
    """How many jobs and requests each scenario uses."""

    sequential_jobs: int
    burst_jobs: int
    sleeper_jobs: int
    concurrent_posts: int
    list_at_scale: int

    def describe(self) -> str:
        """The sizes in words, for the report."""
        at_scale = f"{self.list_at_scale} jobs" if self.list_at_scale else "skipped"
        return (
            f"{self.sequential_jobs} sequential jobs, a burst of {self.burst_jobs}, "
            f"{self.sleeper_jobs} concurrent sleepers, {LISTED_JOBS} jobs listed, "
            f"{self.concurrent_posts} concurrent POSTs, large list: {at_scale}"
        )


def sizes_for(quick: bool, list_jobs: int) -> Sizes:
    """The full run's sizes, or the quick run's (which skips the large list)."""
    if quick:
        return Sizes(
            sequential_jobs=5, burst_jobs=20, sleeper_jobs=10, concurrent_posts=48, list_at_scale=0
        )
    return Sizes(
        sequential_jobs=20,
        burst_jobs=100,
        sleeper_jobs=50,
        concurrent_posts=160,
        list_at_scale=list_jobs,
    )


def build_scenarios(sizes: Sizes) -> list[Scenario]:
    """The scenarios in the order they run (the large list last: it leaves a backlog behind)."""
    scenarios: list[Scenario] = [
        SequentialSubmit(sizes.sequential_jobs),
        BurstOfTrivialJobs(sizes.burst_jobs),
        ConcurrentSleepers(sizes.sleeper_jobs),
        ListWithJobs(LISTED_JOBS),
        ConcurrentPosts(sizes.concurrent_posts, POST_WORKERS),
    ]
    if sizes.list_at_scale > 0:
        scenarios.append(ListAtScale(sizes.list_at_scale, LISTED_JOBS))
    return scenarios


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.run",
        description="Compare jobs-server with Ray's job server on one Ray cluster.",
    )
    parser.add_argument(
        "--quick", action="store_true", help="small sizes, no large list (a few minutes)"
    )
    parser.add_argument(
        "--list-jobs",
        type=int,
        default=DEFAULT_LIST_AT_SCALE,
        metavar="N",
        help="time GET /api/jobs/ on our server with N jobs (0 skips; skipped with --quick)",
    )
    parser.add_argument(
        "--keep-logs", action="store_true", help="keep the temp dir with Ray's and our logs"
    )
    return parser.parse_args(argv)


async def warm_up(ctx: RunContext) -> None:
    """One `true` job, so the first measured job does not pay for a cold server."""
    started_s = time.monotonic()
    [job_id] = ctx.job_ids("warmup", 1)
    await ctx.api.submit("true", job_id)
    watch = await watch_statuses(
        ctx.api,
        [job_id],
        is_terminal,
        interval_s=WARM_UP_POLL_INTERVAL_S,
        timeout_s=WARM_UP_TIMEOUT_S,
    )
    if watch.missing([job_id]):
        ctx.note(f"warm-up job not done after {WARM_UP_TIMEOUT_S:.0f} s")
    logger.info("%s warmed up in %.2f s", ctx.server, time.monotonic() - started_s)


async def measure_all(scenarios: list[Scenario], urls: dict[Server, str]) -> Results:
    """Run every scenario against each of its servers, Ray's first."""
    results = Results()
    run_tag = uuid.uuid4().hex[:6]
    async with new_session() as session:
        apis = {server: JobsApi(session, url) for server, url in urls.items()}
        for server, api in apis.items():
            await warm_up(RunContext(api, server, results, run_tag))
        for number, scenario in enumerate(scenarios, start=1):
            for server in scenario.servers:
                ctx = RunContext(apis[server], server, results, run_tag)
                results.record(server, await measure_one(number, scenario, ctx))
    return results


async def measure_one(number: int, scenario: Scenario, ctx: RunContext) -> dict[str, Figure]:
    """One scenario against one server; request errors become a note and missing figures."""
    logger.info("[%d] %s: %s ...", number, scenario.title, ctx.server)
    started_s = time.monotonic()
    try:
        figures = await scenario.measure(ctx)
    except REQUEST_ERRORS as error:
        ctx.note(f"{scenario.title} failed: {type(error).__name__}: {error}")
        figures = {}
    by_key = {metric.key: metric for metric in scenario.metrics()}
    for key, metric in by_key.items():
        figures.setdefault(key, Figure(None, "error"))
        logger.info("    %s: %s", metric.label, format_value(figures[key], metric.unit))
    logger.info("[%d] %s done in %.1f s", number, ctx.server, time.monotonic() - started_s)
    return figures


def render(
    metrics: list[Metric], results: Results, sizes: Sizes, started: datetime.datetime
) -> str:
    """results.md: when, where and how it ran, the table, then the notes."""
    lines = [
        "# jobs-server vs Ray's job server",
        "",
        f"- date: {started.isoformat(timespec='seconds')}",
        f"- machine: {os.cpu_count()} cores",
        f"- command: `{shlex.join(sys.orig_argv)}` (from the repository root)",
        f"- Ray {importlib.metadata.version('ray')}; sizes: {sizes.describe()}",
        "",
        markdown_table(metrics, results),
        "",
        "Ratios are ours/Ray's; whether lower or higher is better is said in each row.",
        "",
        "## How it measures",
        "",
        *[f"- {text}" for text in METHOD_NOTES],
    ]
    if results.notes:
        lines += ["", "## Notes from this run", "", *[f"- {text}" for text in results.notes]]
    return "\n".join(lines) + "\n"


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(message)s", datefmt="%H:%M:%S"
    )
    # A SIGTERM unwinds like Ctrl-C, so the finally blocks stop every process group we started.
    signal.signal(signal.SIGTERM, _interrupt)
    sizes = sizes_for(args.quick, args.list_jobs)
    scenarios = build_scenarios(sizes)
    started = datetime.datetime.now().astimezone()
    # Short path: Ray's session directory holds Unix sockets, whose paths are length-limited.
    work_dir = Path(tempfile.mkdtemp(prefix="jobs-bench-", dir="/tmp"))
    logger.info("work dir %s; sizes: %s", work_dir, sizes.describe())
    survivors: list[tuple[int, str]] = []
    try:
        with ray_head(work_dir) as head, jobs_server(head.gcs_address, work_dir) as ours_url:
            results = asyncio.run(
                measure_all(scenarios, {Server.RAY: head.dashboard_url, Server.OURS: ours_url})
            )
    finally:
        # Every Ray process of this cluster names the work dir in its command line.
        survivors = kill_survivors(str(work_dir))
        for pid, cmdline in survivors:
            logger.warning("process %d outlived its process group, killed: %s", pid, cmdline)
        if args.keep_logs:
            logger.info("logs kept in %s", work_dir)
        else:
            shutil.rmtree(work_dir, ignore_errors=True)
    for pid, cmdline in survivors:
        results.note(None, f"process {pid} outlived its process group (killed): {cmdline}")
    report = render([m for s in scenarios for m in s.metrics()], results, sizes, started)
    RESULTS_PATH.write_text(report)
    sys.stdout.write(report)
    logger.info("written to %s", RESULTS_PATH)


if __name__ == "__main__":
    main()
