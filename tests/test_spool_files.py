"""Worker spool files (issue 32, item 8): another user of the node, who can read the code and
write to the shared /tmp, squats the spool's predictable path; the supervisor never writes
through it, and what it creates is private (files 0600 in directories 0700, no symlink followed).

The attacker is played by root's test with another uid (nobody) owning what it plants, in a
stand-in for /tmp (sticky, world-writable) that `tempfile` is pointed at. The spool is made as a
supervisor on a worker node makes it: `spool_path`, then the command's start writes to it (a
launcher, or the fork server)."""

from __future__ import annotations

import os
import stat
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from jobs_server.manager.supervisor.command_start import start_entrypoint
from jobs_server.manager.supervisor.containment import Containment
from jobs_server.manager.supervisor.fork_server import ForkServer
from jobs_server.manager.supervisor.log_shipping import spool_path
from tests.support.fork_servers import subreaper_fork_server

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="another user's files need root")

ATTACKER_UID = 65534  # nobody
NAMESPACE = "tenant_ns"
LOG_NAME = "job-driver-raysubmit_x.log"
VICTIM_TEXT = "the server user's precious file\n"


@pytest.fixture(params=["launcher", "fork-server"])
async def fork_server(request: pytest.FixtureRequest) -> AsyncIterator[ForkServer | None]:
    """Both ways a supervisor starts a command (and opens its log)."""
    if request.param == "launcher":
        yield None
        return
    async with subreaper_fork_server() as server:
        yield server


def predictable_roots(shared: Path) -> list[Path]:
    """The names an attacker who read the code squats: the spool root of before, this user's."""
    return [shared / "jobs_server_spool", shared / f"jobs_server_spool-{os.getuid()}"]


def attackers_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(0o777)
    os.chown(path, ATTACKER_UID, ATTACKER_UID)
    return path


def victim_file(tmp_path: Path) -> Path:
    victim = tmp_path / "victim" / ".bashrc"
    victim.parent.mkdir(mode=0o700)
    victim.write_text(VICTIM_TEXT)
    victim.chmod(0o600)
    return victim


async def run_command(fork_server: ForkServer | None, path: Path, text: str) -> None:
    """One attempt of a job's command, writing to its log at `path`."""
    process = await start_entrypoint(
        f"echo {text}",
        log_path=path,
        env=dict(os.environ),
        containment=Containment.MARKER,
        fork_server=fork_server,
    )
    assert await process.wait() == 0


async def spool_a_job(fork_server: ForkServer | None, text: str) -> Path:
    """What a supervisor on a worker node does with a job's log: its spool path, made fresh
    (attempts.py), then the command writing to it."""
    path = spool_path(NAMESPACE, LOG_NAME)
    path.unlink(missing_ok=True)
    await run_command(fork_server, path, text)
    return path


def attacker_may_replace(path: Path) -> bool:
    """Whether the attacker's uid may remove `path` and plant another file in its place."""
    info = os.lstat(path.parent)
    if info.st_uid == ATTACKER_UID:
        return True
    return bool(info.st_mode & stat.S_IWOTH) and not info.st_mode & stat.S_ISVTX


def files_under(path: Path) -> list[Path]:
    return sorted(path.rglob("*"))


def assert_private(path: Path, shared: Path) -> None:
    """`path` is a file of ours, 0600, and every directory from the shared one down to it is
    ours, 0700 and not a symlink: nobody else can plant or read anything there."""
    assert shared in path.parents, path
    for directory in reversed(path.relative_to(shared).parents[:-1]):
        info = os.lstat(shared / directory)
        assert stat.S_ISDIR(info.st_mode), directory  # lstat: a symlink is not a directory
        assert (info.st_uid, stat.S_IMODE(info.st_mode)) == (os.getuid(), 0o700), (
            directory,
            info.st_uid,
            oct(info.st_mode),
        )
    info = os.lstat(path)
    assert stat.S_ISREG(info.st_mode)
    assert (info.st_uid, stat.S_IMODE(info.st_mode)) == (os.getuid(), 0o600), oct(info.st_mode)


async def test_a_spool_root_squatted_as_a_symlink_is_never_written_through(
    shared_tmp: Path, tmp_path: Path, fork_server: ForkServer | None
) -> None:
    """The attacker points the predictable names at a directory of its own: the supervisor
    writes nothing there (before: the log, in a directory tree the attacker owns)."""
    trap = attackers_dir(tmp_path / "attacker")
    for root in predictable_roots(shared_tmp):
        root.symlink_to(trap, target_is_directory=True)
    path = await spool_a_job(fork_server, "secret-output")
    assert files_under(trap) == []
    assert path.read_text() == "secret-output\n"
    assert_private(path, shared_tmp)


async def test_a_spool_file_replaced_by_a_symlink_to_a_victim_leaves_the_victim_untouched(
    shared_tmp: Path, tmp_path: Path, fork_server: ForkServer | None
) -> None:
    """The attacker makes the predictable directories its own (mode 0777); between two
    attempts of the job it replaces the spool file with a symlink to a file of the server's
    user, wherever its permissions let it. The retry does not append to the victim (before:
    it did), and the spool was never in the attacker's directory."""
    victim = victim_file(tmp_path)
    for root in predictable_roots(shared_tmp):
        attackers_dir(root / NAMESPACE)
        attackers_dir(root)
    path = await spool_a_job(fork_server, "first")
    if attacker_may_replace(path):
        path.unlink()
        path.symlink_to(victim)
    await run_command(fork_server, path, "retry")  # the retry appends to the same spool
    assert victim.read_text() == VICTIM_TEXT
    assert path.read_text() == "first\nretry\n"
    assert_private(path, shared_tmp)


async def test_a_symlink_at_the_spool_file_in_our_own_directory_is_not_followed(
    shared_tmp: Path, tmp_path: Path, fork_server: ForkServer | None
) -> None:
    """Whatever put it there, the log is opened with O_NOFOLLOW: the start fails, the victim
    is untouched (before: the command's output was appended to it)."""
    victim = victim_file(tmp_path)
    path = spool_path(NAMESPACE, LOG_NAME)
    path.parent.mkdir(parents=True, exist_ok=True)  # as the command's start does
    path.symlink_to(victim)
    with pytest.raises(OSError, match="symbolic links"):  # ELOOP
        await run_command(fork_server, path, "appended")
    assert victim.read_text() == VICTIM_TEXT


async def test_our_own_spool_directories_with_loose_modes_are_made_private(
    shared_tmp: Path, fork_server: ForkServer | None
) -> None:
    """Directories of ours left open (an older version's, a umask of 0) are closed to 0700
    before the spool is written; a created spool file is 0600 whatever the umask (before:
    0666 less the umask, in directories 0777 less the umask)."""
    for root in predictable_roots(shared_tmp):
        (root / NAMESPACE).mkdir(parents=True)
        root.chmod(0o777)
        (root / NAMESPACE).chmod(0o777)
    umask = os.umask(0)
    try:
        path = await spool_a_job(fork_server, "private")
    finally:
        os.umask(umask)
    assert path.read_text() == "private\n"
    assert_private(path, shared_tmp)


def test_a_spool_path_made_fresh_is_private(shared_tmp: Path) -> None:
    """No squatter: the spool's directories are made 0700 and are this user's own."""
    umask = os.umask(0)
    try:
        path = spool_path(NAMESPACE, LOG_NAME)
        path.parent.mkdir(parents=True, exist_ok=True)  # as the command's start does
    finally:
        os.umask(umask)
    path.touch(mode=0o600)
    assert_private(path, shared_tmp)
