"""The jobs run below the control plane (`--jobs-nice`): the nice value of their processes and,
where the kernel has autogroups, of their scheduling group, the fork server's session. With real
processes (a fork server of this test process) and through a real server on Ray."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import ray
from aiohttp.test_utils import TestClient
from ray._private.ray_constants import RAY_WORKER_NICENESS

from jobs_server.app import create_app
from jobs_server.manager.supervisor.containment import Containment
from jobs_server.settings import DEFAULT_JOBS_NICE, Settings
from tests.support.api import job_logs, submit, wait_for_status
from tests.support.fork_servers import CONTAINMENTS, job_env, subreaper_fork_server

# What a job says of its priority: its nice value, then its scheduling group's line (empty
# where the kernel has no autogroups).
REPORT_PRIORITY = "nice; cat /proc/self/autogroup 2>/dev/null || true"


def _autogroups_on() -> bool:
    try:
        return Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip() == "1"
    except OSError:
        return False


def _check_report(report: str, nice: int, *, launched_at: int) -> None:
    """A job's processes are at least at `nice` (or at the value of the process that launched
    them, if higher: Ray starts its workers at 15), and its scheduling group at `nice`."""
    lines = report.splitlines()
    assert int(lines[0]) == max(nice, launched_at), report
    if _autogroups_on():
        assert lines[1].endswith(f" nice {nice}"), report


@pytest.mark.parametrize("containment", CONTAINMENTS)
@pytest.mark.parametrize("nice", [0, 7])
async def test_a_forked_job_runs_at_the_fork_servers_nice_value_and_autogroup(
    tmp_path: Path, containment: Containment, nice: int
) -> None:
    before = os.nice(0)
    async with subreaper_fork_server(nice=nice) as forks:
        log_path = tmp_path / "job.log"
        process = await forks.spawn(
            REPORT_PRIORITY, log_path=log_path, env=job_env("nice"), containment=containment
        )
        assert await asyncio.wait_for(process.wait(), 30) == 0
        _check_report(log_path.read_text(), nice, launched_at=os.nice(0))
    # The fork server lowered its own priority, never this process's (the supervisor's).
    assert os.nice(0) == before


async def test_the_servers_jobs_run_below_it_by_default(
    client: TestClient[Any, Any], settings: Settings
) -> None:
    """Through the whole chain: the server's setting, its supervisor actor, the fork server."""
    assert settings.jobs_nice == DEFAULT_JOBS_NICE > 0
    job_id = await submit(client, entrypoint=REPORT_PRIORITY)
    job = await wait_for_status(client, job_id)
    assert job["status"] == "SUCCEEDED", job
    # The supervisor is a Ray worker: at Ray's worker niceness (15 by default), or the
    # value RAY_worker_niceness gives the cluster.
    worker_niceness = int(os.environ.get(RAY_WORKER_NICENESS, "15"))
    _check_report(await job_logs(client, job_id), DEFAULT_JOBS_NICE, launched_at=worker_niceness)


async def test_a_restart_with_another_jobs_nice_runs_its_jobs_at_that_value(
    aiohttp_client: Callable[..., Awaitable[TestClient[Any, Any]]], settings: Settings
) -> None:
    """A shared supervisor keeps the value it was created with: a server started again with
    another value on the same cluster makes supervisors of its own and retires the idle
    ones of the server before (they used to take its jobs, at the old value)."""
    worker_niceness = int(os.environ.get(RAY_WORKER_NICENESS, "15"))
    reports = {}
    supervisors = {}
    for jobs_nice in (5, 7):
        client = await aiohttp_client(
            create_app(settings.model_copy(update={"jobs_nice": jobs_nice}))
        )
        try:
            job_id = await submit(client, entrypoint=REPORT_PRIORITY)
            job = await wait_for_status(client, job_id)
            assert job["status"] == "SUCCEEDED", job
            reports[jobs_nice] = await job_logs(client, job_id)
            supervisors[jobs_nice] = shared_supervisors(settings.namespace)
        finally:
            await client.close()
    _check_report(reports[5], 5, launched_at=worker_niceness)
    _check_report(reports[7], 7, launched_at=worker_niceness)
    assert supervisors[5]
    assert supervisors[7]
    assert not supervisors[5] & supervisors[7]  # the second made its own
    # ... and retired the first server's, idle (a killed actor leaves Ray's list soon after).
    for _ in range(300):
        if not supervisors[5] & shared_supervisors(settings.namespace):
            break
        await asyncio.sleep(0.1)
    assert not supervisors[5] & shared_supervisors(settings.namespace)


def shared_supervisors(namespace: str) -> set[str]:
    return {
        actor["name"]
        for actor in ray.util.list_named_actors(all_namespaces=True)
        if actor["namespace"] == namespace and "shared_supervisor" in actor["name"]
    }
