"""A job's processes: finding every process it made, and ending them (command_start.py starts
its command).

Where the host allows it, a job runs in a PID namespace of its own (`containment.py`), and the
kernel holds its processes together. Either way, each job's processes carry a marker in their
environment (`JOBS_SERVER_JOB_TOKEN`), inherited by every child, so a process that called
`setsid` or double-forked is still found (the only way without a namespace; with one, it finds a
namespace whose launcher died). The supervisor is a child subreaper (orphans are re-parented to it
instead of init), so they also stay in its subtree and it can reap them.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import threading
import time
import weakref
from dataclasses import dataclass, field

import psutil

from jobs_server.manager.supervisor.command_start import CommandProcess

# Where callers (tests among them) have always found it.
from jobs_server.manager.supervisor.command_start import start_entrypoint as start_entrypoint
from jobs_server.manager.supervisor.containment import COMMAND_NAMESPACE_PID, Containment

logger = logging.getLogger(__name__)

JOB_TOKEN_ENV_VAR = "JOBS_SERVER_JOB_TOKEN"
# The commands a stop found exited on their own as it was about to signal them (see
# `ended_before_the_stop`), while anything holds them.
_ENDED_BEFORE_THEIR_STOP: weakref.WeakSet[CommandProcess] = weakref.WeakSet()
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


def find_job_processes(
    job_token: str,
    root_pid: int | None = None,
    *,
    other_roots: frozenset[int] = frozenset(),
    group: int | None = None,
) -> list[int]:
    """Every live process of a job: the command's descendants, and the orphans it left. Each
    parent comes before its children, the order to signal them in (see `signal_job_processes`).

    Orphans are re-parented to this process (a subreaper), so they are found among its own
    children by the job's marker, or as members of the process group `group` (the init of a
    namespace whose launcher died is in the launcher's group, and has no marker if a fork server
    forked it).
    Only the job's processes and
    this process's children are read, less `other_roots` (the commands of this supervisor's
    other jobs): stopping fifty jobs at once costs no fifty scans of every process on the node.
    """
    found: dict[int, None] = {}  # an ordered set
    if root_pid is not None:
        found.update(dict.fromkeys(_tree(root_pid)))
    marker = f"{JOB_TOKEN_ENV_VAR}={job_token}".encode()
    for child in _own_children():
        if (
            child not in found
            and child not in other_roots
            and (_environ_has(child, marker) or _in_group(child, group))
        ):
            found.update(dict.fromkeys(_tree(child)))
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


def _tree(pid: int) -> list[int]:
    """`pid` and its descendants, level by level: each parent before its children."""
    tree = [pid]
    seen = {pid}
    for parent in tree:  # grows as it goes
        for child in _children(parent):
            if child not in seen:
                seen.add(child)
                tree.append(child)
    return tree


def _environ_has(pid: int, marker: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as environ:
            return marker in environ.read().split(b"\0")
    except OSError:
        return False


def _in_group(pid: int, group: int | None) -> bool:
    try:
        return group is not None and os.getpgid(pid) == group
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
    containment: Containment = Containment.MARKER,
    other_roots: frozenset[int] = frozenset(),
    group: int | None = None,
) -> int:
    """Send `sig` to every process of the job at once; return how many were signalled.

    At once, because a shell that sees its child die before it is signalled itself runs its
    next command. In a PID namespace, the init (`root_pid`, or the launcher there that passes
    the signal to it) sends it to the whole namespace in one call (SIGKILL to its group ends
    the namespace). Without one, the command's process group first (one call, the processes a
    shell waits for), then every other process it owns.

    What is signalled one by one goes parents first: a process that has a SIGKILL pending runs
    no more code, so no shell is left to see its child die (the supervisor may be preempted
    between two calls, and a namespace's init may take a while to die and end the rest).
    """
    root = root_pid if root_pid is not None and _is_alive(root_pid) else None
    if root is not None and containment == Containment.PID_NAMESPACE and sig != signal.SIGKILL:
        with contextlib.suppress(ProcessLookupError):
            os.kill(root, sig)
        return 1  # its namespace holds every other process of it
    found = find_job_processes(job_token, root_pid, other_roots=other_roots, group=group)
    if root is not None:
        with contextlib.suppress(ProcessLookupError):
            # The command leads a process group of its own: its group id is its pid.
            os.killpg(root, sig)
    for pid in found:
        if root is None or _group_of(pid) != root:  # else signalled with its group
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
    return len(found)


def _group_of(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


async def kill_job_processes(
    job_token: str,
    root_pid: int | None = None,
    *,
    containment: Containment = Containment.MARKER,
    other_roots: frozenset[int] = frozenset(),
    group: int | None = None,
) -> None:
    """SIGKILL the job's processes until none is left (a forking process may add one meanwhile)."""
    for _ in range(_KILL_ROUNDS):
        killed = signal_job_processes(
            job_token,
            signal.SIGKILL,
            root_pid,
            containment=containment,
            other_roots=other_roots,
            group=group,
        )
        if killed == 0:
            return
        await asyncio.sleep(_KILL_ROUND_WAIT_S)


def has_exited(process: CommandProcess) -> bool:
    """Whether the command has exited, even if asyncio (or a `ForkedProcess`) has not
    collected its status yet (without collecting it: they still do)."""
    if process.returncode is not None:
        return True
    try:
        return os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True  # collected meanwhile


def command_has_ended(process: CommandProcess, containment: Containment) -> bool:
    """Whether the command has ended: `has_exited`, or in a PID namespace, its shell has. What
    waits for the shell outlives it a moment: the init reaps it and exits as it did (or reports
    its status to a launcher, which exits so); on a busy node that is long enough for a stop to
    come in it, and the stop would find nothing left to stop."""
    if has_exited(process):
        return True
    if containment != Containment.PID_NAMESPACE:
        return False  # the process is the shell itself
    # The process is the init (zygote.py), or a launcher whose one child is the init, there
    # from before the command was reported started. The init's first child is the shell (the
    # others are orphans it adopted).
    inits = [process.pid] if is_namespace_init(process) else _children(process.pid)
    return not any(
        _is_alive(child) and _namespace_pid(child) in (COMMAND_NAMESPACE_PID, None)
        for init in inits
        if _is_alive(init)
        for child in _children(init)
    )


def ended_before_the_stop(process: CommandProcess) -> bool:
    """Whether a command that was being stopped had exited on its own before the stop reached
    it (between "has it ended?" and the SIGTERM): its namespace's init says so (zygote.py),
    or the command (or its launcher) was found exited as the stop was about to signal it.
    False otherwise: it counts as stopped."""
    return (
        process in _ENDED_BEFORE_THEIR_STOP
        or getattr(process, "stop_reached_command", None) is False
    )


def is_namespace_init(process: CommandProcess) -> bool:
    """Whether the command's process is its PID namespace's init (a fork server's, with no
    launcher: zygote.py), not a launcher or the shell."""
    return bool(getattr(process, "namespace_init", False))


def _namespace_pid(pid: int) -> int | None:
    """`pid`'s number in its own (innermost) PID namespace; None if unknown (it is gone, or a
    kernel before 4.1 does not say)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("NSpid:"):
                    return int(line.split()[-1])
    except (OSError, ValueError):
        pass
    return None


def ended_with_its_namespace(process: CommandProcess, containment: Containment) -> bool:
    """Whether nothing of the command can be left: its PID namespace's init has exited (the
    process itself, or the launcher that exited, not killed by a signal, after it), and the
    init's end killed and reaped the whole namespace."""
    return (
        containment == Containment.PID_NAMESPACE
        and process.returncode is not None
        and (process.returncode >= 0 or is_namespace_init(process))
    )


def reap_orphans(keep: set[int]) -> None:
    """Collect exited orphans re-parented to this subreaper, except `keep` (awaited elsewhere)."""
    for child in _own_children():
        if child not in keep and not _is_alive(child):
            with contextlib.suppress(ChildProcessError):
                os.waitpid(child, os.WNOHANG)


@dataclass
class StopDeadline:
    """When a stopping job's grace period ends. A later stop with a shorter grace period moves
    it earlier (never later), as a second `kubectl delete --grace-period` does."""

    at_s: float
    """On the `time.monotonic()` clock."""
    moved: asyncio.Event = field(default_factory=asyncio.Event)

    @classmethod
    def after(cls, grace_period_s: float) -> StopDeadline:
        return cls(at_s=time.monotonic() + grace_period_s)

    def shorten_to(self, grace_period_s: float) -> None:
        """End the grace period `grace_period_s` from now, if that is sooner."""
        at_s = time.monotonic() + grace_period_s
        if at_s < self.at_s:
            self.at_s = at_s
            self.moved.set()

    async def wait_for_exit(self, process: CommandProcess) -> None:
        """Return when the process exits or the deadline (as it is by then) passes."""
        exited = asyncio.ensure_future(process.wait())
        try:
            while not exited.done():
                self.moved.clear()
                moved = asyncio.ensure_future(self.moved.wait())
                await asyncio.wait(
                    {exited, moved},
                    timeout=max(0.0, self.at_s - time.monotonic()),
                    return_when=asyncio.FIRST_COMPLETED,
                )
                moved.cancel()
                if not moved.done() and time.monotonic() >= self.at_s:
                    return
        finally:
            exited.cancel()


async def stop_job_processes(
    process: CommandProcess,
    *,
    job_token: str,
    deadline: StopDeadline,
    containment: Containment = Containment.MARKER,
    other_roots: frozenset[int] = frozenset(),
    terminated: bool = False,
) -> int:
    """SIGTERM every process of the job (unless `terminated`: it was sent as the command
    started, and a second one would run a job's TERM trap twice), wait until the deadline for
    the command to exit, then SIGKILL what is left. Return the command's exit code (negative:
    the ending signal)."""
    if not terminated:
        if has_exited(process):
            # It exited on its own since "has it ended?" said no: no stop reaches it (nothing
            # else reaps it meanwhile: this is the event loop's thread). What it left is
            # killed below.
            _ENDED_BEFORE_THEIR_STOP.add(process)
        else:
            signal_job_processes(
                job_token,
                signal.SIGTERM,
                process.pid,
                containment=containment,
                other_roots=other_roots,
            )
    await deadline.wait_for_exit(process)
    await kill_job_processes(
        job_token, process.pid, containment=containment, other_roots=other_roots
    )
    return await process.wait()
