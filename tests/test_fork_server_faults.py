"""The fork server's faults, with real processes and without Ray: a fork server killed while
its jobs run or while it starts some, and a supervisor killed (its fork server dies with it,
its guardian kills the jobs)."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import signal
import struct
import subprocess
import sys
import termios
from collections.abc import AsyncIterator
from pathlib import Path

import psutil
import pytest

from jobs_server.manager.supervisor.containment import Containment
from jobs_server.manager.supervisor.early_stop import EarlyStop
from jobs_server.manager.supervisor.fork_server import (
    ForkedProcess,
    ForkServer,
    ForkServerDiedError,
)
from jobs_server.manager.supervisor.process import kill_job_processes, signal_job_processes
from tests.support.fork_servers import (
    CONTAINMENTS,
    REPO,
    is_alive,
    job_env,
    marked_processes,
    poll_until,
    processes_with_tokens,
    subreaper_fork_server,
    wait_until,
)


@pytest.fixture
async def forks() -> AsyncIterator[ForkServer]:
    async with subreaper_fork_server() as server:
        yield server


@pytest.mark.parametrize("containment", CONTAINMENTS)
async def test_jobs_run_on_when_their_fork_server_is_killed_and_the_next_starts_a_new_one(
    forks: ForkServer, tmp_path: Path, containment: Containment
) -> None:
    processes = [
        await forks.spawn(
            "sleep 60; echo finished",
            log_path=tmp_path / f"{index}.log",
            env=job_env(f"zygote-killed-{index}"),
            containment=containment,
        )
        for index in range(3)
    ]
    zygote = forks.pid
    assert zygote is not None
    os.kill(zygote, signal.SIGKILL)
    await wait_until(lambda: forks.pid is None, "the fork server's death went unnoticed")
    process = await forks.spawn(
        "exit 5", log_path=tmp_path / "next.log", env={}, containment=containment
    )
    assert await process.wait() == 5
    assert forks.pid not in (None, zygote)
    assert [process.returncode for process in processes] == [None] * len(processes)
    for index, process in enumerate(processes):
        signal_job_processes(
            f"zygote-killed-{index}", signal.SIGTERM, process.pid, containment=containment
        )
    codes = [await asyncio.wait_for(process.wait(), 15) for process in processes]
    assert codes == [-signal.SIGTERM] * len(processes)


@pytest.mark.parametrize("containment", CONTAINMENTS)
async def test_a_job_the_fork_server_was_starting_when_it_died_leaves_nothing(
    forks: ForkServer, tmp_path: Path, containment: Containment
) -> None:
    """Killed in the middle of a burst of starts: each job either runs (and is awaited as
    any), or failed to start and none of its processes is left. A burst may end before the
    kill lands (all started: a loaded machine ran the fork server first); another is sent."""
    for burst in range(5):
        if await _kill_amid_a_burst(forks, tmp_path, f"{burst}-{containment}", containment):
            return
    pytest.fail("every burst of 100 starts had started before its fork server was killed")


async def _kill_amid_a_burst(
    forks: ForkServer, logs: Path, burst: str, containment: Containment
) -> bool:
    """Whether some start failed."""
    tokens = [f"dies-starting-{burst}-{i}" for i in range(100)]
    starts = [
        asyncio.ensure_future(
            forks.spawn(
                # Longer than any wait below: a job left running cannot pass by ending on its own.
                "sleep 600",
                log_path=logs / f"{burst}-{index}.log",
                env={**os.environ, "JOBS_SERVER_JOB_TOKEN": token},
                containment=containment,
            )
        )
        for index, token in enumerate(tokens)
    ]
    # Once one has started, the others are being started.
    await asyncio.wait(starts, return_when=asyncio.FIRST_COMPLETED)
    assert forks.pid is not None
    os.kill(forks.pid, signal.SIGKILL)
    ended = await asyncio.gather(*starts, return_exceptions=True)
    failed = [
        token for token, end in zip(tokens, ended, strict=True) if isinstance(end, BaseException)
    ]
    started = [end for end in ended if isinstance(end, ForkedProcess)]
    assert len(started) + len(failed) == len(tokens)
    assert started
    assert {type(end) for end in ended if isinstance(end, BaseException)} <= {ForkServerDiedError}
    try:
        await wait_until(
            lambda: not processes_with_tokens("JOBS_SERVER_JOB_TOKEN", failed),
            "a job that failed to start runs",
        )
        assert [process.returncode for process in started] == [None] * len(started)
    finally:
        for process in started:
            await kill_job_processes("unused", process.pid, containment=containment)
            await process.wait()
    return bool(failed)


# The smallest pipe (a page): about 200 "forked" reports fill it.
_PIPE_BYTES = 4096
_F_SETPIPE_SZ = 1031


def _unread_bytes(fd: int) -> int:
    return struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0" * 4))[0]


@pytest.mark.parametrize("clone_parent", [True, False], ids=["cloned", "forked-between"])
@pytest.mark.parametrize("containment", CONTAINMENTS)
async def test_a_job_whose_start_the_dead_fork_server_never_reported_never_runs(
    tmp_path: Path, containment: Containment, clone_parent: bool
) -> None:
    """The fork server dies between a job's fork and its report ("forked <job> <pid>"): no one
    knows that process, so it must end by itself rather than run the job unseen (before: it
    ran on; CI saw it once in 100 starts under load). The window is held open: the reports'
    pipe is full and unread, so the fork server waits to write a "forked" line."""
    loop = asyncio.get_running_loop()
    async with subreaper_fork_server(clone_parent=clone_parent) as forks:
        forks.start()
        assert forks.pid is not None
        loop.remove_reader(forks._reports)
        fcntl.fcntl(forks._reports, _F_SETPIPE_SZ, _PIPE_BYTES)
        tokens = [f"unreported-{containment}-{clone_parent}-{index}" for index in range(300)]
        starts = [
            asyncio.ensure_future(
                forks.spawn(
                    "sleep 600",
                    log_path=tmp_path / f"{index}.log",
                    # Small requests: the fork server reads them in one go, and so forks and
                    # reports them one after the other before it reports any as started.
                    env={"PATH": os.environ["PATH"], "JOBS_SERVER_JOB_TOKEN": token},
                    containment=containment,
                )
            )
            for index, token in enumerate(tokens)
        ]
        await wait_until(
            lambda: _unread_bytes(forks._reports) > _PIPE_BYTES - 32, "the reports never filled"
        )
        await asyncio.sleep(0.5)  # the fork server gets to the write that waits
        os.kill(forks.pid, signal.SIGKILL)
        loop.add_reader(forks._reports, forks._read_reports)
        ended = await asyncio.gather(*starts, return_exceptions=True)
        started = [end for end in ended if isinstance(end, ForkedProcess)]
        failed = [
            token
            for token, end in zip(tokens, ended, strict=True)
            if not isinstance(end, ForkedProcess)
        ]
        try:
            assert len(failed) > 100  # those the full pipe held back
            await wait_until(
                lambda: not processes_with_tokens("JOBS_SERVER_JOB_TOKEN", failed),
                "a job that failed to start runs",
                timeout_s=30,
            )
        finally:
            for process in started:
                await kill_job_processes("unused", process.pid, containment=containment)
                await process.wait()
            for pid in processes_with_tokens("JOBS_SERVER_JOB_TOKEN", failed):
                os.kill(pid, signal.SIGKILL)


# A supervisor that learns of the starts this late (a busy one: CI saw a second).
LATE_REPORT_S = 2.0
# Stopped at once, it writes nothing; stopped once it runs, "a" at most: "b" means it ran on.
# Long enough that only the stop can end it: with `sleep 1`, a loaded machine (a fresh-clone run
# of b8c0877) took more than the second between "a" in the log and the stop, the command ended
# on its own (exit 0) and the test failed as if the stop had not reached it.
SLEEPY = "echo a; sleep 30; echo b"


@pytest.mark.parametrize("containment", CONTAINMENTS)
@pytest.mark.parametrize("stopped", ["as-it-is-requested", "once-it-runs"])
async def test_a_stop_reaches_a_starting_command_before_its_start_is_reported(
    forks: ForkServer,
    tmp_path: Path,
    containment: Containment,
    stopped: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The supervisor learns of the start late: the stop asked for meanwhile still ends the
    command at once (before, it ran on to its end and was recorded STOPPED: CI, 8 of 120)."""
    loop = asyncio.get_running_loop()
    report_started = forks._started
    monkeypatch.setattr(
        forks, "_started", lambda job: loop.call_later(LATE_REPORT_S, report_started, job)
    )
    log_path = tmp_path / "job.log"
    early_stop = EarlyStop(asyncio.Event())
    starting = asyncio.ensure_future(
        forks.spawn(
            SLEEPY,
            log_path=log_path,
            env=job_env(f"stopped-starting-{stopped}"),
            containment=containment,
            early_stop=early_stop,
        )
    )
    if stopped == "once-it-runs":
        await wait_until(lambda: log_path.exists() and log_path.read_bytes(), "it never ran")
    early_stop.requested.set()
    # All of it at once, long before its start is reported: its `sleep` too, not left to end
    # on its own (or to be killed later).
    await wait_until(
        lambda: not marked_processes(f"JOBS_SERVER_JOB_TOKEN=stopped-starting-{stopped}"),
        "a process of the stopped command runs on",
        timeout_s=LATE_REPORT_S / 4,
    )
    process = await asyncio.wait_for(starting, 30)
    assert early_stop.sent
    assert await asyncio.wait_for(process.wait(), 30) == -signal.SIGTERM
    await asyncio.sleep(1.5)  # what a command that ran on would need to write "b"
    assert log_path.read_bytes() in {b"", b"a\n"}


# A supervisor's processes as supervisor.py prepares them: the guardian, a subreaper, the fork
# server; then one job.
SUPERVISOR_SCRIPT = """
import asyncio, os, subprocess, sys, time
from pathlib import Path
from jobs_server.manager.supervisor.containment import Containment
from jobs_server.manager.supervisor.early_stop import EarlyStop
from jobs_server.manager.supervisor.fork_server import ForkServer
from jobs_server.manager.supervisor.guardian import SUPERVISOR_TOKEN_ENV_VAR, start_guardian
from jobs_server.manager.supervisor.process import become_child_subreaper

async def main():
    token = sys.argv[4]
    if sys.argv[5] == "guardian":
        guardian = start_guardian(token)
    become_child_subreaper()
    forks = ForkServer(token)
    forks.start()
    process = await forks.spawn(
        "sleep 600; echo never", log_path=Path(sys.argv[1]),
        env={"JOBS_SERVER_JOB_TOKEN": token, SUPERVISOR_TOKEN_ENV_VAR: token},
        containment=Containment(sys.argv[2]),
    )
    if sys.argv[3] == "keep-requests-open":
        # Another process holds the request pipe: no EOF, only the parent-death signal.
        subprocess.Popen(["sleep", "600"], pass_fds=(forks._requests,), start_new_session=True)
    print(forks.pid, process.pid, flush=True)
    time.sleep(600)

asyncio.run(main())
"""


@pytest.mark.parametrize("containment", CONTAINMENTS)
@pytest.mark.parametrize(
    ("requests", "guardian"),
    [
        # Each way the fork server learns its supervisor died, alone: EOF on its requests,
        # its parent-death signal (the guardian would kill it too).
        ("close-requests", "no-guardian"),
        ("keep-requests-open", "no-guardian"),
        ("close-requests", "guardian"),
    ],
)
def test_the_fork_server_and_its_jobs_die_with_the_supervisor(
    tmp_path: Path, containment: Containment, requests: str, guardian: str
) -> None:
    marker = f"JOBS_SERVER_JOB_TOKEN=supervisor-dies-{containment}-{requests}-{guardian}"
    supervisor = subprocess.Popen(
        [
            sys.executable,
            "-c",
            SUPERVISOR_SCRIPT,
            str(tmp_path / "job.log"),
            containment,
            requests,
            marker.partition("=")[2],
            guardian,
        ],
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    holders = []
    try:
        assert supervisor.stdout is not None
        zygote, launcher = map(int, supervisor.stdout.readline().split())
        holders = [
            child.pid
            for child in psutil.Process(supervisor.pid).children()
            if child.pid != zygote and child.name() == "sleep"
        ]
        assert is_alive(zygote)
        assert is_alive(launcher)
        supervisor.kill()
        supervisor.wait()
        poll_until(lambda: not is_alive(zygote), "the fork server outlived its supervisor")
        if guardian == "guardian":
            # The launchers carry the supervisor's marker (the fork server's environment).
            poll_until(lambda: not is_alive(launcher), "a launcher outlived its supervisor")
            poll_until(
                lambda: not marked_processes(marker), "a job process outlived its supervisor"
            )
    finally:
        for pid in holders + marked_processes(marker):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if supervisor.poll() is None:
            supervisor.kill()
            supervisor.wait()
