"""A stop ends all of a job at once, and a ceiling bounds its grace period (real Ray and processes).

A shell that sees its child die before it gets the signal itself runs its next command; a
grace period of 1e9 s would make a job that ignores SIGTERM unkillable.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from jobs_server.manager.supervisor.containment import Containment
from jobs_server.manager.supervisor.early_stop import EarlyStop
from jobs_server.manager.supervisor.job_run import SUBMISSION_ID_ENV_VAR
from jobs_server.manager.supervisor.process import (
    find_job_processes,
    kill_job_processes,
    signal_job_processes,
    start_entrypoint,
)
from jobs_server.settings import Settings
from tests.support.api import Client, job_logs, submit, wait_for_log, wait_for_status
from tests.support.commands import ESCAPED_SHELLS, MANY_THEN_FINISHES

STOPPED_JOBS = 100
NEVER_FINISHES = "sleep 60; echo finished"
IGNORES_SIGTERM = "trap '' TERM; echo ready; sleep 1000"
# Stopped at once, it writes nothing; stopped later, "a" at most: "b" means it ran on.
SLEEPY = "echo a; sleep 1; echo b"
STOP_RACES = 120
STOP_RACE_BATCH = 40
# What a job that ran on after its stop needs to show it: the rest of its sleep, and more.
SURVIVOR_SHOWS_S = 1.5


def job_processes(job_id: str) -> list[int]:
    """The live processes of the job, on the whole node: each carries its submission id in
    its environment (the launcher of its PID namespace too)."""
    marker = f"{SUBMISSION_ID_ENV_VAR}={job_id}".encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as environ:
                if marker not in environ.read().split(b"\0"):
                    continue
            with open(f"/proc/{name}/stat", "rb") as stat:
                if stat.read().rpartition(b")")[2].split()[0] == b"Z":
                    continue  # ended, not yet reaped
        except (OSError, IndexError):
            continue
        found.append(int(name))
    return found


async def _stop_right_after_submit(client: Client, index: int) -> dict[str, Any]:
    job_id = await submit(client, entrypoint=SLEEPY)
    # Spread over the command's start: before it, while the launcher starts it, while the
    # supervisor writes RUNNING, and after.
    await asyncio.sleep((index % 20) * 0.015)
    response = await client.post(f"/api/jobs/{job_id}/stop")
    assert response.status == 200, await response.text()
    job = await wait_for_status(client, job_id, timeout_s=120, poll_s=0.01)
    # The stop has answered and the job has ended: nothing of it may run now.
    return {"id": job_id, "job": job, "alive_after_stop": job_processes(job_id)}


async def test_nothing_of_a_job_stopped_right_after_submit_runs_after_the_stop(
    client: Client,
) -> None:
    """A stop that meets the command as it starts (the server read PENDING, the supervisor
    has started it and not yet written RUNNING): once the stop has answered and the job is
    STOPPED, none of its processes is alive, it never writes again, and "stopped before it
    started" is said only of a job that wrote nothing."""
    results: list[dict[str, Any]] = []
    for batch in range(STOP_RACES // STOP_RACE_BATCH):
        results += await asyncio.gather(
            *(
                _stop_right_after_submit(client, batch * STOP_RACE_BATCH + index)
                for index in range(STOP_RACE_BATCH)
            )
        )
    await asyncio.sleep(SURVIVOR_SHOWS_S)
    wrong = []
    for result in results:
        job, log = result["job"], await job_logs(client, result["id"])
        result["log"] = log
        if (
            job["status"] not in {"STOPPED", "SUCCEEDED"}
            or (job["status"] == "STOPPED" and ("b" in log or result["alive_after_stop"]))
            or ("before it started" in job["message"] and log)
            or job_processes(result["id"])
        ):
            wrong.append((result["id"], job["status"], job["message"], log, result))
    statuses = sorted(result["job"]["status"] for result in results)
    assert not wrong, f"{len(wrong)} of {len(results)} wrong ({statuses}): {wrong[:5]}"


async def test_a_stop_that_comes_once_the_command_has_ended_leaves_it_succeeded(
    client: Client,
) -> None:
    """The command (the shell) has ended, but its namespace's init has not reaped it yet (on a
    busy node that takes a while; here the init is held with SIGSTOP). A stop that comes then
    finds the job ended on its own: SUCCEEDED, not STOPPED with all of its output (CI, 1 of 120
    in the test above). A launcher held the same way, where one waits for the init, is
    tests/test_fork_server.py's."""
    if os.geteuid() != 0:
        pytest.skip("a PID namespace needs CAP_SYS_ADMIN")
    job_id = await submit(client, entrypoint="echo a; sleep 0.5; echo b")
    deadline = time.monotonic() + 60
    while not (shells := [p for p in job_processes(job_id) if _name(p) == "sh"]):
        assert time.monotonic() < deadline, "the job's shell never ran"
        await asyncio.sleep(0.01)
    shell = psutil.Process(shells[0])
    init = shell.parent()
    init.suspend()
    try:
        await wait_for_log(client, job_id, "a\nb\n")
        await _wait_until_ended(shell, "the job's command")
        response = await client.post(f"/api/jobs/{job_id}/stop")
        assert response.status == 200, await response.text()
    finally:
        init.resume()
    job = await wait_for_status(client, job_id)
    assert (job["status"], job["driver_exit_code"]) == ("SUCCEEDED", 0), job


async def _wait_until_ended(process: psutil.Process, what: str, timeout_s: float = 30) -> None:
    """Until `process` has exited (a zombie not yet reaped, or gone)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if process.status() == psutil.STATUS_ZOMBIE:
                return
        except psutil.NoSuchProcess:
            return
        assert time.monotonic() < deadline, f"{what} never ended"
        await asyncio.sleep(0.01)


def _name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as comm:
            return comm.read().strip()
    except OSError:
        return ""


async def test_a_stopped_shell_runs_no_further_command(client: Client) -> None:
    job_ids = await asyncio.gather(
        *(submit(client, entrypoint=MANY_THEN_FINISHES) for _ in range(STOPPED_JOBS))
    )
    for job_id in job_ids:
        await wait_for_status(client, job_id, {"RUNNING"})
    stops = await asyncio.gather(*(client.post(f"/api/jobs/{job_id}/stop") for job_id in job_ids))
    assert [response.status for response in stops] == [200] * STOPPED_JOBS
    jobs = [await wait_for_status(client, job_id, timeout_s=120) for job_id in job_ids]
    assert {job["status"] for job in jobs} == {"STOPPED"}
    logs = {job_id: await job_logs(client, job_id) for job_id in job_ids}
    assert {job_id: log for job_id, log in logs.items() if log} == {}


async def test_a_stop_asked_for_as_a_launcher_starts_ends_it_before_its_command_runs(
    tmp_path: Path,
) -> None:
    """Without a fork server, a contained command starts through a launcher that takes a
    Python start: a stop asked for meanwhile sends it SIGTERM at once, and the command never
    runs (before, it waited for the start and the command ran on meanwhile)."""
    if os.geteuid() != 0:
        pytest.skip("a PID namespace needs CAP_SYS_ADMIN")
    early_stop = EarlyStop(asyncio.Event())
    early_stop.requested.set()
    log_path = tmp_path / "job.log"
    process = await start_entrypoint(
        SLEEPY,
        log_path=log_path,
        env={**os.environ, "JOBS_SERVER_JOB_TOKEN": "stopped-launcher"},
        containment=Containment.PID_NAMESPACE,
        early_stop=early_stop,
    )
    assert early_stop.sent
    assert await asyncio.wait_for(process.wait(), 30) == -signal.SIGTERM
    await asyncio.sleep(SURVIVOR_SHOWS_S)
    assert log_path.read_bytes() == b""


@pytest.mark.parametrize("containment", list(Containment))
async def test_a_stop_reaches_the_shell_and_its_child_at_once(
    tmp_path: Path, containment: Containment
) -> None:
    """Without Ray, for each containment (the marker one is what a host without namespaces
    gets): the shell never runs the command after the one that was stopped."""
    if containment is Containment.PID_NAMESPACE and os.geteuid() != 0:
        pytest.skip("a PID namespace needs CAP_SYS_ADMIN")
    token = "stop-test"
    runs = []
    for index in range(20):
        log_path = tmp_path / f"{index}.log"
        process = await start_entrypoint(
            MANY_THEN_FINISHES,
            log_path=log_path,
            env={**os.environ, "JOBS_SERVER_JOB_TOKEN": f"{token}-{index}"},
            containment=containment,
        )
        runs.append((process, log_path, f"{token}-{index}"))
    await asyncio.sleep(0.5)  # let the shells start their sleep
    try:
        for process, _, job_token in runs:
            signal_job_processes(job_token, signal.SIGTERM, process.pid, containment=containment)
        codes = [await asyncio.wait_for(process.wait(), 30) for process, _, _ in runs]
    finally:
        for process, _, _ in runs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
    await asyncio.sleep(0.2)
    assert codes == [-signal.SIGTERM] * len(runs)
    assert [log_path.read_bytes() for _, log_path, _ in runs] == [b""] * len(runs)


# Jobs enough that some parent and child are not in the order of their pids' hashes (the order
# of a set of pids, which a stop once signalled them in).
ESCAPED_SHELL_JOBS = 10


async def _start_escaped_shells(
    tmp_path: Path, containment: Containment
) -> list[tuple[asyncio.subprocess.Process, Path, str]]:
    jobs = []
    for index in range(ESCAPED_SHELL_JOBS):
        job_token, log_path = f"escaped-{index}", tmp_path / f"escaped-{index}.log"
        process = await start_entrypoint(
            ESCAPED_SHELLS,
            log_path=log_path,
            env={**os.environ, "JOBS_SERVER_JOB_TOKEN": job_token},
            containment=containment,
        )
        jobs.append((process, log_path, job_token))
    # Every escaped shell has started its sleep: 1 + 8 shells, 8 + 1 sleeps (and an init).
    processes = 18 + (containment == Containment.PID_NAMESPACE)
    deadline = time.monotonic() + 30
    for process, _, job_token in jobs:
        while len(find_job_processes(job_token, process.pid)) < processes:
            assert time.monotonic() < deadline, "the escaped shells never started"
            await asyncio.sleep(0.05)
    return jobs


async def _kill_all(
    jobs: list[tuple[asyncio.subprocess.Process, Path, str]], containment: Containment
) -> None:
    for process, _, job_token in jobs:
        await kill_job_processes(job_token, process.pid, containment=containment)
        await process.wait()


def test_a_jobs_processes_are_found_parents_first(tmp_path: Path) -> None:
    async def check() -> None:
        jobs = await _start_escaped_shells(tmp_path, Containment.MARKER)
        try:
            for process, _, job_token in jobs:
                found = find_job_processes(job_token, process.pid)
                for index, pid in enumerate(found):
                    parent = psutil.Process(pid).ppid()
                    assert parent not in found[index:], f"{pid} comes before its parent {parent}"
        finally:
            await _kill_all(jobs, Containment.MARKER)

    asyncio.run(check())


@pytest.mark.parametrize("containment", list(Containment))
async def test_a_kill_paused_between_two_signals_lets_no_shell_run_on(
    tmp_path: Path, containment: Containment, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The supervisor may be preempted between two signals (a busy node): a shell whose child
    was killed first would run its next command meanwhile. Injected here as a pause after
    every signal sent to one process."""
    if containment is Containment.PID_NAMESPACE and os.geteuid() != 0:
        pytest.skip("a PID namespace needs CAP_SYS_ADMIN")
    jobs = await _start_escaped_shells(tmp_path, containment)
    real_kill = os.kill

    def kill_then_pause(pid: int, sig: int) -> None:
        real_kill(pid, sig)
        time.sleep(0.02)

    monkeypatch.setattr(os, "kill", kill_then_pause)
    try:
        for process, _, job_token in jobs:
            signal_job_processes(job_token, signal.SIGKILL, process.pid, containment=containment)
    finally:
        monkeypatch.undo()
        await _kill_all(jobs, containment)
    assert [process.returncode for process, _, _ in jobs] == [-signal.SIGKILL] * len(jobs)
    await asyncio.sleep(0.3)  # what ran on has written by now
    assert [log_path.read_text() for _, log_path, _ in jobs] == ["ready\n"] * len(jobs)


@pytest.mark.parametrize(
    ("query", "body"),
    [("", {"grace_period_s": 1e9}), ("?grace_period_s=301", None), ("", {"grace_period_s": 300.5})],
)
async def test_a_grace_period_over_the_ceiling_is_refused_and_changes_nothing(
    client: Client, query: str, body: dict[str, Any] | None
) -> None:
    job_id = await submit(client, entrypoint="sleep 60")
    await wait_for_status(client, job_id, {"RUNNING"})
    response = await client.post(f"/api/jobs/{job_id}/stop{query}", json=body)
    assert response.status == 400
    error = (await response.json())["error"]
    assert error["code"] == "invalid_request"
    assert error["message"].startswith("grace_period_s: ")
    assert "300" in error["message"]
    await asyncio.sleep(1)
    assert (await wait_for_status(client, job_id, {"RUNNING"}))["status"] == "RUNNING"
    assert await (await client.post(f"/api/jobs/{job_id}/stop")).json() == {"stopped": True}
    assert (await wait_for_status(client, job_id))["status"] == "STOPPED"


async def test_a_second_stop_with_a_shorter_grace_shortens_the_running_one(
    client: Client,
) -> None:
    job_id = await submit(client, entrypoint=IGNORES_SIGTERM)
    await wait_for_log(client, job_id, "ready\n")
    first = await client.post(f"/api/jobs/{job_id}/stop", json={"grace_period_s": 100})
    assert await first.json() == {"stopped": True}
    await asyncio.sleep(1)
    assert (await wait_for_status(client, job_id, {"RUNNING"}))["status"] == "RUNNING"
    second = await client.post(f"/api/jobs/{job_id}/stop", json={"grace_period_s": 0.5})
    assert await second.json() == {"stopped": True}
    # Far below the first grace period: only the second one can end it in time.
    job = await wait_for_status(client, job_id, timeout_s=30)
    assert job["status"] == "STOPPED"
    assert job["driver_exit_code"] == -signal.SIGKILL


async def test_a_second_stop_with_a_longer_grace_does_not_lengthen_it(client: Client) -> None:
    job_id = await submit(client, entrypoint=IGNORES_SIGTERM)
    await wait_for_log(client, job_id, "ready\n")
    await client.post(f"/api/jobs/{job_id}/stop", json={"grace_period_s": 1})
    await client.post(f"/api/jobs/{job_id}/stop", json={"grace_period_s": 200})
    # Far below the second grace period: only the first one can end it in time.
    assert (await wait_for_status(client, job_id, timeout_s=60))["status"] == "STOPPED"


def test_the_ceiling_is_a_setting_with_a_flag_and_a_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from jobs_server.cli import build_parser, load_settings

    assert Settings().max_stop_grace_s == 300
    monkeypatch.setenv("JOBS_SERVER_MAX_STOP_GRACE_S", "60")
    assert Settings().max_stop_grace_s == 60
    flags = vars(
        build_parser().parse_args(["serve", "--max-stop-grace-s", "7", "--stop-grace-s", "2"])
    )
    flags.pop("command")
    assert load_settings(flags).max_stop_grace_s == 7
    with pytest.raises(ValueError, match="stop_grace_s"):
        Settings(stop_grace_s=10, max_stop_grace_s=5)
