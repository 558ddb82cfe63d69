"""Starting a job's command and signalling its whole process tree."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
from collections.abc import Mapping
from pathlib import Path

import psutil

logger = logging.getLogger(__name__)

SHELL = "/bin/sh"


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


def process_tree(root_pid: int) -> list[psutil.Process]:
    """The root, its descendants, and anything still in its session (a process group leader's
    children that were orphaned keep the session id even after their parent exits)."""
    found: dict[int, psutil.Process] = {}
    try:
        root = psutil.Process(root_pid)
        found[root.pid] = root
        for child in root.children(recursive=True):
            found[child.pid] = child
    except psutil.NoSuchProcess:
        pass
    for candidate in psutil.process_iter():
        with contextlib.suppress(psutil.Error, OSError):
            if candidate.pid not in found and os.getsid(candidate.pid) == root_pid:
                found[candidate.pid] = candidate
    return list(found.values())


def signal_process_tree(root_pid: int, sig: signal.Signals) -> int:
    """Send `sig` to every process of the tree; return how many were signalled."""
    signalled = 0
    for process in process_tree(root_pid):
        with contextlib.suppress(psutil.NoSuchProcess):
            process.send_signal(sig)
            signalled += 1
    logger.debug("sent %s to %d processes of %d", sig.name, signalled, root_pid)
    return signalled


async def stop_process_tree(process: asyncio.subprocess.Process, *, grace_period_s: float) -> int:
    """SIGTERM the tree, wait up to the grace period for the command to exit, then SIGKILL what
    is left. Return the command's exit code (negative: the signal that ended it)."""
    signal_process_tree(process.pid, signal.SIGTERM)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(process.wait(), timeout=grace_period_s)
    signal_process_tree(process.pid, signal.SIGKILL)
    return await process.wait()
