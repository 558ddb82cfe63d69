"""The CPU a supervisor spends per job (issue 15): N `true` jobs POSTed to a server with
`--max-running-jobs 50`, and the CPU time (user + system) of the shared supervisor and of every
process it started for them, per job.

    .venv/bin/python -m benchmarks.job_starts [--jobs 2000] [--in-flight 64]

The supervisor's figure is its own CPU time plus its children's: those it reaped (the kernel adds
them to its `children_*` times) and those still alive (a fork server, with the launchers it
reaped), printed with the part that is the supervisor's own. The server's and the GCS's CPU per
job are printed beside it. CPU time, not wall time: the machine may be shared. Prints a markdown
table; progress on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import tempfile
import time
import uuid
from pathlib import Path

import psutil

from benchmarks.client import JobsApi, new_session, submit_with_workers
from benchmarks.processes import (
    jobs_server,
    kill_survivors,
    ray_head,
    set_up_benchmark_process,
    supervisor_processes,
)
from benchmarks.queue import wait_until_all_ended

logger = logging.getLogger("benchmarks.job_starts")

WARM_UP_JOBS = 20
RUN_TIMEOUT_S = 900.0
GCS_NAME = "gcs_server"


def supervisor_process(head_pid: int) -> psutil.Process:
    """The one supervisor actor's process of the Ray head `head_pid` (a run of `true` jobs uses
    the shared one). Other Ray clusters may run on the machine: only the head's are looked at."""
    found = supervisor_processes(head_pid)
    assert len(found) == 1, f"expected one supervisor, found {len(found)}"
    return found[0]


def gcs_process(head_pid: int) -> psutil.Process:
    found = [
        process
        for process in psutil.Process(head_pid).children(recursive=True)
        if process.name() == GCS_NAME
    ]
    assert len(found) == 1, f"expected one GCS, found {len(found)}"
    return found[0]


def machine_busy_s() -> float:
    """The machine's CPU time on anything but idling (every process, the kernel, this client)."""
    times = psutil.cpu_times()
    return (
        sum(times)
        - times.idle
        - times.iowait
        - getattr(times, "steal", 0.0)
        - getattr(times, "guest", 0.0)
        - getattr(times, "guest_nice", 0.0)
    )


def own_cpu_s(process: psutil.Process) -> float:
    times = process.cpu_times()
    return float(times.user + times.system)


def cpu_s(process: psutil.Process, *, with_live_children: bool) -> float:
    """User + system CPU of `process` and of the children it reaped (and, if asked, of its live
    children and what they reaped)."""
    times = process.cpu_times()
    total = times.user + times.system + times.children_user + times.children_system
    if with_live_children:
        for child in process.children():
            with contextlib.suppress(psutil.NoSuchProcess):
                total += cpu_s(child, with_live_children=False)
    return total


async def run(jobs: int, in_flight: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="job-starts-") as work:
        work_dir = Path(work)
        marker = f"js{uuid.uuid4().hex[:8]}"
        try:
            with (
                ray_head(work_dir) as head,
                jobs_server(head.gcs_address, work_dir, ["--max-running-jobs", "50"]) as server,
            ):
                return await _measure(server.url, server.pid, head.pid, jobs, in_flight, marker)
        finally:
            kill_survivors(marker)


async def _measure(
    url: str, server_pid: int, head_pid: int, jobs: int, in_flight: int, marker: str
) -> dict[str, float]:
    async with new_session(max_connections=in_flight + 8) as session:
        api = JobsApi(session, url)
        warm = [f"{marker}-warm-{n}" for n in range(WARM_UP_JOBS)]
        await submit_with_workers(api, "true", warm, 8, time.monotonic() + 120)
        await wait_until_all_ended(api, time.monotonic() + 120)
        supervisor, server = supervisor_process(head_pid), psutil.Process(server_pid)
        gcs = gcs_process(head_pid)
        logger.info("supervisor pid %d (for a profiler)", supervisor.pid)
        supervisor_before = cpu_s(supervisor, with_live_children=True)
        own_before = own_cpu_s(supervisor)
        server_before = cpu_s(server, with_live_children=False)
        gcs_before = own_cpu_s(gcs)
        machine_before = machine_busy_s()
        started_s = time.monotonic()
        ids = [f"{marker}-{n:05d}" for n in range(jobs)]
        _, errors = await submit_with_workers(
            api, "true", ids, in_flight, started_s + RUN_TIMEOUT_S
        )
        await wait_until_all_ended(api, started_s + RUN_TIMEOUT_S)
        wall_s = time.monotonic() - started_s
        supervisor_after = cpu_s(supervisor, with_live_children=True)
        own_after = own_cpu_s(supervisor)
        server_after = cpu_s(server, with_live_children=False)
        gcs_after = own_cpu_s(gcs)
        machine_after = machine_busy_s()
        statuses = await api.list_statuses()
    succeeded = sum(1 for job_id in ids if statuses.get(job_id) == "SUCCEEDED")
    return {
        "jobs": jobs,
        "succeeded": succeeded,
        "post_errors": len(errors),
        "supervisor_ms_per_job": (supervisor_after - supervisor_before) / jobs * 1000,
        "supervisor_own_ms_per_job": (own_after - own_before) / jobs * 1000,
        "server_ms_per_job": (server_after - server_before) / jobs * 1000,
        "gcs_ms_per_job": (gcs_after - gcs_before) / jobs * 1000,
        "machine_ms_per_job": (machine_after - machine_before) / jobs * 1000,
        "completed_per_s": succeeded / wall_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=2000)
    parser.add_argument("--in-flight", type=int, default=64)
    args = parser.parse_args()
    set_up_benchmark_process()
    figures = asyncio.run(run(args.jobs, args.in_flight))
    print(
        "| jobs | succeeded | supervisor + children CPU ms/job (its own) | server CPU ms/job "
        "| GCS CPU ms/job | machine CPU ms/job | jobs/s |"
    )
    print("|---|---|---|---|---|---|---|")
    print(
        f"| {figures['jobs']:.0f} | {figures['succeeded']:.0f} "
        f"| {figures['supervisor_ms_per_job']:.2f} ({figures['supervisor_own_ms_per_job']:.2f}) "
        f"| {figures['server_ms_per_job']:.2f} | {figures['gcs_ms_per_job']:.2f} "
        f"| {figures['machine_ms_per_job']:.2f} "
        f"| {figures['completed_per_s']:.0f} |"
    )


if __name__ == "__main__":
    main()
