"""Many followers of one running job: what a silent job costs the server, and how late a new line
reaches every follower.

Ours: FOLLOWERS Server-Sent Events log followers (`/logs/stream`) plus EVENT_SUBSCRIBERS
`/api/events` subscribers. Ray's: the same number of followers on its websocket tail
(`/api/jobs/{id}/logs/tail`, what `ray job logs --follow` uses); Ray has no event stream. Both
servers run on one Ray head node, in one run, so the ratios compare like with like.

    PYTHONPATH=$PWD RAY_AUTH_MODE=disabled .venv/bin/python -m benchmarks.followers [--followers N]

The job prints `ready`, waits (silent) for a flag file, then prints LINES timestamped lines
LINE_INTERVAL_S apart. The server's CPU (its whole process tree, Ray's: the dashboard and its
agent) is measured over SILENT_WINDOW_S while every follower is connected and the job is silent.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import resource
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import psutil

from benchmarks.client import JobsApi, new_session
from benchmarks.log_readers import connect_tail, logs_path
from benchmarks.log_scenarios import TICK_PREFIX, TickLatencies, python_entrypoint
from benchmarks.processes import (
    jobs_server,
    our_log_processes,
    ray_head,
    ray_log_processes,
)
from benchmarks.stats import percentile

logger = logging.getLogger(__name__)

FOLLOWERS = 1000
EVENT_SUBSCRIBERS = 100
LINES = 20
LINE_INTERVAL_S = 0.5
SILENT_WINDOW_S = 10.0
CONNECT_TIMEOUT_S = 90.0
END_TIMEOUT_S = 120.0
# Opened this many at a time: a thousand at once only measures the accept queue.
CONNECT_BATCH = 50

JOB_SCRIPT = (
    "import os, sys, time\n"
    "print('ready', flush=True)\n"
    "while not os.path.exists(sys.argv[1]):\n"
    "    time.sleep(0.05)\n"
    "for n in range({lines}):\n"
    "    print(f'" + TICK_PREFIX + "{{n}} {{time.time():.6f}}', flush=True)\n"
    "    time.sleep({interval_s})\n"
)


@dataclass
class Result:
    server: str
    followers: int
    connected: int
    silent_cpu_percent: float
    latencies_s: list[float]
    event_subscribers: int = 0
    load_average: float = 0.0
    """The machine's 1-minute load average at the end: other work competing for its cores."""

    @property
    def p50_s(self) -> float:
        return percentile(self.latencies_s, 50) if self.latencies_s else float("nan")

    @property
    def p99_s(self) -> float:
        return percentile(self.latencies_s, 99) if self.latencies_s else float("nan")


def cpu_seconds(processes: Sequence[psutil.Process]) -> float:
    total = 0.0
    for process in processes:
        with contextlib.suppress(psutil.Error):
            times = process.cpu_times()
            total += times.user + times.system
    return total


async def follow_sse(
    api: JobsApi, submission_id: str, ready: asyncio.Event, latencies: TickLatencies
) -> None:
    """Our SSE log stream: feed each event's text, timestamped when it arrives."""
    async with api.session.get(
        api.url(logs_path(submission_id, "/stream")), timeout=aiohttp.ClientTimeout(total=None)
    ) as response:
        response.raise_for_status()
        buffer = b""
        async for chunk in response.content.iter_any():
            received = time.time()
            buffer += chunk.replace(b"\r", b"")  # aiohttp-sse ends lines with CRLF; data is JSON
            *events, buffer = buffer.split(b"\n\n")
            for event in events:
                for line in event.split(b"\n"):
                    if line.startswith(b"data: "):
                        text = json.loads(line[6:])
                        if isinstance(text, str):
                            if "ready" in text:
                                ready.set()
                            latencies.feed(text, received)
                    elif line.startswith(b"event: end"):
                        return


async def follow_websocket(
    api: JobsApi, submission_id: str, ready: asyncio.Event, latencies: TickLatencies
) -> None:
    """Ray's websocket tail (as `ray job logs --follow`)."""
    websocket = await connect_tail(api, submission_id, timeout_s=CONNECT_TIMEOUT_S)
    async with websocket:
        async for message in websocket:
            if message.type is not aiohttp.WSMsgType.TEXT:
                break
            received = time.time()
            if "ready" in message.data:
                ready.set()
            latencies.feed(message.data, received)


async def subscribe_events(api: JobsApi, connected: asyncio.Event, stop: asyncio.Event) -> None:
    async with api.session.get(
        api.url("/api/events?format=ndjson"), timeout=aiohttp.ClientTimeout(total=None)
    ) as response:
        response.raise_for_status()
        connected.set()
        async for _ in response.content.iter_any():
            if stop.is_set():
                break


async def measure(
    name: str,
    base_url: str,
    processes: Sequence[psutil.Process],
    followers: int,
    *,
    websocket: bool,
    event_subscribers: int,
    work_dir: Path,
) -> Result:
    flag = work_dir / f"go-{uuid.uuid4().hex[:8]}"
    script = JOB_SCRIPT.format(lines=LINES, interval_s=LINE_INTERVAL_S)
    async with new_session(max_connections=followers + event_subscribers + 16) as session:
        api = JobsApi(session, base_url)
        job = await api.submit(
            python_entrypoint(script, str(flag)), f"followers-{uuid.uuid4().hex[:8]}"
        )
        follow = follow_websocket if websocket else follow_sse
        readies = [asyncio.Event() for _ in range(followers)]
        latencies = [TickLatencies() for _ in range(followers)]
        tasks: list[asyncio.Task[None]] = []
        for start in range(0, followers, CONNECT_BATCH):
            for index in range(start, min(followers, start + CONNECT_BATCH)):
                tasks.append(
                    asyncio.create_task(
                        follow(api, job.submission_id, readies[index], latencies[index])
                    )
                )
            await asyncio.sleep(0.05)
        stop_events = asyncio.Event()
        subscribed = [asyncio.Event() for _ in range(event_subscribers)]
        subscriber_tasks = [
            asyncio.create_task(subscribe_events(api, subscribed[index], stop_events))
            for index in range(event_subscribers)
        ]
        deadline = time.monotonic() + CONNECT_TIMEOUT_S
        while time.monotonic() < deadline:
            subscribers_settled = all(
                s.is_set() or task.done()
                for s, task in zip(subscribed, subscriber_tasks, strict=True)
            )
            if all(ready.is_set() for ready in readies) and subscribers_settled:
                break
            await asyncio.sleep(0.2)
        for task in tasks + subscriber_tasks:
            if task.done() and task.exception() is not None:
                logger.warning("%s: a client failed: %r", name, task.exception())
                break
        connected = sum(ready.is_set() for ready in readies)
        subscribers = sum(s.is_set() for s in subscribed)
        logger.info(
            "%s: %d/%d followers, %d/%d event subscribers connected",
            name,
            connected,
            followers,
            subscribers,
            event_subscribers,
        )
        await asyncio.sleep(1.0)  # let the connecting settle
        before, started = cpu_seconds(processes), time.monotonic()
        await asyncio.sleep(SILENT_WINDOW_S)
        silent_cpu = (cpu_seconds(processes) - before) / (time.monotonic() - started) * 100
        flag.touch()
        _, pending = await asyncio.wait(tasks, timeout=LINES * LINE_INTERVAL_S + END_TIMEOUT_S)
        for task in pending:
            task.cancel()
        stop_events.set()
        for task in subscriber_tasks:
            task.cancel()
        await asyncio.gather(*tasks, *subscriber_tasks, return_exceptions=True)
    all_latencies = [value for each in latencies for value in each.latencies_s]
    return Result(
        name, followers, connected, silent_cpu, all_latencies, subscribers, os.getloadavg()[0]
    )


def report(ours: Result, ray: Result) -> str:
    def ratio(a: float, b: float) -> str:
        return f"{a / b:.2g}" if b > 0 else "n/a"  # two significant digits: 0.0033, not 0.00

    rows = [
        "| | jobs-server (SSE) | Ray (websocket tail) | ours / Ray's |",
        "|---|---|---|---|",
        f"| followers connected | {ours.connected}/{ours.followers} "
        f"(+{ours.event_subscribers} /api/events) | {ray.connected}/{ray.followers} | |",
        f"| server CPU, job silent (% of a core) | {ours.silent_cpu_percent:.1f} "
        f"| {ray.silent_cpu_percent:.1f} "
        f"| {ratio(ours.silent_cpu_percent, ray.silent_cpu_percent)} |",
        f"| new line → every follower, p50 | {ours.p50_s * 1000:.0f} ms "
        f"| {ray.p50_s * 1000:.0f} ms | {ratio(ours.p50_s, ray.p50_s)} |",
        f"| new line → every follower, p99 | {ours.p99_s * 1000:.0f} ms "
        f"| {ray.p99_s * 1000:.0f} ms | {ratio(ours.p99_s, ray.p99_s)} |",
        f"| lines received | {len(ours.latencies_s)}/{ours.followers * LINES} "
        f"| {len(ray.latencies_s)}/{ray.followers * LINES} | |",
        f"| machine load average (1 min, {os.cpu_count()} cores) | {ours.load_average:.1f} "
        f"| {ray.load_average:.1f} | |",
    ]
    return "\n".join(rows)


async def main(followers: int, event_subscribers: int, *, only_ours: bool = False) -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # children inherit it
    with tempfile.TemporaryDirectory(prefix="bench-followers-") as tmp:
        work_dir = Path(tmp)
        with ray_head(work_dir) as head, jobs_server(head.gcs_address, work_dir) as server:
            ours_processes = our_log_processes(server)
            ours = await measure(
                "jobs-server",
                server.url,
                ours_processes,
                followers,
                websocket=False,
                event_subscribers=event_subscribers,
                work_dir=work_dir,
            )
            if only_ours:
                print(report(ours, Result("Ray", 0, 0, 0.0, [])))
                return
            ray = await measure(
                "Ray",
                head.dashboard_url,
                ray_log_processes(head, []),
                followers,
                websocket=True,
                event_subscribers=0,
                work_dir=work_dir,
            )
    print(report(ours, ray))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--followers", type=int, default=FOLLOWERS)
    parser.add_argument("--event-subscribers", type=int, default=EVENT_SUBSCRIBERS)
    parser.add_argument("--only-ours", action="store_true", help="skip Ray's server (tuning)")
    arguments = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    asyncio.run(
        main(arguments.followers, arguments.event_subscribers, only_ours=arguments.only_ours)
    )
