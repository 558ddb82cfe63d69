"""The queue's burst spread over replicas (issue 34's performance): 10,000 `true` jobs POSTed
with 64 requests in flight and `--max-running-jobs 50`, against one server on SQLite and then
against two replicas sharing one PostgreSQL (the POSTs alternate between them: half reach the
follower, which forwards them to the leader), in one run on one Ray head node.

    .venv/bin/python -m benchmarks.replicas_burst [--jobs 10000] [--in-flight 64] [--quick]

Writes benchmarks/results-replicas-burst.md. Figures: POST p50 and p99 (client-side, over
every POST), jobs completed per second (from the first POST to the last job's end), the most
jobs holding a running slot (the leader's /metrics, sampled), every job SUCCEEDED.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import itertools
import logging
import os
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

import aiohttp

from benchmarks.client import ApiError, JobsApi, Submitted, new_session
from benchmarks.processes import benchmark_run, ray_head, write_report
from benchmarks.queue import slot_holding_jobs, wait_until_all_ended
from benchmarks.stats import percentile_or_nan
from tests.support.postgres import running_postgres
from tests.support.replicas import Replica, ReplicaGroup

logger = logging.getLogger("benchmarks.replicas_burst")

RESULTS_PATH = Path(__file__).with_name("results-replicas-burst.md")
DEFAULT_JOBS = 10_000
QUICK_JOBS = 1_000
DEFAULT_IN_FLIGHT = 64
MAX_RUNNING = 50
WARM_UP_JOBS = 20
SAMPLE_INTERVAL_S = 0.2
BURST_TIMEOUT_S = 900.0
# Targets of issue 34 for the replicas' burst.
POST_P99_TARGET_S = 0.100
COMPLETED_PER_S_TARGET = 300.0


@contextlib.contextmanager
def servers(
    ray_address: str, work_dir: Path, count: int, database_url: str | None
) -> Iterator[list[Replica]]:
    """`count` servers on one namespace and log dir (each its own state dir), on `database_url`
    (None: SQLite, one server), the queue's cap set on each; the leader first."""
    group = ReplicaGroup(
        work_dir,
        ray_address,
        database_url,
        count,
        extra_args=[
            *("--max-running-jobs", str(MAX_RUNNING)),
            *("--max-queued-jobs", str(DEFAULT_JOBS + WARM_UP_JOBS)),
        ],
        namespace=f"bench_{uuid.uuid4().hex[:12]}",
    )
    try:
        group.start()
        leader = group.leader() if count > 1 else group.replicas[0]
        yield [leader, *(replica for replica in group.replicas if replica is not leader)]
    finally:
        group.stop()


async def submit_spread(
    apis: list[JobsApi], ids: list[str], in_flight: int, deadline_s: float
) -> tuple[list[Submitted], list[str]]:
    """POST `true` for each id, `in_flight` at a time, the POSTs in turn to each of `apis`."""
    pending = list(reversed(ids))
    turns = itertools.cycle(apis)
    accepted: list[Submitted] = []
    errors: list[str] = []

    async def worker() -> None:
        while pending and time.monotonic() < deadline_s:
            job_id = pending.pop()
            try:
                accepted.append(await next(turns).submit("true", job_id))
            except (ApiError, aiohttp.ClientError, TimeoutError) as error:
                errors.append(f"{job_id}: {error}")

    await asyncio.gather(*(worker() for _ in range(in_flight)))
    return accepted, errors


async def most_holding(api: JobsApi, stop: asyncio.Event, seen: list[int]) -> None:
    """Sample the leader's count of jobs holding a running slot until `stop`."""
    while not stop.is_set():
        async with api.session.get(api.url("/metrics")) as response:
            seen.append(slot_holding_jobs(await response.text()))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), SAMPLE_INTERVAL_S)


async def burst(replicas: list[Replica], jobs: int, in_flight: int) -> dict[str, float | str]:
    """The burst through every replica in turn; its figures."""
    prefix = f"r{uuid.uuid4().hex[:6]}"
    async with new_session(max_connections=in_flight + 8) as session:
        apis = [JobsApi(session, replica.url) for replica in replicas]
        warm = [f"{prefix}-warm-{n}" for n in range(WARM_UP_JOBS)]
        await submit_spread(apis, warm, 8, time.monotonic() + 120)
        await wait_until_all_ended(apis[0], time.monotonic() + 120)
        stop = asyncio.Event()
        holding: list[int] = []
        sampling = asyncio.create_task(most_holding(apis[0], stop, holding))
        ids = [f"{prefix}-{n:05d}" for n in range(jobs)]
        started_s = time.monotonic()
        accepted, errors = await submit_spread(apis, ids, in_flight, started_s + BURST_TIMEOUT_S)
        posted_s = time.monotonic()
        await wait_until_all_ended(apis[-1], started_s + BURST_TIMEOUT_S)
        done_s = time.monotonic()
        stop.set()
        await sampling
        statuses = await apis[-1].list_statuses()
    latencies = [job.latency_s for job in accepted]
    succeeded = sum(1 for job_id in ids if statuses.get(job_id) == "SUCCEEDED")
    figures: dict[str, float | str] = {
        "post_p50": percentile_or_nan(latencies, 50),
        "post_p99": percentile_or_nan(latencies, 99),
        "completed_per_s": succeeded / (done_s - started_s),
        "accepted_per_s": len(accepted) / (posted_s - started_s),
        "succeeded": succeeded,
        "post_errors": len(errors),
        "max_holding": max(holding, default=0),
    }
    if errors:
        figures["first_error"] = errors[0]
    return figures


def render(
    single: dict[str, float | str],
    spread: dict[str, float | str],
    args: argparse.Namespace,
    started: datetime.datetime,
    loads: tuple[tuple[float, ...], tuple[float, ...]],
) -> str:
    def ms(value: float | str) -> str:
        return f"{float(value) * 1000:.1f} ms"

    def verdict(met: bool) -> str:
        return "**met**" if met else "**not met**"

    p99, rate = float(spread["post_p99"]), float(spread["completed_per_s"])
    lines = [
        "# The burst spread over replicas (issue 34)",
        "",
        f"- date: {started.isoformat(timespec='seconds')}",
        f"- machine: {os.cpu_count()} cores; load average (1, 5, 15 min) before:"
        f" {', '.join(f'{x:.2f}' for x in loads[0])}; after:"
        f" {', '.join(f'{x:.2f}' for x in loads[1])}",
        "- command: `.venv/bin/python -m benchmarks.replicas_burst"
        + (" --quick" if args.quick else "")
        + "` (from the repository root)",
        f"- {args.jobs:,} `true` jobs, {args.in_flight} POSTs in flight,"
        f" `--max-running-jobs {MAX_RUNNING}` on every server; two replicas: the POSTs alternate"
        " (half forwarded by the follower to the leader)",
        "",
        "| | one server, SQLite | two replicas, PostgreSQL | target (replicas) |",
        "|---|---:|---:|---|",
        f"| every job SUCCEEDED | {single['succeeded']:,} | {spread['succeeded']:,} |"
        f" all: {verdict(spread['succeeded'] == args.jobs)} |",
        f"| POST /api/jobs/ p50 | {ms(single['post_p50'])} | {ms(spread['post_p50'])} | — |",
        f"| POST /api/jobs/ p99 | {ms(single['post_p99'])} | {ms(spread['post_p99'])} |"
        f" ≤ 100 ms: {verdict(p99 <= POST_P99_TARGET_S)} |",
        f"| jobs completed per second | {float(single['completed_per_s']):.0f}/s |"
        f" {rate:.0f}/s | ≥ 300/s: {verdict(rate >= COMPLETED_PER_S_TARGET)} |",
        f"| POSTs accepted per second | {float(single['accepted_per_s']):.0f}/s |"
        f" {float(spread['accepted_per_s']):.0f}/s | — |",
        f"| most jobs holding a running slot (the leader's count) | {single['max_holding']} |"
        f" {spread['max_holding']} | ≤ {MAX_RUNNING}:"
        f" {verdict(int(spread['max_holding']) <= MAX_RUNNING)} |",
        f"| POST errors | {single['post_errors']} | {spread['post_errors']} | 0 |",
        "",
    ]
    for name, figures in (("one server", single), ("replicas", spread)):
        if "first_error" in figures:
            lines.append(f"- {name}: first POST error: {figures['first_error']}")
    return "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=None)
    parser.add_argument("--in-flight", type=int, default=DEFAULT_IN_FLIGHT)
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_JOBS:,} jobs")
    args = parser.parse_args(argv)
    if args.jobs is None:
        args.jobs = QUICK_JOBS if args.quick else DEFAULT_JOBS
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    with benchmark_run("jobs-replicas-burst-") as run, ray_head(run.work_dir) as head:
        single_dir = run.work_dir / "single"
        single_dir.mkdir()
        with servers(head.gcs_address, single_dir, 1, None) as single_servers:
            single = asyncio.run(burst(single_servers, args.jobs, args.in_flight))
        logger.info("one server on SQLite: %s", single)
        spread_dir = run.work_dir / "replicas"
        spread_dir.mkdir()
        with (
            running_postgres(durable=True) as postgres,
            servers(head.gcs_address, spread_dir, 2, postgres.create_database()) as replicas,
        ):
            spread = asyncio.run(burst(replicas, args.jobs, args.in_flight))
        logger.info("two replicas on PostgreSQL: %s", spread)
    write_report(render(single, spread, args, run.started, run.loads()), RESULTS_PATH)


if __name__ == "__main__":
    main()
