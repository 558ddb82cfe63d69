"""A cgroup per job attempt: the kernel enforces the job's limits (limits.py) on all of its
processes together, and measures what they used.

    <the jobs' cgroup, --jobs-cgroup>     one per node; on the head, the head-wide memory
      │                                   ceiling (--head-jobs-memory-max-bytes)
      └── sup-<pid>-<start ticks>         one per supervisor process
            └── <run id>-<attempt>        one per attempt: its limits, its peak, its CPU

Where the host has cgroup v2 with the `memory`, `cpu` and `pids` controllers delegated to us,
the tree is one directory; with cgroup v1 (these controllers in the `memory`, `cpu`, `cpuacct`
and `pids` hierarchies) it is the same path in each hierarchy. Neither writable: no limits
(`LimitsSupport.NONE`); what a job used is then measured from its reaped processes (rusage).

A job's first process (its namespace's init, or its launcher) moves itself into the attempt's
cgroup before anything of the job runs (containment.py `join_cgroups`, in the fork server and
the launcher; `AttemptCgroup.join_files` says through which files, and why those), so every
process of the job is born in it. The attempt's cgroup is removed at its end; when the
supervisor is killed, its guardian removes the supervisor's directory after killing its jobs;
when both were (the node's crash, the embedded server's kill -9), the next supervisor or server
on the node sweeps what dead supervisors left (`sweep_dead_supervisors`).

Cgroup files are kernel memory, not disk: a read or write takes microseconds, and is done on
the event loop like any other in-memory work.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import errno
import logging
import os
import resource
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from jobs_server.manager.limits import JobLimits, ResourceUsage

logger = logging.getLogger(__name__)

DEFAULT_JOBS_CGROUP = "jobs-server"
SUPERVISOR_DIR_PREFIX = "sup-"
V1_CONTROLLERS = ("memory", "cpu", "cpuacct", "pids")
V2_CONTROLLERS = ("memory", "cpu", "pids")
CPU_PERIOD_US = 100_000
# A cgroup's tasks are gone some microseconds after their kill is reported; rmdir says EBUSY
# until then.
_REMOVE_TRIES = 50
_REMOVE_RETRY_S = 0.01
_NS_PER_S = 1e9
_US_PER_S = 1e6


class LimitsSupport(enum.StrEnum):
    """How a node enforces limits (`GET /api/version`'s `limits`)."""

    CGROUP2 = "cgroup2"
    CGROUP1 = "cgroup1"
    NONE = "none"


@dataclass(frozen=True)
class JobsCgroupTree:
    """The node's jobs cgroup: its directory in each hierarchy it needs (v2: one)."""

    support: LimitsSupport
    controllers: tuple[tuple[str, str], ...] = ()
    """(controller, absolute directory) for each controller used; for v1, in the order of
    `V1_CONTROLLERS`."""

    @property
    def directories(self) -> tuple[str, ...]:
        """Each directory once (v2: one; v1: one per hierarchy, hierarchies mounted together,
        e.g. `cpu,cpuacct`, sharing one)."""
        return tuple(dict.fromkeys(directory for _, directory in self.controllers))

    def directory_of(self, controller: str) -> str:
        return dict(self.controllers)[controller]


NO_CGROUPS = JobsCgroupTree(LimitsSupport.NONE)


def _own_cgroups() -> dict[str, str]:
    """This process's cgroup path by controller ('' for the v2 hierarchy)."""
    paths: dict[str, str] = {}
    with open("/proc/self/cgroup") as cgroups:
        for line in cgroups:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for controller in controllers.split(",") if controllers else [""]:
                paths[controller] = path
    return paths


def _cgroup_mounts() -> dict[str, str]:
    """Where each cgroup hierarchy is mounted, by controller ('' for cgroup2), from this
    process's mount table: the mount whose root is the hierarchy's root."""
    mounts: dict[str, str] = {}
    with open("/proc/self/mountinfo") as mountinfo:
        for line in mountinfo:
            before, _, after = line.partition(" - ")
            fields, options = before.split(), after.split()
            if len(fields) < 5 or len(options) < 3:
                continue
            root, mount_point, fs_type = fields[3], fields[4], options[0]
            if fs_type == "cgroup2" and "" not in mounts:
                mounts[""] = mount_point
            elif fs_type == "cgroup":
                for option in options[2].split(","):
                    if option in V1_CONTROLLERS and option not in mounts and root == "/":
                        mounts[option] = mount_point
    return mounts


def _resolve(own: str, jobs_cgroup: str) -> str:
    """The jobs cgroup's path in a hierarchy: absolute as given, else under this process's."""
    if jobs_cgroup.startswith("/"):
        return jobs_cgroup
    return f"{own.rstrip('/')}/{jobs_cgroup}"


def find_jobs_tree(jobs_cgroup: str = DEFAULT_JOBS_CGROUP) -> JobsCgroupTree:
    """Make (if missing) and return the node's jobs cgroup, as this host allows: cgroup v2,
    else v1, else none (logged once with the reason). Call it from a thread."""
    try:
        own, mounts = _own_cgroups(), _cgroup_mounts()
    except OSError as error:
        logger.warning("jobs run without limits (no cgroups): %s", error)
        return NO_CGROUPS
    problems = []
    for find in (_find_v2_tree, _find_v1_tree):
        try:
            return find(own, mounts, jobs_cgroup)
        except (OSError, LookupError) as error:
            problems.append(f"{find.__name__.removeprefix('_find_')}: {error}")
    logger.warning("jobs run without limits: %s", "; ".join(problems))
    return NO_CGROUPS


def _find_v2_tree(own: dict[str, str], mounts: dict[str, str], jobs_cgroup: str) -> JobsCgroupTree:
    if "" not in mounts or "" not in own:
        raise LookupError("no cgroup2 hierarchy")
    directory = mounts[""] + _resolve(own[""], jobs_cgroup)
    # Every level down to the jobs' cgroup must pass the controllers on.
    parent = Path(mounts[""])
    for part in Path(directory).relative_to(parent).parts:
        available = (parent / "cgroup.controllers").read_text().split()
        missing = [name for name in V2_CONTROLLERS if name not in available]
        if missing:
            raise LookupError(f"{parent} has no {', '.join(missing)} controller")
        # Refused (EBUSY) where the parent holds processes: it must be delegated to us.
        _enable_v2_subtree(str(parent))
        parent = parent / part
        parent.mkdir(exist_ok=True)
    _enable_v2_subtree(directory)
    _check_writable(directory)
    return JobsCgroupTree(
        LimitsSupport.CGROUP2, controllers=tuple((name, directory) for name in V2_CONTROLLERS)
    )


def _enable_v2_subtree(directory: str) -> None:
    path = Path(directory, "cgroup.subtree_control")
    enabled = path.read_text().split()
    wanted = [f"+{name}" for name in V2_CONTROLLERS if name not in enabled]
    if wanted:
        path.write_text(" ".join(wanted))


def _find_v1_tree(own: dict[str, str], mounts: dict[str, str], jobs_cgroup: str) -> JobsCgroupTree:
    missing = [name for name in V1_CONTROLLERS if name not in mounts or name not in own]
    if missing:
        raise LookupError(f"no cgroup v1 hierarchy of {', '.join(missing)}")
    controllers = tuple(
        (name, mounts[name] + _resolve(own[name], jobs_cgroup)) for name in V1_CONTROLLERS
    )
    tree = JobsCgroupTree(LimitsSupport.CGROUP1, controllers=controllers)
    for directory in tree.directories:
        os.makedirs(directory, exist_ok=True)
        _check_writable(directory)
    return tree


def _check_writable(directory: str) -> None:
    probe = os.path.join(directory, f"probe-{os.getpid()}")
    os.mkdir(probe)
    os.rmdir(probe)


def set_memory_ceiling(tree: JobsCgroupTree, memory_bytes: int | None) -> None:
    """The head-wide ceiling: all the jobs of this node together (the server's node); None:
    none."""
    if tree.support is LimitsSupport.CGROUP2:
        _write(tree.directory_of("memory"), "memory.max", memory_bytes or "max")
    elif tree.support is LimitsSupport.CGROUP1:
        memory = tree.directory_of("memory")
        _write_v1_memory_limit(memory, -1 if memory_bytes is None else memory_bytes)


def jobs_memory_usage(tree: JobsCgroupTree) -> int:
    """What the node's jobs use now (0 without cgroups)."""
    name = {LimitsSupport.CGROUP2: "memory.current", LimitsSupport.CGROUP1: "memory.usage_in_bytes"}
    if tree.support is LimitsSupport.NONE:
        return 0
    try:
        return int(_read(tree.directory_of("memory"), name[tree.support]))
    except (OSError, ValueError):
        return 0


def _write_v1_memory_limit(directory: str, memory_bytes: int) -> None:
    # With swap accounting (memsw), memory and swap together stay within the limit: a job
    # cannot go past it by being swapped out. memsw must stay >= the memory limit, so the
    # order of the two writes depends on the direction.
    memsw = os.path.join(directory, "memory.memsw.limit_in_bytes")
    has_memsw = os.path.exists(memsw)
    try:
        _write(directory, "memory.limit_in_bytes", memory_bytes)
        if has_memsw:
            _write(directory, "memory.memsw.limit_in_bytes", memory_bytes)
    except OSError as error:
        if error.errno != errno.EINVAL or not has_memsw:
            raise
        _write(directory, "memory.memsw.limit_in_bytes", memory_bytes)  # lowering: memsw first
        _write(directory, "memory.limit_in_bytes", memory_bytes)


def supervisor_dir_name() -> str:
    """This process's directory name: its pid and start time, which no later process of the
    same pid has."""
    pid = os.getpid()
    return f"{SUPERVISOR_DIR_PREFIX}{pid}-{_start_ticks(pid)}"


def _start_ticks(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            # After the command's name, which may hold spaces and parentheses.
            fields = stat.read().rpartition(")")[2].split()
    except OSError:
        return None
    return int(fields[19])


def make_supervisor_dirs(tree: JobsCgroupTree) -> tuple[str, ...]:
    """This supervisor's directories in the node's jobs cgroup (made if missing)."""
    name = supervisor_dir_name()
    made = []
    for directory in tree.directories:
        path = os.path.join(directory, name)
        os.makedirs(path, exist_ok=True)
        if tree.support is LimitsSupport.CGROUP2:
            _enable_v2_subtree(path)
        made.append(path)
    return tuple(made)


def sweep_dead_supervisors(tree: JobsCgroupTree) -> list[str]:
    """Remove what supervisors that died with their guardians left in this node's jobs cgroup
    (killing any process still in it). Never a live supervisor's. Returns the removed."""
    removed = []
    for directory in tree.directories:
        try:
            names = os.listdir(directory)
        except OSError:
            continue
        for name in names:
            if not name.startswith(SUPERVISOR_DIR_PREFIX) or _supervisor_lives(name):
                continue
            path = os.path.join(directory, name)
            for child in _subdirectories(path):
                _kill_and_remove(child, tree.support)
            if _kill_and_remove(path, tree.support):
                removed.append(path)
    return removed


def _supervisor_lives(name: str) -> bool:
    pid, _, start = name.removeprefix(SUPERVISOR_DIR_PREFIX).partition("-")
    if not pid.isdigit():
        return True  # not ours to judge
    return str(_start_ticks(int(pid))) == start


def _subdirectories(path: str) -> Iterator[str]:
    with contextlib.suppress(OSError):
        for entry in os.scandir(path):
            if entry.is_dir(follow_symlinks=False):
                yield entry.path


def _kill_and_remove(path: str, support: LimitsSupport) -> bool:
    """Kill what is left in the cgroup at `path` and remove it, now (for sweeps)."""
    for _ in range(_REMOVE_TRIES):
        _kill_members(path, support)
        try:
            os.rmdir(path)
            return True
        except FileNotFoundError:
            return False
        except OSError as error:
            if error.errno != errno.EBUSY:
                logger.warning("cannot remove the cgroup %s: %s", path, error)
                return False
        time.sleep(_REMOVE_RETRY_S)  # a sweep runs in a thread, or at a start
    return False


def _kill_members(path: str, support: LimitsSupport) -> None:
    if support is LimitsSupport.CGROUP2:
        with contextlib.suppress(OSError):
            _write(path, "cgroup.kill", 1)
        return
    with contextlib.suppress(OSError):
        for pid in _read(path, "cgroup.procs").split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)


class AttemptCgroup:
    """One attempt's cgroup: made with its limits, joined by the attempt's first process
    (`join_files`), read at its end (`usage`), then removed (`remove`)."""

    def __init__(
        self,
        tree: JobsCgroupTree,
        supervisor_dirs: tuple[str, ...],
        name: str,
        limits: JobLimits | None = None,
    ) -> None:
        self._tree = tree
        by_directory = dict(zip(tree.directories, supervisor_dirs, strict=True))
        # v1: only the hierarchies this attempt needs. Memory (its limit, the head's ceiling,
        # its peak) and cpuacct (its CPU time) always; cpu and pids for their limits. Each
        # hierarchy is a mkdir, a join and an rmdir more per job.
        limits = limits or JobLimits()
        self._controllers = {"memory", "cpuacct"} | {
            controller
            for controller, limit in (("cpu", limits.cpu_cores), ("pids", limits.max_processes))
            if limit is not None
        }
        self._paths = {
            controller: os.path.join(by_directory[directory], name)
            for controller, directory in tree.controllers
            if tree.support is LimitsSupport.CGROUP2 or controller in self._controllers
        }
        self.directories = tuple(dict.fromkeys(self._paths.values()))

    @classmethod
    def make(
        cls,
        tree: JobsCgroupTree,
        supervisor_dirs: tuple[str, ...],
        name: str,
        limits: JobLimits | None,
    ) -> AttemptCgroup:
        """Make the attempt's cgroup and set its limits (OSError if the host refuses)."""
        cgroup = cls(tree, supervisor_dirs, name, limits)
        for directory in cgroup.directories:
            with contextlib.suppress(FileExistsError):  # an attempt of a run met again
                os.mkdir(directory)
        try:
            cgroup._set_limits(limits or JobLimits())
        except OSError:
            cgroup.remove_now()
            raise
        return cgroup

    @property
    def join_files(self) -> tuple[str, ...]:
        """The files the attempt's first process writes "0" to, to move itself in (its pid
        need not be known: "0" is the writer). v1: `tasks`, which moves the writing thread
        alone and so skips the kernel's global threadgroup lock, whose write side waits for an
        RCU grace period when no migration came just before (about 10 ms on an idle host,
        against 0.3 ms: benchmarks/job_limits.py). The first process is single-threaded (a
        fork of the single-threaded fork server, or a launcher or shell before it starts
        anything), so its thread is all of it. v2: `cgroup.procs` (`tasks` is v1's)."""
        name = "cgroup.procs" if self._tree.support is LimitsSupport.CGROUP2 else "tasks"
        return tuple(os.path.join(directory, name) for directory in self.directories)

    def _set_limits(self, limits: JobLimits) -> None:
        paths = self._paths
        if self._tree.support is LimitsSupport.CGROUP2:
            if limits.memory_bytes is not None:
                _write(paths["memory"], "memory.max", limits.memory_bytes)
                with contextlib.suppress(FileNotFoundError):  # no swap accounting
                    _write(paths["memory"], "memory.swap.max", 0)
            if limits.cpu_cores is not None:
                quota = max(1000, round(limits.cpu_cores * CPU_PERIOD_US))
                _write(paths["cpu"], "cpu.max", f"{quota} {CPU_PERIOD_US}")
            if limits.max_processes is not None:
                _write(paths["pids"], "pids.max", limits.max_processes)
            return
        if limits.memory_bytes is not None:
            _write_v1_memory_limit(paths["memory"], limits.memory_bytes)
        if limits.cpu_cores is not None:
            # Against the period a new cgroup starts with: CPU_PERIOD_US, the kernel's default.
            quota = max(1000, round(limits.cpu_cores * CPU_PERIOD_US))
            _write(paths["cpu"], "cpu.cfs_quota_us", quota)
        if limits.max_processes is not None:
            _write(paths["pids"], "pids.max", limits.max_processes)

    def usage(self) -> ResourceUsage:
        """What the attempt's processes used, as the cgroup counted it (None where a file is
        missing or unreadable)."""
        if self._tree.support is LimitsSupport.CGROUP2:
            return self._v2_usage()
        return self._v1_usage()

    def _v2_usage(self) -> ResourceUsage:
        paths = self._paths
        cpu = _read_keyed(paths["cpu"], "cpu.stat")
        events = _read_keyed(paths["memory"], "memory.events")
        peak = _read_int(paths["memory"], "memory.peak")
        return ResourceUsage(
            peak_memory_bytes=peak,
            cpu_user_s=_scaled(cpu.get("user_usec"), _US_PER_S),
            cpu_system_s=_scaled(cpu.get("system_usec"), _US_PER_S),
            cpu_throttled_s=_scaled(cpu.get("throttled_usec"), _US_PER_S),
            oom_killed=events.get("oom_kill", 0) > 0,
        )

    def _v1_usage(self) -> ResourceUsage:
        paths = self._paths
        cpu = _read_keyed(paths["cpu"], "cpu.stat") if "cpu" in paths else {}
        oom = _read_keyed(paths["memory"], "memory.oom_control")
        return ResourceUsage(
            peak_memory_bytes=_read_int(paths["memory"], "memory.max_usage_in_bytes"),
            cpu_user_s=_scaled(_read_int(paths["cpuacct"], "cpuacct.usage_user"), _NS_PER_S),
            cpu_system_s=_scaled(_read_int(paths["cpuacct"], "cpuacct.usage_sys"), _NS_PER_S),
            cpu_throttled_s=_scaled(cpu.get("throttled_time"), _NS_PER_S),
            oom_killed=oom.get("oom_kill", 0) > 0,
        )

    async def remove(self) -> None:
        """Kill what is left in it and remove it (at the attempt's end: in a PID namespace,
        nothing is left, but the kernel may not have taken the last exits out yet)."""
        for _ in range(_REMOVE_TRIES):
            if self._remove_once():
                return
            await asyncio.sleep(_REMOVE_RETRY_S)
        logger.warning("the cgroups %s stay: they do not empty", ", ".join(self.directories))

    def remove_now(self) -> None:
        """Remove it at once if it is empty (a failed start's)."""
        self._remove_once()

    def _remove_once(self) -> bool:
        left = False
        for directory in self.directories:
            # Empty at almost every attempt's end (in a PID namespace always): the kill, a read
            # of its processes, only where the rmdir finds some.
            if not _removed(directory):
                _kill_members(directory, self._tree.support)
                left = not _removed(directory) or left
        return not left


def _removed(directory: str) -> bool:
    """Whether the cgroup at `directory` is gone now (False: busy, processes in it)."""
    try:
        os.rmdir(directory)
    except FileNotFoundError:
        pass
    except OSError as error:
        if error.errno == errno.EBUSY:
            return False
        logger.warning("cannot remove the cgroup %s: %s", directory, error)
    return True


def _write(directory: str, name: str, value: int | str) -> None:
    with open(os.path.join(directory, name), "w") as file:
        file.write(str(value))


def _read(directory: str, name: str) -> str:
    with open(os.path.join(directory, name)) as file:
        return file.read()


def _read_int(directory: str, name: str) -> int | None:
    try:
        return int(_read(directory, name))
    except (OSError, ValueError):
        return None


def _read_keyed(directory: str, name: str) -> dict[str, int]:
    """A flat keyed file (`cpu.stat`, `memory.events`, v1's `memory.oom_control`)."""
    values: dict[str, int] = {}
    with contextlib.suppress(OSError):
        for line in _read(directory, name).splitlines():
            key, _, value = line.partition(" ")
            with contextlib.suppress(ValueError):
                values[key] = int(value)
    return values


def _scaled(value: int | None, per_second: float) -> float | None:
    return None if value is None else value / per_second


def attempt_usage(
    cgroup: AttemptCgroup | None, rusage: resource.struct_rusage | None
) -> ResourceUsage:
    """What an attempt used: its cgroup's counts, each missing one from the rusage of its
    reaped first process (wait4: it and every descendant reaped in its tree)."""
    counted = cgroup.usage() if cgroup is not None else ResourceUsage()
    if rusage is None:
        return counted
    return counted.model_copy(
        update={
            "peak_memory_bytes": counted.peak_memory_bytes
            if counted.peak_memory_bytes is not None
            else rusage.ru_maxrss * 1024,  # KiB on Linux
            "cpu_user_s": counted.cpu_user_s if counted.cpu_user_s is not None else rusage.ru_utime,
            "cpu_system_s": counted.cpu_system_s
            if counted.cpu_system_s is not None
            else rusage.ru_stime,
        }
    )
