"""The fork server (zygote) that starts a supervisor's jobs, with real processes and without Ray:
what a job's command does and how it ends, and how its processes are found and stopped."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import psutil
import pytest

from jobs_server.manager.supervisor.containment import Containment
from jobs_server.manager.supervisor.fork_server import ForkedProcess, ForkServer
from jobs_server.manager.supervisor.process import (
    _namespace_pid,
    command_has_ended,
    find_job_processes,
    kill_job_processes,
    signal_job_processes,
)
from tests.support.commands import ESCAPED_SHELLS, MANY_THEN_FINISHES
from tests.support.fork_servers import (
    CONTAINMENTS,
    job_env,
    marked_processes,
    subreaper_fork_server,
    wait_until,
)

PYTHON = os.path.realpath(sys.executable)


@pytest.fixture(params=[True, False], ids=["cloned", "forked-between"])
async def forks(request: pytest.FixtureRequest) -> AsyncIterator[ForkServer]:
    """Each test with the job's first process cloned as the supervisor's child (in a PID
    namespace, the namespace's init itself), and with a launcher forked twice (the way where
    the clone is refused)."""
    async with subreaper_fork_server(clone_parent=request.param) as server:
        yield server


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
        # As a SIGTERM's end reads in an init's exit code (128 + 15), but an exit of its own.
        ("exit 143", 143, b""),
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
    # What an init left of a signal's end was read and removed.
    assert os.listdir(forks._ends_dir or tmp_path) == []


@pytest.mark.parametrize("containment", CONTAINMENTS)
async def test_a_forked_job_runs_with_its_own_environment_and_process_group(
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
        assert os.getpgid(process.pid) == process.pid  # a process group of its own
        # The supervisor's child (cloned as such, or re-parented), as a launcher it starts
        # itself is.
        assert psutil.Process(process.pid).ppid() == os.getpid()
        assert os.getpgid(process.pid) != os.getpgid(forks.pid or 0)
    finally:
        await kill_job_processes("own-env", process.pid, containment=containment)
    assert await process.wait() == -signal.SIGKILL


async def test_a_contained_job_is_its_namespaces_init_unless_the_clone_is_refused(
    forks: ForkServer, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """Cloned, the job's first process is the init of its PID namespace (no launcher: a copy
    of the interpreter less per job); forked between (where a clone is refused), a launcher
    whose child is the init."""
    if os.geteuid() != 0:
        pytest.skip("a PID namespace needs CAP_SYS_ADMIN")
    process = await forks.spawn(
        "sleep 60",
        log_path=tmp_path / "job.log",
        env=job_env("shape"),
        containment=Containment.PID_NAMESPACE,
    )
    try:
        cloned = request.node.callspec.params["forks"]
        init = process.pid
        if not cloned:
            [launched] = psutil.Process(process.pid).children()
            init = launched.pid
        assert _namespace_pid(init) == 1
        assert process.namespace_init is cloned
    finally:
        await kill_job_processes("shape", process.pid, containment=Containment.PID_NAMESPACE)
    assert await process.wait() == -signal.SIGKILL


@pytest.mark.parametrize(
    ("clone_parent", "held"), [(True, "init"), (False, "init"), (False, "launcher")]
)
async def test_a_command_has_ended_once_its_shell_has_even_while_its_waiter_is_held(
    tmp_path: Path, clone_parent: bool, held: str
) -> None:
    """The shell has exited, but what waits for it has not noticed (held with SIGSTOP here; on
    a busy node it may not run for a while): the command has ended all the same, so a stop
    that comes now leaves it as it ended (tests/test_stopping.py). Cloned, the init is the
    job's process; forked between, a launcher waits for the init."""
    if os.geteuid() != 0:
        pytest.skip("a PID namespace needs CAP_SYS_ADMIN")
    go = tmp_path / "go"
    async with subreaper_fork_server(clone_parent=clone_parent) as forks:
        process = await forks.spawn(
            # Ends once told, after its waiter is held: a fixed sleep could end first on a
            # loaded machine (then the shell is gone before the test looks: NoSuchProcess).
            f"while [ ! -e {go} ]; do sleep 0.02; done",
            log_path=tmp_path / "job.log",
            env=job_env("held"),
            containment=Containment.PID_NAMESPACE,
        )
        assert process.namespace_init is clone_parent
        init = psutil.Process(process.pid)
        if not clone_parent:
            [init] = init.children()
        [shell] = init.children()
        assert not command_has_ended(process, Containment.PID_NAMESPACE)
        waiter = init if held == "init" else psutil.Process(process.pid)
        waiter.suspend()
        try:
            go.touch()
            ended = shell if held == "init" else init
            await wait_until(
                lambda: ended.status() == psutil.STATUS_ZOMBIE, "the shell never ended"
            )
            assert process.returncode is None
            assert command_has_ended(process, Containment.PID_NAMESPACE)
        finally:
            waiter.resume()
        assert await asyncio.wait_for(process.wait(), 30) == 0


def scheduling_group(pid: int) -> tuple[int, str]:
    """The session of `pid`, and its autogroup where the kernel has them: the unit the
    scheduler shares the CPU between when autogroups are on (as on most desktop and cloud
    kernels), whatever the processes' nice values."""
    try:
        autogroup = Path(f"/proc/{pid}/autogroup").read_text().split()[0]
    except OSError:
        autogroup = ""
    return os.getsid(pid), autogroup


@pytest.mark.parametrize("containment", CONTAINMENTS)
async def test_the_jobs_share_one_session_so_they_weigh_as_one_against_the_server(
    forks: ForkServer, tmp_path: Path, containment: Containment
) -> None:
    """A session per job is a scheduling group per job where autogroups are on: 50 jobs got 50
    shares of the CPU against the server's one (and Ray's), and each short job preempted the
    server as a fresh group. In the fork server's session, every job's process (the launcher,
    the namespace's init, the command) is in one group."""
    entrypoint = "sh -c 'sleep 60' & sleep 60"
    processes = [
        await forks.spawn(
            entrypoint, log_path=tmp_path / f"{n}.log", env=job_env(f"job-{n}"), containment=c
        )
        for n, c in enumerate([containment, containment])
    ]
    try:
        own = scheduling_group(forks.pid or 0)
        for process in processes:
            await wait_until(lambda p=process: len(tree(p.pid)) >= 3, "the job's processes")
            for member in tree(process.pid):
                with contextlib.suppress(psutil.NoSuchProcess, ProcessLookupError):
                    assert scheduling_group(member.pid) == own, member.cmdline()
    finally:
        for n, process in enumerate(processes):
            await kill_job_processes(f"job-{n}", process.pid, containment=containment)


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
    async with subreaper_fork_server(shell) as forks:
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


@pytest.mark.parametrize("containment", CONTAINMENTS)
async def test_a_forked_command_starts_with_no_signal_blocked_or_ignored(
    forks: ForkServer, tmp_path: Path, containment: Containment
) -> None:
    """Python ignores SIGPIPE and SIGXFSZ, and the launch holds the stop signals blocked until
    its handlers are set: the command must see none of that (its `grep` inherits its state)."""
    log_path = tmp_path / "job.log"
    process = await forks.spawn(
        "grep -E '^Sig(Blk|Ign):' /proc/self/status",
        log_path=log_path,
        env=job_env("signals"),
        containment=containment,
    )
    assert await asyncio.wait_for(process.wait(), 30) == 0
    status = dict(line.split(":\t") for line in log_path.read_text().splitlines())
    assert int(status["SigBlk"], 16) == 0
    # Signals 1-31. glibc's posix_spawn leaves its own two (32 and 33, which glibc programs
    # take back when they need them) ignored, as in any program it spawns.
    assert int(status["SigIgn"], 16) & 0x7FFF_FFFF == 0


async def test_a_contained_job_whose_shell_cannot_run_ends_with_127_and_says_why(
    tmp_path: Path,
) -> None:
    if os.geteuid() != 0:
        pytest.skip("a PID namespace needs CAP_SYS_ADMIN")
    log_path = tmp_path / "job.log"
    async with subreaper_fork_server("/nonexistent/sh") as forks:
        process = await forks.spawn(
            "true",
            log_path=log_path,
            env=job_env("no-shell"),
            containment=Containment.PID_NAMESPACE,
        )
        assert await asyncio.wait_for(process.wait(), 30) == 127
    assert log_path.read_text() == (
        "jobs-server: cannot run /nonexistent/sh: "
        "[Errno 2] No such file or directory: '/nonexistent/sh'\n"
    )


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


def test_a_process_in_a_dead_launchers_group_is_found_without_a_marker() -> None:
    """The init of a namespace whose launcher was killed carries no job marker (a fork server
    forked it): the scan after the attempt finds it among this process's children by its
    process group."""
    orphan = subprocess.Popen(["sleep", "60"], process_group=0)
    try:
        assert find_job_processes("no-such-job", group=orphan.pid) == [orphan.pid]
        assert find_job_processes("no-such-job") == []
    finally:
        orphan.kill()
        orphan.wait()
