"""Fate sharing: a tiny watcher process that kills a supervisor's jobs when the supervisor dies.

The supervisor starts the guardian with a pipe as its stdin and never writes to it. When the
supervisor exits for any reason, `kill -9` included, the kernel closes the pipe, the guardian's
read returns, and it SIGKILLs every process that carries the supervisor's marker in its
environment: the jobs' processes, including those that called `setsid` or double-forked.

The guardian is plain standard-library Python run with `python -c`, so it needs nothing installed.
"""

from __future__ import annotations

import subprocess
import sys

SUPERVISOR_TOKEN_ENV_VAR = "JOBS_SERVER_SUPERVISOR_TOKEN"

GUARDIAN_SOURCE = r"""
import os, signal, sys, time

# Detach from the supervisor: Ray kills a dying worker's child processes, and the guardian must
# outlive the supervisor to do its work.
if os.fork() > 0:
    os._exit(0)
os.setsid()
marker = sys.argv[1].encode()
sys.stdin.buffer.read()  # returns when the supervisor's end of the pipe closes
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
