"""The queue under a burst (issue 15): 10,000 `true` jobs POSTed with 64 requests in flight to a
server with `--max-running-jobs 50`, and 1,000 `sleep 300` jobs with no cap.

    .venv/bin/python -m benchmarks.queue [--jobs 10000] [--in-flight 64] [--max-running 50]
                                         [--sleepers 1000] [--keep-logs]

Starts a Ray head node and jobs-server on it (a fresh state directory per scenario). Burst: POSTs
every job, while a sampler lists the RUNNING jobs and the server's RSS every 100 ms; waits until
the archive has no unfinished job left, then checks every job SUCCEEDED. Sleepers: POSTs them,
times from the last answer until none is PENDING, then measures the server's CPU over 10 s with
all of them running, and stops them. Prints a markdown table (progress on stderr) and writes it to
benchmarks/results-queue.md, with the load average before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import importlib.metadata
import logging
import os
import shlex
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import psutil
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.client import JobsApi, new_session, submit_with_workers
from benchmarks.processes import (
    benchmark_run,
    jobs_server,
    process_tree,
    ray_head,
    supervisor_processes,
    write_report,
)
from benchmarks.stats import percentile_or_nan, summed_rss_bytes

logger = logging.getLogger("benchmarks.queue")

RESULTS_PATH = Path(__file__).with_name("results-queue.md")
DEFAULT_JOBS = 10_000
DEFAULT_IN_FLIGHT = 64
DEFAULT_MAX_RUNNING = 50
DEFAULT_SLEEPERS = 1_000
WARM_UP_JOBS = 20
SAMPLE_INTERVAL_S = 0.1
# `/metrics` counts the whole history by status: scraped every 10th sample (once a second, as a
# Prometheus would at most), so the benchmark does not load the server it measures.
METRICS_EVERY_N_SAMPLES = 10
DONE_POLL_INTERVAL_S = 0.2
BURST_TIMEOUT_S = 900.0
SLEEPERS_RUNNING_TIMEOUT_S = 300.0
IDLE_CPU_WINDOW_S = 10.0
# A dashboard's polls of the live jobs, timed one after another with the sleepers running.
DASHBOARD_POLLS = 40
DASHBOARD_QUERIES = ("status=PENDING", "status=RUNNING")
# How long the sleepers get to end once stopped (the cluster's end stops the rest).
STOP_TIMEOUT_S = 60.0
MIB = 2**20
# The figures for main (no cap): the same burst.
MAIN_POST_P50_S = 0.172
MAIN_POST_P99_S = 0.984
MAIN_MAX_RUNNING = 392
MAIN_RSS_GROWTH = 356 * MIB

METHOD_NOTES = [
    "Burst: one `aiohttp` client, `--in-flight` workers each POSTing the next `true` job as soon "
    "as its previous answer arrived. Latency: from sending a POST to its answer.",
    f"Slots, sampled: every {SAMPLE_INTERVAL_S * METRICS_EVERY_N_SAMPLES:g} s, the server's own "
    "count of the jobs holding a running slot (`jobs_server_slot_holding_jobs` in `GET /metrics`,"
    " summed over tenants): what the cap holds; the maximum over the run.",
    "Seen RUNNING, sampled at the same moments: `GET /api/jobs/?status=RUNNING`, counting those "
    "still RUNNING (for information: a `true` job ends within 0.1 s of its start, before its "
    "start is written, so it goes from PENDING to SUCCEEDED and is never seen RUNNING).",
    "Commands alive, sampled at the same moments: the first processes of contained jobs with "
    "a child (the namespace's init with its shell, or a launcher with its init: each job's "
    "command runs under one, from its start to its end; the fork server, with the same command "
    "line, leads its session and is not counted), an independent count of what ran at once. "
    "Only the "
    "supervisors' children are read (a scan of every process on the machine every 100 ms took "
    "a share of the two cores being measured).",
    "RSS: the server process and its children, sampled with the running jobs; growth: the "
    f"highest sample minus the RSS after {WARM_UP_JOBS} warm-up jobs.",
    "Completed per second: jobs / (the moment the archive is first seen with no unfinished job "
    f"(`?status=PENDING,RUNNING&limit=1`, polled every {DONE_POLL_INTERVAL_S * 1000:.0f} ms) "
    "minus the first POST). Then the whole list is read to check that every job SUCCEEDED.",
    "Sleepers: a fresh server without a cap; all RUNNING: from the last POST's answer until "
    "`?status=PENDING` lists none still PENDING. Idle CPU: the server process's CPU time (user +"
    f" system) over {IDLE_CPU_WINDOW_S:.0f} s of wall time with all of them running and no "
    "request, as a share of one core.",
    f"A dashboard's poll, with the sleepers running: {DASHBOARD_POLLS} requests of each "
    "status-filtered list one after another; the server process's CPU time per request, and "
    "the mean latency. A status filter reads every live job (its archived row and its KV "
    "record), so this is what polling the live jobs costs the server.",
]


# In the command line of a contained job's first process (containment.py): its namespace's
# init, cloned by the supervisor's fork server (zygote.py), or a launcher with the init under
# it. The fork server itself has it too, but leads its session, and has no child of its own
# (unless a clone is refused).
LAUNCHER_MARK = "CLONE_NEWPID"


def commands_running(supervisors: list[psutil.Process]) -> int:
    """Jobs whose command runs now, counted by their first processes (contained jobs): each is
    a supervisor's child that carries the mark, does not lead its session (the fork server
    does), and has a child (the init's shell, or the launcher's init). Only the supervisors'
    children are read: a scan of every process on the machine every sample took a share of the
    cores being measured."""
    count = 0
    for supervisor in supervisors:
        with contextlib.suppress(psutil.Error):
            for child in supervisor.children():
                with contextlib.suppress(psutil.Error, OSError):
                    if _is_marked(child) and os.getsid(child.pid) != child.pid and child.children():
                        count += 1
    return count


def _is_marked(process: psutil.Process) -> bool:
    try:
        return any(LAUNCHER_MARK in part for part in process.cmdline())
    except psutil.Error:
        return False


@dataclass
class Sampler:
    """The most RUNNING jobs and the highest RSS seen while it runs."""

    api: JobsApi
    processes: list[psutil.Process]
    supervisors: list[psutil.Process] = field(default_factory=list)
    max_running: int = 0
    max_holding: int = 0
    max_commands: int = 0
    peak_rss: int = 0
    samples: int = 0
    errors: list[str] = field(default_factory=list)

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                async with self.api.session.get(
                    self.api.url("/api/jobs/?status=RUNNING")
                ) as response:
                    jobs = await response.json()
                running = sum(1 for job in jobs if job["status"] == "RUNNING")
                self.max_running = max(self.max_running, running)
                if self.samples % METRICS_EVERY_N_SAMPLES == 0:
                    async with self.api.session.get(self.api.url("/metrics")) as response:
                        exposition = await response.text()
                    self.max_holding = max(self.max_holding, slot_holding_jobs(exposition))
            except (aiohttp.ClientError, TimeoutError, ValueError) as error:
                self.errors.append(f"{type(error).__name__}: {error}")
            self.peak_rss = max(self.peak_rss, summed_rss_bytes(self.processes))
            self.max_commands = max(
                self.max_commands, await asyncio.to_thread(commands_running, self.supervisors)
            )
            self.samples += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), SAMPLE_INTERVAL_S)


def slot_holding_jobs(exposition: str) -> int:
    """The server's count of jobs holding a running slot, over every tenant."""
    return int(
        sum(
            sample.value
            for family in text_string_to_metric_families(exposition)
            if family.name == "jobs_server_slot_holding_jobs"
            for sample in family.samples
        )
    )


async def unfinished_left(api: JobsApi) -> bool:
    async with api.session.get(api.url("/api/jobs/?status=PENDING,RUNNING&limit=1")) as response:
        return bool(await response.json())


async def wait_until_all_ended(api: JobsApi, deadline_s: float) -> None:
    """Poll until the archive lists no unfinished job, or `deadline_s` (monotonic) passes."""
    for _ in range(int(max(0.0, deadline_s - time.monotonic()) / DONE_POLL_INTERVAL_S) + 1):
        if not await unfinished_left(api) or time.monotonic() > deadline_s:
            return
        await asyncio.sleep(DONE_POLL_INTERVAL_S)


async def burst(
    url: str, pid: int, head_pid: int, args: argparse.Namespace
) -> dict[str, float | str]:
    """The capped burst's figures."""
    processes = process_tree(psutil.Process(pid))
    prefix = f"q{uuid.uuid4().hex[:6]}"
    async with new_session(max_connections=args.in_flight + 8) as session:
        api = JobsApi(session, url)
        warm = [f"{prefix}-warm-{n}" for n in range(WARM_UP_JOBS)]
        await submit_with_workers(api, "true", warm, 8, time.monotonic() + 120)
        await wait_until_all_ended(api, time.monotonic() + 120)
        rss_before = summed_rss_bytes(processes)
        sampler = Sampler(api, processes, supervisor_processes(head_pid), peak_rss=rss_before)
        stop = asyncio.Event()
        sampling = asyncio.create_task(sampler.run(stop))
        ids = [f"{prefix}-{n:05d}" for n in range(args.jobs)]
        started_s = time.monotonic()
        accepted, errors = await submit_with_workers(
            api, "true", ids, args.in_flight, started_s + BURST_TIMEOUT_S
        )
        posted_s = time.monotonic()
        logger.info(
            "%d POSTs answered in %.1f s (%d errors)",
            len(accepted),
            posted_s - started_s,
            len(errors),
        )
        await wait_until_all_ended(api, started_s + BURST_TIMEOUT_S)
        done_s = time.monotonic()
        stop.set()
        await sampling
        statuses = await api.list_statuses()
    latencies = [job.latency_s for job in accepted]
    ours = [statuses.get(job_id) for job_id in ids]
    succeeded = sum(1 for status in ours if status == "SUCCEEDED")
    figures: dict[str, float | str] = {
        "post_p50": percentile_or_nan(latencies, 50),
        "post_p99": percentile_or_nan(latencies, 99),
        "max_running": sampler.max_running,
        "max_holding": sampler.max_holding,
        "max_commands": sampler.max_commands,
        "completed_per_s": succeeded / (done_s - started_s),
        "rss_growth": sampler.peak_rss - rss_before,
        "succeeded": succeeded,
        "post_errors": len(errors),
        "accepted_per_s": len(accepted) / (posted_s - started_s),
        "samples": sampler.samples,
    }
    if errors:
        figures["first_error"] = errors[0]
    if sampler.errors:
        figures["sample_errors"] = f"{len(sampler.errors)}, e.g. {sampler.errors[0]}"
    return figures


async def sleepers(url: str, pid: int, args: argparse.Namespace) -> dict[str, float | str]:
    """1,000 `sleep 300` jobs, no cap: time until all RUNNING, the server's idle CPU."""
    prefix = f"s{uuid.uuid4().hex[:6]}"
    ids = [f"{prefix}-{n:04d}" for n in range(args.sleepers)]
    figures: dict[str, float | str] = {}
    async with new_session(max_connections=args.in_flight + 8) as session:
        api = JobsApi(session, url)
        started_s = time.monotonic()
        accepted, errors = await submit_with_workers(
            api, "sleep 300", ids, args.in_flight, started_s + SLEEPERS_RUNNING_TIMEOUT_S
        )
        last_answer_s = time.monotonic()
        figures["sleepers_accepted"] = len(accepted)
        if errors:
            figures["sleeper_errors"] = f"{len(errors)}, e.g. {errors[0]}"
        pending = len(ids)
        for _ in range(int(SLEEPERS_RUNNING_TIMEOUT_S / DONE_POLL_INTERVAL_S)):
            async with session.get(api.url("/api/jobs/?status=PENDING")) as response:
                jobs = await response.json()
            pending = sum(1 for job in jobs if job["status"] == "PENDING")
            if pending == 0:
                break
            await asyncio.sleep(DONE_POLL_INTERVAL_S)
        figures["all_running_s"] = time.monotonic() - last_answer_s if pending == 0 else "timeout"
        async with session.get(api.url("/api/jobs/?status=RUNNING")) as response:
            figures["sleepers_running"] = len(await response.json())
        server = psutil.Process(pid)
        before = server.cpu_times()
        await asyncio.sleep(IDLE_CPU_WINDOW_S)  # the measurement window: no request meanwhile
        after = server.cpu_times()
        used_s = (after.user - before.user) + (after.system - before.system)
        figures["idle_cpu"] = used_s / IDLE_CPU_WINDOW_S
        figures["rss_with_sleepers"] = summed_rss_bytes(process_tree(server))
        for query in DASHBOARD_QUERIES:
            cpu_s, wall_s = await poll_cost(api, server, query)
            name = query.removeprefix("status=").lower()
            figures[f"poll_{name}_cpu"], figures[f"poll_{name}_wall"] = cpu_s, wall_s
        logger.info("sleepers: %s; stopping them", figures)
        stop_errors = 0
        semaphore = asyncio.Semaphore(args.in_flight)

        async def stop(job_id: str) -> None:
            nonlocal stop_errors
            async with semaphore:
                try:
                    await api.stop(job_id)
                except Exception:
                    stop_errors += 1

        await asyncio.gather(*(stop(job.submission_id) for job in accepted))
        await wait_until_all_ended(api, time.monotonic() + STOP_TIMEOUT_S)
        if stop_errors:
            figures["stop_errors"] = stop_errors
    return figures


async def poll_cost(api: JobsApi, server: psutil.Process, query: str) -> tuple[float, float]:
    """The server's CPU seconds per `GET /api/jobs/?{query}`, and its mean latency, over
    DASHBOARD_POLLS polls one after another (a dashboard that polls the live jobs)."""
    before, started_s = server.cpu_times(), time.monotonic()
    for _ in range(DASHBOARD_POLLS):
        async with api.session.get(api.url(f"/api/jobs/?{query}")) as response:
            response.raise_for_status()
            await response.read()
    elapsed_s, after = time.monotonic() - started_s, server.cpu_times()
    used_s = (after.user - before.user) + (after.system - before.system)
    return used_s / DASHBOARD_POLLS, elapsed_s / DASHBOARD_POLLS


def fmt_s(value: float | str) -> str:
    if isinstance(value, str):
        return value
    return f"{value * 1000:.1f} ms" if value < 1 else f"{value:.2f} s"


def verdict(met: bool, *figures: float | str) -> str:
    if any(isinstance(f, str) or f != f for f in figures):  # a string, or NaN: no figure
        return "not measured"
    return "**met**" if met else "**not met**"


def render(
    capped: dict[str, float | str],
    uncapped: dict[str, float | str],
    args: argparse.Namespace,
    started: datetime.datetime,
    load: tuple[tuple[float, float, float], tuple[float, float, float]],
) -> str:
    def num(figures: dict[str, float | str], key: str) -> float:
        value = figures.get(key)
        return float(value) if isinstance(value, int | float) else float("nan")

    jobs, cap = f"{args.jobs:,}", args.max_running
    p50, p99 = num(capped, "post_p50"), num(capped, "post_p99")
    running, rate = num(capped, "max_running"), num(capped, "completed_per_s")
    holding = num(capped, "max_holding")
    commands = num(capped, "max_commands")
    growth, all_running = num(capped, "rss_growth"), uncapped.get("all_running_s", "not run")
    idle = num(uncapped, "idle_cpu")
    succeeded = num(capped, "succeeded")  # NaN: the burst was not run (`--only sleepers`)
    rows = [
        (
            f"every job completes ({jobs} `true`, {args.in_flight} in flight, cap {cap})",
            "—",
            f"{succeeded:,.0f} SUCCEEDED" if succeeded == succeeded else "not run",
            "all",
            verdict(num(capped, "succeeded") == args.jobs, num(capped, "succeeded")),
        ),
        ("POST /api/jobs/ p50", fmt_s(MAIN_POST_P50_S), fmt_s(p50), "—", "for information"),
        (
            "POST /api/jobs/ p99",
            fmt_s(MAIN_POST_P99_S),
            fmt_s(p99),
            "≤ 100 ms",
            verdict(p99 <= 0.1, p99),
        ),
        (
            "most jobs holding a running slot at once (sampled: the server's count)",
            "—",
            f"{holding:.0f}",
            f"≤ {cap}",
            verdict(holding <= cap, holding),
        ),
        (
            "most jobs seen RUNNING at once (sampled through the API)",
            str(MAIN_MAX_RUNNING),
            f"{running:.0f}",
            "—",
            "for information",
        ),
        (
            "most job commands alive at once (sampled: their first processes)",
            "—",
            f"{commands:.0f}",
            f"≤ {cap}",
            verdict(commands <= cap, commands),
        ),
        ("jobs completed per second", "—", f"{rate:.0f}/s", "≥ 150/s", verdict(rate >= 150, rate)),
        (
            "server RSS growth",
            f"+{MAIN_RSS_GROWTH / MIB:.0f} MiB",
            f"+{growth / MIB:.1f} MiB",
            "≤ 100 MiB",
            verdict(growth <= 100 * MIB, growth),
        ),
        (
            f"{args.sleepers:,} `sleep 300`, no cap: last POST → all RUNNING",
            "—",
            fmt_s(all_running),
            "≤ 5 s",
            verdict(isinstance(all_running, float) and all_running <= 5, all_running),
        ),
        (
            f"server CPU, idle with {args.sleepers:,} running",
            "—",
            f"{idle * 100:.1f} %",
            "≤ 5 %",
            verdict(idle <= 0.05, idle),
        ),
        *[
            (
                f"server CPU per `GET /api/jobs/?{query}` with {args.sleepers:,} running "
                f"(a dashboard's poll; mean latency "
                f"{fmt_s(num(uncapped, f'poll_{name}_wall'))})",
                "—",
                fmt_s(num(uncapped, f"poll_{name}_cpu")),
                "—",
                "for information",
            )
            for query in DASHBOARD_QUERIES
            for name in [query.removeprefix("status=").lower()]
        ],
    ]
    lines = [
        "# The queue under a burst (issue 15)",
        "",
        f"- date: {started.isoformat(timespec='seconds')}",
        f"- machine: {os.cpu_count()} cores; load average (1, 5, 15 min) before: "
        f"{', '.join(f'{x:.2f}' for x in load[0])}; after: "
        f"{', '.join(f'{x:.2f}' for x in load[1])}",
        f"- command: `{shlex.join(sys.orig_argv)}` (from the repository root)",
        f"- Ray {importlib.metadata.version('ray')}",
        "",
        "| scenario | main, no cap (issue 15) | this server | target | |",
        "|---|---:|---:|---|---|",
        *[f"| {' | '.join(row)} |" for row in rows],
        "",
        "## Other figures of this run",
        "",
        *[f"- burst `{key}`: {value}" for key, value in capped.items()],
        *[f"- sleepers `{key}`: {value}" for key, value in uncapped.items()],
        "",
        "## How it measures",
        "",
        *[f"- {text}" for text in METHOD_NOTES],
    ]
    return "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.queue", description="The queue under a burst (issue 15)."
    )
    parser.add_argument("--jobs", type=int, default=DEFAULT_JOBS, metavar="N")
    parser.add_argument("--in-flight", type=int, default=DEFAULT_IN_FLIGHT, metavar="N")
    parser.add_argument("--max-running", type=int, default=DEFAULT_MAX_RUNNING, metavar="N")
    parser.add_argument("--sleepers", type=int, default=DEFAULT_SLEEPERS, metavar="N")
    parser.add_argument("--only", choices=["burst", "sleepers"], default=None)
    parser.add_argument(
        "--keep-logs", action="store_true", help="keep the temp dir with Ray's and our logs"
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    capped: dict[str, float | str] = {}
    uncapped: dict[str, float | str] = {}
    with (
        benchmark_run("jobs-queue-", keep_logs=args.keep_logs) as run,
        ray_head(run.work_dir) as head,
    ):
        if args.only in (None, "burst"):
            burst_dir = run.work_dir / "burst"
            burst_dir.mkdir()
            flags = ["--max-running-jobs", str(args.max_running)]
            flags += ["--max-queued-jobs", str(args.jobs)]
            with jobs_server(head.gcs_address, burst_dir, flags) as ours:
                capped = asyncio.run(burst(ours.url, ours.pid, head.pid, args))
            logger.info("burst: %s", capped)
        if args.only in (None, "sleepers"):
            sleepers_dir = run.work_dir / "sleepers"
            sleepers_dir.mkdir()
            with jobs_server(head.gcs_address, sleepers_dir) as ours:
                uncapped = asyncio.run(sleepers(ours.url, ours.pid, args))
            logger.info("sleepers: %s", uncapped)
    write_report(render(capped, uncapped, args, run.started, run.loads()), RESULTS_PATH)


if __name__ == "__main__":
    main()
