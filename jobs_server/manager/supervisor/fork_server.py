"""The supervisor's side of its fork server (zygote.py): one process, started once, forks the
first process of every job (its namespace's init, or a launcher), where starting an interpreter
per job cost most of a short job's CPU.

Each job's first process is the supervisor's child (cloned as such, or re-parented to it: the
supervisor must be a child subreaper; zygote.py says why both): the supervisor reaps it (woken by
a pidfd on the event loop: no thread per child, no `Popen` per job), and a `ForkedProcess` stands
in for the `asyncio.subprocess.Process` a launcher it starts itself would be. One reader of the fork
server's reports feeds them. If the fork server dies, the jobs it started run on; a job it was
starting is killed and fails to start, and the next job starts a new fork server.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import itertools
import logging
import os
import resource
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

from jobs_server.manager.supervisor.containment import SHELL, Containment
from jobs_server.manager.supervisor.early_stop import EarlyStop, until_started_or_stopped
from jobs_server.manager.supervisor.guardian import SUPERVISOR_TOKEN_ENV_VAR
from jobs_server.manager.supervisor.zygote import ZYGOTE_SOURCE

logger = logging.getLogger(__name__)

_READ_SIZE = 1 << 16
# Asyncio's figure for a child whose status someone else collected.
_UNKNOWN_EXIT_CODE = 255
# A fork server's ends directory in the temp dir: `<prefix><random>`, made under the staging
# prefix and renamed once its lock is held.
ENDS_DIR_PREFIX = "jobs-server-ends-"
_ENDS_DIR_STAGING_PREFIX = ".jobs-server-ends-new-"
_RENAME_TRIES = 4
_DIRECTORY_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class ForkServerDiedError(OSError):
    """The fork server died before the command was reported started."""


class ForkedProcess:
    """A job's first process (its launcher, or its namespace's init), forked by the fork server
    as this process's child: `pid`, `returncode` and `wait()` as an `asyncio.subprocess.Process`
    has them."""

    def __init__(self, pid: int, *, end_path: str | None = None) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self.rusage: resource.struct_rusage | None = None
        """Once it has exited: what it and the descendants it (and they) reaped used (wait4):
        in a PID namespace, every process of the job, whose init reaps them all."""
        self.stop_reached_command: bool | None = None
        """An init's, once it has exited: whether a stop (a signal it passes on) reached its
        command while it ran; False if the command ended on its own, a stop coming after."""
        # An init's: where it left the wait status of a command that a signal ended.
        self._end_path = end_path
        self._exited = asyncio.Event()
        # Readable when the process exits (opened before anything may reap it).
        self._pidfd = os.pidfd_open(pid)
        asyncio.get_running_loop().add_reader(self._pidfd, self._reap)

    async def wait(self) -> int:
        await self._exited.wait()
        assert self.returncode is not None
        return self.returncode

    def _reap(self) -> None:
        try:
            pid, status, rusage = os.wait4(self.pid, os.WNOHANG)
        except ChildProcessError:
            pid, status, rusage = self.pid, -1, None  # collected by someone else
        if pid == 0:
            return
        self.rusage = rusage
        asyncio.get_running_loop().remove_reader(self._pidfd)
        os.close(self._pidfd)
        returncode = _UNKNOWN_EXIT_CODE if status < 0 else os.waitstatus_to_exitcode(status)
        if self._end_path is not None and status >= 0:
            if os.WIFSIGNALED(status):
                self.stop_reached_command = True  # the init itself was killed: a stop's SIGKILL
            else:
                returncode, self.stop_reached_command = _command_end(self._end_path, returncode)
        self.returncode = returncode
        self._exited.set()

    @property
    def namespace_init(self) -> bool:
        """Whether this is its PID namespace's init (no launcher: zygote.py): once it has
        exited, nothing of the job is left."""
        return self._end_path is not None


def _command_end(end_path: str, returncode: int) -> tuple[int, bool]:
    """How the command of an init that exited with `returncode` ended: by the signal whose wait
    status the init left in `end_path` (zygote.py: `become_init`), or as the init did; and
    whether a stop reached it while it ran (the init says " stopped" there)."""
    try:
        with open(end_path, "rb") as end:
            status, *stopped = end.read().split()
        command_returncode = os.waitstatus_to_exitcode(int(status))
    except (OSError, ValueError):
        return returncode, False  # none left: the command's own exit code
    with contextlib.suppress(OSError):
        os.unlink(end_path)
    return command_returncode, stopped == [b"stopped"]


def make_ends_dir() -> tuple[str, int]:
    """A new ends directory (0700) in the temp dir, and a descriptor of it that holds its lock
    for as long as it is open, in this process only (close-on-exec: neither the fork server nor
    a job holds it, so an orphaned job does not keep a dead supervisor's directory "alive": the
    directory is read by the supervisor alone, and an init finding it gone loses nothing the
    supervisor could still read). It is locked before it gets a name a sweep looks at."""
    staging = tempfile.mkdtemp(prefix=_ENDS_DIR_STAGING_PREFIX)
    lock = os.open(staging, _DIRECTORY_FLAGS)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for _ in range(_RENAME_TRIES - 1):
            with contextlib.suppress(OSError):  # the name is taken: another one
                return _renamed(staging), lock
        return _renamed(staging), lock
    except BaseException:
        os.close(lock)
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _renamed(staging: str) -> str:
    path = os.path.join(os.path.dirname(staging), ENDS_DIR_PREFIX + secrets.token_hex(8))
    os.rename(staging, path)  # fails onto anything but an empty directory of ours
    return path


def sweep_ends_dirs(parent: str, *, keep: str) -> list[str]:
    """Remove the ends directories in `parent` whose fork server's supervisor is gone (killed
    with its guardian: a node's crash): this user's own directories that nobody holds the lock
    of and no process was started with (a live fork server of a version without the lock names
    its directory in its arguments). Never a live one's, another user's, or what a symlink
    points at. Returns the removed."""
    try:
        names = os.listdir(parent)
    except OSError:
        return []
    unheld: dict[str, int] = {}
    try:
        for name in names:
            path = os.path.join(parent, name)
            if not name.startswith(ENDS_DIR_PREFIX) or path == keep:
                continue
            try:
                lock = os.open(path, _DIRECTORY_FLAGS)
            except OSError:
                continue  # gone, a symlink, not a directory
            try:
                if os.fstat(lock).st_uid == os.getuid():
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    unheld[path], lock = lock, -1
            except BlockingIOError:
                pass  # its supervisor lives
            finally:
                if lock >= 0:
                    os.close(lock)
        removed = sorted(set(unheld) - _process_arguments(set(unheld)))
        for path in removed:
            shutil.rmtree(path, ignore_errors=True)
        return removed
    finally:
        for lock in unheld.values():
            os.close(lock)


def _process_arguments(wanted: set[str]) -> set[str]:
    """Those of `wanted` that a process of this node has among its arguments."""
    if not wanted:
        return set()
    found: set[str] = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                arguments = cmdline.read().split(b"\0")
        except OSError:
            continue  # gone meanwhile
        found.update(wanted.intersection(map(os.fsdecode, arguments)))
    return found


def _reap_later(pid: int) -> None:
    """Reap a launcher nobody awaits when it exits."""
    with contextlib.suppress(OSError):  # gone already
        ForkedProcess(pid)


class ForkServer:
    """Starts jobs through one fork server, which it (re)starts when needed."""

    def __init__(
        self,
        supervisor_token: str,
        *,
        shell: str = SHELL,
        clone_parent: bool = True,
        nice: int = 0,
    ) -> None:
        self._supervisor_token = supervisor_token
        self._shell = shell
        # The jobs' nice value, at least (zygote.py's `lower_priority`); 0: the supervisor's.
        self._nice = nice
        # False: the launcher is forked twice, as where the clone is refused (zygote.py).
        self._clone_parent = clone_parent
        self._process: subprocess.Popen[bytes] | None = None
        self._requests = -1
        self._reports = -1
        self._unsent = bytearray()
        self._partial_report = b""
        self._job_numbers = itertools.count()
        self._starting: dict[int, asyncio.Future[ForkedProcess]] = {}
        self._forked: dict[int, int] = {}  # job: launcher pid, until it is reported started
        # Jobs stopped before their launcher was forked: it gets SIGTERM when it is.
        self._stop_when_forked: dict[int, Containment] = {}
        # Jobs forked as their namespace's init (no launcher), until reported started.
        self._inits: set[int] = set()
        # Where the inits leave how a command that a signal ended did end (zygote.py), and the
        # descriptor that holds its lock while this fork server may start jobs.
        self._ends_dir: str | None = None
        self._ends_lock = -1

    @property
    def ends_dir(self) -> str | None:
        """Where the inits leave their commands' ends, once started (until closed)."""
        return self._ends_dir

    @property
    def pid(self) -> int | None:
        """The fork server's process id while it runs (for tests)."""
        return None if self._process is None else self._process.pid

    def start(self) -> None:
        """Start the fork server. Call it from the event loop's thread (the fork server's
        parent-death signal comes when the thread that forked it ends) of a child subreaper.
        Raises OSError where this host has no pidfds (Linux < 5.3)."""
        os.close(os.pidfd_open(os.getpid()))
        env = {
            name: value
            for name, value in os.environ.items()
            if not name.upper().startswith("JOBS_SERVER_")
        }
        # Marked as the jobs' processes are: the guardian kills it and its launchers too.
        env[SUPERVISOR_TOKEN_ENV_VAR] = self._supervisor_token
        if self._ends_dir is None:
            self._ends_dir, self._ends_lock = make_ends_dir()
            # What killed supervisors left (their close never ran, nor their guardian): few, as
            # each fork server's start sweeps; a few ms at the first job of a supervisor.
            for removed in sweep_ends_dirs(os.path.dirname(self._ends_dir), keep=self._ends_dir):
                logger.info("removed %s: its supervisor is gone", removed)
        process = subprocess.Popen(
            [
                sys.executable,
                "-I",
                "-S",
                "-c",
                ZYGOTE_SOURCE,
                str(os.getpid()),
                "1" if self._clone_parent else "0",
                self._ends_dir,
                str(self._nice),
            ],
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
        self,
        entrypoint: str,
        *,
        log_path: Path,
        env: Mapping[str, str],
        containment: Containment,
        early_stop: EarlyStop | None = None,
        cgroup_join_files: tuple[str, ...] = (),
    ) -> ForkedProcess:
        """Run `entrypoint` as `containment.launch_argv` would (its first process in the
        cgroup of `cgroup_join_files`); return once the command runs (or has been sent SIGTERM:
        `early_stop`). Raises OSError if it cannot start (the log would not open, the fork
        server died, the cgroup refused it)."""
        if self._process is None:
            self.start()
        job = next(self._job_numbers)
        started: asyncio.Future[ForkedProcess] = asyncio.get_running_loop().create_future()
        self._starting[job] = started
        fields = [str(job), str(containment), self._shell, os.fspath(log_path), entrypoint]
        fields.append("\n".join(cgroup_join_files))
        fields += [f"{name}={value}" for name, value in env.items()]
        if any("\0" in field for field in fields) or any(not n or "=" in n for n in env):
            del self._starting[job]
            raise OSError("cannot start the job: a NUL, or an empty or '=' env var name")
        frame = b"\0".join(os.fsencode(field) for field in fields)
        self._send(b"%d\n%s" % (len(frame), frame))
        try:
            if await until_started_or_stopped(started, early_stop):
                self._stop_starting(job, containment)
            return await started
        except asyncio.CancelledError:
            started.cancel()  # nobody awaits it: `_started` kills it
            raise

    def _stop_starting(self, job: int, containment: Containment) -> None:
        """SIGTERM to a job's launcher as soon as it is forked: it holds the signal (blocked
        since before its fork) until its handlers pass it on, so its command never runs on."""
        pid = self._forked.get(job)
        if pid is None:
            self._stop_when_forked[job] = containment
            return
        if containment != Containment.PID_NAMESPACE:
            with contextlib.suppress(ProcessLookupError):
                # The launcher became the shell, in a group of its own: all of it at once (no
                # shell sees its child die). No such group yet: it has not exec'd, see below.
                os.killpg(pid, signal.SIGTERM)
                return
        # A namespace's launcher passes it to the init, which signals the whole namespace.
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)

    def close(self) -> None:
        """End the fork server and wait for it, and remove its ends directory with what is in
        it (as the supervisor ends). The jobs it started run on; the end of a signal that ends
        one of them now is read as the exit code 128 + its number (as without the file)."""
        process = self._process
        if process is not None:
            self._died()
            process.wait()
        if self._ends_dir is not None:
            shutil.rmtree(self._ends_dir, ignore_errors=True)
            os.close(self._ends_lock)  # after: no sweep meets it half removed
            self._ends_dir, self._ends_lock = None, -1

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
            logger.warning("the fork server died; the next job starts a new one")
            self._died()
            return
        *lines, self._partial_report = (self._partial_report + data).split(b"\n")
        for line in lines:
            what, job_number, detail = (line + b" ").split(b" ", 2)
            job = int(job_number)
            if what == b"forked":
                launched, _, shape = detail.strip().partition(b" ")
                self._forked[job] = int(launched)
                if shape == b"init":
                    self._inits.add(job)
                if job in self._stop_when_forked:
                    self._stop_starting(job, self._stop_when_forked.pop(job))
            elif what == b"started":
                self._started(job)
            else:
                self._stop_when_forked.pop(job, None)
                self._inits.discard(job)
                pid = self._forked.pop(job, None)
                if pid is not None:
                    _reap_later(pid)  # the launcher that could not exec its shell
                failed = self._starting.pop(job, None)
                if failed is not None and not failed.done():
                    failed.set_exception(OSError(detail.strip().decode()))

    def _started(self, job: int) -> None:
        pid = self._forked.pop(job)
        started = self._starting.pop(job)
        end_path = None
        if job in self._inits:
            self._inits.discard(job)
            assert self._ends_dir is not None
            end_path = os.path.join(self._ends_dir, str(job))
        try:
            process = ForkedProcess(pid, end_path=end_path)
        except OSError as error:  # reaped by someone else already: its exit code is lost
            if not started.done():
                started.set_exception(error)
            return
        if started.cancelled():
            # Nobody awaits it: it must not run on unseen.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
        else:
            started.set_result(process)

    def _died(self) -> None:
        """Forget the fork server. What it was starting is killed (its launcher's group: the
        launcher, and its init or shell) and fails to start; what it started runs on."""
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
        for pid in self._forked.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)  # it may not lead its group yet
                os.killpg(pid, signal.SIGKILL)
            _reap_later(pid)
        for started in self._starting.values():
            if not started.done():
                started.set_exception(ForkServerDiedError("the supervisor's fork server died"))
        self._starting.clear()
        self._forked.clear()
        self._stop_when_forked.clear()
        self._inits.clear()
        process.poll()  # reaped now if it has ended; else by the supervisor's orphan reaping
