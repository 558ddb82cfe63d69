"""Starting a job's command: through the supervisor's fork server, or a launcher per job
(`containment.py`); what the rest of the supervisor holds of it (`CommandProcess`)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import signal
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import BinaryIO, Protocol, overload

from jobs_server.manager.supervisor.containment import SHELL, Containment, launch_argv
from jobs_server.manager.supervisor.early_stop import EarlyStop, until_started_or_stopped
from jobs_server.manager.supervisor.fork_server import ForkServer
from jobs_server.manager.tenancy import RunAs

# Changes user, groups first, then execs: util-linux's, at its absolute path (a job's PATH is
# not looked at while the start still runs as the server's user).
SETPRIV = "/usr/bin/setpriv"
ENV = "/usr/bin/env"
# The markers the job's processes are found by (process.py, guardian.py): the only variables the
# start has while it runs as the server's user.
_MARKER_PREFIX = "JOBS_SERVER_"


class CommandProcess(Protocol):
    """A started command (in a PID namespace, its launcher or its namespace's init), this
    process's child: an `asyncio.subprocess.Process`, or a `ForkedProcess`."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    async def wait(self) -> int: ...


@overload
async def start_entrypoint(
    entrypoint: str,
    *,
    log_path: Path,
    env: Mapping[str, str],
    containment: Containment,
    fork_server: None = None,
    early_stop: EarlyStop | None = None,
    run_as: RunAs | None = None,
    cgroup_join_files: tuple[str, ...] = (),
) -> asyncio.subprocess.Process: ...


@overload
async def start_entrypoint(
    entrypoint: str,
    *,
    log_path: Path,
    env: Mapping[str, str],
    containment: Containment,
    fork_server: ForkServer | None,
    early_stop: EarlyStop | None = None,
    run_as: RunAs | None = None,
    cgroup_join_files: tuple[str, ...] = (),
) -> CommandProcess: ...


async def start_entrypoint(
    entrypoint: str,
    *,
    log_path: Path,
    env: Mapping[str, str],
    containment: Containment,
    fork_server: ForkServer | None = None,
    early_stop: EarlyStop | None = None,
    run_as: RunAs | None = None,
    cgroup_join_files: tuple[str, ...] = (),
) -> CommandProcess:
    """Run `entrypoint` with `/bin/sh -c` in a process group of its own (in the fork server's
    session, or a new one for a launcher started here; in a PID namespace of its own if
    `containment` says so; in the attempt's cgroup whose join files are `cgroup_join_files`,
    if any); stdout and stderr go to the log. Return once the command runs (or
    has been sent SIGTERM: `early_stop`).

    Through `fork_server` if given (a fork per job), else by starting a launcher (a Python start
    per job)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    if run_as is not None:
        entrypoint, env = as_user(entrypoint, env, run_as)
    if fork_server is not None:
        return await fork_server.spawn(
            entrypoint,
            log_path=log_path,
            env=env,
            containment=containment,
            early_stop=early_stop,
            cgroup_join_files=cgroup_join_files,
        )
    if containment != Containment.PID_NAMESPACE:
        # The shell itself: it runs when this returns, and a stop reaches it from then on.
        argv = launch_argv(entrypoint, containment, None, cgroup_join_files)
        return await _spawn(argv, log_path, env, ())
    started_r, started_w = os.pipe()
    try:
        try:
            process = await _spawn(
                launch_argv(entrypoint, containment, started_w, cgroup_join_files),
                log_path,
                env,
                (started_w,),
            )
        finally:
            os.close(started_w)
        # The launcher takes a Python start before the shell runs: RUNNING means it runs.
        started = asyncio.ensure_future(_wait_for_eof(started_r))
        try:
            if await until_started_or_stopped(started, early_stop):
                # Before its handlers, SIGTERM ends the launcher itself: the shell never runs.
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGTERM)
            await started
        finally:
            started.cancel()
    finally:
        os.close(started_r)
    return process


def as_user(entrypoint: str, env: Mapping[str, str], run_as: RunAs) -> tuple[str, dict[str, str]]:
    """The entrypoint and environment that run `entrypoint` with `env` as `run_as`: the shell
    that starts as the server's user gets only the markers (a job's LD_PRELOAD, PATH or ENV
    must not reach a process of the server's user) and execs setpriv, which sets the groups,
    the gid and the uid, then `env -i` gives the job's shell its whole environment. The log is
    the descriptor it inherits: the user need not be able to open it."""
    command = [
        SETPRIV,
        f"--groups={','.join(map(str, run_as.groups or (run_as.gid,)))}",
        f"--regid={run_as.gid}",
        f"--reuid={run_as.uid}",
        "--",
        ENV,
        "-i",
        *(f"{name}={value}" for name, value in env.items()),
        SHELL,
        "-c",
        entrypoint,
    ]
    markers = {name: value for name, value in env.items() if name.startswith(_MARKER_PREFIX)}
    return "exec " + shlex.join(command), markers


async def _spawn(
    argv: list[str], log_path: Path, env: Mapping[str, str], pass_fds: tuple[int, ...]
) -> asyncio.subprocess.Process:
    with open_log_for_append(log_path) as log_file:
        # The child keeps its own copy of the descriptor; ours closes when this block ends.
        return await asyncio.create_subprocess_exec(
            *argv,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=dict(env),
            start_new_session=True,
            pass_fds=pass_fds,
        )


def open_log_for_append(log_path: Path) -> BinaryIO:
    """The log, for the command's output: made 0600 if missing, never through a symlink at its
    name (a spool is in the node's shared temp dir: log_shipping.py)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC | os.O_NOFOLLOW
    return os.fdopen(os.open(log_path, flags, 0o600), "ab")


async def _wait_for_eof(fd: int) -> None:
    """Return when every write end of the pipe `fd` reads from has closed (nobody writes to it,
    so readable means that)."""
    loop = asyncio.get_running_loop()
    closed: asyncio.Future[None] = loop.create_future()

    def on_readable() -> None:
        if not closed.done():
            closed.set_result(None)

    loop.add_reader(fd, on_readable)
    try:
        await closed
    finally:
        loop.remove_reader(fd)
