"""The API while CPU-bound jobs run on the head node: Ray's job server and jobs-server, side by
side on one Ray head.

    .venv/bin/python -m benchmarks.busy_head [--busy-jobs 20] [--gets 300] [--posts 100]

On each server in turn: `--busy-jobs` jobs that each keep a core busy, 5 s for them to settle,
then `GET /api/jobs/{id}` one request after another, then POSTs of `true` one after another
(latency: sending to the whole answer). The busy jobs are stopped before the next server. Where
the kernel has autogroups, a job in a session of its own is a scheduling group of its own
(docs/operations.md: CPU priority on a busy head node). Prints a markdown table with the ratios
ours/Ray's (progress on stderr) and writes it to benchmarks/results-busy-head.md.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import logging
import os
import tempfile
import time
import uuid
from pathlib import Path

from benchmarks.client import JobsApi, new_session, submit_with_workers
from benchmarks.processes import (
    jobs_server,
    kill_survivors,
    ray_head,
    set_up_benchmark_process,
)
from benchmarks.stats import percentile
from tests.support.api import TERMINAL_STATUSES

logger = logging.getLogger("benchmarks.busy_head")

RESULTS_PATH = Path(__file__).with_name("results-busy-head.md")
SETTLE_S = 5.0
SUBMIT_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 60.0
FIGURES = ("GET p50", "GET p99", "POST p50", "POST p99")


async def measure(url: str, marker: str, busy_jobs: int, gets: int, posts: int) -> list[float]:
    """The figures (seconds, in FIGURES' order) of the server at `url`."""
    async with new_session(max_connections=16) as session:
        api = JobsApi(session, url)
        busy = [f"{marker}-busy-{n}" for n in range(busy_jobs)]
        # The marker in the command line: what outlives the run is found and killed.
        command = f"while :; do :; done; : {marker}"
        _, errors = await submit_with_workers(
            api, command, busy, 4, time.monotonic() + SUBMIT_TIMEOUT_S
        )
        assert not errors, errors
        await asyncio.sleep(SETTLE_S)
        get_s = []
        for _ in range(gets):
            sent_s = time.monotonic()
            async with session.get(api.url(f"/api/jobs/{busy[0]}")) as response:
                await response.read()
                assert response.status == 200, response.status
            get_s.append(time.monotonic() - sent_s)
        post_s = [(await api.submit("true", f"{marker}-true-{n}")).latency_s for n in range(posts)]
        for submission_id in busy:
            async with session.post(api.url(f"/api/jobs/{submission_id}/stop")) as response:
                await response.read()
        # Stopped before the next server is measured (Ray's stop only asks).
        deadline_s = time.monotonic() + STOP_TIMEOUT_S
        while time.monotonic() < deadline_s:
            statuses = await api.list_statuses()
            if all(statuses.get(job) in TERMINAL_STATUSES for job in busy):
                break
            await asyncio.sleep(0.5)
    return [
        percentile(get_s, 50),
        percentile(get_s, 99),
        percentile(post_s, 50),
        percentile(post_s, 99),
    ]


async def run(busy_jobs: int, gets: int, posts: int) -> dict[str, list[float]]:
    with tempfile.TemporaryDirectory(prefix="busy-head-") as work:
        work_dir = Path(work)
        marker = f"bh{uuid.uuid4().hex[:8]}"
        try:
            with ray_head(work_dir) as head:
                with jobs_server(head.gcs_address, work_dir) as server:
                    logger.info("jobs-server: %d busy jobs", busy_jobs)
                    ours = await measure(server.url, f"{marker}o", busy_jobs, gets, posts)
                kill_survivors(f"{marker}o")
                logger.info("Ray's job server: %d busy jobs", busy_jobs)
                ray = await measure(head.dashboard_url, f"{marker}r", busy_jobs, gets, posts)
        finally:
            kill_survivors(marker)
    return {"ray": ray, "ours": ours}


def report(results: dict[str, list[float]], busy_jobs: int, gets: int, posts: int) -> str:
    load = ", ".join(f"{value:.2f}" for value in os.getloadavg())
    autogroups = Path("/proc/sys/kernel/sched_autogroup_enabled")
    lines = [
        "# The API while CPU-bound jobs run on the head node",
        "",
        f"- date: {datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds')}",
        f"- machine: {os.cpu_count()} cores; load average after (1, 5, 15 min): {load}; "
        f"autogroups: {autogroups.read_text().strip() if autogroups.exists() else 'none'}",
        "- command: `.venv/bin/python -m benchmarks.busy_head` (from the repository root)",
        f"- {busy_jobs} jobs each keeping a core busy; {gets} GETs of one job, then {posts} "
        "POSTs of `true`, one request after another",
        "",
        "| figure | Ray's job server | jobs-server | ratio (ours/Ray's) |",
        "|---|---:|---:|---:|",
    ]
    for name, ray, ours in zip(FIGURES, results["ray"], results["ours"], strict=True):
        lines.append(f"| {name} | {ray * 1000:.1f} ms | {ours * 1000:.1f} ms | {ours / ray:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--busy-jobs", type=int, default=20, metavar="N")
    parser.add_argument("--gets", type=int, default=300, metavar="N")
    parser.add_argument("--posts", type=int, default=100, metavar="N")
    args = parser.parse_args()
    set_up_benchmark_process()
    results = asyncio.run(run(args.busy_jobs, args.gets, args.posts))
    table = report(results, args.busy_jobs, args.gets, args.posts)
    RESULTS_PATH.write_text(table)
    print(table)


if __name__ == "__main__":
    main()
