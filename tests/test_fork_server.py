"""The fork server (zygote) that starts a supervisor's jobs, with real processes and without Ray:
what a job's command does and how it ends, and the lifetimes of the fork server, its launchers
and their jobs when something dies."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import psutil
import pytest

from jobs_server.manager.containment import Containment
from jobs_server.manager.fork_server import ForkedProcess, ForkServer, ForkServerDiedError
from jobs_server.manager.process import (
    become_child_subreaper,
    find_job_processes,
    kill_job_processes,
    signal_job_processes,
)
from tests.test_stopping import ESCAPED_SHELLS, MANY_THEN_FINISHES

CONTAINMENTS = [
    pytest.param(
        containment,
        marks=pytest.mark.skipif(
            containment is Containment.PID_NAMESPACE and os.geteuid() != 0,
            reason="a PID namespace needs CAP_SYS_ADMIN",
        ),
    )
    for containment in Containment
]
REPO = Path(__file__).resolve().parent.parent
PYTHON = os.path.realpath(sys.executable)
PR_SET_CHILD_SUBREAPER = 36


@pytest.fixture
async def forks() -> AsyncIterator[ForkServer]:
    """A fork server of this test process, made a child subreaper for the test (as a
    supervisor is): the launchers are re-parented to it."""
    assert become_child_subreaper()
    server = ForkServer("fork-server-test")
    server.start()
    try:
        yield server
    finally:
        server.close()
        ctypes.CDLL(None).prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)


def job_env(job_token: str) -> dict[str, str]:
    return {**os.environ, "JOBS_SERVER_JOB_TOKEN": job_token}


def is_alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def marked_processes(marker: str) -> list[int]:
    """Live processes anywhere on the node whose environment holds `marker` (NAME=value)."""
    found = []
    for process in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            name, _, value = marker.partition("=")
            if process.environ().get(name) == value and is_alive(process.pid):
                found.append(process.pid)
    return found


async def wait_until(condition: Callable[[], object], what: str, timeout_s: float = 15) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.02)


def poll_until(condition: Callable[[], object], what: str, timeout_s: float = 15) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def tree(pid: int) -> list[psutil.Process]:
    with contextlib.suppress(psutil.NoSuchProcess):
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    return []


@pytest.mark.parametrize("containment", CONTAINMENTS)
@pytest.mark.parametrize(
    ("entrypoint", "exit_code", "log"),
    [
        ("echo out; echo err >&2; exit 3", 3, b"out\nerr\n"),
        ("true", 0, b""),
        ("kill -TERM $$", -signal.SIGTERM, b""),
        ("kill -KILL $$", -signal.SIGKILL, b""),
        ("yes | head -c 2", 0, b"y\n"),  # SIGPIPE ends `yes`, as in any shell
        ("cat; echo read-nothing", 0, b"read-nothing\n"),  # stdin is /dev/null
    ],
)
async def test_a_forked_job_ends_exactly_as_its_command(
    forks: ForkServer,
    tmp_path: Path,
    containment: Containment,
    entrypoint: str,
    exit_code: int,
    log: bytes,
) -> None:
    log_path = tmp_path / "job.log"
    log_path.write_bytes(b"before\n")  # appended to, never truncated
    process = await forks.spawn(
        entrypoint, log_path=log_path, env=job_env("exits"), containment=containment
    )
    assert await asyncio.wait_for(process.wait(), 30) == exit_code
    assert process.returncode == exit_code
    assert log_path.read_bytes() == b"before\n" + log


@pytest.mark.parametrize("containment", CONTAINMENTS)
async def test_a_forked_job_runs_with_its_own_environment_and_session(
    forks: ForkServer, tmp_path: Path, containment: Containment
) -> None:
    log_path = tmp_path / "job.log"
    process = await forks.spawn(
        'echo "$JOBS_SERVER_JOB_TOKEN $ONLY_HERE"; sleep 60',
        log_path=log_path,
        env={**job_env("own-env"), "ONLY_HERE": "yes"},
        containment=containment,
    )
    try:
        await wait_until(lambda: log_path.read_bytes(), "the job wrote nothing")
        assert log_path.read_text() == "own-env yes\n"
        assert os.getsid(process.pid) == process.pid  # a session of its own
        # The supervisor's child (re-parented), as a launcher it starts itself is.
        assert psutil.Process(process.pid).ppid() == os.getpid()
        assert os.getsid(process.pid) != os.getsid(forks.pid or 0)
    finally:
        await kill_job_processes("own-env", process.pid, containment=containment)
    assert await process.wait() == -signal.SIGKILL


@pytest.mark.parametrize("containment", CONTAINMENTS)
async def test_started_means_the_shell_has_exec_d(
    forks: ForkServer, tmp_path: Path, containment: Containment
) -> None:
    """RUNNING means it runs: when the start is reported, the deepest process of the job is
    the shell (or what it runs), not a Python process of the fork server's."""
    ran = []
    for index in range(20):
        process = await forks.spawn(
            "sleep 60",
            log_path=tmp_path / f"{index}.log",
            env=job_env(f"exec-{index}"),
            containment=containment,
        )
        ran.append([child.exe() != PYTHON for child in tree(process.pid)])
        await kill_job_processes(f"exec-{index}", process.pid, containment=containment)
        await process.wait()
    assert [any(runs) for runs in ran] == [True] * len(ran)


@pytest.mark.parametrize(
    ("shell", "log_path", "reason"),
    [
        (
            "/bin/sh",
            Path("/nonexistent/job.log"),
            "No such file or directory: '/nonexistent/job.log'",
        ),
        ("/nonexistent/sh", None, "No such file or directory: '/nonexistent/sh'"),
    ],
)
async def test_a_job_that_cannot_start_raises(
    tmp_path: Path, shell: str, log_path: Path | None, reason: str
) -> None:
    assert become_child_subreaper()
    forks = ForkServer("fork-server-test", shell=shell)
    forks.start()
    try:
        with pytest.raises(OSError, match=reason):
            await forks.spawn(
                "true",
                log_path=log_path or tmp_path / "job.log",
                env=job_env("no-start"),
                containment=Containment.MARKER,
            )
        zygote = forks.pid
        # The fork server goes on serving.
        with contextlib.suppress(OSError):
            await forks.spawn(
                "exit 4", log_path=tmp_path / "next.log", env={}, containment=Containment.MARKER
            )
        assert forks.pid == zygote
        assert (tmp_path / "next.log").exists()  # opened by the fork server: it served
    finally:
        forks.close()
        ctypes.CDLL(None).prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)


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
    any), or failed to start and none of its processes is left."""
    markers = [f"JOBS_SERVER_JOB_TOKEN=dies-starting-{containment}-{i}" for i in range(100)]
    starts = [
        asyncio.ensure_future(
            forks.spawn(
                "sleep 60",
                log_path=tmp_path / f"{index}.log",
                env={**os.environ, "JOBS_SERVER_JOB_TOKEN": marker.partition("=")[2]},
                containment=containment,
            )
        )
        for index, marker in enumerate(markers)
    ]
    # Once one has started, the others are being started.
    await asyncio.wait(starts, return_when=asyncio.FIRST_COMPLETED)
    assert forks.pid is not None
    os.kill(forks.pid, signal.SIGKILL)
    ended = await asyncio.gather(*starts, return_exceptions=True)
    failed = [
        marker for marker, end in zip(markers, ended, strict=True) if isinstance(end, BaseException)
    ]
    started = [end for end in ended if isinstance(end, ForkedProcess)]
    assert len(started) + len(failed) == len(markers)
    assert started
    assert failed
    assert {type(end) for end in ended if isinstance(end, BaseException)} <= {ForkServerDiedError}
    try:
        await wait_until(
            lambda: not any(map(marked_processes, failed)), "a job that failed to start runs"
        )
        assert [process.returncode for process in started] == [None] * len(started)
    finally:
        for process in started:
            await kill_job_processes("unused", process.pid, containment=containment)
            await process.wait()


@pytest.mark.parametrize("containment", CONTAINMENTS)
async def test_a_stop_reaches_every_process_of_a_forked_job_at_once(
    forks: ForkServer, tmp_path: Path, containment: Containment
) -> None:
    """As tests/test_stopping.py's for the launcher: no shell runs its next command."""
    runs: list[tuple[ForkedProcess, Path, str]] = []
    for index in range(20):
        log_path, job_token = tmp_path / f"{index}.log", f"fork-stop-{index}"
        process = await forks.spawn(
            MANY_THEN_FINISHES, log_path=log_path, env=job_env(job_token), containment=containment
        )
        runs.append((process, log_path, job_token))
    await asyncio.sleep(0.5)  # let the shells start their sleeps (a stop during it is fine too)
    try:
        for process, _, job_token in runs:
            signal_job_processes(job_token, signal.SIGTERM, process.pid, containment=containment)
        codes = [await asyncio.wait_for(process.wait(), 30) for process, _, _ in runs]
    finally:
        for process, _, job_token in runs:
            await kill_job_processes(job_token, process.pid, containment=containment)
    assert codes == [-signal.SIGTERM] * len(runs)
    assert [log_path.read_bytes() for _, log_path, _ in runs] == [b""] * len(runs)


@pytest.mark.parametrize("containment", CONTAINMENTS)
async def test_escaped_shells_of_a_forked_job_are_found_and_killed(
    forks: ForkServer, tmp_path: Path, containment: Containment
) -> None:
    log_path, job_token = tmp_path / "escaped.log", "fork-escaped"
    process = await forks.spawn(
        ESCAPED_SHELLS, log_path=log_path, env=job_env(job_token), containment=containment
    )
    # 1 + 8 shells, 8 + 1 sleeps (and an init).
    expected = 18 + (containment == Containment.PID_NAMESPACE)
    await wait_until(
        lambda: len(find_job_processes(job_token, process.pid)) >= expected,
        "the escaped shells never started",
    )
    await kill_job_processes(job_token, process.pid, containment=containment)
    assert await process.wait() == -signal.SIGKILL
    assert marked_processes(f"JOBS_SERVER_JOB_TOKEN={job_token}") == []
    assert log_path.read_text() == "ready\n"


# A supervisor's processes as supervisor.py prepares them: the guardian, a subreaper, the fork
# server; then one job.
SUPERVISOR_SCRIPT = """
import asyncio, os, subprocess, sys, time
from pathlib import Path
from jobs_server.manager.containment import Containment
from jobs_server.manager.fork_server import ForkServer
from jobs_server.manager.guardian import SUPERVISOR_TOKEN_ENV_VAR, start_guardian
from jobs_server.manager.process import become_child_subreaper

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


def test_a_process_in_a_dead_launchers_session_is_found_without_a_marker() -> None:
    """The init of a namespace whose launcher was killed carries no job marker (a fork server
    forked it): the scan after the attempt finds it among this process's children by session."""
    orphan = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        assert find_job_processes("no-such-job", session=orphan.pid) == [orphan.pid]
        assert find_job_processes("no-such-job") == []
    finally:
        orphan.kill()
        orphan.wait()
