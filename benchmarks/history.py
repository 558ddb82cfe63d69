"""History at scale: jobs-server with 100,000 finished jobs in its archive, against itself with
1,000 and against Ray's job server with 300 jobs.

    .venv/bin/python -m benchmarks.history [--jobs 100000] [--baseline-jobs 1000] [--keep-logs]

Starts a Ray head node with its dashboard (Ray's job server), fills Ray's server with 300 `true`
jobs through its API and times its list; then, for each size, writes that many finished jobs
into a fresh state directory through the archive's own writer (`Archive.insert`, one
transaction per job, as the server records a job) and starts jobs-server on it, on the same
cluster: start to healthz 200, page and filtered page latencies, RSS, and the unpaginated list
streamed while its RSS is sampled. Prints a markdown table (progress goes to stderr) and writes
it to benchmarks/results-history.md.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import importlib.metadata
import json
import logging
import os
import shlex
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

import aiohttp
import psutil

from benchmarks.client import JobsApi, new_session
from benchmarks.processes import (
    RayHead,
    jobs_server,
    kill_survivors,
    process_tree,
    ray_head,
    set_up_benchmark_process,
)
from benchmarks.report import (
    Better,
    Figure,
    Metric,
    OursAtMost,
    Results,
    Server,
    Unit,
    format_value,
    markdown_table,
)
from benchmarks.run import LISTED_JOBS, measure_one, settle, warm_up
from benchmarks.scenarios import ListWithJobs, RunContext
from benchmarks.stats import PeakRssGrowth, percentile, summed_rss_bytes
from jobs_server.manager.archive.sqlite import Archive, archive_path
from jobs_server.manager.records import JobRecord, JobSpec, JobStatus, new_run_id, now_ms

logger = logging.getLogger("benchmarks.history")

RESULTS_PATH = Path(__file__).with_name("results-history.md")
DEFAULT_JOBS = 100_000
DEFAULT_BASELINE_JOBS = 1_000
PAGE_LIMIT = 100
TIMED_REQUESTS = 200
# The archive's jobs: one in this many failed, and their `team` metadata takes this many values
# round the clock, so `status=FAILED&metadata.team=x` matches 1 in 100.
FAILED_EVERY = 10
TEAMS = ("x", "y", "z", "u", "v", "w", "p", "q", "r", "s")
# Within the default retention (30 days): the server keeps them all.
HISTORY_SPAN_MS = 20 * 24 * 3600 * 1000
PAGE_PATH = f"/api/jobs/?limit={PAGE_LIMIT}"
FILTERED_PATH = f"/api/jobs/?status=FAILED&metadata.team=x&limit={PAGE_LIMIT}"
FULL_LIST_PATH = "/api/jobs/"
RSS_SAMPLE_INTERVAL_S = 0.02
FULL_LIST_TIMEOUT_S = 600.0
MIB = 2**20

METHOD_NOTES = [
    "The archive is filled before the server starts, through the archive's own writer "
    "(`Archive.insert` of a finished record, one SQLite transaction per job with its events, "
    "as the server writes a job it learns of): not through the HTTP API, which would take "
    "hours for 100,000 jobs on Ray. Jobs are spread over the last 20 days (inside the default "
    f"30-day retention), 1 in {FAILED_EVERY} FAILED, metadata `team` cycling through "
    f"{len(TEAMS)} values, so the filtered page matches 1 job in 100.",
    "Each size gets a fresh server process on the same Ray cluster (`--state-dir` of its own). "
    "Start: from starting the process to the first 200 from /api/healthz (polled every 100 ms).",
    f"Latencies: {TIMED_REQUESTS} sequential requests each, from sending to the body's last "
    "byte. Ray's row is its GET /api/jobs/ (Ray has no pages) with 300 jobs listed, measured "
    "in the same run on the same cluster.",
    "RSS: the server process and its children, after the timed pages (caches warm). Peak RSS "
    f"growth of the full list: sampled every {RSS_SAMPLE_INTERVAL_S * 1000:.0f} ms in a thread "
    "from just before GET /api/jobs/ to its body's end, peak minus first sample; the client "
    "reads the body in chunks and then checks it lists every job.",
]


def metrics(jobs: int, baseline: int, ray_jobs: int) -> list[Metric]:
    many, few = f"{jobs:,}", f"{baseline:,}"
    return [
        Metric(
            "page_p50",
            f"GET /api/jobs/?limit={PAGE_LIMIT} p50, ours with {many} vs Ray's list of {ray_jobs}",
            Unit.SECONDS,
            Better.LOWER,
            OursAtMost("≤ 20 ms", 0.020),
            ray_key="list_p50",
        ),
        Metric(
            "filtered_p50",
            f"GET /api/jobs/?status=FAILED&metadata.team=x&limit={PAGE_LIMIT} p50, ours with"
            f" {many} vs Ray's list of {ray_jobs}",
            Unit.SECONDS,
            Better.LOWER,
            OursAtMost("≤ 50 ms", 0.050),
            ray_key="list_p50",
        ),
        Metric(
            "page_p99",
            f"same page p99, ours with {many}",
            Unit.SECONDS,
            Better.LOWER,
            ray_key="list_p99",
        ),
        Metric(
            "start_s",
            f"server start to healthz 200, {many} jobs",
            Unit.SECONDS,
            Better.LOWER,
            OursAtMost("≤ 5 s", 5.0),
        ),
        Metric(
            "rss_growth",
            f"server RSS with {many} jobs minus with {few}",
            Unit.BYTES,
            Better.LOWER,
            OursAtMost("≤ 50 MiB", 50 * MIB),
        ),
        Metric(
            "stream_growth",
            f"peak RSS growth while the unpaginated list of {many} streams",
            Unit.BYTES,
            Better.LOWER,
            OursAtMost("≤ 64 MiB", 64 * MIB),
        ),
        Metric("rss", f"server RSS with {many} jobs", Unit.BYTES, Better.LOWER),
        Metric("baseline_rss", f"server RSS with {few} jobs", Unit.BYTES, Better.LOWER),
        Metric("baseline_page_p50", f"page p50 with {few} jobs", Unit.SECONDS, Better.LOWER),
        Metric("baseline_start_s", f"start to healthz 200, {few} jobs", Unit.SECONDS, Better.LOWER),
        Metric(
            "stream_s",
            f"GET /api/jobs/ (all {many}), to the last byte",
            Unit.SECONDS,
            Better.LOWER,
        ),
    ]


async def fill_archive(state_dir: Path, jobs: int) -> None:
    """`jobs` finished jobs in the archive of `state_dir`, written by the archive itself."""
    archive = Archive(archive_path(state_dir))
    await archive.open()
    try:
        first_ms = now_ms() - HISTORY_SPAN_MS
        step_ms = HISTORY_SPAN_MS // max(jobs, 1)
        started_s = time.monotonic()
        for number in range(jobs):
            start_ms = first_ms + number * step_ms
            failed = number % FAILED_EVERY == FAILED_EVERY - 1
            spec = JobSpec(
                entrypoint=f"python train.py --run {number}",
                submission_id=f"history-{number:07d}",
                metadata={"team": TEAMS[(number // FAILED_EVERY) % len(TEAMS)], "run": str(number)},
            )
            await archive.insert(
                JobRecord(
                    spec=spec,
                    status=JobStatus.FAILED if failed else JobStatus.SUCCEEDED,
                    message="Job failed." if failed else "Job finished successfully.",
                    start_time=start_ms,
                    end_time=start_ms + 1000,
                    driver_exit_code=1 if failed else 0,
                    run_id=new_run_id(),
                )
            )
        logger.info("archive of %d jobs written in %.1f s", jobs, time.monotonic() - started_s)
    finally:
        await archive.close()


async def latencies_s(session: aiohttp.ClientSession, url: str, requests: int) -> list[float]:
    """Seconds of each of `requests` sequential GETs, to the body's last byte."""
    timings = []
    for _ in range(requests):
        started_s = time.monotonic()
        async with session.get(url) as response:
            await response.read()
            if response.status != 200:
                raise RuntimeError(f"GET {url}: {response.status}")
        timings.append(time.monotonic() - started_s)
    return timings


async def full_list(
    session: aiohttp.ClientSession, url: str, processes: list[psutil.Process]
) -> tuple[float, int, int]:
    """GET the whole list, read in chunks: its seconds, the peak RSS growth, the jobs listed."""
    body = bytearray()
    with PeakRssGrowth(
        processes, interval_s=RSS_SAMPLE_INTERVAL_S, max_duration_s=FULL_LIST_TIMEOUT_S
    ) as growth:
        started_s = time.monotonic()
        async with session.get(url, timeout=aiohttp.ClientTimeout(FULL_LIST_TIMEOUT_S)) as reply:
            async for chunk in reply.content.iter_chunked(1 << 20):
                body += chunk
            if reply.status != 200:
                raise RuntimeError(f"GET {url}: {reply.status}")
        elapsed_s = time.monotonic() - started_s
    listed = len(json.loads(bytes(body)))
    return elapsed_s, growth.growth_bytes, listed


async def measure_ours(url: str, pid: int, jobs: int, results: Results) -> dict[str, float]:
    """The figures of one of our servers, with `jobs` in its archive."""
    processes = process_tree(psutil.Process(pid))
    async with new_session() as session:
        page = await latencies_s(session, url + PAGE_PATH, TIMED_REQUESTS)
        filtered = await latencies_s(session, url + FILTERED_PATH, TIMED_REQUESTS)
        async with session.get(url + FILTERED_PATH) as response:
            matched = len(await response.json())
        if matched != min(PAGE_LIMIT, jobs // 100):
            results.note(Server.OURS, f"the filtered page of {jobs} jobs listed {matched}")
        rss = summed_rss_bytes(processes)
        stream_s, stream_growth, listed = await full_list(session, url + FULL_LIST_PATH, processes)
    if listed != jobs:
        results.note(Server.OURS, f"the full list of {jobs} jobs listed {listed}")
    return {
        "page_p50": percentile(page, 50),
        "page_p99": percentile(page, 99),
        "filtered_p50": percentile(filtered, 50),
        "rss": rss,
        "stream_s": stream_s,
        "stream_growth": stream_growth,
    }


def run_ours(head_gcs: str, work_dir: Path, jobs: int, results: Results) -> dict[str, float]:
    """Fill a state directory with `jobs`, start a server on it, measure it, stop it."""
    state_dir = work_dir / f"state-{jobs}"
    asyncio.run(fill_archive(state_dir, jobs))
    server_dir = work_dir / f"server-{jobs}"
    server_dir.mkdir()
    started_s = time.monotonic()
    with jobs_server(head_gcs, server_dir, ["--state-dir", str(state_dir)]) as ours:
        start_s = time.monotonic() - started_s
        figures = asyncio.run(measure_ours(ours.url, ours.pid, jobs, results))
    return {**figures, "start_s": start_s}


async def measure_ray(head: RayHead, ray_jobs: int, results: Results) -> dict[str, Figure]:
    """Ray's GET /api/jobs/ with `ray_jobs` jobs (the `jobs` benchmark's scenario)."""
    async with new_session() as session:
        api = JobsApi(session, head.dashboard_url)
        ctx = RunContext(api, Server.RAY, results, uuid.uuid4().hex[:6], lambda: [], head)
        await warm_up(ctx)
        figures = await measure_one(1, ListWithJobs(ray_jobs), ctx)
    await settle()
    return figures


def render(table_metrics: list[Metric], results: Results, started: datetime.datetime) -> str:
    lines = [
        "# History at scale: jobs-server's archive vs Ray's job server",
        "",
        f"- date: {started.isoformat(timespec='seconds')}",
        f"- machine: {os.cpu_count()} cores",
        f"- command: `{shlex.join(sys.orig_argv)}` (from the repository root)",
        f"- Ray {importlib.metadata.version('ray')}",
        "",
        markdown_table(table_metrics, results),
        "",
        "Ratios are ours/Ray's. Targets on our own figures are absolute.",
        "",
        "## How it measures",
        "",
        *[f"- {text}" for text in METHOD_NOTES],
    ]
    if results.notes:
        lines += ["", "## Notes from this run", "", *[f"- {text}" for text in results.notes]]
    return "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.history",
        description="jobs-server with a long history in its archive, against Ray's job server.",
    )
    parser.add_argument("--jobs", type=int, default=DEFAULT_JOBS, metavar="N")
    parser.add_argument("--baseline-jobs", type=int, default=DEFAULT_BASELINE_JOBS, metavar="N")
    parser.add_argument("--ray-jobs", type=int, default=LISTED_JOBS, metavar="N")
    parser.add_argument(
        "--keep-logs", action="store_true", help="keep the temp dir with Ray's and our logs"
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    set_up_benchmark_process()
    started = datetime.datetime.now().astimezone()
    work_dir = Path(tempfile.mkdtemp(prefix="jobs-history-", dir="/tmp"))
    results = Results()
    try:
        with ray_head(work_dir) as head:
            results.record(Server.RAY, asyncio.run(measure_ray(head, args.ray_jobs, results)))
            baseline = run_ours(head.gcs_address, work_dir, args.baseline_jobs, results)
            many = run_ours(head.gcs_address, work_dir, args.jobs, results)
    finally:
        for pid, cmdline in kill_survivors(str(work_dir)):
            results.note(None, f"process {pid} outlived its process group (killed): {cmdline}")
        if args.keep_logs:
            logger.info("logs kept in %s", work_dir)
        else:
            shutil.rmtree(work_dir, ignore_errors=True)
    figures = {key: Figure(value) for key, value in many.items()}
    figures["rss_growth"] = Figure(many["rss"] - baseline["rss"])
    figures["baseline_rss"] = Figure(baseline["rss"])
    figures["baseline_page_p50"] = Figure(baseline["page_p50"])
    figures["baseline_start_s"] = Figure(baseline["start_s"])
    results.record(Server.OURS, figures)
    table_metrics = metrics(args.jobs, args.baseline_jobs, args.ray_jobs)
    for metric in table_metrics:
        logger.info(
            "%s: %s", metric.label, format_value(results.get(Server.OURS, metric.key), metric.unit)
        )
    report = render(table_metrics, results, started)
    RESULTS_PATH.write_text(report)
    sys.stdout.write(report)
    logger.info("written to %s", RESULTS_PATH)


if __name__ == "__main__":
    main()
