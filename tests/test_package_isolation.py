"""Uploaded packages are immutable and each tenant's own (issue 32, item 5), on a real server
process with two tenants and real Ray: one tenant's upload never changes what another tenant's
job runs, a name once taken keeps its bytes, and Ray's own client uploads a copy of its own."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import io
import os
import secrets
import shutil
import zipfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import ClientSession
from ray._private.runtime_env.packaging import get_uri_for_directory
from ray.job_submission import JobStatus, JobSubmissionClient

from tests.support.processes import wait_until
from tests.support.tenant_server import (
    TenantServer,
    run_tenant_server,
    submit_as,
    wait_until_terminal,
)

# A job whose working dir is a package reads this file of it.
WHO_FILE = "who.txt"
# A runtime env is set up on a node of its own supervisor: longer than a plain job.
JOB_DEADLINE_S = 180


@pytest.fixture(scope="module")
def server(ray_connection: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TenantServer]:
    yield from run_tenant_server(ray_connection, tmp_path_factory.mktemp("package-isolation"))


@pytest.fixture
async def session(server: TenantServer) -> AsyncIterator[ClientSession]:
    async with ClientSession(
        base_url=server.url, timeout=aiohttp.ClientTimeout(total=120)
    ) as session:
        yield session


def package_of(who: str) -> bytes:
    """A working_dir zip whose `who.txt` says `who`."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr(WHO_FILE, who + "\n")
    return buffer.getvalue()


def new_package_name() -> str:
    return f"_ray_pkg_{secrets.token_hex(20)}.zip"


async def put_package(
    session: ClientSession, server: TenantServer, key: str, name: str, data: bytes
) -> tuple[int, Any]:
    async with session.put(
        f"/api/packages/gcs/{name}", data=data, headers=server.headers(key)
    ) as response:
        return response.status, await response.json()


async def get_package(
    session: ClientSession, server: TenantServer, key: str, name: str
) -> tuple[int, Any]:
    async with session.get(f"/api/packages/gcs/{name}", headers=server.headers(key)) as response:
        return response.status, await response.json()


async def run_in_package(
    session: ClientSession, server: TenantServer, key: str, name: str
) -> tuple[dict[str, Any], str]:
    """Run `cat who.txt` in the package as `key`'s tenant; the job's details and log."""
    job_id = await submit_as(
        session,
        server,
        key,
        entrypoint=f"cat {WHO_FILE}",
        runtime_env={"working_dir": f"gcs://{name}"},
    )
    job = await wait_until_terminal(session, server, job_id, timeout_s=JOB_DEADLINE_S)
    async with session.get(f"/api/jobs/{job_id}/logs", headers=server.headers(key)) as response:
        assert response.status == 200, await response.text()
        logs = str((await response.json())["logs"])
    return job, logs


async def test_another_tenants_upload_of_the_name_never_reaches_its_jobs(
    session: ClientSession, server: TenantServer
) -> None:
    name = new_package_name()
    assert await put_package(session, server, "b-submit", name, package_of("team-b")) == (
        200,
        {"uri": f"gcs://{name}"},
    )
    # team-a cannot see team-b's package: Ray's client would upload its own ...
    status, body = await get_package(session, server, "a-submit", name)
    assert (status, body["error"]["code"]) == (404, "package_not_found")
    # ... which is team-a's alone: team-b's stays as it was.
    assert (await put_package(session, server, "a-submit", name, package_of("team-a")))[0] == 200
    job, logs = await run_in_package(session, server, "b-submit", name)
    assert (job["status"], logs) == ("SUCCEEDED", "team-b\n"), job
    # The job's details name the package as its client gave it.
    assert job["runtime_env"] == {"working_dir": f"gcs://{name}"}
    job, logs = await run_in_package(session, server, "a-submit", name)
    assert (job["status"], logs) == ("SUCCEEDED", "team-a\n"), job


async def test_a_job_cannot_name_a_package_its_tenant_did_not_upload(
    session: ClientSession, server: TenantServer
) -> None:
    name = new_package_name()
    assert (await put_package(session, server, "b-submit", name, package_of("team-b")))[0] == 200
    response = await session.post(
        "/api/jobs/",
        json={"entrypoint": f"cat {WHO_FILE}", "runtime_env": {"working_dir": f"gcs://{name}"}},
        headers=server.headers("a-submit"),
    )
    assert response.status == 400, await response.text()
    error = (await response.json())["error"]
    assert error["code"] == "invalid_runtime_env"
    assert "runtime_env.working_dir" in error["message"]
    assert "never uploaded" in error["message"]


async def test_a_package_is_immutable_the_same_bytes_again_are_accepted(
    session: ClientSession, server: TenantServer
) -> None:
    name = new_package_name()
    original = package_of("the original")
    assert (await put_package(session, server, "b-submit", name, original))[0] == 200
    # The same bytes again (a client that lost the answer and retries): accepted.
    assert await put_package(session, server, "b-submit", name, original) == (
        200,
        {"uri": f"gcs://{name}"},
    )
    # Other bytes under the taken name: refused, and nothing changes.
    status, body = await put_package(session, server, "b-submit", name, package_of("other"))
    assert status == 409, body
    assert body["error"]["code"] == "package_exists"
    assert f"gcs://{name}" in body["error"]["message"]
    job, logs = await run_in_package(session, server, "b-submit", name)
    assert (job["status"], logs) == ("SUCCEEDED", "the original\n"), job


async def test_a_put_while_a_job_that_uses_the_package_starts_changes_nothing(
    session: ClientSession, server: TenantServer
) -> None:
    name = new_package_name()
    assert (await put_package(session, server, "b-submit", name, package_of("before")))[0] == 200
    job_id = await submit_as(
        session,
        server,
        "b-submit",
        entrypoint=f"cat {WHO_FILE}",
        runtime_env={"working_dir": f"gcs://{name}"},
    )
    # The job's supervisor (and its runtime env) is being set up now.
    status, body = await put_package(session, server, "b-submit", name, package_of("after"))
    assert status == 409, body
    job = await wait_until_terminal(session, server, job_id, timeout_s=JOB_DEADLINE_S)
    async with session.get(f"/api/jobs/{job_id}/logs", headers=server.headers("b-submit")) as r:
        logs = (await r.json())["logs"]
    assert (job["status"], logs) == ("SUCCEEDED", "before\n"), job


async def test_of_two_concurrent_puts_with_different_bytes_exactly_one_wins(
    session: ClientSession, server: TenantServer
) -> None:
    name = new_package_name()
    # A package large enough that the two bodies are in flight together.
    contents = {who: package_of(who + "\n" + secrets.token_hex(256 * 1024)) for who in ("1", "2")}
    answers = await asyncio.gather(
        *(put_package(session, server, "b-submit", name, data) for data in contents.values())
    )
    statuses = sorted(status for status, _ in answers)
    assert statuses == [200, 409], answers
    winner = next(who for (status, _), who in zip(answers, contents, strict=True) if status == 200)
    # The loser's bytes are nowhere: the job runs the winner's.
    job, logs = await run_in_package(session, server, "b-submit", name)
    assert job["status"] == "SUCCEEDED", job
    assert logs.splitlines()[0] == winner


def _client(server: TenantServer, key: str) -> JobSubmissionClient:
    return JobSubmissionClient(server.url, headers=server.headers(key))


def test_ray_clients_of_two_tenants_with_the_same_directory_each_upload_their_own(
    server: TenantServer, tmp_path: Path
) -> None:
    """The same directory content gets the same package name (Ray's client hashes the files):
    team-a's client finds it missing and uploads its own copy, whose zip differs (other file
    times), and both jobs run."""
    b_dir, a_dir = tmp_path / "b", tmp_path / "a"
    b_dir.mkdir()
    (b_dir / WHO_FILE).write_text(f"shared content {secrets.token_hex(8)}\n")
    shutil.copytree(b_dir, a_dir)
    os.utime(a_dir / WHO_FILE, (1_000_000_000, 1_000_000_000))
    uri = get_uri_for_directory(str(a_dir), include_gitignore=True)
    assert uri == get_uri_for_directory(str(b_dir), include_gitignore=True)
    name = uri.removeprefix("gcs://")

    jobs = {}
    for key, directory in (("b-submit", b_dir), ("a-submit", a_dir)):
        client = _client(server, key)
        if key == "a-submit":
            # Team-b's upload of the name is not team-a's.
            assert not client._package_exists(uri)
        jobs[key] = client.submit_job(
            entrypoint=f"cat {WHO_FILE}", runtime_env={"working_dir": str(directory)}
        )
        assert client._package_exists(uri)
    for key, job_id in jobs.items():
        client = _client(server, key)
        wait_until(
            lambda client=client, job_id=job_id: client.get_job_status(job_id).is_terminal(),
            JOB_DEADLINE_S,
            f"{job_id} ends",
        )
        info = client.get_job_info(job_id)
        assert info.status == JobStatus.SUCCEEDED, info
        assert client.get_job_logs(job_id) == (b_dir / WHO_FILE).read_text()
        assert info.runtime_env is not None
        assert info.runtime_env["working_dir"] == f"gcs://{name}"


def wheel_of(distribution: str, who: str) -> bytes:
    """A pure-Python wheel whose module `isolated_mod` says `who`."""
    dist_info = f"{distribution}-0.1.dist-info"
    files = {
        "isolated_mod/__init__.py": f"WHO = {who!r}\n",
        f"{dist_info}/METADATA": f"Metadata-Version: 2.1\nName: {distribution}\nVersion: 0.1\n",
        f"{dist_info}/WHEEL": (
            "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        ),
    }
    record = [
        f"{path},sha256={_record_digest(text.encode())},{len(text.encode())}"
        for path, text in files.items()
    ]
    files[f"{dist_info}/RECORD"] = "\n".join([*record, f"{dist_info}/RECORD,,"]) + "\n"
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for path, text in files.items():
            archive.writestr(path, text)
    return buffer.getvalue()


def _record_digest(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def test_two_tenants_wheels_of_one_file_name_are_each_their_own(
    server: TenantServer, tmp_path: Path
) -> None:
    """A wheel is named by its file name, not its content: two tenants' wheels of one name
    differ, and each tenant's job imports its own (pip installs the tenant's copy)."""
    distribution = f"iso_{secrets.token_hex(4)}"
    jobs = {}
    for key, who in (("b-submit", "team-b"), ("a-submit", "team-a")):
        wheel = tmp_path / who / f"{distribution}-0.1-py3-none-any.whl"
        wheel.parent.mkdir()
        wheel.write_bytes(wheel_of(distribution, who))
        jobs[key] = (
            _client(server, key).submit_job(
                entrypoint="python -c 'import isolated_mod; print(isolated_mod.WHO)'",
                runtime_env={"py_modules": [str(wheel)]},
            ),
            who,
        )
    for key, (job_id, who) in jobs.items():
        client = _client(server, key)
        wait_until(
            lambda client=client, job_id=job_id: client.get_job_status(job_id).is_terminal(),
            JOB_DEADLINE_S,
            f"{job_id} ends",
        )
        info = client.get_job_info(job_id)
        logs = client.get_job_logs(job_id)
        assert info.status == JobStatus.SUCCEEDED, (info, logs)
        assert logs == f"{who}\n"
