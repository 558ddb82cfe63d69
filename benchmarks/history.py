"""History at scale: jobs-server with 100,000 finished jobs in its archive, on SQLite and on
PostgreSQL side by side, against itself with 1,000 and against Ray's job server with 300 jobs.

    .venv/bin/python -m benchmarks.history [--jobs 100000] [--baseline-jobs 1000]
        [--stores sqlite,postgresql] [--skip-ray] [--keep-logs]

Starts a Ray head node with its dashboard (Ray's job server), fills Ray's server with 300 `true`
jobs through its API and times its list; starts a PostgreSQL server of the distribution's (as
the tests do: tests/support/postgres.py) on a loopback port; then, for each store and size,
writes that many finished jobs into a fresh store (a state directory, or a database) through
the archive's own writer (`archive.insert` of each record, a thousand at a time: the group
commit that records a burst of submits) and starts jobs-server on it, on the same cluster:
start to healthz 200, page, filtered page and deep page latencies (by cursor), RSS, the
unpaginated list streamed while its RSS is sampled, and the start to healthz 200 again after a
restart. Prints a markdown table (progress goes to stderr) and writes it to
benchmarks/results-history.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import importlib.metadata
import json
import logging
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from enum import StrEnum
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
    ratio_of,
)
from benchmarks.run import LISTED_JOBS, measure_one, settle, warm_up
from benchmarks.scenarios import ListWithJobs, RunContext
from benchmarks.stats import PeakRssGrowth, percentile, summed_rss_bytes
from jobs_server.manager.archive.interface import JobArchive, create_archive
from jobs_server.manager.records import JobRecord, JobSpec, JobStatus, new_run_id, now_ms
from tests.support.postgres import PostgresServer, postgres_bin_dir, running_postgres

logger = logging.getLogger("benchmarks.history")

RESULTS_PATH = Path(__file__).with_name("results-history.md")
DEFAULT_JOBS = 100_000
DEFAULT_BASELINE_JOBS = 1_000
PAGE_LIMIT = 100
TIMED_REQUESTS = 200
# Records written at once while the archive is filled: they share the group commit's batches.
FILL_CONCURRENCY = 1_000
# The archive's jobs: one in this many failed, and their `team` metadata takes this many values
# round the clock, so `status=FAILED&metadata.team=x` matches 1 in 100.
FAILED_EVERY = 10
TEAMS = ("x", "y", "z", "u", "v", "w", "p", "q", "r", "s")
# Within the default retention (30 days): the server keeps them all.
HISTORY_SPAN_MS = 20 * 24 * 3600 * 1000
PAGE_PATH = f"/api/jobs/?limit={PAGE_LIMIT}"
FILTERED_PATH = f"/api/jobs/?status=FAILED&metadata.team=x&limit={PAGE_LIMIT}"
FULL_LIST_PATH = "/api/jobs/"
# The deep filtered page starts after the job this far into the history.
DEEP_FRACTION = 0.9
RSS_SAMPLE_INTERVAL_S = 0.02
FULL_LIST_TIMEOUT_S = 600.0
MIB = 2**20


class Store(StrEnum):
    """The archive's two stores."""

    SQLITE = "sqlite"
    POSTGRESQL = "postgresql"

    @property
    def title(self) -> str:
        return {Store.SQLITE: "SQLite", Store.POSTGRESQL: "PostgreSQL"}[self]


METHOD_NOTES = [
    "Both stores hold the same history, in the same run, on the same Ray cluster: SQLite at "
    "`<state-dir>/jobs.db` (the default), PostgreSQL through `--database-url` to a server of "
    "the distribution's started for the run as the tests start theirs "
    "(`tests/support/postgres.py`: `initdb` in a temp dir, loopback TCP, its default "
    "configuration, durable commits), a database of its own per size.",
    "The archive is filled before the server starts, through the archive's own writer "
    f"(`archive.insert` of each finished record, {FILL_CONCURRENCY:,} at a time: the group "
    "commit batches them, as it batches a burst of submits): not through the HTTP API, which "
    "would take hours for 100,000 jobs on Ray. Jobs are spread over the last 20 days (inside "
    f"the default 30-day retention), 1 in {FAILED_EVERY} FAILED, metadata `team` cycling "
    f"through {len(TEAMS)} values, so the filtered page matches 1 job in 100.",
    "Each store and size gets a fresh server process on the same Ray cluster (`--state-dir` of "
    "its own). Start: from starting the process to the first 200 from /api/healthz (polled "
    "every 100 ms). Restart: the same, for a second server process on the same state dir and "
    "database once the first has stopped (SIGTERM).",
    f"Latencies: {TIMED_REQUESTS} sequential requests each, from sending to the body's last "
    "byte. Ray's row is its GET /api/jobs/ (Ray has no pages) with 300 jobs listed, measured "
    "in the same run on the same cluster. Deep pages: every page of the whole history, each "
    'fetched from the previous one\'s `Link: rel="next"` (the `after` cursor), one request '
    "after the other; the deep filtered page starts after the job "
    f"{DEEP_FRACTION:.0%} into the history.",
    "RSS: the server process and its children, after the timed first and filtered pages "
    "(caches warm), before the pages by cursor; once more after them, which have filled the "
    "cache of finished jobs' details JSON to its bound. Peak RSS "
    f"growth of the full list: sampled every {RSS_SAMPLE_INTERVAL_S * 1000:.0f} ms in a thread "
    "from just before GET /api/jobs/ to its body's end, peak minus first sample; the client "
    "reads the body in chunks and then checks it lists every job.",
]


def metrics(jobs: int, baseline: int, ray_jobs: int) -> list[Metric]:
    many, few = f"{jobs:,}", f"{baseline:,}"
    pages = f"{-(-jobs // PAGE_LIMIT):,}"
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
            "page_p99",
            f"same page p99, ours with {many}",
            Unit.SECONDS,
            Better.LOWER,
            ray_key="list_p99",
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
            "filtered_p99",
            "same filtered page p99",
            Unit.SECONDS,
            Better.LOWER,
            ray_key="list_p99",
        ),
        Metric(
            "deep_p50",
            f"every page of {many} by cursor (`after`, {pages} pages of {PAGE_LIMIT}): p50",
            Unit.SECONDS,
            Better.LOWER,
            OursAtMost("≤ 20 ms", 0.020),
        ),
        Metric("deep_p99", "same pages by cursor: p99", Unit.SECONDS, Better.LOWER),
        Metric(
            "deep_filtered_p50",
            f"filtered page after the job {DEEP_FRACTION:.0%} in (`after`): p50",
            Unit.SECONDS,
            Better.LOWER,
            OursAtMost("≤ 50 ms", 0.050),
        ),
        Metric(
            "start_s",
            f"server start to healthz 200, {many} jobs",
            Unit.SECONDS,
            Better.LOWER,
            OursAtMost("≤ 5 s", 5.0),
        ),
        Metric(
            "restart_s",
            f"restart (same state dir and database) to healthz 200, {many} jobs",
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
        Metric(
            "walked_rss",
            f"server RSS with {many} jobs after every page by cursor (details' JSON cache full)",
            Unit.BYTES,
            Better.LOWER,
        ),
        Metric("baseline_page_p50", f"page p50 with {few} jobs", Unit.SECONDS, Better.LOWER),
        Metric("baseline_start_s", f"start to healthz 200, {few} jobs", Unit.SECONDS, Better.LOWER),
        Metric(
            "stream_s",
            f"GET /api/jobs/ (all {many}), to the last byte",
            Unit.SECONDS,
            Better.LOWER,
        ),
        Metric("fill_s", f"archive filled with {many} jobs", Unit.SECONDS, Better.LOWER),
    ]


def history_record(number: int, jobs: int) -> JobRecord:
    """The `number`th of `jobs` finished jobs of the history (the same on every store)."""
    start_ms = now_ms() - HISTORY_SPAN_MS + number * (HISTORY_SPAN_MS // max(jobs, 1))
    failed = number % FAILED_EVERY == FAILED_EVERY - 1
    spec = JobSpec(
        entrypoint=f"python train.py --run {number}",
        submission_id=history_id(number),
        metadata={"team": TEAMS[(number // FAILED_EVERY) % len(TEAMS)], "run": str(number)},
    )
    return JobRecord(
        spec=spec,
        status=JobStatus.FAILED if failed else JobStatus.SUCCEEDED,
        message="Job failed." if failed else "Job finished successfully.",
        start_time=start_ms,
        end_time=start_ms + 1000,
        driver_exit_code=1 if failed else 0,
        run_id=new_run_id(),
    )


def history_id(number: int) -> str:
    return f"history-{number:07d}"


async def fill_archive(archive: JobArchive, jobs: int) -> float:
    """`jobs` finished jobs in `archive`, written by the archive itself; the seconds it took."""
    await archive.open()
    try:
        started_s = time.monotonic()
        for first in range(0, jobs, FILL_CONCURRENCY):
            numbers = range(first, min(first + FILL_CONCURRENCY, jobs))
            await asyncio.gather(*(archive.insert(history_record(n, jobs)) for n in numbers))
        fill_s = time.monotonic() - started_s
        logger.info("archive of %d jobs written in %.1f s", jobs, fill_s)
    finally:
        await archive.close()
    return fill_s


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


async def cursor_walk(session: aiohttp.ClientSession, url: str) -> tuple[list[float], int]:
    """Every page from `url` on, each from the last one's `Link: rel="next"`: the seconds of
    each, and the jobs listed in all."""
    base = url.split("/api/", 1)[0]
    timings, listed, next_url = [], 0, url
    while next_url:
        started_s = time.monotonic()
        async with session.get(next_url) as response:
            body = await response.read()
            if response.status != 200:
                raise RuntimeError(f"GET {next_url}: {response.status}")
            link = response.headers.get("Link", "")
        timings.append(time.monotonic() - started_s)
        listed += len(json.loads(body))
        next_url = base + link[1 : link.index(">")] if 'rel="next"' in link else ""
    return timings, listed


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


async def measure_ours(
    url: str, pid: int, jobs: int, notes: list[str], *, deep: bool
) -> dict[str, float]:
    """The figures of one of our servers, with `jobs` in its archive (the deep pages too, if
    `deep`)."""
    processes = process_tree(psutil.Process(pid))
    figures: dict[str, float] = {}
    async with new_session() as session:
        page = await latencies_s(session, url + PAGE_PATH, TIMED_REQUESTS)
        filtered = await latencies_s(session, url + FILTERED_PATH, TIMED_REQUESTS)
        async with session.get(url + FILTERED_PATH) as response:
            matched = len(await response.json())
        if matched != min(PAGE_LIMIT, jobs // 100):
            notes.append(f"the filtered page of {jobs} jobs listed {matched}")
        rss = summed_rss_bytes(processes)
        if deep:
            walk, walked = await cursor_walk(session, url + PAGE_PATH)
            if walked != jobs:
                notes.append(f"the pages by cursor of {jobs} jobs listed {walked}")
            deep_filtered_path = f"{FILTERED_PATH}&after={history_id(int(jobs * DEEP_FRACTION))}"
            deep_filtered = await latencies_s(session, url + deep_filtered_path, TIMED_REQUESTS)
            figures |= {
                "deep_p50": percentile(walk, 50),
                "deep_p99": percentile(walk, 99),
                "deep_filtered_p50": percentile(deep_filtered, 50),
                "walked_rss": summed_rss_bytes(processes),
            }
        stream_s, stream_growth, listed = await full_list(session, url + FULL_LIST_PATH, processes)
    if listed != jobs:
        notes.append(f"the full list of {jobs} jobs listed {listed}")
    return figures | {
        "page_p50": percentile(page, 50),
        "page_p99": percentile(page, 99),
        "filtered_p50": percentile(filtered, 50),
        "filtered_p99": percentile(filtered, 99),
        "rss": rss,
        "stream_s": stream_s,
        "stream_growth": stream_growth,
    }


@dataclass
class StoreRun:
    """One store under test: where its history goes, and what it noticed."""

    store: Store
    postgres: PostgresServer | None
    notes: list[str]

    def database_url(self) -> str | None:
        """A fresh database (PostgreSQL), or None (SQLite in the state dir)."""
        return None if self.postgres is None else self.postgres.create_database()


def run_ours(
    head_gcs: str, work_dir: Path, run: StoreRun, jobs: int, *, deep: bool
) -> dict[str, float]:
    """Fill a store with `jobs`, start a server on it, measure it, stop it; start it again."""
    state_dir = work_dir / f"{run.store}-state-{jobs}"
    database_url = run.database_url()
    fill_s = asyncio.run(fill_archive(create_archive(database_url, state_dir), jobs))
    server_dir = work_dir / f"{run.store}-server-{jobs}"
    server_dir.mkdir()
    args = ["--state-dir", str(state_dir), "--log-dir", str(server_dir / "logs")]
    if database_url is not None:
        args += ["--database-url", database_url]
    started_s = time.monotonic()
    with jobs_server(head_gcs, server_dir, args) as ours:
        start_s = time.monotonic() - started_s
        figures = asyncio.run(measure_ours(ours.url, ours.pid, jobs, run.notes, deep=deep))
    started_s = time.monotonic()
    with jobs_server(head_gcs, server_dir, args):
        restart_s = time.monotonic() - started_s
    return figures | {"start_s": start_s, "restart_s": restart_s, "fill_s": fill_s}


async def measure_ray(head: RayHead, ray_jobs: int, results: Results) -> dict[str, Figure]:
    """Ray's GET /api/jobs/ with `ray_jobs` jobs (the `jobs` benchmark's scenario)."""
    async with new_session() as session:
        api = JobsApi(session, head.dashboard_url)
        ctx = RunContext(api, Server.RAY, results, uuid.uuid4().hex[:6], lambda: [], head)
        await warm_up(ctx)
        figures = await measure_one(1, ListWithJobs(ray_jobs), ctx)
    await settle()
    return figures


def store_figures(many: dict[str, float], baseline: dict[str, float]) -> dict[str, Figure]:
    """One store's row values, from its runs at both sizes."""
    figures = {key: Figure(value) for key, value in many.items()}
    figures["rss_growth"] = Figure(many["rss"] - baseline["rss"])
    figures["baseline_rss"] = Figure(baseline["rss"])
    figures["baseline_page_p50"] = Figure(baseline["page_p50"])
    figures["baseline_start_s"] = Figure(baseline["start_s"])
    return figures


def table(table_metrics: list[Metric], ray: Results, stores: dict[Store, dict[str, Figure]]) -> str:
    """The markdown table: Ray's, then each store's figure; ratios to Ray's and between the
    stores; each store's verdict on the target."""
    titles = [store.title for store in stores]
    lines = [
        f"| scenario | {Server.RAY} | "
        + " | ".join(f"jobs-server on {title}" for title in titles)
        + f" | ratio to Ray's ({' · '.join(titles)}) | PostgreSQL/SQLite | target |",
        "|---|---:|" + "---:|" * len(stores) + "---|---|---|",
    ]
    for metric in table_metrics:
        ray_figure = ray.get(Server.RAY, metric.ray_key or metric.key)
        ours = [figures.get(metric.key, Figure(None, "not run")) for figures in stores.values()]
        to_ray = [ratio_of(figure, ray_figure) for figure in ours]
        sqlite = stores.get(Store.SQLITE, {}).get(metric.key, Figure(None))
        postgres = stores.get(Store.POSTGRESQL, {}).get(metric.key, Figure(None))
        between = ratio_of(postgres, sqlite)
        target = "— (for information)"
        if metric.target is not None:
            verdicts = [
                f"{store.title} **{_word(metric.target.verdict(figure, None, metric.better))}**"
                for store, figure in zip(stores, ours, strict=True)
            ]
            target = f"{metric.target.text}: {', '.join(verdicts)}"
        cells = [
            metric.label,
            format_value(ray_figure, metric.unit),
            *(format_value(figure, metric.unit) for figure in ours),
            "—" if all(r is None for r in to_ray) else " · ".join(_ratio(r) for r in to_ray),
            _ratio(between),
            target,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _ratio(value: float | None) -> str:
    return "—" if value is None else f"{value:.3g}"


def _word(verdict: bool | None) -> str:
    return {None: "not measured", True: "met", False: "not met"}[verdict]


def render(
    table_metrics: list[Metric],
    ray: Results,
    stores: dict[Store, dict[str, Figure]],
    notes: list[str],
    started: datetime.datetime,
    load: tuple[float, float],
) -> str:
    lines = [
        "# History at scale: jobs-server's archive on SQLite and on PostgreSQL vs Ray's job server",
        "",
        f"- date: {started.isoformat(timespec='seconds')}",
        f"- machine: {os.cpu_count()} cores, {psutil.virtual_memory().total / 2**30:.0f} GiB",
        f"- command: `{shlex.join(sys.orig_argv)}` (from the repository root)",
        f"- Ray {importlib.metadata.version('ray')}",
        f"- PostgreSQL {postgres_version()}",
        f"- load average (1 min) at the start and at the end: {load[0]:.1f}, {load[1]:.1f}",
        "",
        table(table_metrics, ray, stores),
        "",
        "Ratios are ours/Ray's (lower is better), and PostgreSQL's figure over SQLite's. Targets"
        " on our own figures are absolute.",
        "",
        "## How it measures",
        "",
        *[f"- {text}" for text in METHOD_NOTES],
    ]
    if notes:
        lines += ["", "## Notes from this run", "", *[f"- {text}" for text in notes]]
    return "\n".join(lines) + "\n"


def postgres_version() -> str:
    """The version of the PostgreSQL server the run starts."""
    bin_dir = postgres_bin_dir()
    if bin_dir is None:
        return "not installed"
    output = subprocess.run(
        [str(bin_dir / "postgres"), "--version"], capture_output=True, text=True, check=False
    ).stdout
    words = output.split()
    return words[2] if len(words) > 2 else "unknown"


@contextlib.contextmanager
def store_runs(stores: Sequence[Store]) -> Iterator[list[StoreRun]]:
    """The stores under test, a PostgreSQL server started for them if one is PostgreSQL."""
    with contextlib.ExitStack() as stack:
        postgres = None
        if Store.POSTGRESQL in stores:
            postgres = stack.enter_context(running_postgres(durable=True))
            logger.info("PostgreSQL on 127.0.0.1:%d (pid %d)", postgres.port, postgres.pid)
        yield [
            StoreRun(store, postgres if store is Store.POSTGRESQL else None, []) for store in stores
        ]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.history",
        description=(
            "jobs-server with a long history in its archive, on SQLite and PostgreSQL, against"
            " Ray's job server."
        ),
    )
    parser.add_argument("--jobs", type=int, default=DEFAULT_JOBS, metavar="N")
    parser.add_argument("--baseline-jobs", type=int, default=DEFAULT_BASELINE_JOBS, metavar="N")
    parser.add_argument("--ray-jobs", type=int, default=LISTED_JOBS, metavar="N")
    parser.add_argument(
        "--stores",
        type=lambda text: [Store(name) for name in text.split(",")],
        default=list(Store),
        metavar="sqlite,postgresql",
        help="the stores to measure (default: both)",
    )
    parser.add_argument(
        "--skip-ray", action="store_true", help="do not measure Ray's job server (quicker)"
    )
    parser.add_argument(
        "--keep-logs", action="store_true", help="keep the temp dir with Ray's and our logs"
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    set_up_benchmark_process()
    started = datetime.datetime.now().astimezone()
    # The machine is shared: what else ran shows in the figures.
    load_at_start = os.getloadavg()[0]
    work_dir = Path(tempfile.mkdtemp(prefix="jobs-history-", dir="/tmp"))
    ray = Results()
    stores: dict[Store, dict[str, Figure]] = {}
    notes: list[str] = []
    try:
        with ray_head(work_dir) as head, store_runs(args.stores) as runs:
            if not args.skip_ray:
                ray.record(Server.RAY, asyncio.run(measure_ray(head, args.ray_jobs, ray)))
            for run in runs:
                baseline = run_ours(head.gcs_address, work_dir, run, args.baseline_jobs, deep=False)
                many = run_ours(head.gcs_address, work_dir, run, args.jobs, deep=True)
                stores[run.store] = store_figures(many, baseline)
                notes += [f"{run.store.title}: {text}" for text in run.notes]
    finally:
        for pid, cmdline in kill_survivors(str(work_dir)):
            notes.append(f"process {pid} outlived its process group (killed): {cmdline}")
        if args.keep_logs:
            logger.info("logs kept in %s", work_dir)
        else:
            shutil.rmtree(work_dir, ignore_errors=True)
    notes = ray.notes + notes
    table_metrics = metrics(args.jobs, args.baseline_jobs, args.ray_jobs)
    for store, figures in stores.items():
        for metric in table_metrics:
            figure = figures.get(metric.key, Figure(None))
            logger.info("%s, %s: %s", store.title, metric.label, format_value(figure, metric.unit))
    load = (load_at_start, os.getloadavg()[0])
    report = render(table_metrics, ray, stores, notes, started, load)
    RESULTS_PATH.write_text(report)
    sys.stdout.write(report)
    logger.info("written to %s", RESULTS_PATH)


if __name__ == "__main__":
    main()
