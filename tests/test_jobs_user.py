"""`--jobs-user` and a tenant's `run_as` (issue 32, item 7): where the server may change user, a
job's command runs as that Unix user, and cannot read the server's state dir."""

from __future__ import annotations

import codecs
import importlib
import os
import pwd
import select
import signal
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from aiohttp import ClientSession

from jobs_server import cli
from tests.support.tenant_server import (
    TenantServer,
    run_tenant_server,
    submit_as,
    wait_until_terminal,
)

JOBS_USER = "jobs-test-user"
RUN_AS_USER = "jobs-test-run-as"
NO_SUCH_USER = "jobs-test-no-such-user"

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="changing user needs root")


def _ensure_user(name: str) -> int:
    try:
        return pwd.getpwnam(name).pw_uid
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", name], check=True)
        return pwd.getpwnam(name).pw_uid


@pytest.fixture(scope="session")
def users() -> dict[str, int]:
    """The test users' uids (created if missing)."""
    return {name: _ensure_user(name) for name in (JOBS_USER, RUN_AS_USER)}


@pytest.fixture(scope="module")
def server(
    ray_connection: str, tmp_path_factory: pytest.TempPathFactory, users: dict[str, int]
) -> Iterator[TenantServer]:
    workdir = tmp_path_factory.mktemp("jobs_user")
    # The state dir is the server's alone (as the state-dir work makes it; here from the start).
    (workdir / "state").mkdir(mode=0o700)
    yield from run_tenant_server(
        ray_connection,
        workdir,
        limits=f'\n[tenants.team-a]\nrun_as = "{RUN_AS_USER}"\n',
        extra_args=["--jobs-user", JOBS_USER],
    )


@pytest.fixture
async def session(server: TenantServer) -> AsyncIterator[ClientSession]:
    async with ClientSession(server.url) as session:
        yield session


async def _run(session: ClientSession, server: TenantServer, key: str, entrypoint: str) -> str:
    job_id = await submit_as(session, server, key, entrypoint=entrypoint)
    job = await wait_until_terminal(session, server, job_id)
    assert job["status"] == "SUCCEEDED", job
    response = await session.get(f"/api/jobs/{job_id}/logs", headers=server.headers("ops-admin"))
    return str((await response.json())["logs"])


async def test_a_job_runs_as_the_jobs_user_and_cannot_read_the_state_dir(
    session: ClientSession, server: TenantServer, users: dict[str, int]
) -> None:
    state_db = server.tokens_file.parent / "state" / "jobs.db"
    assert state_db.exists()
    logs = await _run(
        session,
        server,
        "b-submit",
        f'id -u; echo "home=$HOME user=$USER"; cat {state_db} >/dev/null 2>&1 || echo denied',
    )
    lines = logs.splitlines()
    assert lines[0] == str(users[JOBS_USER]), logs
    assert f"user={JOBS_USER}" in lines[1], logs
    assert lines[2] == "denied", logs


async def test_a_tenant_with_run_as_runs_as_its_user_another_as_the_default(
    session: ClientSession, server: TenantServer, users: dict[str, int]
) -> None:
    assert (await _run(session, server, "a-submit", "id -u")).split() == [str(users[RUN_AS_USER])]
    assert (await _run(session, server, "ops-admin", "id -u")).split() == [str(users[JOBS_USER])]


@pytest.mark.parametrize("where", ["flag", "tokens file"])
def test_a_user_that_does_not_exist_is_refused_at_start(tmp_path: Path, where: str) -> None:
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(f'[tenants.team-a]\nrun_as = "{NO_SUCH_USER}"\n')
    args = ["--jobs-user", NO_SUCH_USER] if where == "flag" else ["--tokens-file", str(tokens)]
    result = subprocess.run(
        [sys.executable, "-m", "jobs_server", "serve", "--port", "0", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "JOBS_SERVER_STATE_DIR": str(tmp_path / "state")},
    )
    assert result.returncode == 1, result.stderr
    assert f"no such user: {NO_SUCH_USER!r}" in result.stderr, result.stderr


@pytest.mark.parametrize("where", ["flag", "tokens file"])
def test_a_server_that_cannot_change_user_is_refused_at_start(
    users: dict[str, int], where: str
) -> None:
    """Run as an unprivileged user (no CAP_SETUID): jobs that are to run as another user would
    fail one by one at their start, so the server does not start at all, and says why. The
    server's start runs in a fork of this process that became that user (the interpreter's
    files may be out of an unprivileged user's reach, as under /root)."""
    uid = users[JOBS_USER]
    # In a directory the user can reach (pytest's are root's alone).
    with tempfile.TemporaryDirectory() as reachable:
        os.chmod(reachable, 0o755)
        state = Path(reachable) / "state"
        state.mkdir(mode=0o700)
        os.chown(state, uid, -1)
        tokens = Path(reachable) / "tokens.toml"
        tokens.write_text(f'[tenants.team-a]\nrun_as = "{RUN_AS_USER}"\n')
        tokens.chmod(0o644)
        args = ["--jobs-user", RUN_AS_USER] if where == "flag" else ["--tokens-file", str(tokens)]
        outcome = _serve_as(uid, [*args, "--state-dir", str(state)])
    assert outcome == (
        f"jobs-server: jobs are to run as {RUN_AS_USER} (--jobs-user, run_as), but this server"
        " cannot change user: it needs root or CAP_SETUID and CAP_SETGID"
    )


def _serve_as(uid: int, args: list[str]) -> str:
    """What `jobs-server serve ARGS` exits with, started as the user `uid` (without root's
    capabilities: setuid drops them)."""
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover (the child reports through the pipe)
        try:
            os.close(read_end)
            # What the start loads, loaded while root: the interpreter's files may be out of
            # the user's reach (under /root).
            codecs.lookup("ascii")
            importlib.import_module("jobs_server.app")
            os.setgroups([])
            os.setgid(pwd.getpwuid(uid).pw_gid)
            os.setuid(uid)
            try:
                cli.main(["serve", "--port", "0", *args])
                outcome = "started"
            except SystemExit as exit:
                outcome = str(exit.code)
            except BaseException as error:
                outcome = f"raised {error!r}"
            os.write(write_end, outcome.encode())
        finally:
            os._exit(0)
    os.close(write_end)
    try:
        # A start that went on (no refusal) would serve: it is killed after a minute.
        if not select.select([read_end], [], [], 60)[0]:
            os.kill(child, signal.SIGKILL)
            return "it did not exit"
        with os.fdopen(read_end, "rb", closefd=False) as reader:
            return reader.read().decode()
    finally:
        os.close(read_end)
        os.waitpid(child, 0)
