"""`--jobs-user` and a tenant's `run_as` (issue 32, item 7): where the server may change user, a
job's command runs as that Unix user, and cannot read the server's state dir."""

from __future__ import annotations

import os
import pwd
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from aiohttp import ClientSession

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
