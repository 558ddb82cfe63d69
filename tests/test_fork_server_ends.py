"""The fork server's ends directory (where its jobs' PID namespace inits leave how a signal ended
their command), issue 32, item 20: removed with whatever is in it when the fork server is
closed or its supervisor dies; one left by a supervisor killed with its guardian is swept at a
later fork server's start; a live one never is.

Real fork servers, real supervisors' processes (a script like the supervisor's preparation),
in a temp dir of the test's own (`tempfile` pointed at it, TMPDIR for the scripts)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from jobs_server.manager.supervisor.containment import Containment
from tests.support.fork_servers import REPO, is_alive, poll_until, subreaper_fork_server, wait_until

ENDS_PREFIX = "jobs-server-ends-"

# Another supervisor of this user: its fork server started (with its guardian, as a supervisor
# prepares its processes: supervisor.py), then idle; it prints its ends directory and fork server.
OWNER_SCRIPT = r"""
import asyncio, sys, time
from jobs_server.manager.supervisor import guardian as guardians
from jobs_server.manager.supervisor.fork_server import ForkServer

async def main():
    token = sys.argv[1]
    forks = ForkServer(token)
    if sys.argv[2] == "guardian":
        guardian = guardians.start_guardian(token)
        forks.start()
        guardians.remove_when_supervisor_dies(guardian, forks._ends_dir)
    else:
        forks.start()
    print(forks._ends_dir, forks.pid, flush=True)
    time.sleep(600)

asyncio.run(main())
"""


def ends_dirs(parent: Path) -> list[Path]:
    return sorted(path for path in parent.iterdir() if path.name.startswith(ENDS_PREFIX))


class Owner:
    """Another supervisor of this user: a process with a started fork server."""

    def __init__(self, shared_tmp: Path, token: str, *, guardian: bool) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", OWNER_SCRIPT, token, "guardian" if guardian else "alone"],
            stdout=subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(shared_tmp)},
        )
        assert self.process.stdout is not None
        ends_dir, zygote = self.process.stdout.readline().split()
        self.ends_dir = Path(os.fsdecode(ends_dir))
        self.zygote = int(zygote)

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()
        poll_until(lambda: not is_alive(self.zygote), "the fork server outlived its owner")


@pytest.fixture
def owners(shared_tmp: Path) -> Iterator[list[Owner]]:
    started: list[Owner] = []
    yield started
    for owner in started:
        if owner.process.poll() is None:
            owner.kill()


@pytest.mark.skipif(os.geteuid() != 0, reason="a PID namespace needs CAP_SYS_ADMIN")
async def test_a_closed_fork_server_leaves_no_ends_directory(
    shared_tmp: Path, tmp_path: Path
) -> None:
    """Closed with an init's end file not yet read (its job ended by a signal, not reaped
    yet): the directory goes with the file (before: rmdir failed and it stayed)."""
    async with subreaper_fork_server() as forks:
        (ends_dir,) = ends_dirs(shared_tmp)
        process = await forks.spawn(
            "kill -KILL $$",
            log_path=tmp_path / "job.log",
            env={},
            containment=Containment.PID_NAMESPACE,
        )
        # Its init has exited (a zombie, reaped once this test awaits): its file is there.
        poll_until(
            lambda: psutil.Process(process.pid).status() == psutil.STATUS_ZOMBIE,
            "the job's init did not exit",
        )
        assert os.listdir(ends_dir) != []
        forks.close()
        assert ends_dirs(shared_tmp) == []
        assert await process.wait() == 128 + signal.SIGKILL


async def test_an_ends_directory_left_by_a_killed_supervisor_is_swept_at_the_next_start(
    shared_tmp: Path, owners: list[Owner]
) -> None:
    """A supervisor killed with its guardian (the node's crash: nothing of it cleans up)
    leaves its directory, with an end file nobody will read; the next fork server of this
    user to start removes it (before: it stayed, one per supervisor, for ever)."""
    owners.append(Owner(shared_tmp, "ends-killed", guardian=False))
    dead = owners[-1]
    (dead.ends_dir / "7").write_bytes(b"9 stopped")
    dead.kill()
    assert dead.ends_dir.exists()
    async with subreaper_fork_server() as forks:
        assert ends_dirs(shared_tmp) == [Path(forks._ends_dir or "")]


async def test_a_supervisors_guardian_removes_its_ends_directory_when_it_dies(
    shared_tmp: Path, owners: list[Owner]
) -> None:
    """A supervisor killed alone (`ray.kill`, kill -9: its fork server's close never runs):
    its guardian removes the directory as it kills its jobs, without waiting for another start
    (before: it stayed)."""
    owners.append(Owner(shared_tmp, "ends-guarded", guardian=True))
    owner = owners[-1]
    (owner.ends_dir / "3").write_bytes(b"15")
    owner.kill()
    await wait_until(lambda: not owner.ends_dir.exists(), "the dead supervisor's ends dir stayed")


async def test_a_live_fork_servers_ends_directory_is_never_swept(
    shared_tmp: Path, owners: list[Owner]
) -> None:
    """Other supervisors run (another process; another fork server of this one): starting a
    fork server leaves their directories and the files in them."""
    owners.append(Owner(shared_tmp, "ends-live", guardian=False))
    live = owners[-1]
    (live.ends_dir / "1").write_bytes(b"9")
    async with subreaper_fork_server() as first, subreaper_fork_server() as second:
        assert live.ends_dir.exists()
        assert (live.ends_dir / "1").read_bytes() == b"9"
        assert ends_dirs(shared_tmp) == sorted(
            [live.ends_dir, Path(first._ends_dir or ""), Path(second._ends_dir or "")]
        )
    assert ends_dirs(shared_tmp) == [live.ends_dir]
    assert is_alive(live.zygote)


@pytest.mark.skipif(os.geteuid() != 0, reason="another user's directory needs root")
async def test_a_sweep_leaves_what_is_not_this_users_own_directory(shared_tmp: Path) -> None:
    """An ends-like name another user made, or a symlink of that name, is left alone (and
    nothing behind the symlink is removed)."""
    foreign = shared_tmp / f"{ENDS_PREFIX}foreign"
    foreign.mkdir()
    (foreign / "1").write_bytes(b"theirs")
    os.chown(foreign, 65534, 65534)
    target = shared_tmp.parent / "target"
    target.mkdir()
    (target / "kept").write_bytes(b"kept")
    (shared_tmp / f"{ENDS_PREFIX}link").symlink_to(target, target_is_directory=True)
    async with subreaper_fork_server():
        pass
    assert (foreign / "1").read_bytes() == b"theirs"
    assert (target / "kept").read_bytes() == b"kept"
    assert (shared_tmp / f"{ENDS_PREFIX}link").is_symlink()


async def test_a_live_fork_server_of_a_version_without_the_lock_keeps_its_directory(
    shared_tmp: Path,
) -> None:
    """A version before the lock made its directory with `mkdtemp` and holds no lock: while a
    process was started with it among its arguments (its fork server), a start leaves it;
    once that process is gone, the next start removes it."""
    legacy = Path(tempfile.mkdtemp(prefix=ENDS_PREFIX))
    (legacy / "2").write_bytes(b"9")
    fork_server = await asyncio.create_subprocess_exec(
        sys.executable, "-c", "import time; time.sleep(600)", str(legacy)
    )
    try:
        async with subreaper_fork_server():
            assert (legacy / "2").read_bytes() == b"9"
    finally:
        fork_server.kill()
        await fork_server.wait()
    async with subreaper_fork_server() as forks:
        assert ends_dirs(shared_tmp) == [Path(forks._ends_dir or "")]
