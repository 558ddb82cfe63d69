"""The supervisor's side of its fork server (zygote.py): one process, started once, forks the
launcher of every job, where starting an interpreter per job cost most of a short job's CPU.

One reader of the fork server's reports (on the event loop: no thread per child, no `Popen` per
job) feeds a `ForkedProcess` per job, which stands in for an `asyncio.subprocess.Process`.
If the fork server dies, so do its launchers (their parent-death signal) and so their jobs: each
ends as killed by SIGKILL, and the next job starts a new fork server.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from jobs_server.manager.containment import SHELL, Containment
from jobs_server.manager.guardian import SUPERVISOR_TOKEN_ENV_VAR
from jobs_server.manager.zygote import ZYGOTE_SOURCE

logger = logging.getLogger(__name__)

FORK_SERVER_DIED = "when its supervisor's fork server died"
_READ_SIZE = 1 << 16


class ForkServerDiedError(OSError):
    """The fork server died before the command was reported started."""


class ForkedProcess:
    """A job's launcher, forked by the fork server: `pid`, `returncode` and `wait()` as an
    `asyncio.subprocess.Process` has them."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self.ended_by = ""
        """Why it ended, if not of itself (`FORK_SERVER_DIED`)."""
        self._exited = asyncio.Event()

    async def wait(self) -> int:
        await self._exited.wait()
        assert self.returncode is not None
        return self.returncode

    def end(self, returncode: int, ended_by: str = "") -> None:
        if self.returncode is None:
            self.returncode, self.ended_by = returncode, ended_by
            self._exited.set()


class ForkServer:
    """Starts jobs' launchers through one fork server, which it (re)starts when needed."""

    def __init__(self, supervisor_token: str) -> None:
        self._supervisor_token = supervisor_token
        self._process: subprocess.Popen[bytes] | None = None
        self._requests = -1
        self._reports = -1
        self._unsent = bytearray()
        self._partial_report = b""
        self._job_numbers = itertools.count()
        self._starting: dict[int, asyncio.Future[ForkedProcess]] = {}
        self._running: dict[int, ForkedProcess] = {}

    @property
    def pid(self) -> int | None:
        """The fork server's process id while it runs (for tests)."""
        return None if self._process is None else self._process.pid

    def start(self) -> None:
        """Start the fork server (from the event loop's thread: its parent-death signal comes
        when the thread that forked it ends)."""
        env = {
            name: value
            for name, value in os.environ.items()
            if not name.upper().startswith("JOBS_SERVER_")
        }
        # Marked as the jobs' processes are: the guardian kills it (and so its launchers) too.
        env[SUPERVISOR_TOKEN_ENV_VAR] = self._supervisor_token
        process = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", ZYGOTE_SOURCE, str(os.getpid())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            # Its own session: stopping a job's processes never reaches it.
            start_new_session=True,
        )
        assert process.stdin is not None
        assert process.stdout is not None
        self._process = process
        self._requests, self._reports = process.stdin.fileno(), process.stdout.fileno()
        os.set_blocking(self._requests, False)
        os.set_blocking(self._reports, False)
        asyncio.get_running_loop().add_reader(self._reports, self._read_reports)

    async def spawn(
        self, entrypoint: str, *, log_path: Path, env: Mapping[str, str], containment: Containment
    ) -> ForkedProcess:
        """Run `entrypoint` as `containment.launch_argv` would; return once the command runs.
        Raises OSError if it cannot start (the log would not open, the fork server died)."""
        if self._process is None:
            self.start()
        job = next(self._job_numbers)
        started: asyncio.Future[ForkedProcess] = asyncio.get_running_loop().create_future()
        self._starting[job] = started
        fields = [str(job), str(containment), SHELL, os.fspath(log_path), entrypoint]
        fields += [f"{name}={value}" for name, value in env.items()]
        frame = b"\0".join(os.fsencode(field) for field in fields)
        self._send(b"%d\n%s" % (len(frame), frame))
        return await started

    def close(self) -> None:
        """End the fork server (and with it every launcher it forked) and wait for it."""
        process = self._process
        if process is None:
            return
        self._died()
        process.wait()

    def _send(self, data: bytes) -> None:
        self._unsent += data
        if len(self._unsent) == len(data):
            self._flush()

    def _flush(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            written = os.write(self._requests, self._unsent)
        except BlockingIOError:
            written = 0
        except OSError:
            self._unsent.clear()  # it died: its reports' end says so
            loop.remove_writer(self._requests)
            return
        del self._unsent[:written]
        if self._unsent:
            loop.add_writer(self._requests, self._flush)
        else:
            loop.remove_writer(self._requests)

    def _read_reports(self) -> None:
        try:
            data = os.read(self._reports, _READ_SIZE)
        except BlockingIOError:
            return
        if not data:
            logger.warning("the fork server died; its jobs were killed with it")
            self._died()
            return
        *lines, self._partial_report = (self._partial_report + data).split(b"\n")
        for line in lines:
            what, job, detail = line.split(b" ", 2)
            if what == b"started":
                self._started(int(job), ForkedProcess(int(detail)))
            elif what == b"exited":
                process = self._running.pop(int(job), None)
                if process is not None:
                    process.end(os.waitstatus_to_exitcode(int(detail)))
            else:
                started = self._starting.pop(int(job))
                if not started.done():
                    started.set_exception(OSError(detail.decode(errors="replace")))

    def _started(self, job: int, process: ForkedProcess) -> None:
        started = self._starting.pop(job)
        if started.cancelled():
            # Nobody awaits it: it must not run on unseen.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            return
        self._running[job] = process
        started.set_result(process)

    def _died(self) -> None:
        """Forget the fork server; its jobs died with it (their launchers' death signal)."""
        process, self._process = self._process, None
        if process is None:
            return
        loop = asyncio.get_running_loop()
        loop.remove_reader(self._reports)
        loop.remove_writer(self._requests)
        assert process.stdin is not None
        assert process.stdout is not None
        process.stdin.close()
        process.stdout.close()
        self._unsent.clear()
        self._partial_report = b""
        for started in self._starting.values():
            if not started.done():
                started.set_exception(ForkServerDiedError("the supervisor's fork server died"))
        for running in self._running.values():
            running.end(-signal.SIGKILL, FORK_SERVER_DIED)
        self._starting.clear()
        self._running.clear()
        process.poll()  # reaped now if it has ended; else by the supervisor's orphan reaping
