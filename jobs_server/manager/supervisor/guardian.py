"""Fate sharing: a tiny watcher process that kills a supervisor's jobs when the supervisor dies.

The supervisor starts the guardian with a pipe as its stdin and never writes to it. When the
supervisor exits for any reason, `kill -9` included, the kernel closes the pipe, the guardian's
read returns, and it SIGKILLs every process that carries the supervisor's marker in its
environment: the jobs' processes, including those that called `setsid` or double-forked.

The supervisor may name directories of its own on the pipe (`remove_when_supervisor_dies`): the
guardian removes them once the jobs are killed, as nothing of the supervisor would.

The guardian is plain standard-library Python run with `python -c`, so it needs nothing installed.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys

logger = logging.getLogger(__name__)

SUPERVISOR_TOKEN_ENV_VAR = "JOBS_SERVER_SUPERVISOR_TOKEN"

GUARDIAN_SOURCE = r"""
import os, signal, sys, time

# Detach from the supervisor: Ray kills a dying worker's child processes, and the guardian must
# outlive the supervisor to do its work.
if os.fork() > 0:
    os._exit(0)
os.setsid()
marker = sys.argv[1].encode()
# Returns when the supervisor's end of the pipe closes: the directories it named meanwhile.
directories = sys.stdin.buffer.read().splitlines()
me = os.getpid()
for _ in range(100):
    killed = 0
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open("/proc/%s/environ" % name, "rb") as environ:
                if marker not in environ.read().split(b"\0"):
                    continue
            os.kill(int(name), signal.SIGKILL)
            killed += 1
        except OSError:
            pass
    if not killed:
        break
    time.sleep(0.05)
if directories:
    import shutil
    for directory in directories:
        shutil.rmtree(os.fsdecode(directory), ignore_errors=True)
"""


def start_guardian(supervisor_token: str) -> subprocess.Popen[bytes]:
    """Start the guardian for the processes marked with `supervisor_token`.

    Call it before the supervisor becomes a subreaper, or the detached guardian comes back to
    it as a child. Keep the returned object: its open stdin is what the guardian watches.
    """
    launcher = subprocess.Popen(
        [sys.executable, "-c", GUARDIAN_SOURCE, f"{SUPERVISOR_TOKEN_ENV_VAR}={supervisor_token}"],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        # Its own session: stopping a job's processes never reaches it.
        start_new_session=True,
    )
    launcher.wait()  # the launcher exits at once, leaving the forked guardian behind
    return launcher


def remove_when_supervisor_dies(guardian: subprocess.Popen[bytes], directory: str) -> None:
    """Have the guardian started by `start_guardian` remove `directory` (with what is in it)
    when this process dies, after its jobs."""
    assert guardian.stdin is not None
    try:
        # A line on a pipe nobody else writes: never blocks, never interleaves.
        guardian.stdin.write(os.fsencode(directory) + b"\n")
        guardian.stdin.flush()
    except OSError as error:  # the guardian is gone: a later start's sweep removes it
        logger.warning("the guardian cannot remove %s: %s", directory, error)
