"""A cgroup per attempt (jobs_server/manager/supervisor/cgroups.py), on this host's real cgroups
(v1 here, as root): every way a job starts puts all of it in its attempt's cgroup before it
runs, the kernel holds it to its limits, what it used is counted, and nothing is left behind,
also of supervisors that died. Without Ray: the fork server and the launcher are driven here as
a supervisor drives them (tests/support/fork_servers.py)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from jobs_server.manager.cluster.head_jobs_cgroup import (
    MIN_HEAD_JOBS_MEMORY_BYTES,
    head_jobs_memory_default,
    meminfo_bytes,
    set_up_head_jobs_cgroup,
)
from jobs_server.manager.limits import JobLimits, ResourceUsage
from jobs_server.manager.supervisor import cgroups as cgroups_module
from jobs_server.manager.supervisor.cgroups import (
    AttemptCgroup,
    JobsCgroupTree,
    LimitsSupport,
    attempt_usage,
    find_jobs_tree,
    make_supervisor_dirs,
    supervisor_dir_name,
    sweep_dead_supervisors,
)
from jobs_server.manager.supervisor.command_start import start_entrypoint
from jobs_server.manager.supervisor.containment import Containment
from tests.support.fork_servers import CONTAINMENTS, job_env, subreaper_fork_server

MiB = 1 << 20


def _remove_tree(tree: JobsCgroupTree) -> None:
    """Bottom-up, killing what a failed test left in it."""
    for directory in tree.directories:
        for root, _, _ in os.walk(directory, topdown=False):
            for _ in range(100):
                for pid in Path(root, "cgroup.procs").read_text().split():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(pid), signal.SIGKILL)
                try:
                    os.rmdir(root)
                    break
                except OSError:
                    time.sleep(0.02)


@pytest.fixture
def tree() -> Iterator[JobsCgroupTree]:
    """A jobs cgroup of this test's own, removed after it."""
    found = find_jobs_tree(f"jobs-server-test-{secrets.token_hex(4)}")
    if found.support is LimitsSupport.NONE:
        pytest.skip("this host gives no writable cgroup tree")
    yield found
    _remove_tree(found)


def procs_of(cgroup: AttemptCgroup) -> set[int]:
    pids: set[int] = set()
    for directory in cgroup.directories:
        pids.update(int(pid) for pid in Path(directory, "cgroup.procs").read_text().split())
    return pids


def test_this_host_is_found_to_have_cgroup_v1(tree: JobsCgroupTree) -> None:
    """These machines mount v1 (the unified hierarchy has no controllers): the v1 tree, with
    each controller's directory under this process's own cgroup in its hierarchy."""
    assert tree.support is LimitsSupport.CGROUP1
    own = dict(
        line.split(":", 2)[1:] for line in Path("/proc/self/cgroup").read_text().splitlines()
    )
    for controller, directory in tree.controllers:
        assert directory.startswith(f"/sys/fs/cgroup/{controller}{own[controller].rstrip('/')}/")
        assert os.path.isdir(directory)


def test_limits_are_written_where_the_kernel_reads_them(tree: JobsCgroupTree) -> None:
    dirs = make_supervisor_dirs(tree)
    limits = JobLimits(memory_bytes=64 * MiB, cpu_cores=0.25, max_processes=7)
    cgroup = AttemptCgroup.make(tree, dirs, "run-1", limits)
    memory, cpu, pids = (tree.directory_of(name) for name in ("memory", "cpu", "pids"))
    name = supervisor_dir_name()
    assert Path(memory, name, "run-1", "memory.limit_in_bytes").read_text().strip() == str(64 * MiB)
    assert Path(cpu, name, "run-1", "cpu.cfs_quota_us").read_text().strip() == "25000"
    assert Path(cpu, name, "run-1", "cpu.cfs_period_us").read_text().strip() == "100000"
    assert Path(pids, name, "run-1", "pids.max").read_text().strip() == "7"
    cgroup.remove_now()
    assert not any(os.path.exists(directory) for directory in cgroup.directories)


def test_an_attempt_without_cpu_or_process_limits_stays_out_of_those_hierarchies(
    tree: JobsCgroupTree,
) -> None:
    """Memory (its ceiling and peak) and cpuacct (its CPU time) always; cpu and pids only for
    a limit there: each hierarchy is a mkdir, a join and an rmdir per job."""
    dirs = make_supervisor_dirs(tree)
    cgroup = AttemptCgroup.make(tree, dirs, "plain", JobLimits(memory_bytes=64 * MiB))
    assert set(cgroup.directories) == {
        os.path.join(tree.directory_of(name), supervisor_dir_name(), "plain")
        for name in ("memory", "cpuacct")
    }
    for name in ("cpu", "pids"):
        assert not os.path.exists(
            os.path.join(tree.directory_of(name), supervisor_dir_name(), "plain")
        )
    assert cgroup.usage().cpu_throttled_s is None  # no CPU limit: nothing held it back
    cgroup.remove_now()


@pytest.mark.parametrize("containment", CONTAINMENTS)
@pytest.mark.parametrize("clone_parent", [True, False], ids=["cloned", "forked-between"])
async def test_every_process_of_a_forked_job_is_born_in_its_cgroup(
    tree: JobsCgroupTree, tmp_path: Path, containment: Containment, clone_parent: bool
) -> None:
    """Its first process joins before the command runs, so a process the command starts at
    once (even one that leaves its session) is in the cgroup from its birth."""
    cgroup = AttemptCgroup.make(tree, make_supervisor_dirs(tree), "born", None)
    ready = tmp_path / "ready"
    async with subreaper_fork_server(clone_parent=clone_parent) as forks:
        process = await forks.spawn(
            # Shell builtins after the sleeper's start: no process of the job comes or goes
            # while the test compares (a transient `mv` was once a member, not yet a child).
            f"setsid sleep 30 & echo $! > {ready}; wait",
            log_path=tmp_path / "job.log",
            env=job_env("born"),
            containment=containment,
            cgroup_join_files=cgroup.join_files,
        )
        await _until(ready.exists)
        members = procs_of(cgroup)
        # The first process (in a PID namespace, the node's pid of its init), its shell, the
        # escaped sleeper: all of it, and nothing else.
        job = {p.pid for p in psutil.Process(process.pid).children(recursive=True)}
        assert members == job | {process.pid}, (members, job, process.pid)
        assert len(members) >= 2  # the shell and its sleeper (and an init, or a launcher)
        # The shell's group; the escaped sleeper is left to the cgroup's removal to kill.
        os.killpg(process.pid, 9)
        await asyncio.wait_for(process.wait(), 30)
    await cgroup.remove()
    assert not any(map(os.path.exists, cgroup.directories))


@pytest.mark.parametrize("containment", CONTAINMENTS)
async def test_a_launched_job_is_born_in_its_cgroup_too(
    tree: JobsCgroupTree, tmp_path: Path, containment: Containment
) -> None:
    """Without a fork server: the launcher joins (PID namespace), or the shell itself
    (marker containment) before it execs the job's."""
    cgroup = AttemptCgroup.make(tree, make_supervisor_dirs(tree), "launched", None)
    process = await start_entrypoint(
        "sleep 30",
        log_path=tmp_path / "job.log",
        env=job_env("launched"),
        containment=containment,
        cgroup_join_files=cgroup.join_files,
    )
    try:
        # Marker containment: the shell is the process, and joins before it execs the job's.
        await _until(lambda: process.pid in procs_of(cgroup))
    finally:
        process.kill()
        await process.wait()
    await cgroup.remove()


async def test_a_job_whose_cgroup_refuses_it_fails_to_start_and_says_why(
    tree: JobsCgroupTree, tmp_path: Path
) -> None:
    cgroup = AttemptCgroup.make(tree, make_supervisor_dirs(tree), "refused", None)
    async with subreaper_fork_server() as forks:
        with pytest.raises(OSError, match="cgroup"):
            await forks.spawn(
                "echo ran",
                log_path=tmp_path / "job.log",
                env=job_env("refused"),
                containment=Containment.PID_NAMESPACE,
                cgroup_join_files=(str(tmp_path / "no-such-cgroup" / "cgroup.procs"),),
            )
    assert b"ran" not in (tmp_path / "job.log").read_bytes()
    cgroup.remove_now()


async def test_the_kernel_holds_a_job_to_its_memory_and_its_use_is_counted(
    tree: JobsCgroupTree, tmp_path: Path
) -> None:
    cgroup = AttemptCgroup.make(
        tree, make_supervisor_dirs(tree), "oom", JobLimits(memory_bytes=64 * MiB)
    )
    async with subreaper_fork_server() as forks:
        process = await forks.spawn(
            f"{sys.executable} -c 'b = bytearray(200 << 20)'",
            log_path=tmp_path / "job.log",
            env=job_env("oom"),
            containment=Containment.PID_NAMESPACE,
            cgroup_join_files=cgroup.join_files,
        )
        assert await asyncio.wait_for(process.wait(), 30) != 0
    usage = attempt_usage(cgroup, process.rusage)
    assert usage.oom_killed
    assert usage.peak_memory_bytes is not None
    assert 60 * MiB <= usage.peak_memory_bytes <= 64 * MiB
    await cgroup.remove()


async def test_without_a_cgroup_a_jobs_use_comes_from_its_reaped_processes(
    tmp_path: Path,
) -> None:
    """wait4 of a namespace's init: its command's grandchild's peak and CPU are in it."""
    async with subreaper_fork_server() as forks:
        # Its own CPU time, whatever the machine's load: not a wall-clock busy loop.
        spin = "import time\nwhile time.process_time() < 0.5: pass"
        process = await forks.spawn(
            f"sh -c \"{sys.executable} -c 'b = bytearray(100 << 20)'\"; "
            f"{sys.executable} -c '{spin}'; true",
            log_path=tmp_path / "job.log",
            env=job_env("rusage"),
            containment=Containment.PID_NAMESPACE,
        )
        assert await asyncio.wait_for(process.wait(), 30) == 0
    usage = attempt_usage(None, process.rusage)
    assert usage.peak_memory_bytes is not None
    assert 100 * MiB <= usage.peak_memory_bytes <= 100 * MiB * 1.1 + 30 * MiB
    assert usage.cpu_user_s is not None
    assert usage.cpu_system_s is not None
    assert usage.cpu_user_s + usage.cpu_system_s >= 0.4
    assert not usage.oom_killed


def test_a_sweep_removes_exactly_what_dead_supervisors_left(tree: JobsCgroupTree) -> None:
    """A dead supervisor's directory (its pid gone, or reused by a later process: the start
    time tells) goes, with its attempts' cgroups and any process still in them; a live one's
    stays."""
    live = make_supervisor_dirs(tree)
    live_attempt = AttemptCgroup.make(tree, live, "live-run-1", None)
    dead_pid = _exited_pid()
    dead_name = f"sup-{dead_pid}-1"
    reused_name = f"sup-{os.getpid()}-1"  # this pid, another start time
    for name in (dead_name, reused_name):
        for directory in tree.directories:
            os.makedirs(os.path.join(directory, name, "run-1"))
    straggler = subprocess.Popen(["sleep", "60"])
    try:
        for directory in tree.directories:
            Path(directory, dead_name, "run-1", "cgroup.procs").write_text(str(straggler.pid))
        removed = sweep_dead_supervisors(tree)
        assert straggler.wait(timeout=10) == -9
    finally:
        if straggler.poll() is None:
            straggler.kill()
    assert sorted(removed) == sorted(
        os.path.join(directory, name)
        for directory in tree.directories
        for name in (dead_name, reused_name)
    )
    for directory in (*live, *live_attempt.directories):
        assert os.path.isdir(directory)


def _exited_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def test_the_heads_ceiling_is_written_where_the_kernel_reads_it(tree: JobsCgroupTree) -> None:
    set_up_head_jobs_cgroup(Path(tree.directories[0]).name, 300 * MiB)
    limit = Path(tree.directory_of("memory"), "memory.limit_in_bytes").read_text()
    assert int(limit) == 300 * MiB
    set_up_head_jobs_cgroup(Path(tree.directories[0]).name, 0)  # 0: none
    limit = Path(tree.directory_of("memory"), "memory.limit_in_bytes").read_text()
    assert int(limit) > 1 << 60  # the kernel's "unlimited"
    assert 0 < meminfo_bytes("MemAvailable") <= meminfo_bytes("MemTotal")


@pytest.mark.parametrize(
    ("available", "jobs", "ceiling"),
    [
        (20 << 30, 0, 19 << 30),
        (20 << 30, 3 << 30, 22 << 30),  # a restarted server: its running jobs count as theirs
        (1 << 30, 0, MIN_HEAD_JOBS_MEMORY_BYTES),  # never less than 256 MiB
    ],
)
def test_the_default_ceiling_is_what_is_available_less_a_gib(
    available: int, jobs: int, ceiling: int
) -> None:
    assert head_jobs_memory_default(available, jobs) == ceiling


async def _until(condition: object, timeout_s: float = 15) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():  # type: ignore[operator]
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.02)


def test_the_v2_tree_passes_the_controllers_down_and_reads_v2s_files(tmp_path: Path) -> None:
    """This host has no cgroup v2 controllers (all are in v1 hierarchies), so the v2 way is
    checked here on a stand-in of the unified hierarchy's files: which files it reads and
    writes, at which level, in which format. The kernel's side of v2 is not exercised."""
    mount = tmp_path / "unified"
    (mount / "service").mkdir(parents=True)
    for level in (mount, mount / "service"):
        (level / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
        (level / "cgroup.subtree_control").write_text("")
    jobs = mount / "service" / "jobs"
    jobs.mkdir()  # the kernel makes a new cgroup's files; the stand-in needs them made
    (jobs / "cgroup.subtree_control").write_text("")

    tree = cgroups_module._find_v2_tree({"": "/service"}, {"": str(mount)}, "jobs")
    assert tree.support is LimitsSupport.CGROUP2
    assert tree.directories == (str(jobs),)
    for level in (mount, mount / "service"):
        assert (level / "cgroup.subtree_control").read_text() == "+memory +cpu +pids"
    assert (jobs / "cgroup.subtree_control").read_text() == "+memory +cpu +pids"

    supervisor = jobs / "sup"
    attempt = supervisor / "run-1"
    attempt.mkdir(parents=True)
    (supervisor / "cgroup.subtree_control").write_text("")
    cgroup = AttemptCgroup(tree, (str(supervisor),), "run-1")
    cgroup._set_limits(JobLimits(memory_bytes=64 * MiB, cpu_cores=1.5, max_processes=9))
    assert (attempt / "memory.max").read_text() == str(64 * MiB)
    assert (attempt / "memory.swap.max").read_text() == "0"
    assert (attempt / "cpu.max").read_text() == "150000 100000"
    assert (attempt / "pids.max").read_text() == "9"
    (attempt / "memory.peak").write_text("1048576\n")
    (attempt / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n")
    (attempt / "cpu.stat").write_text(
        "usage_usec 2500000\nuser_usec 2000000\nsystem_usec 500000\n"
        "nr_periods 10\nnr_throttled 4\nthrottled_usec 300000\n"
    )
    assert cgroup.usage() == ResourceUsage(
        peak_memory_bytes=MiB,
        cpu_user_s=2.0,
        cpu_system_s=0.5,
        cpu_throttled_s=0.3,
        oom_killed=True,
    )
