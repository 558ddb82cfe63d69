"""The cgroups of a test module's jobs (issue 35), found the kernel's way, not the server's: the
module's own jobs cgroup (`--jobs-cgroup`) in each hierarchy, a job's attempt cgroup read from
its first process's /proc/<pid>/cgroup, the supervisors' directories in it, and the whole tree
removed at the end.

    <the module's jobs cgroup>            beside the test process's own cgroup, as the server
      └── sup-<pid>-<start ticks>         resolves it (the server and its Ray are our children)
            └── <run id>-<attempt>

With cgroup v1 the tree is the same path in each of the `memory`, `cpu`, `cpuacct` and `pids`
hierarchies; with v2 it is one directory.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

V1_CONTROLLERS = ("memory", "cpu", "cpuacct", "pids")
ALWAYS_V1_CONTROLLERS = ("memory", "cpuacct")
V2_CONTROLLERS = ("memory", "cpu", "pids")
SUPERVISOR_PREFIX = "sup-"
# A cgroup whose last process was just killed is busy (EBUSY) until the kernel has taken it out.
_REMOVE_DEADLINE_S = 10.0
_REMOVE_RETRY_S = 0.05


def _own_cgroups() -> dict[str, str]:
    """This process's cgroup path by controller ('' for the v2 hierarchy)."""
    paths: dict[str, str] = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(",") if controllers else [""]:
            paths[controller] = path
    return paths


def _mounts() -> dict[str, Path]:
    """Where each hierarchy's root is mounted, by controller ('' for cgroup2)."""
    mounts: dict[str, Path] = {}
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        before, _, after = line.partition(" - ")
        fields, options = before.split(), after.split()
        if len(fields) < 5 or len(options) < 3 or fields[3] != "/":
            continue
        if options[0] == "cgroup2":
            mounts.setdefault("", Path(fields[4]))
        elif options[0] == "cgroup":
            for option in options[2].split(","):
                mounts.setdefault(option, Path(fields[4]))
    return mounts


def _start_ticks(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # Field 22, counted after the command's name (which may hold spaces and parentheses).
    return stat.rpartition(")")[2].split()[19]


def supervisor_lives(name: str) -> bool:
    """Whether the supervisor a `sup-<pid>-<start ticks>` directory names still runs."""
    pid, _, ticks = name.removeprefix(SUPERVISOR_PREFIX).partition("-")
    return pid.isdigit() and _start_ticks(int(pid)) == ticks


@dataclass(frozen=True)
class AttemptCgroup:
    """A running job's attempt cgroup: its directory by controller."""

    supervisor_dir: str
    """`sup-<pid>-<start ticks>`: the supervisor the attempt runs under."""
    name: str
    """`<run id>-<attempt number>`."""
    directories: dict[str, Path]

    @property
    def supervisor_pid(self) -> int:
        return int(self.supervisor_dir.removeprefix(SUPERVISOR_PREFIX).split("-")[0])

    def read(self, controller: str, file_name: str) -> str:
        return (self.directories[controller] / file_name).read_text().strip()

    def processes(self) -> list[int]:
        """The pids in it (every hierarchy it is in holds the same processes; the memory one,
        which every attempt has, is read)."""
        return [int(pid) for pid in self.read("memory", "cgroup.procs").split()]

    def exists(self) -> bool:
        """Whether any of its directories is left."""
        return any(directory.exists() for directory in self.directories.values())


class JobsCgroups:
    """One `--jobs-cgroup` (relative: beside this process's own cgroup, in each hierarchy)."""

    def __init__(self, name: str) -> None:
        self.name = name
        own, mounts = _own_cgroups(), _mounts()
        self._v1 = {
            controller: mounts[controller] / own[controller].lstrip("/") / name
            for controller in V1_CONTROLLERS
            if controller in mounts and controller in own
        }
        self._v2 = mounts[""] / own[""].lstrip("/") / name if "" in mounts and "" in own else None

    def directories(self, support: str) -> dict[str, Path]:
        """The jobs cgroup's directory by controller, for the server's `limits` (`GET
        /api/version`: cgroup1, cgroup2 or none)."""
        if support == "cgroup1":
            return dict(self._v1)
        if support == "cgroup2" and self._v2 is not None:
            return dict.fromkeys(V2_CONTROLLERS, self._v2)
        return {}

    def attempt_of(self, pid: int, support: str) -> AttemptCgroup:
        """The attempt cgroup process `pid` (a job's first process) runs in; AssertionError
        naming where it runs instead if that is not an attempt cgroup of this tree."""
        roots = self.directories(support)
        assert roots, f"no cgroup hierarchy of limits {support!r} to look in"
        paths = {}
        for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            for controller in controllers.split(",") if controllers else [""]:
                paths[controller] = path
        found: dict[str, tuple[str, str]] = {}
        where: dict[str, Path] = {}
        for controller, root in roots.items():
            mount = _mounts()["" if support == "cgroup2" else controller]
            where[controller] = mount / paths["" if support == "cgroup2" else controller].lstrip(
                "/"
            )
            try:
                parts = where[controller].relative_to(root).parts
            except ValueError:
                parts = ()
            if len(parts) == 2 and parts[0].startswith(SUPERVISOR_PREFIX):
                found[controller] = (parts[0], parts[1])
        # v1: an attempt is always in the memory and cpuacct hierarchies, and in cpu and pids
        # only for a limit there (cgroups.py); wherever it is, it is the one attempt.
        required = set(roots) if support == "cgroup2" else set(ALWAYS_V1_CONTROLLERS)
        in_one = required <= set(found) and len(set(found.values())) == 1
        assert in_one, (
            f"process {pid} (a job's first process) runs in no attempt cgroup under"
            f" {self.name!r} (<jobs cgroup>/sup-<pid>-<ticks>/<run id>-<attempt>) in the"
            f" {sorted(required)} hierarchies: its cgroups are"
            f" {sorted((c, str(p)) for c, p in where.items())}"
        )
        supervisor_dir, name = next(iter(found.values()))
        return AttemptCgroup(supervisor_dir, name, {c: where[c] for c in found})

    def supervisor_dirs(self, support: str) -> dict[str, list[str]]:
        """The `sup-*` directories in the tree, by controller."""
        found = {}
        for controller, root in self.directories(support).items():
            with contextlib.suppress(FileNotFoundError):
                found[controller] = sorted(
                    entry.name
                    for entry in os.scandir(root)
                    if entry.is_dir() and entry.name.startswith(SUPERVISOR_PREFIX)
                )
        return found

    def dead_supervisor_dirs(self, support: str) -> dict[str, list[str]]:
        """The `sup-*` directories whose supervisor no longer runs, by controller (none: {})."""
        dead = {
            controller: [name for name in names if not supervisor_lives(name)]
            for controller, names in self.supervisor_dirs(support).items()
        }
        return {controller: names for controller, names in dead.items() if names}

    def remove(self) -> list[str]:
        """Remove the tree in every hierarchy, children first, killing what still runs in it
        (the module's jobs). Returns the directories that would not go."""
        roots = {*self._v1.values(), *([self._v2] if self._v2 is not None else [])}
        left = []
        for root in roots:
            if not root.exists():
                continue
            for directory, _, _ in os.walk(root, topdown=False):  # children first
                if not _remove_cgroup(Path(directory)):
                    left.append(directory)
        return left


def _remove_cgroup(directory: Path) -> bool:
    deadline = time.monotonic() + _REMOVE_DEADLINE_S
    while True:
        with contextlib.suppress(OSError):
            for pid in (directory / "cgroup.procs").read_text().split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
        try:
            os.rmdir(directory)
            return True
        except FileNotFoundError:
            return True
        except OSError as error:
            if error.errno != errno.EBUSY or time.monotonic() > deadline:
                return False
        time.sleep(_REMOVE_RETRY_S)
