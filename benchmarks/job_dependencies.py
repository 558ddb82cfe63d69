"""Job dependencies (issue 36): how soon a job starts after the job it depends on ended.

    .venv/bin/python -m benchmarks.job_dependencies [--quick] [--chains 1000]
                                                    [--in-flight 1,8] [--ray-chains 20]
                                                    [--keep-logs]

One Ray head, our server and Ray's job server on it. Ours: for each `--in-flight` count, a
phase of `--chains` chains of 3 jobs, each chain submitted at once (A; B with `depends_on: [A]`;
C with `depends_on: [B]`, condition `succeeded`), that many chains at a time (a worker submits a
chain, waits for its last job's end, then submits the next): one at a time measures the wait
itself, 8 at a time the same under a load of jobs. Each job's command is `date +%s%N`: it prints
when it ran. Figures per link (A → B, B → C):

- command: the wall-clock time the child's command printed minus its parent's `end_time` (the
  server's wall clock, in ms; the same machine): from the parent's recorded end until the
  child's command runs;
- server: the child's first attempt's `start_time` minus its parent's `end_time`;
- and, read from the archive (`jobs.db`, after the server stopped), where the time went: the
  parent's end → the child queued (`dependencies_met_time`, written when its dependencies all
  held) → its attempt's start.

Ray's job server has no dependencies: a chain there is driven from outside, as a pipeline does
today. `--ray-chains` chains, one at a time: submit A, poll its status every 5 ms until it ended,
then submit B, and so on; the same command figure (the child's printed time minus the parent's
`end_time`).

Prints the tables (progress on stderr) and writes them to benchmarks/results-job-dependencies.md
(not with `--quick`: 100 chains, 5 on Ray's).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import importlib.metadata
import itertools
import json
import logging
import os
import shlex
import sqlite3
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.client import ApiError, JobsApi, is_terminal, new_session
from benchmarks.processes import benchmark_run, jobs_server, ray_head, write_report
from benchmarks.stats import percentile, percentile_or_nan

logger = logging.getLogger("benchmarks.job_dependencies")

RESULTS_PATH = Path(__file__).with_name("results-job-dependencies.md")
COMMAND = [".venv/bin/python", "-m", "benchmarks.job_dependencies"]
ENTRYPOINT = "date +%s%N"
CHAIN_LENGTH = 3
DEFAULT_CHAINS = 1_000
DEFAULT_IN_FLIGHT = (1, 8)
DEFAULT_RAY_CHAINS = 20
QUICK_CHAINS = 100
QUICK_RAY_CHAINS = 5
WARM_UP_CHAINS = 5
# A worker looks at its chain's last job this often (ours); Ray's chain driver at its parent.
CHAIN_POLL_INTERVAL_S = 0.05
RAY_POLL_INTERVAL_S = 0.005
CHAIN_TIMEOUT_S = 120.0
# The target: a child starts within 50 ms of its parent's end, at p50.
TARGET_START_P50_S = 0.050
NS_PER_MS = 1_000_000


@dataclass
class Links:
    """Child start minus parent end, in seconds, one per link (parent → child)."""

    server_s: list[float] = field(default_factory=list)
    command_s: list[float] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    prefix: str = ""
    in_flight: int = 1
    chains_per_s: float = 0.0
    # From the archive: parent end → child queued, child queued → its attempt's start.
    queued_s: list[float] = field(default_factory=list)
    queued_to_start_s: list[float] = field(default_factory=list)
    # The control: a chain's first job (no dependency), its submit → its attempt's start.
    root_submit_to_start_s: list[float] = field(default_factory=list)


async def printed_time_ms(api: JobsApi, job_id: str) -> float | None:
    """The wall-clock time (ms) the job's `date +%s%N` printed, from its log."""
    async with api.session.get(api.url(f"/api/jobs/{job_id}/logs")) as response:
        if response.status != 200:
            return None
        lines = str((await response.json())["logs"]).splitlines()
    # Ray's log also holds its own lines ("Runtime env is setting up.", "Running entrypoint").
    printed = [line for line in lines if line.strip().isdigit()]
    return int(printed[0]) / NS_PER_MS if printed else None


async def add_links(api: JobsApi, chain: list[str], links: Links) -> None:
    """Each link's figures, from the chain's details and its children's logs."""
    jobs = [await api.job(job_id) for job_id in chain]
    for job in jobs:
        if job["status"] != "SUCCEEDED":
            links.failed.append(f"{job['submission_id']} {job['status']}: {job.get('message')}")
    for parent, child in itertools.pairwise(jobs):
        parent_end_ms = parent.get("end_time")
        if parent["status"] != "SUCCEEDED" or not parent_end_ms:
            continue
        attempts = child.get("attempts") or []
        if attempts:
            links.server_s.append((attempts[0]["start_time"] - parent_end_ms) / 1000)
        printed_ms = await printed_time_ms(api, child["submission_id"])
        if printed_ms is not None:
            links.command_s.append((printed_ms - parent_end_ms) / 1000)


async def our_chains(url: str, chains: int, in_flight: int) -> Links:
    """`chains` chains of 3 on our server, `in_flight` at a time, each submitted at once."""
    prefix = f"c{uuid.uuid4().hex[:6]}"
    links = Links(prefix=prefix, in_flight=in_flight)
    async with new_session(max_connections=2 * in_flight + 4) as session:
        api = JobsApi(session, url)

        async def one_chain(name: str, into: Links) -> None:
            chain = [f"{name}-{step}" for step in range(CHAIN_LENGTH)]
            for step, job_id in enumerate(chain):
                body: dict[str, Any] = {"entrypoint": ENTRYPOINT, "submission_id": job_id}
                if step:
                    body["depends_on"] = [{"submission_id": chain[step - 1]}]
                async with session.post(api.url("/api/jobs/"), json=body) as response:
                    if response.status != 200:
                        raise ApiError(f"POST {job_id}: {response.status} {await response.text()}")
            deadline_s = time.monotonic() + CHAIN_TIMEOUT_S
            while not is_terminal(await api.status(chain[-1])):
                if time.monotonic() > deadline_s:
                    raise TimeoutError(f"chain {name} still unfinished after {CHAIN_TIMEOUT_S} s")
                await asyncio.sleep(CHAIN_POLL_INTERVAL_S)
            await add_links(api, chain, into)

        await asyncio.gather(
            *(one_chain(f"{prefix}-warm-{n}", Links()) for n in range(WARM_UP_CHAINS))
        )
        names = [f"{prefix}-{n:04d}" for n in range(chains)]
        started_s = time.monotonic()

        async def worker() -> None:
            while names:
                await one_chain(names.pop(0), links)

        await asyncio.gather(*(worker() for _ in range(in_flight)))
        took_s = time.monotonic() - started_s
        links.chains_per_s = chains / took_s
        logger.info("%d chains on ours, %d at a time, in %.1f s", chains, in_flight, took_s)
    return links


def add_archive_breakdown(database: Path, phases: list[Links]) -> None:
    """Each phase's links split at the child's `dependencies_met_time`, from the archive's rows
    (read-only, after the server stopped)."""
    connection = sqlite3.connect(f"file:{database}?mode=ro", uri=True)
    try:
        records = {
            job_id: json.loads(record)
            for job_id, record in connection.execute("SELECT submission_id, record FROM jobs")
        }
    finally:
        connection.close()
    for links in phases:
        for job_id, record in records.items():
            dependencies = record["spec"].get("depends_on") or []
            if not job_id.startswith(f"{links.prefix}-") or "-warm-" in job_id:
                continue
            attempts = record.get("attempts") or []
            if not dependencies:
                if attempts and record.get("start_time"):
                    started_s = (attempts[0]["start_time"] - record["start_time"]) / 1000
                    links.root_submit_to_start_s.append(started_s)
                continue
            parent_end_ms = records[dependencies[0]["submission_id"]].get("end_time")
            queued_ms = record.get("dependencies_met_time")
            if parent_end_ms and queued_ms and attempts:
                links.queued_s.append((queued_ms - parent_end_ms) / 1000)
                links.queued_to_start_s.append((attempts[0]["start_time"] - queued_ms) / 1000)


async def ray_chains(url: str, chains: int) -> Links:
    """`chains` chains of 3 on Ray's server, driven from here: each child submitted once its
    parent is seen ended (polled every 5 ms)."""
    links = Links()
    prefix = f"r{uuid.uuid4().hex[:6]}"
    async with new_session(max_connections=4) as session:
        api = JobsApi(session, url)
        for number in range(chains):
            chain = [f"{prefix}-{number:03d}-{step}" for step in range(CHAIN_LENGTH)]
            for job_id in chain:
                await api.submit(ENTRYPOINT, job_id)
                deadline_s = time.monotonic() + CHAIN_TIMEOUT_S
                while not is_terminal(await api.status(job_id)):
                    if time.monotonic() > deadline_s:
                        raise TimeoutError(f"{job_id} still unfinished on Ray's server")
                    await asyncio.sleep(RAY_POLL_INTERVAL_S)
            await add_links(api, chain, links)
    links.server_s.clear()  # Ray's jobs have no attempts: only the command's figure compares
    return links


def fmt(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms" if abs(seconds) < 1 else f"{seconds:.2f} s"


def row(name: str, values: list[float]) -> str:
    if not values:
        return f"| {name} | — | — | — | — |"
    return (
        f"| {name} | {len(values):,} | {fmt(percentile(values, 50))} |"
        f" {fmt(percentile(values, 99))} | {fmt(max(values))} |"
    )


def render(
    phases: list[Links],
    rays: Links,
    args: argparse.Namespace,
    started: datetime.datetime,
    load: tuple[tuple[float, float, float], tuple[float, float, float]],
) -> str:
    first = phases[0]
    command_p50 = percentile_or_nan(first.command_s, 50)
    server_p50 = percentile_or_nan(first.server_s, 50)
    failures = [failure for links in [*phases, rays] for failure in links.failed]

    def verdict(seconds: float) -> str:
        return "**met**" if seconds <= TARGET_START_P50_S and not failures else "**not met**"

    def at_a_time(links: Links) -> str:
        return "one chain at a time" if links.in_flight == 1 else f"{links.in_flight} at a time"

    ray_p50 = percentile_or_nan(rays.command_s, 50)
    lines = [
        "# Job dependencies: a child's start after its parent's end (issue 36)",
        "",
        f"- date: {started.isoformat(timespec='seconds')}",
        f"- machine: {os.cpu_count()} cores; load average (1, 5, 15 min) at start:"
        f" {', '.join(f'{v:.2f}' for v in load[0])}; end: {', '.join(f'{v:.2f}' for v in load[1])}",
        f"- command: `{shlex.join(COMMAND + sys.argv[1:])}` (from the repository root)",
        f"- Ray {importlib.metadata.version('ray')}; ours: {args.chains:,} chains of"
        f" {CHAIN_LENGTH} (`{ENTRYPOINT}`) per phase, {', '.join(map(at_a_time, phases))};"
        f" Ray's: {args.ray_chains} chains driven by the client, one at a time",
        "",
        "## Target",
        "",
        "| target | figure | |",
        "|---|---:|---|",
        f"| the child starts within 50 ms of its parent's end, p50 ({at_a_time(first)}):"
        f" its command runs | {fmt(command_p50)} | {verdict(command_p50)} |",
        f"| same, the server's record of its attempt's start | {fmt(server_p50)} |"
        f" {verdict(server_p50)} |",
        "",
        "## Child start minus parent end",
        "",
        "| link (parent end → child start) | links | p50 | p99 | max |",
        "|---|---:|---:|---:|---:|",
    ]
    for links in phases:
        name = f"ours, {at_a_time(links)} ({links.chains_per_s:.1f} chains/s)"
        lines += [
            row(f"{name}: the child's command printed", links.command_s),
            row(f"{name}: the child's attempt start (server)", links.server_s),
            row(f"{name}: the child queued (archive)", links.queued_s),
            row(f"{name}: queued → its attempt's start (archive)", links.queued_to_start_s),
            row(
                f"{name}, control: a chain's first job, submit → its attempt's start (archive)",
                links.root_submit_to_start_s,
            ),
        ]
    lines += [
        row("Ray's, a client polling every 5 ms submits the child: its command printed",
            rays.command_s),
        f"| ratio ours/Ray's, command p50 ({at_a_time(first)}) | |"
        f" {command_p50 / ray_p50:.3f} | | |",
        "",
    ]  # fmt: skip
    if failures:
        lines += [f"Jobs that did not succeed: {len(failures)}, e.g. {failures[0]}", ""]
    lines += [
        "## How it measures",
        "",
        "- Ours: a chain's three POSTs go out back to back (B and C wait PENDING for their"
        " parent); a worker then polls the last job every 50 ms until it ended, reads the three"
        " jobs' details and the children's logs, and submits its next chain. Each phase starts"
        f" with {WARM_UP_CHAINS} chains at once, not counted.",
        "- Command: the child's own `date +%s%N` minus its parent's `end_time`. Server: the"
        " child's first attempt's `start_time` minus its parent's `end_time`. Archive: the"
        " child's `dependencies_met_time` (written when it entered the queue) minus its"
        " parent's `end_time`, and its attempt's start minus that. The control: a chain's"
        " first job, which waits for nothing, from its submit (`start_time`) to its attempt's"
        " start. All the server's wall clock in ms, on the same machine as the command's.",
        "- Ray's: its job server has no dependencies; the client submits each job once it sees"
        " the previous one ended (polling every 5 ms), as a pipeline driven from outside does.",
        "",
    ]
    return "\n".join(lines)


def in_flight_counts(text: str) -> tuple[int, ...]:
    counts = tuple(int(part) for part in text.split(","))
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"expected counts like 1,8, got {text!r}")
    return counts


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.job_dependencies",
        description="Chains of 3 jobs: a child's start after its parent's end (issue 36).",
    )
    parser.add_argument(
        "--quick", action="store_true", help=f"{QUICK_CHAINS} chains, {QUICK_RAY_CHAINS} on Ray's"
    )
    parser.add_argument("--chains", type=int, default=None, metavar="N", help="per phase")
    parser.add_argument(
        "--in-flight",
        type=in_flight_counts,
        default=DEFAULT_IN_FLIGHT,
        metavar="N,M",
        help="chains at a time, a phase each (default 1,8)",
    )
    parser.add_argument("--ray-chains", type=int, default=None, metavar="N")
    parser.add_argument(
        "--keep-logs", action="store_true", help="keep the temp dir with Ray's and our logs"
    )
    args = parser.parse_args(argv)
    if args.chains is None:
        args.chains = QUICK_CHAINS if args.quick else DEFAULT_CHAINS
    if args.ray_chains is None:
        args.ray_chains = QUICK_RAY_CHAINS if args.quick else DEFAULT_RAY_CHAINS
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    with (
        benchmark_run("jobs-dependencies-", keep_logs=args.keep_logs) as run,
        ray_head(run.work_dir) as head,
    ):
        with jobs_server(head.gcs_address, run.work_dir) as server:
            phases = [
                asyncio.run(our_chains(server.url, args.chains, in_flight))
                for in_flight in args.in_flight
            ]
        add_archive_breakdown(run.work_dir / "jobs-server-state" / "jobs.db", phases)
        for links in phases:
            logger.info(
                "ours, %d at a time: command p50 %s",
                links.in_flight,
                fmt(percentile(links.command_s, 50)),
            )
        rays = asyncio.run(ray_chains(head.dashboard_url, args.ray_chains))
    report = render(phases, rays, args, run.started, run.loads())
    write_report(report, RESULTS_PATH, keep=not args.quick)


if __name__ == "__main__":
    main()
