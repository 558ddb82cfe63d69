"""Every job within its limits, every job accounted (issue 35): the kernel ends a job past its
memory limit as JOB_OUT_OF_MEMORY and nothing else, contains a fork bomb, holds a busy loop to
its CPU share; each attempt reports its peak memory and CPU time; and no job cgroup outlives a
supervisor or a server killed -9. Real Ray, a real server, real processes, real cgroups.

The module's servers run their jobs under a jobs cgroup of the module's own (`--jobs-cgroup`),
so the tests see exactly their own cgroups (tests/support/job_cgroups.py), and the module
removes that tree at its end.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import secrets
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import requests

from jobs_server.settings import Settings
from tests.support.api import TERMINAL_STATUSES, Client, job_logs, submit
from tests.support.job_cgroups import JobsCgroups, supervisor_lives
from tests.support.processes import poll_until, wait_until
from tests.support.restarts import JOB_TIMEOUT_S, embedded_server

pytestmark = [pytest.mark.ray, pytest.mark.slow]

MIB = 1 << 20
POLL_S = 0.1
# From the submit to the end of a job the kernel kills for its memory ("within seconds"; the
# rest is its start on a loaded machine).
OUT_OF_MEMORY_TIMEOUT_S = 30
# How long a job's cgroups may outlive its end, or a dead supervisor's its recovery.
CGROUP_GONE_TIMEOUT_S = 30
MAX_PROCESSES = 50
# A fork loop stops here if nothing stops it first: far past the limit, and harmless to the
# machine when no limit holds (as before the supervisor enforced one).
FORK_CAP = 200
CPU_CORES = 0.5
BUSY_S = 5
# cpuacct's counters and the period boundaries: a little over the quota is measurement.
CPU_SLACK_S = 0.3


@pytest.fixture(scope="module")
def job_cgroups() -> Iterator[JobsCgroups]:
    """A jobs cgroup of this module's own; removed (children first) when the module ends."""
    cgroups = JobsCgroups(f"jobs-server-test-{secrets.token_hex(4)}")
    yield cgroups
    left = cgroups.remove()
    assert left == [], f"the module's cgroups would not go: {left}"


@pytest.fixture
def settings(settings: Settings, job_cgroups: JobsCgroups) -> Settings:
    """The session's test settings, with the module's jobs cgroup."""
    return settings.model_copy(update={"jobs_cgroup": job_cgroups.name})


async def limits_support(client: Client) -> str:
    """`GET /api/version`'s `limits`: cgroup2, cgroup1 or none."""
    response = await client.get("/api/version")
    assert response.status == 200, await response.text()
    return str((await response.json())["limits"])


@pytest.fixture
async def enforcing(client: Client) -> str:
    """The server's `limits`, for a test of enforcement: skipped where the host has none."""
    support = await limits_support(client)
    if support == "none":
        pytest.skip("GET /api/version says limits: none (no writable cgroup tree): not enforced")
    return support


def python_job(tmp_path: Path, name: str, source: str) -> str:
    """An entrypoint running `source` with this interpreter (the same binary in every job, so
    the jobs' interpreters weigh the same)."""
    script = tmp_path / f"{name}.py"
    script.write_text(source)
    return f"{sys.executable} {script}"


async def assert_healthy(client: Client) -> None:
    response = await client.get("/api/healthz")
    assert response.status == 200, await response.text()


async def job_details(client: Client, job_id: str) -> dict[str, Any]:
    response = await client.get(f"/api/jobs/{job_id}")
    assert response.status == 200, await response.text()
    return dict(await response.json())


async def wait_while_healthy(
    client: Client,
    job_id: str,
    statuses: set[str] = TERMINAL_STATUSES,
    timeout_s: float = JOB_TIMEOUT_S,
) -> dict[str, Any]:
    """Poll the job until its status is one of `statuses`; the server answers its probe 200 at
    every poll."""
    deadline = time.monotonic() + timeout_s
    while True:
        await assert_healthy(client)
        job = await job_details(client, job_id)
        if job["status"] in statuses:
            return job
        assert time.monotonic() < deadline, f"job {job_id} still {job['status']}: {job}"
        await asyncio.sleep(POLL_S)


def names_the_limit(message: str, limit_bytes: int) -> bool:
    """Whether a message names a memory limit: in bytes, or in MiB."""
    mib = limit_bytes // MIB
    return str(limit_bytes) in message or re.search(rf"\b{mib}(\.0+)? ?MiB\b", message) is not None


async def test_a_job_past_its_memory_limit_ends_out_of_memory_and_nothing_else_is_touched(
    client: Client, enforcing: str, job_cgroups: JobsCgroups, tmp_path: Path
) -> None:
    go = tmp_path / "go"
    sleeper = await submit(
        client, entrypoint=f"echo up; while [ ! -e {go} ]; do sleep 0.05; done; echo done"
    )
    running = await wait_while_healthy(client, sleeper, {"RUNNING"})
    sleeper_process = psutil.Process(int(running["driver_info"]["pid"]))
    supervisor = sleeper_process.parent()
    assert supervisor is not None

    limit = 100 * MIB
    # bytes * n writes every byte: each page is touched, so each is charged.
    hog = await submit(
        client,
        entrypoint=python_job(tmp_path, "hog", 'data = b"x" * (300 << 20)\n'),
        limits={"memory_bytes": limit},
    )
    job = await wait_while_healthy(client, hog, timeout_s=OUT_OF_MEMORY_TIMEOUT_S)
    assert (job["status"], job["error_type"]) == ("FAILED", "JOB_OUT_OF_MEMORY"), job
    assert names_the_limit(job["message"], limit), job["message"]
    assert job["limits"] == {"memory_bytes": limit, "cpu_cores": None, "max_processes": None}
    peak = job["attempts"][-1]["peak_memory_bytes"]
    assert peak is not None, job["attempts"]
    assert peak <= limit * 1.05, job["attempts"]
    assert job["peak_memory_bytes"] == peak

    # The other job on the same supervisor runs on untouched, in its own attempt cgroup.
    assert (await job_details(client, sleeper))["status"] == "RUNNING"
    assert sleeper_process.is_running()
    assert supervisor.is_running()
    attempt = job_cgroups.attempt_of(sleeper_process.pid, enforcing)
    assert attempt.supervisor_pid == supervisor.pid
    go.touch()
    done = await wait_while_healthy(client, sleeper)
    assert done["status"] == "SUCCEEDED", done
    assert await job_logs(client, sleeper) == "up\ndone\n"
    assert supervisor.is_running()


FORK_LOOP = f"""\
import os, time
forked = 0
while forked < {FORK_CAP}:
    try:
        pid = os.fork()
    except OSError:  # EAGAIN: the kernel refuses a process past the limit
        break
    if pid == 0:
        try:
            os.execvp("sleep", ["sleep", "1000"])
        finally:
            os._exit(127)
    forked += 1
print("forked", forked, flush=True)
time.sleep(1000)
"""


async def test_a_fork_bomb_is_contained_by_its_process_limit(
    client: Client, enforcing: str, job_cgroups: JobsCgroups, tmp_path: Path
) -> None:
    job_id = await submit(
        client,
        entrypoint=python_job(tmp_path, "forks", FORK_LOOP),
        limits={"max_processes": MAX_PROCESSES},
    )
    running = await wait_while_healthy(client, job_id, {"RUNNING"})
    first = psutil.Process(int(running["driver_info"]["pid"]))
    most = 0
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while "forked" not in (logs := await job_logs(client, job_id)):
        assert time.monotonic() < deadline, f"the fork loop never reported: {logs!r}"
        with contextlib.suppress(psutil.Error):
            most = max(most, 1 + len(first.children(recursive=True)))
        await assert_healthy(client)
        await asyncio.sleep(POLL_S)
    forked = int(logs.split()[-1])
    assert forked < MAX_PROCESSES, (
        f"the job forked {forked} processes under max_processes {MAX_PROCESSES}: not enforced"
    )
    most = max(most, 1 + len(first.children(recursive=True)))
    assert most <= MAX_PROCESSES

    attempt = job_cgroups.attempt_of(first.pid, enforcing)
    assert attempt.read("pids", "pids.max") == str(MAX_PROCESSES)
    assert int(attempt.read("pids", "pids.current")) <= MAX_PROCESSES
    # Every process of the job is in it: the first, the interpreter and what it forked.
    assert forked + 2 <= len(attempt.processes()) <= MAX_PROCESSES
    await assert_healthy(client)

    response = await client.post(f"/api/jobs/{job_id}/stop")
    assert await response.json() == {"stopped": True}
    assert (await wait_while_healthy(client, job_id))["status"] == "STOPPED"
    await poll_until(lambda: not attempt.exists(), CGROUP_GONE_TIMEOUT_S, "its cgroup's removal")


async def test_a_busy_loop_under_half_a_core_uses_at_most_its_share_and_is_throttled(
    client: Client, enforcing: str
) -> None:
    job_id = await submit(
        client,
        # timeout's 124 is the loop's expected end.
        entrypoint=f"timeout {BUSY_S} sh -c 'while :; do :; done'; [ $? -eq 124 ]",
        limits={"cpu_cores": CPU_CORES},
    )
    job = await wait_while_healthy(client, job_id)
    assert job["status"] == "SUCCEEDED", job
    assert job["limits"] == {"memory_bytes": None, "cpu_cores": CPU_CORES, "max_processes": None}
    attempt = job["attempts"][-1]
    measured = (attempt["cpu_user_s"], attempt["cpu_system_s"], attempt["cpu_throttled_s"])
    assert None not in measured, f"CPU not accounted: {attempt}"
    used = attempt["cpu_user_s"] + attempt["cpu_system_s"]
    # The bound: at most 0.6 of a core over the loop's time.
    assert used <= 0.6 * BUSY_S + CPU_SLACK_S, attempt
    assert attempt["cpu_throttled_s"] > 0, attempt


TOUCHED_BYTES = 200 * MIB
TOUCH = f'import time\ndata = b"x" * {TOUCHED_BYTES}\ntime.sleep(0.5)\n'
# One second of CPU time of its own, however loaded the machine is.
BUSY_ONE_S = (
    "import time\nend = time.process_time() + 1\nwhile time.process_time() < end:\n  pass\n"
)


async def test_every_attempt_reports_its_peak_memory_and_cpu_time(
    client: Client, tmp_path: Path
) -> None:
    """With or without limits, with or without cgroups."""
    jobs = {
        "baseline": await submit(
            client, entrypoint=python_job(tmp_path, "baseline", "import time\ntime.sleep(0.5)\n")
        ),
        "touch": await submit(client, entrypoint=python_job(tmp_path, "touch", TOUCH)),
        "touch-limited": await submit(
            client,
            entrypoint=python_job(tmp_path, "touch-limited", TOUCH),
            limits={"memory_bytes": 512 * MIB},
        ),
        "busy": await submit(client, entrypoint=python_job(tmp_path, "busy", BUSY_ONE_S)),
    }
    ended = {name: await wait_while_healthy(client, job_id) for name, job_id in jobs.items()}
    for name, job in ended.items():
        assert job["status"] == "SUCCEEDED", (name, job)
        attempt = job["attempts"][-1]
        measured = {
            field: attempt[field] for field in ("peak_memory_bytes", "cpu_user_s", "cpu_system_s")
        }
        assert None not in measured.values(), f"{name}: not accounted: {attempt}"
        # The job itself carries its last attempt's.
        assert {field: job[field] for field in measured} == measured, (name, job)
    assert ended["touch"]["limits"] is None
    assert ended["touch-limited"]["limits"]["memory_bytes"] == 512 * MIB

    baseline = ended["baseline"]["peak_memory_bytes"]
    for name in ("touch", "touch-limited"):
        peak = ended[name]["peak_memory_bytes"]
        # Within 10 % of what it touched, beside what the interpreter itself takes.
        assert TOUCHED_BYTES <= peak <= TOUCHED_BYTES * 1.1 + baseline, (name, peak, baseline)
    busy = ended["busy"]["attempts"][-1]
    assert busy["cpu_user_s"] + busy["cpu_system_s"] >= 0.9, busy


async def test_no_cgroup_of_a_job_is_left_after_its_supervisor_is_killed_9(
    client: Client, enforcing: str, job_cgroups: JobsCgroups
) -> None:
    job_id = await submit(
        client,
        entrypoint="echo up; sleep 1000",
        limits={"memory_bytes": 256 * MIB, "max_processes": MAX_PROCESSES},
    )
    running = await wait_while_healthy(client, job_id, {"RUNNING"})
    first = psutil.Process(int(running["driver_info"]["pid"]))
    attempt = job_cgroups.attempt_of(first.pid, enforcing)
    # The directory names the supervisor the job runs under: its ancestor.
    assert attempt.supervisor_pid in [parent.pid for parent in first.parents()]
    os.kill(attempt.supervisor_pid, signal.SIGKILL)

    job = await wait_while_healthy(client, job_id)
    assert (job["status"], job["error_type"]) == ("FAILED", "JOB_SUPERVISOR_ACTOR_DIED"), job

    def all_gone() -> bool:
        supervisors = job_cgroups.supervisor_dirs(enforcing).values()
        return not attempt.exists() and not any(attempt.supervisor_dir in s for s in supervisors)

    await poll_until(all_gone, CGROUP_GONE_TIMEOUT_S, "the killed supervisor's cgroups to go")
    await poll_until(lambda: not first.is_running(), CGROUP_GONE_TIMEOUT_S, "the job's end")
    await assert_healthy(client)


def test_no_cgroup_of_a_dead_supervisor_is_left_after_an_embedded_server_is_killed_9(
    tmp_path: Path, ray_tmpdir: Path, job_cgroups: JobsCgroups
) -> None:
    server = embedded_server(tmp_path, ray_tmpdir, "--jobs-cgroup", job_cgroups.name)
    server.start()
    try:
        version = requests.get(f"{server.url}/api/version", timeout=30)
        support = str(version.json()["limits"])
        if support == "none":
            pytest.skip("GET /api/version says limits: none (no writable cgroup tree)")
        job_id = server.submit(
            entrypoint="echo up; sleep 1000",
            limits={"memory_bytes": 256 * MIB, "max_processes": MAX_PROCESSES},
        )
        running = server.wait_status(job_id, "RUNNING")
        first = psutil.Process(int(running["driver_info"]["pid"]))
        attempt = job_cgroups.attempt_of(first.pid, support)

        server.kill()  # its embedded Ray, and the supervisor in it, die with it
        wait_until(
            lambda: not supervisor_lives(attempt.supervisor_dir),
            CGROUP_GONE_TIMEOUT_S,
            "the supervisor's death with its Ray",
        )
        server.start()  # the same state dir, the same --jobs-cgroup
        left: dict[str, list[str]] = {}

        def none_left() -> bool:
            left.clear()
            left.update(job_cgroups.dead_supervisor_dirs(support))
            return left == {} and not attempt.exists()

        with contextlib.suppress(AssertionError):
            wait_until(none_left, CGROUP_GONE_TIMEOUT_S, "the dead supervisors' cgroups to go")
        assert (left, attempt.exists()) == ({}, False), "cgroups of dead supervisors are left"
        wait_until(lambda: not first.is_running(), CGROUP_GONE_TIMEOUT_S, "the job's end")
        assert server.wait_status(job_id, "FAILED")["status"] == "FAILED"
    finally:
        server.stop()
