"""Webhooks (issue 36): how soon a job's webhook arrives after its end, and what sending them
costs the API, on a burst of jobs each with a webhook to a loopback receiver.

    .venv/bin/python -m benchmarks.webhooks [--quick] [--jobs 10000] [--in-flight 64]
                                            [--max-running 50] [--keep-logs]

One Ray head; for each run a fresh server of ours (`--max-running-jobs 50`, a webhook secret
file, `--webhook-allow-http --webhook-allow-private` as the receiver is on loopback). A run is
queue.py's burst: `--jobs` `true` jobs POSTed with `--in-flight` requests in flight. In the runs
"with" every POST carries `notify: [{url: <the receiver>, events: [job.succeeded, job.failed,
job.stopped]}]` (one delivery per job, its end); in the runs "without" the same burst carries
none; in the runs "notify, never sent" it asks only for `job.stopped`, which a `true` job never
has (the submit's check and the planner run, no delivery is written or sent: against "with",
what sending costs). The order is ABCCBA, so the machine's drift falls on all alike.

The receiver is a process of its own (an aiohttp server on 127.0.0.1): it checks every
signature with `standardwebhooks` (a bad one is answered 400 and counted), answers 204, and
notes when each delivery arrived (the wall clock). A delivery's time after the job's end is that
arrival minus the job's `end_time` in the body's details (the server's wall clock, in ms: the
same machine). The benchmark waits for every job's end and then for every delivery.

Ray's job server has no webhooks: there is nothing of its to run side by side.

Prints the tables (progress on stderr) and writes them to benchmarks/results-webhooks.md (not
with `--quick`, which runs 1,000 jobs per run).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import datetime
import enum
import importlib.metadata
import logging
import multiprocessing
import os
import shlex
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.sharedctypes import Synchronized
from pathlib import Path
from typing import Any

import aiohttp
import psutil

from benchmarks.client import JobsApi, new_session
from benchmarks.job_starts import own_cpu_s
from benchmarks.processes import (
    HTTP_HOST,
    benchmark_run,
    jobs_server,
    ray_head,
    write_report,
)
from benchmarks.queue import DEFAULT_IN_FLIGHT, DEFAULT_JOBS, DEFAULT_MAX_RUNNING
from benchmarks.stats import percentile, percentile_or_nan

logger = logging.getLogger("benchmarks.webhooks")

RESULTS_PATH = Path(__file__).with_name("results-webhooks.md")
COMMAND = [".venv/bin/python", "-m", "benchmarks.webhooks"]
QUICK_JOBS = 1_000
TERMINAL = ["job.succeeded", "job.failed", "job.stopped"]
WARM_UP_JOBS = 20
RUN_TIMEOUT_S = 900.0
# After the last job's end, every delivery must have arrived within this.
DELIVERIES_TIMEOUT_S = 300.0
DONE_POLL_INTERVAL_S = 0.2
# Each run starts once the 1-min load average is below this (or after the wait's bound).
DEFAULT_SETTLE_LOAD = 2.0
DEFAULT_SETTLE_MAX_S = 300.0
RECEIVER_READY_TIMEOUT_S = 30.0
# The targets: a delivery within 1 s of its job's end at p99; the burst's POST p99 with
# webhooks within 10 % of the same burst's without.
TARGET_DELIVERY_P99_S = 1.0
TARGET_POST_P99_RATIO = 1.10


class Variant(enum.StrEnum):
    """What a run's POSTs carry."""

    WITHOUT = "without"
    WITH = "with"
    UNSENT = "notify, never sent"

    def notify(self, url: str) -> list[dict[str, Any]] | None:
        """The `notify` of its POSTs: the terminal events; for UNSENT only `job.stopped`,
        which a `true` job never has (the submit's check and the planner run, nothing is
        written to the outbox or sent: what the sender costs shows against WITH)."""
        if self is Variant.WITHOUT:
            return None
        return [{"url": url, "events": ["job.stopped"] if self is Variant.UNSENT else TERMINAL}]

    @property
    def sends(self) -> bool:
        return self is Variant.WITH


RUN_ORDER = (
    Variant.WITHOUT,
    Variant.WITH,
    Variant.UNSENT,
    Variant.UNSENT,
    Variant.WITH,
    Variant.WITHOUT,
)


# The receiver, in a process of its own.


@dataclass(frozen=True)
class Arrival:
    """One delivery as the receiver got it."""

    webhook_id: str
    event_type: str
    submission_id: str
    end_time_ms: int | None
    received_ms: float


def run_receiver(secret: str, answers: Connection, received: Synchronized[int]) -> None:
    """Serve POSTs on a free loopback port (sent back first) until told to stop, then send
    back the arrivals and the number of badly signed deliveries."""
    from aiohttp import web
    from standardwebhooks.webhooks import Webhook, WebhookVerificationError

    webhook = Webhook(secret)
    arrivals: list[Arrival] = []
    bad_signatures = 0

    async def receive(request: web.Request) -> web.Response:
        nonlocal bad_signatures
        body = await request.read()
        received_ms = time.time() * 1000
        try:
            event = webhook.verify(body, dict(request.headers))
        except WebhookVerificationError:
            bad_signatures += 1
            return web.Response(status=400)
        data = event["data"]
        arrivals.append(
            Arrival(
                request.headers["webhook-id"],
                event["type"],
                data["submission_id"],
                data.get("end_time"),
                received_ms,
            )
        )
        with received.get_lock():
            received.value += 1
        return web.Response(status=204)

    async def serve() -> None:
        app = web.Application()
        app.router.add_post("/hook", receive)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, HTTP_HOST, 0)
        await site.start()
        port = runner.addresses[0][1]
        answers.send(port)
        stop = asyncio.Event()
        asyncio.get_running_loop().add_reader(answers.fileno(), stop.set)
        await stop.wait()
        answers.recv()
        await runner.cleanup()
        answers.send((arrivals, bad_signatures))

    asyncio.run(serve())


@dataclass
class Receiver:
    process: multiprocessing.process.BaseProcess
    connection: Connection
    received: Synchronized[int]
    url: str

    async def wait_for(self, count: int, deadline_s: float) -> None:
        """Until `count` deliveries arrived, or `deadline_s` (monotonic) passed: a counter in
        another process, polled (there is no event to wait on across processes here)."""
        while self.received.value < count and time.monotonic() < deadline_s:  # noqa: ASYNC110
            await asyncio.sleep(DONE_POLL_INTERVAL_S)

    def finish(self) -> tuple[list[Arrival], int]:
        self.connection.send("stop")
        arrivals, bad = self.connection.recv()
        self.process.join(timeout=30)
        return arrivals, bad


@contextlib.contextmanager
def receiver(secret: str) -> Any:
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    received = context.Value("q", 0)
    process = context.Process(target=run_receiver, args=(secret, theirs, received), daemon=True)
    process.start()
    try:
        if not ours.poll(RECEIVER_READY_TIMEOUT_S):
            raise RuntimeError("the receiver did not start")
        port = ours.recv()
        yield Receiver(process, ours, received, f"http://{HTTP_HOST}:{port}/hook")
    finally:
        if process.is_alive():
            process.kill()
            process.join(timeout=10)


# A run: one burst on a fresh server.


@dataclass
class RunFigures:
    variant: Variant
    load_1m: float
    job_ids: set[str] = field(default_factory=set)
    post_latencies_s: list[float] = field(default_factory=list)
    post_errors: list[str] = field(default_factory=list)
    succeeded: int = 0
    burst_s: float = 0.0
    server_cpu_s: float = 0.0
    delivery_after_end_s: list[float] = field(default_factory=list)
    deliveries: int = 0
    duplicates: int = 0
    bad_signatures: int = 0
    missing: int = 0
    wait_for_last_delivery_s: float = 0.0


async def post_burst(
    api: JobsApi, ids: list[str], in_flight: int, notify: list[dict[str, Any]] | None
) -> tuple[list[float], list[str]]:
    """POST every job with `in_flight` requests in flight: the latencies and the errors."""
    queue = list(reversed(ids))
    latencies: list[float] = []
    errors: list[str] = []

    async def worker() -> None:
        while queue:
            job_id = queue.pop()
            body: dict[str, Any] = {"entrypoint": "true", "submission_id": job_id}
            if notify is not None:
                body["notify"] = notify
            sent_s = time.monotonic()
            try:
                async with api.session.post(api.url("/api/jobs/"), json=body) as response:
                    text = await response.text()
                    if response.status != 200:
                        errors.append(f"{response.status}: {text[:200]}")
                        continue
            except (aiohttp.ClientError, TimeoutError) as error:
                errors.append(f"{type(error).__name__}: {error}")
                continue
            latencies.append(time.monotonic() - sent_s)

    await asyncio.gather(*(worker() for _ in range(in_flight)))
    return latencies, errors


async def all_ended(api: JobsApi, deadline_s: float) -> None:
    while time.monotonic() < deadline_s:
        async with api.session.get(api.url("/api/jobs/?status=PENDING,RUNNING&limit=1")) as answer:
            if not await answer.json():
                return
        await asyncio.sleep(DONE_POLL_INTERVAL_S)
    raise RuntimeError("jobs still unfinished at the deadline")


async def one_run(
    url: str, pid: int, hook: Receiver, args: argparse.Namespace, variant: Variant
) -> RunFigures:
    figures = RunFigures(variant, os.getloadavg()[0])
    prefix = f"w{uuid.uuid4().hex[:6]}"
    notify = variant.notify(hook.url)
    server = psutil.Process(pid)
    async with new_session(max_connections=args.in_flight + 8) as session:
        api = JobsApi(session, url)
        warm = [f"{prefix}-warm-{n}" for n in range(WARM_UP_JOBS)]
        await post_burst(api, warm, 8, notify)
        await all_ended(api, time.monotonic() + 120)
        ids = [f"{prefix}-{n:05d}" for n in range(args.jobs)]
        figures.job_ids = set(ids)
        cpu_before_s = own_cpu_s(server)
        started_s = time.monotonic()
        figures.post_latencies_s, figures.post_errors = await post_burst(
            api, ids, args.in_flight, notify
        )
        logger.info(
            "%d POSTs answered in %.1f s (%d errors)",
            len(figures.post_latencies_s),
            time.monotonic() - started_s,
            len(figures.post_errors),
        )
        await all_ended(api, started_s + RUN_TIMEOUT_S)
        figures.burst_s = time.monotonic() - started_s
        ended_s = time.monotonic()
        if variant.sends:
            expected = len(warm) + len(ids)
            await hook.wait_for(expected, ended_s + DELIVERIES_TIMEOUT_S)
            figures.wait_for_last_delivery_s = time.monotonic() - ended_s
        figures.server_cpu_s = own_cpu_s(server) - cpu_before_s
        statuses = await api.list_statuses()
    figures.succeeded = sum(statuses.get(job_id) == "SUCCEEDED" for job_id in ids)
    return figures


def add_arrivals(figures: RunFigures, arrivals: list[Arrival], bad: int) -> None:
    """The run's deliveries: the first arrival of each job's, its time after the job's end
    (without webhooks, any arrival would be a bug: counted, none missing)."""
    ids = figures.job_ids
    figures.bad_signatures = bad
    first: dict[str, Arrival] = {}
    for arrival in arrivals:
        if arrival.submission_id not in ids:
            continue  # the warm-up's
        figures.deliveries += 1
        if arrival.submission_id in first:
            figures.duplicates += 1
            continue
        first[arrival.submission_id] = arrival
    figures.missing = len(ids) - len(first) if figures.variant.sends else 0
    figures.delivery_after_end_s = [
        (arrival.received_ms - arrival.end_time_ms) / 1000
        for arrival in first.values()
        if arrival.end_time_ms is not None
    ]


def settle(below: float, max_s: float) -> None:
    """Wait until the 1-min load average is below `below` (at most `max_s`): a run's burst
    raises it to 10-15 on two cores, and the next run started at once measured the last one's
    leftovers (a control of the same server work differed from its twin by half)."""
    if below <= 0:
        return
    deadline = time.monotonic() + max_s
    while os.getloadavg()[0] >= below and time.monotonic() < deadline:
        time.sleep(5)
    logger.info("load average %.2f at the run's start", os.getloadavg()[0])


def run_all(args: argparse.Namespace, work_dir: Path) -> list[RunFigures]:
    secret = "whsec_" + base64.b64encode(os.urandom(32)).decode()
    secret_file = work_dir / "webhook-secret"
    secret_file.write_text(secret + "\n")
    secret_file.chmod(0o600)
    runs: list[RunFigures] = []
    with ray_head(work_dir) as head:
        for number, variant in enumerate(RUN_ORDER, start=1):
            run_dir = work_dir / f"run-{number}"
            run_dir.mkdir()
            flags = [
                "--max-running-jobs", str(args.max_running),
                "--max-queued-jobs", str(args.jobs + WARM_UP_JOBS),
                "--webhook-secret-file", str(secret_file),
                "--webhook-allow-http", "--webhook-allow-private",
            ]  # fmt: skip
            settle(args.settle_load, args.settle_max_s)
            with receiver(secret) as hook, jobs_server(head.gcs_address, run_dir, flags) as ours:
                logger.info("run %d: %s", number, variant)
                figures = asyncio.run(one_run(ours.url, ours.pid, hook, args, variant))
                arrivals, bad = hook.finish()
            add_arrivals(figures, arrivals, bad)
            logger.info("run %d: %s", number, summary(figures))
            runs.append(figures)
    return runs


def summary(figures: RunFigures) -> str:
    parts = [
        f"POST p99 {percentile(figures.post_latencies_s, 99) * 1000:.1f} ms",
        f"{figures.succeeded} succeeded",
    ]
    if figures.variant.sends and figures.delivery_after_end_s:
        parts.append(
            f"delivery p99 {percentile(figures.delivery_after_end_s, 99) * 1000:.0f} ms,"
            f" {figures.missing} missing, {figures.bad_signatures} bad"
        )
    return ", ".join(parts)


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms" if seconds < 10 else f"{seconds:.1f} s"


def render(
    runs: list[RunFigures],
    args: argparse.Namespace,
    started: datetime.datetime,
    load: tuple[tuple[float, float, float], tuple[float, float, float]],
) -> str:
    def pooled(variant: Variant, name: str) -> list[float]:
        return [v for r in runs if r.variant is variant for v in getattr(r, name)]

    without_p99 = percentile(pooled(Variant.WITHOUT, "post_latencies_s"), 99)
    with_p99 = percentile(pooled(Variant.WITH, "post_latencies_s"), 99)
    unsent = pooled(Variant.UNSENT, "post_latencies_s")
    unsent_p99 = percentile_or_nan(unsent, 99)
    deliveries = pooled(Variant.WITH, "delivery_after_end_s")
    delivery_p99 = percentile_or_nan(deliveries, 99)
    missing = sum(r.missing for r in runs if r.variant.sends)
    bad = sum(r.bad_signatures for r in runs)
    ratio = with_p99 / without_p99

    def verdict(met: bool) -> str:
        return "**met**" if met else "**not met**"

    lines = [
        "# Webhooks: delivery after a job's end, and the POST's cost (issue 36)",
        "",
        f"- date: {started.isoformat(timespec='seconds')}",
        f"- machine: {os.cpu_count()} cores; load average (1, 5, 15 min) at start:"
        f" {', '.join(f'{v:.2f}' for v in load[0])}; end: {', '.join(f'{v:.2f}' for v in load[1])}",
        f"- command: `{shlex.join(COMMAND + sys.argv[1:])}` (from the repository root)",
        f"- Ray {importlib.metadata.version('ray')}; each run: {args.jobs:,} `true` jobs,"
        f" {args.in_flight} POSTs in flight, `--max-running-jobs {args.max_running}`; a fresh"
        " server per run, order ABCCBA",
        "",
        "## Targets",
        "",
        "| target | figure | |",
        "|---|---:|---|",
        f"| every delivery within 1 s of its job's end, p99 | {ms(delivery_p99)}"
        f" ({len(deliveries):,} deliveries, {missing} missing, {bad} badly signed) |"
        f" {verdict(delivery_p99 <= TARGET_DELIVERY_P99_S and missing == 0 and bad == 0)} |",
        f"| POST p99 with webhooks within 10 % of the same burst's without | {ratio:.3f}"
        f" ({ms(with_p99)} / {ms(without_p99)}) | {verdict(ratio <= TARGET_POST_P99_RATIO)} |",
        f"| for information: POST p99 with a `notify` never sent (`job.stopped` only) against"
        f" without | {unsent_p99 / without_p99:.3f} ({ms(unsent_p99)}) | |",
        "",
        "## Runs",
        "",
        "| run | notify | load (1 min) | succeeded | POST p50 | POST p99 | jobs/s |"
        " server CPU ms/job | deliveries (duplicates) | delivery after end p50 | p99 | max |"
        " last delivery after the last end |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for number, run in enumerate(runs, start=1):
        after = run.delivery_after_end_s
        lines.append(
            f"| {number} | {run.variant} | {run.load_1m:.2f} |"
            f" {run.succeeded:,} | {ms(percentile(run.post_latencies_s, 50))} |"
            f" {ms(percentile(run.post_latencies_s, 99))} | {run.succeeded / run.burst_s:.1f} |"
            f" {run.server_cpu_s / args.jobs * 1000:.2f} |"
            + (
                f" {run.deliveries:,} ({run.duplicates}) | {ms(percentile(after, 50))} |"
                f" {ms(percentile(after, 99))} | {ms(max(after))} |"
                f" {ms(run.wait_for_last_delivery_s)} |"
                if run.variant.sends and after
                else " — | — | — | — | — |"
            )
        )
    lines += [
        "",
        "## How it measures",
        "",
        (
            f"- Each run starts once the 1-min load average is below {args.settle_load:g} (at"
            f" most {args.settle_max_s:g} s of waiting): a burst raises it to 10-15 on two cores."
            if args.settle_load > 0
            else "- Runs start one after another, without waiting for the load to settle."
        ),
        "- A run: a fresh server of ours on the same Ray head, warmed up with 20 jobs (with the"
        " run's webhooks), then the burst: every job POSTed with the run's body by"
        f" {args.in_flight} workers, each sending its next POST when its last was answered. POST"
        " latency: from sending to the answer. Jobs/s: succeeded jobs over the time from the"
        " first POST until no job is PENDING or RUNNING.",
        "- With webhooks, each job's `notify` asks for its terminal events: one delivery per job."
        " The receiver (a process of its own, on loopback) verifies each signature with"
        " `standardwebhooks` and notes its arrival on the wall clock; a delivery's time after its"
        " job's end is that minus `end_time` in the body's job details (ms, the server's wall"
        " clock, the same machine). A job's first delivery counts; others are duplicates (at"
        " least once).",
        "- Server CPU per job: the server process's user + system time over the burst and the"
        " deliveries that followed (its sender runs in it), per job of the burst.",
        "",
    ]
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.webhooks",
        description="Webhooks under a burst: delivery after a job's end, POST p99 (issue 36).",
    )
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_JOBS:,} jobs per run")
    parser.add_argument("--jobs", type=int, default=None, metavar="N")
    parser.add_argument("--in-flight", type=int, default=DEFAULT_IN_FLIGHT, metavar="N")
    parser.add_argument("--max-running", type=int, default=DEFAULT_MAX_RUNNING, metavar="N")
    parser.add_argument(
        "--settle-load",
        type=float,
        default=DEFAULT_SETTLE_LOAD,
        metavar="L",
        help="before each run, wait for the 1-min load average to drop below L (0: do not)",
    )
    parser.add_argument("--settle-max-s", type=float, default=DEFAULT_SETTLE_MAX_S, metavar="S")
    parser.add_argument(
        "--keep-logs", action="store_true", help="keep the temp dir with Ray's and our logs"
    )
    args = parser.parse_args(argv)
    if args.jobs is None:
        args.jobs = QUICK_JOBS if args.quick else DEFAULT_JOBS
    if args.quick:
        args.settle_load = 0.0
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    with benchmark_run("jobs-webhooks-", keep_logs=args.keep_logs) as run:
        runs = run_all(args, run.work_dir)
    write_report(render(runs, args, run.started, run.loads()), RESULTS_PATH, keep=not args.quick)


if __name__ == "__main__":
    main()
