"""Benchmark jobs-server against Ray's own job server, side by side on one Ray cluster.

    .venv/bin/python -m benchmarks.run [--quick] [--only {jobs,logs,remote}] [--list-jobs N]
                                       [--keep-logs]

Starts a Ray head node with its dashboard (which serves Ray's jobs API) and jobs-server on the same
cluster (and, for the remote scenarios, a worker node joined to it), drives both servers through
the same HTTP client, prints a markdown table (progress goes to stderr) and writes it to
benchmarks/results.md, or benchmarks/results-<group>.md for `--only <group>`.
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
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil

from benchmarks.client import JobsApi, is_terminal, new_session, watch_statuses
from benchmarks.log_scenarios import BigLog, LogTailLatency, TimeToFirstLine
from benchmarks.processes import (
    RAY_NUM_CPUS,
    RayHead,
    jobs_server,
    kill_survivors,
    our_log_processes,
    ray_head,
    ray_log_processes,
    ray_worker,
    set_up_benchmark_process,
)
from benchmarks.remote_scenarios import NodeLoss
from benchmarks.report import Figure, Metric, Results, Server, format_value, markdown_table
from benchmarks.scenarios import (
    ON_WORKER,
    REQUEST_ERRORS,
    WORKER_RESOURCE,
    WORKER_RESOURCE_AMOUNT,
    BurstOfTrivialJobs,
    ConcurrentPosts,
    ConcurrentSleepers,
    ListAtScale,
    ListWithJobs,
    RunContext,
    Scenario,
    SequentialSubmit,
)
from tests.support.ray_nodes import RayNode

logger = logging.getLogger("benchmarks")

RESULTS_PATH = Path(__file__).with_name("results.md")
WARM_UP_TIMEOUT_S = 120.0
WARM_UP_POLL_INTERVAL_S = 0.1
LISTED_JOBS = 300
POST_WORKERS = 16
DEFAULT_LIST_AT_SCALE = 10_000
SCENARIO_GROUPS = ("jobs", "logs", "remote")
WORKER_NODE_CPUS = 2

METHOD_NOTES = [
    f"Both servers run on the same Ray head node ({RAY_NUM_CPUS} CPUs) and are driven by the "
    "same aiohttp client; each scenario runs against Ray's server, then ours (ours first where "
    "Ray's exiting workers would skew our memory baseline), and its jobs end before the next "
    "scenario starts; between the two, the run waits until the CPUs are idle.",
    "Sequential jobs are polled with GET /api/jobs/{id} every 5 ms. Many jobs at once are "
    "watched with GET /api/jobs/ (one request per poll: every 50 ms for the burst, every 10 ms "
    "for the concurrent `sleep 60` jobs and their stop); a job is timed when the first response "
    "showing the wanted status arrives.",
    "Memory per running job: (sum of PSS over every process on the machine but the benchmark's, "
    "with all jobs RUNNING) minus (the same sum just before submitting), divided by the jobs "
    "RUNNING; anything else running on the machine adds noise.",
    "Log tail latency: the job prints `tick <n> <time.time()>` every 50 ms (flushed); the client "
    "follows GET /api/jobs/{id}/logs/tail (websocket, connected right after the POST) and takes "
    "the wall-clock time a frame arrives minus the time printed in each line it completes.",
    "Submit → first log line: from sending the POST of `echo first; sleep 2` to the websocket "
    "frame that completes `first` (the tail is opened as soon as the POST answers; a 404 is "
    "retried every 10 ms). One job at a time.",
    "Large log: the job writes exactly N bytes of base64 text and ends; then each reader reads "
    "the whole log once. The JSON GET's log must be whole lines of the server's own (Ray writes "
    "a few before the job's output) followed by exactly the job's N bytes, and every other reader "
    "must return as many bytes; otherwise the row says error. Throughput is the log's bytes over "
    "the time from sending the request to the end of the body (for the websocket, to the "
    "server's close; Ray's tail waits for its 1 s poll to see the job ended). Peak RSS growth "
    "during the JSON GET: summed RSS of the server's processes sampled every 20 ms in a thread, "
    "from just before the request to the end of the body, peak minus first sample; ours is the "
    "jobs-server process and its children, Ray's is the dashboard process with its module "
    "subprocesses (the job module among them) plus the dashboard agent, which reads the file.",
    "Remote scenarios (`job on a worker node`, `--only remote`): a worker node joins the cluster "
    f"on {ON_WORKER.node_ip} ({WORKER_NODE_CPUS} CPUs, resource `{WORKER_RESOURCE}`, on the same "
    "machine; its Ray temp dir is the head's path, as `/tmp/ray` is on every machine of a real "
    "cluster: a node's dashboard agent looks for job logs under the head's session path); the "
    "tail latency and large log scenarios above run again with "
    f'`entrypoint_resources: {{"{WORKER_RESOURCE}": 1}}`, which only that node has, and where '
    "each job ran is checked in GET /api/jobs/{id} (`driver_info.node_ip_address`; Ray's server "
    "fills `driver_info` only for jobs that connect to Ray as a driver, so for Ray's the host of "
    "`driver_agent_http_address`); a note says if a job ran elsewhere. Ray's server serves such a "
    "log from the worker node's dashboard agent; ours pulls it into the head's log file while the "
    "job runs and serves it from there. Ray's peak RSS also counts the worker's dashboard agent.",
    "Submit → all of a large log readable: from sending the POST to the first status poll (GET "
    "/api/jobs/ every 100 ms) that shows the job ended, counted only if the JSON GET sent right "
    "after returns all N bytes.",
    "Lost worker node: a throwaway worker node (one per server, each with a resource only it has) "
    "runs a job that prints one line and sleeps; once GET /logs shows the line, the node's raylet "
    "gets SIGKILL. Then GET /api/jobs/ every 100 ms until the job is terminal (at most "
    "120 s; the row says FAILED's delay), then one GET /logs: whether it still holds the line, "
    "and the HTTP status. A note says if the job's process outlived the node.",
]


@dataclass(frozen=True)
class Sizes:
    """How many jobs and requests each scenario uses."""

    sequential_jobs: int
    burst_jobs: int
    sleeper_jobs: int
    concurrent_posts: int
    list_at_scale: int
    tail_lines: int
    first_line_jobs: int
    big_log_bytes: int

    def describe(self, only: str | None = None) -> str:
        """The sizes in words, for the report (those of one group's scenarios, or all)."""
        at_scale = f"{self.list_at_scale} jobs" if self.list_at_scale else "skipped"
        big_log = f"a {self.big_log_bytes / 2**20:.0f} MiB log"
        by_group = {
            "jobs": f"{self.sequential_jobs} sequential jobs, a burst of {self.burst_jobs}, "
            f"{self.sleeper_jobs} concurrent sleepers, {LISTED_JOBS} jobs listed, "
            f"{self.concurrent_posts} concurrent POSTs, large list: {at_scale}",
            "logs": f"{self.tail_lines} tailed log lines, {self.first_line_jobs} first-line jobs, "
            f"{big_log}",
            "remote": f"{self.tail_lines} tailed log lines and {big_log} on a worker node, "
            "a lost worker node per server",
        }
        return "; ".join(text for group, text in by_group.items() if only in (None, group))


def sizes_for(quick: bool, list_jobs: int) -> Sizes:
    """The full run's sizes, or the quick run's (which skips the large list)."""
    if quick:
        return Sizes(
            sequential_jobs=5,
            burst_jobs=20,
            sleeper_jobs=10,
            concurrent_posts=48,
            list_at_scale=0,
            tail_lines=20,
            first_line_jobs=3,
            big_log_bytes=20 * 2**20,
        )
    return Sizes(
        sequential_jobs=20,
        burst_jobs=100,
        sleeper_jobs=50,
        concurrent_posts=160,
        list_at_scale=list_jobs,
        tail_lines=60,
        first_line_jobs=5,
        big_log_bytes=100 * 2**20,
    )


def build_scenarios(sizes: Sizes, only: str | None = None) -> list[Scenario]:
    """The scenarios in the order they run (the large list last: it leaves a backlog behind),
    or only those of one group."""
    scenarios: list[Scenario] = [
        SequentialSubmit(sizes.sequential_jobs),
        BurstOfTrivialJobs(sizes.burst_jobs),
        ConcurrentSleepers(sizes.sleeper_jobs),
        ListWithJobs(LISTED_JOBS),
        ConcurrentPosts(sizes.concurrent_posts, POST_WORKERS),
        LogTailLatency(sizes.tail_lines),
        TimeToFirstLine(sizes.first_line_jobs),
        BigLog(sizes.big_log_bytes),
        LogTailLatency(sizes.tail_lines, ON_WORKER),
        BigLog(sizes.big_log_bytes, ON_WORKER),
        NodeLoss(),
    ]
    if sizes.list_at_scale > 0:
        scenarios.append(ListAtScale(sizes.list_at_scale, LISTED_JOBS))
    return [s for s in scenarios if only is None or s.group == only]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.run",
        description="Compare jobs-server with Ray's job server on one Ray cluster.",
    )
    parser.add_argument(
        "--quick", action="store_true", help="small sizes, no large list (a few minutes)"
    )
    parser.add_argument(
        "--only",
        choices=SCENARIO_GROUPS,
        help="run only the job, the log or the remote (job on a worker node) scenarios, and "
        "write benchmarks/results-<group>.md instead of results.md",
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


async def measure_all(
    scenarios: list[Scenario],
    urls: dict[Server, str],
    log_processes: dict[Server, Callable[[], list[psutil.Process]]],
    head: RayHead,
) -> Results:
    """Run every scenario against each of its servers, Ray's first."""
    results = Results()
    run_tag = uuid.uuid4().hex[:6]
    async with new_session() as session:
        apis = {server: JobsApi(session, url) for server, url in urls.items()}
        contexts = {
            server: RunContext(api, server, results, run_tag, log_processes[server], head)
            for server, api in apis.items()
        }
        for ctx in contexts.values():
            await warm_up(ctx)
        measured = still_busy = 0
        for number, scenario in enumerate(scenarios, start=1):
            for server in scenario.servers:
                ctx = contexts[server]
                results.record(server, await measure_one(number, scenario, ctx))
                measured += 1
                if not await settle():
                    still_busy += 1
    if still_busy:
        results.note(
            None,
            f"after {still_busy} of {measured} measurements the CPUs were still over "
            f"{SETTLE_CPU_PERCENT:.0f}% busy {SETTLE_TIMEOUT_S:.0f} s later: something else ran "
            f"on the machine (load average {os.getloadavg()[0]:.1f} at the end), which slows "
            "both servers",
        )
    return results


# Two cores: the next measurement waits until the last server's clean-up has stopped using them.
SETTLE_CPU_PERCENT = 25.0
SETTLE_TIMEOUT_S = 60.0


async def settle() -> bool:
    """Wait (bounded) until the machine's CPUs are mostly idle; False if they never were."""
    deadline_s = time.monotonic() + SETTLE_TIMEOUT_S
    while time.monotonic() < deadline_s:
        busy = await asyncio.to_thread(psutil.cpu_percent, 1.0)
        if busy < SETTLE_CPU_PERCENT:
            return True
    logger.info("    the machine is still busy after %.0f s; going on", SETTLE_TIMEOUT_S)
    return False


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
    metrics: list[Metric],
    results: Results,
    sizes: Sizes,
    started: datetime.datetime,
    only: str | None = None,
) -> str:
    """results.md: when, where and how it ran, the table, then the notes."""
    lines = [
        "# jobs-server vs Ray's job server",
        "",
        f"- date: {started.isoformat(timespec='seconds')}",
        f"- machine: {os.cpu_count()} cores",
        f"- command: `{shlex.join(sys.orig_argv)}` (from the repository root)",
        f"- Ray {importlib.metadata.version('ray')}; sizes: {sizes.describe(only)}",
        *([f"- only the {only} scenarios ran"] if only else []),
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


def worker_node(head: RayHead) -> contextlib.AbstractContextManager[RayNode]:
    """The worker node the remote scenarios' jobs run on: the only one with their resource."""
    return ray_worker(
        head,
        name="worker",
        ip=ON_WORKER.node_ip,
        resources={WORKER_RESOURCE: WORKER_RESOURCE_AMOUNT},
        num_cpus=WORKER_NODE_CPUS,
    )


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    set_up_benchmark_process()
    sizes = sizes_for(args.quick, args.list_jobs)
    scenarios = build_scenarios(sizes, args.only)
    started = datetime.datetime.now().astimezone()
    # Short path: Ray's session directory holds Unix sockets, whose paths are length-limited.
    work_dir = Path(tempfile.mkdtemp(prefix="jobs-bench-", dir="/tmp"))
    logger.info("work dir %s; sizes: %s", work_dir, sizes.describe(args.only))
    survivors: list[tuple[int, str]] = []
    try:
        with contextlib.ExitStack() as stack:
            head = stack.enter_context(ray_head(work_dir))
            ours = stack.enter_context(jobs_server(head.gcs_address, work_dir))
            workers: list[RayNode] = []
            if any(scenario.group == ON_WORKER.group for scenario in scenarios):
                workers.append(stack.enter_context(worker_node(head)))
            results = asyncio.run(
                measure_all(
                    scenarios,
                    {Server.RAY: head.dashboard_url, Server.OURS: ours.url},
                    {
                        Server.RAY: lambda: ray_log_processes(head, workers),
                        Server.OURS: lambda: our_log_processes(ours),
                    },
                    head,
                )
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
    metrics = [m for s in scenarios for m in s.metrics()]
    report = render(metrics, results, sizes, started, args.only)
    # A partial run does not replace the full run's table (which docs/performance.md quotes).
    results_path = RESULTS_PATH.with_name(f"results-{args.only}.md") if args.only else RESULTS_PATH
    results_path.write_text(report)
    sys.stdout.write(report)
    logger.info("written to %s", results_path)


if __name__ == "__main__":
    main()
