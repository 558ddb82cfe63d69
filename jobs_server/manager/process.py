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
import threading
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


def find_job_processes(
    job_token: str, root_pid: int | None = None, *, other_roots: frozenset[int] = frozenset()
) -> list[int]:
    """Every live process of a job: the command's descendants, and the orphans it left.

    Orphans are re-parented to this process (a subreaper), so they are found among its own
    children by the job's marker. Only the job's processes and this process's children are
    read, less `other_roots` (the commands of this supervisor's other jobs): stopping fifty jobs
    at once costs no fifty scans of every process on the node.
    """
    found: set[int] = set()
    if root_pid is not None:
        found |= {root_pid, *_descendants(root_pid)}
    marker = f"{JOB_TOKEN_ENV_VAR}={job_token}".encode()
    for child in _own_children():
        if child not in found and child not in other_roots and _environ_has(child, marker):
            found |= {child, *_descendants(child)}
    return [pid for pid in found if _is_alive(pid)]


def _own_children() -> list[int]:
    """This process's children: the commands it started (forked from this thread, the event
    loop's) and the orphans re-parented to it (which the kernel lists under the main thread).

    A Ray worker runs dozens of threads, one more per running command (asyncio's child
    watcher); reading only these two keeps a stop cheap while fifty jobs run.
    """
    return _children(os.getpid(), threads=sorted({os.getpid(), threading.get_native_id()}))


def _children(pid: int, threads: list[int] | None = None) -> list[int]:
    """Direct children of `pid`, from /proc/<pid>/task/<tid>/children (psutil where absent)."""
    if threads is None:
        try:
            threads = [int(thread) for thread in os.listdir(f"/proc/{pid}/task")]
        except OSError:
            return []
    children: list[int] = []
    for thread in threads:
        try:
            with open(f"/proc/{pid}/task/{thread}/children") as listing:
                children.extend(int(child) for child in listing.read().split())
        except FileNotFoundError:
            return _children_by_psutil(pid)  # a kernel without CONFIG_PROC_CHILDREN
        except (OSError, ValueError):
            continue
    return children


def _children_by_psutil(pid: int) -> list[int]:
    try:
        return [child.pid for child in psutil.Process(pid).children()]
    except psutil.Error:
        return []


def _descendants(pid: int) -> set[int]:
    found: set[int] = set()
    pending = [pid]
    while pending:
        for child in _children(pending.pop()):
            if child not in found:
                found.add(child)
                pending.append(child)
    return found


def _environ_has(pid: int, marker: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as environ:
            return marker in environ.read().split(b"\0")
    except OSError:
        return False


def _is_alive(pid: int) -> bool:
    """Running or stopped, not a zombie waiting to be reaped."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            # The state follows the command name, which is in parentheses and may hold spaces.
            return stat.read().rpartition(b")")[2].split()[0] != b"Z"
    except (OSError, IndexError):
        return False


def signal_job_processes(
    job_token: str,
    sig: signal.Signals,
    root_pid: int | None = None,
    *,
    other_roots: frozenset[int] = frozenset(),
) -> int:
    """Send `sig` to every process of the job; return how many were signalled."""
    signalled = 0
    for pid in find_job_processes(job_token, root_pid, other_roots=other_roots):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
            signalled += 1
    return signalled


async def kill_job_processes(
    job_token: str, root_pid: int | None = None, *, other_roots: frozenset[int] = frozenset()
) -> None:
    """SIGKILL the job's processes until none is left (a forking process may add one meanwhile)."""
    for _ in range(_KILL_ROUNDS):
        if signal_job_processes(job_token, signal.SIGKILL, root_pid, other_roots=other_roots) == 0:
            return
        await asyncio.sleep(_KILL_ROUND_WAIT_S)


def reap_orphans(keep: set[int]) -> None:
    """Collect exited orphans re-parented to this subreaper, except `keep` (awaited elsewhere)."""
    for child in _own_children():
        if child not in keep and not _is_alive(child):
            with contextlib.suppress(ChildProcessError):
                os.waitpid(child, os.WNOHANG)


async def stop_job_processes(
    process: asyncio.subprocess.Process,
    *,
    job_token: str,
    grace_period_s: float,
    other_roots: frozenset[int] = frozenset(),
) -> int:
    """SIGTERM every process of the job, wait up to the grace period for the command to exit,
    then SIGKILL what is left. Return the command's exit code (negative: the ending signal)."""
    signal_job_processes(job_token, signal.SIGTERM, process.pid, other_roots=other_roots)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(process.wait(), timeout=grace_period_s)
    await kill_job_processes(job_token, process.pid, other_roots=other_roots)
    return await process.wait()
