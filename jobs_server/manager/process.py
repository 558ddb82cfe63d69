"""A job's processes: starting its command, finding every process it made, and ending them.

Each job's processes carry a marker in their environment (`JOBS_SERVER_JOB_TOKEN`), inherited by
every child, so a process that called `setsid` or double-forked is still found. The supervisor is a
child subreaper (orphans are re-parented to it instead of init), so they also stay in its subtree
and it can reap them.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import subprocess
from collections.abc import Mapping
from pathlib import Path

import psutil

logger = logging.getLogger(__name__)

SHELL = "/bin/sh"
JOB_TOKEN_ENV_VAR = "JOBS_SERVER_JOB_TOKEN"
# A SIGKILLed process may take a moment to leave the process table.
_KILL_ROUNDS = 5
_KILL_ROUND_WAIT_S = 0.05
_PR_SET_CHILD_SUBREAPER = 36


def become_child_subreaper() -> bool:
    """Make orphaned descendants re-parent to this process (Linux); return whether it worked."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


async def start_entrypoint(
    entrypoint: str, *, log_path: Path, env: Mapping[str, str]
) -> asyncio.subprocess.Process:
    """Run `entrypoint` with `/bin/sh -c` in a new session; stdout and stderr go to the log."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log_file:
        # The child keeps its own copy of the descriptor; ours closes when this block ends.
        return await asyncio.create_subprocess_exec(
            SHELL,
            "-c",
            entrypoint,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=dict(env),
            start_new_session=True,
        )


def find_job_processes(job_token: str, root_pid: int | None = None) -> list[psutil.Process]:
    """Every live process of a job: the root's descendants and anything carrying its marker."""
    found: dict[int, psutil.Process] = {}
    if root_pid is not None:
        with contextlib.suppress(psutil.Error):
            root = psutil.Process(root_pid)
            found[root.pid] = root
            found.update((child.pid, child) for child in root.children(recursive=True))
    marker = f"{JOB_TOKEN_ENV_VAR}={job_token}".encode()
    for pid in psutil.pids():
        if pid in found or pid == os.getpid():
            continue
        if _environ_has(pid, marker):
            with contextlib.suppress(psutil.Error):
                found[pid] = psutil.Process(pid)
    return [process for process in found.values() if _is_alive(process)]


def _environ_has(pid: int, marker: bytes) -> bool:
    # Reading /proc directly is several times faster than psutil's environ() for a full scan.
    try:
        with open(f"/proc/{pid}/environ", "rb") as environ:
            return marker in environ.read().split(b"\0")
    except OSError:
        return False


def _is_alive(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def signal_job_processes(job_token: str, sig: signal.Signals, root_pid: int | None = None) -> int:
    """Send `sig` to every process of the job; return how many were signalled."""
    signalled = 0
    for process in find_job_processes(job_token, root_pid):
        with contextlib.suppress(psutil.Error):
            process.send_signal(sig)
            signalled += 1
    return signalled


async def kill_job_processes(job_token: str, root_pid: int | None = None) -> None:
    """SIGKILL the job's processes until none is left (a forking process may add one meanwhile)."""
    for _ in range(_KILL_ROUNDS):
        if signal_job_processes(job_token, signal.SIGKILL, root_pid) == 0:
            return
        await asyncio.sleep(_KILL_ROUND_WAIT_S)


def reap_orphans(keep: set[int]) -> None:
    """Collect exited orphans re-parented to this subreaper, except `keep` (awaited elsewhere)."""
    with contextlib.suppress(psutil.Error):
        for child in psutil.Process().children():
            if child.pid in keep:
                continue
            with contextlib.suppress(psutil.Error, ChildProcessError):
                if child.status() == psutil.STATUS_ZOMBIE:
                    os.waitpid(child.pid, os.WNOHANG)


async def stop_job_processes(
    process: asyncio.subprocess.Process, *, job_token: str, grace_period_s: float
) -> int:
    """SIGTERM every process of the job, wait up to the grace period for the command to exit,
    then SIGKILL what is left. Return the command's exit code (negative: the ending signal)."""
    signal_job_processes(job_token, signal.SIGTERM, process.pid)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(process.wait(), timeout=grace_period_s)
    await kill_job_processes(job_token, process.pid)
    return await process.wait()
