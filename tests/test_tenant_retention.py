"""One tenant's flood does not delete another's history (issue 32, item 9): retention keeps each
tenant within its own `max_jobs`/`max_age_s` (the tokens file's `[tenants.X]`, the server's
--retention-* as their ceiling), and the server-wide count deletes from the tenants over their
share first. A non-admin's 429 and a queued job's message show its own tenant's counts only.

The sweep on the real archive first; then through a real server process on real Ray (its
tokens file, SIGHUP, its queue)."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest
from aiohttp import ClientSession

from jobs_server.access.tokens import TokensFileError, parse_tokens
from jobs_server.manager.archive.interface import JobArchive
from jobs_server.manager.archive.retention import Retention, RetentionPolicy
from jobs_server.manager.archive.sqlite import JobQuery
from jobs_server.manager.records import JobRecord, JobSpec, JobStatus, new_run_id, now_ms
from jobs_server.manager.tenancy import NO_LIMITS, TenantLimits
from tests.support.tenant_server import (
    KEY_SPECS,
    TenantServer,
    run_tenant_server,
    submit_as,
    tokens_toml,
    wait_until_terminal,
)

DAY_MS = 24 * 3600 * 1000
DAY_S = 24 * 3600.0


async def add_job(
    archive: JobArchive,
    submission_id: str,
    *,
    tenant: str,
    status: JobStatus = JobStatus.SUCCEEDED,
    ended_ms_ago: int = 0,
) -> None:
    now = now_ms()
    record = JobRecord(
        spec=JobSpec(entrypoint="true", submission_id=submission_id),
        start_time=now - ended_ms_ago - 1000,
        run_id=new_run_id(),
        tenant=tenant,
    )
    await archive.insert(record)
    if status is not JobStatus.PENDING:
        end_time = now - ended_ms_ago if status.is_terminal() else None
        await archive.update(record.with_changes(status=status, end_time=end_time))


def sweeper(
    archive: JobArchive,
    *,
    max_jobs: int = 100_000,
    max_age_s: float = 30 * DAY_S,
    limits: dict[str, TenantLimits] | None = None,
) -> Retention:
    async def delete_job(record: JobRecord) -> bool:
        return await archive.delete(record.submission_id, record.run_id)

    policy = RetentionPolicy(max_age_s=max_age_s, max_jobs=max_jobs, interval_s=3600)
    kwargs: dict[str, Any] = {}
    if limits is not None:
        kwargs["tenant_limits"] = lambda tenant: limits.get(tenant, NO_LIMITS)
    return Retention(archive=archive, delete_job=delete_job, policy=policy, **kwargs)


async def kept(archive: JobArchive, tenant: str) -> list[str]:
    return [r.submission_id for r in (await archive.page(JobQuery(tenant=tenant)))[0]]


async def test_a_flood_over_the_server_wide_count_deletes_the_flooder_s_jobs(
    archive: JobArchive,
) -> None:
    """No tenant caps: the server's max_jobs still holds overall, but from the tenant over its
    share first. B's history is older than all of A's flood, and stays."""
    for number in range(4):
        await add_job(archive, f"b-{number}", tenant="team-b")
    for number in range(20):
        await add_job(archive, f"a-{number}", tenant="team-a")

    assert await sweeper(archive, max_jobs=10).sweep() == 14
    assert await kept(archive, "team-b") == [f"b-{number}" for number in range(4)]
    assert await kept(archive, "team-a") == [f"a-{number}" for number in range(14, 20)]


async def test_the_server_wide_count_shares_between_tenants_over_it(archive: JobArchive) -> None:
    """Both over their share: each keeps its share of the server's count, its newest jobs; a
    live one among the oldest stays too (never deleted)."""
    for number in range(8):
        status = JobStatus.RUNNING if number == 0 else JobStatus.SUCCEEDED
        await add_job(archive, f"b-{number}", tenant="team-b", status=status)
    for number in range(12):
        await add_job(archive, f"a-{number}", tenant="team-a")
    await add_job(archive, "c-0", tenant="team-c")

    await sweeper(archive, max_jobs=11).sweep()
    # c has 1, below the level; a and b share the other 10.
    assert await kept(archive, "team-c") == ["c-0"]
    assert await kept(archive, "team-a") == [f"a-{number}" for number in range(7, 12)]
    assert await kept(archive, "team-b") == ["b-0", *[f"b-{number}" for number in range(3, 8)]]


async def test_a_tenant_s_own_count_deletes_only_its_jobs(archive: JobArchive) -> None:
    for number in range(3):
        await add_job(archive, f"b-{number}", tenant="team-b")
    for number in range(10):
        status = JobStatus.RUNNING if number == 1 else JobStatus.SUCCEEDED
        await add_job(archive, f"a-{number}", tenant="team-a", status=status)
    limits = {"team-a": TenantLimits(max_jobs=3)}

    assert await sweeper(archive, max_jobs=1000, limits=limits).sweep() == 6
    assert await kept(archive, "team-a") == ["a-1", "a-7", "a-8", "a-9"]
    assert await kept(archive, "team-b") == ["b-0", "b-1", "b-2"]


async def test_a_tenant_s_own_age_deletes_only_its_jobs(archive: JobArchive) -> None:
    for tenant in ("team-a", "team-b"):
        await add_job(archive, f"{tenant}-old", tenant=tenant, ended_ms_ago=2 * DAY_MS)
        await add_job(archive, f"{tenant}-live", tenant=tenant, status=JobStatus.RUNNING)
        await add_job(archive, f"{tenant}-new", tenant=tenant, ended_ms_ago=DAY_MS // 2)
    limits = {"team-a": TenantLimits(max_age_s=DAY_S)}

    assert await sweeper(archive, limits=limits).sweep() == 1
    assert await kept(archive, "team-a") == ["team-a-live", "team-a-new"]
    assert await kept(archive, "team-b") == ["team-b-old", "team-b-live", "team-b-new"]


async def test_a_tenant_s_caps_above_the_server_s_are_clamped_to_them(archive: JobArchive) -> None:
    for number in range(6):
        await add_job(archive, f"a-{number}", tenant="team-a", ended_ms_ago=(6 - number) * DAY_MS)
    limits = {"team-a": TenantLimits(max_jobs=1000, max_age_s=365 * DAY_S)}

    # The server keeps 4.5 days: a tenant asking for a year still loses the older ones.
    await sweeper(archive, max_age_s=4.5 * DAY_S, limits=limits).sweep()
    assert await kept(archive, "team-a") == ["a-2", "a-3", "a-4", "a-5"]
    # And at most the server's count, whatever the tenant's.
    await sweeper(archive, max_jobs=2, limits=limits).sweep()
    assert await kept(archive, "team-a") == ["a-4", "a-5"]


def test_the_tokens_file_takes_retention_caps_per_tenant() -> None:
    tokens = parse_tokens(
        "[tenants.team-a]\nmax_jobs = 50\nmax_age_s = 3600\n"
        "[tenants.team-b]\nmax_age_s = 1.5\n[tenants.team-c]\nmax_running = 2\n",
        source="t.toml",
    )
    assert tokens.limits_for("team-a") == TenantLimits(max_jobs=50, max_age_s=3600.0)
    assert tokens.limits_for("team-b") == TenantLimits(max_age_s=1.5)
    assert tokens.limits_for("team-c") == TenantLimits(max_running=2)
    # Above any server's ceiling: taken, and clamped where it is used (the server's caps win).
    assert parse_tokens("[tenants.team-a]\nmax_jobs = 10000000000\n", source="t.toml").limits_for(
        "team-a"
    ) == TenantLimits(max_jobs=10_000_000_000)


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("max_jobs = 0\n", "tenants.team-a.max_jobs: Input should be greater than or equal to 1"),
        ("max_jobs = 2.5\n", "tenants.team-a.max_jobs: Input should be a valid integer"),
        ('max_jobs = "9"\n', "tenants.team-a.max_jobs: Input should be a valid integer"),
        ("max_age_s = 0\n", "tenants.team-a.max_age_s: Input should be greater than 0"),
        ("max_age_s = -1.0\n", "tenants.team-a.max_age_s: Input should be greater than 0"),
        ("max_age_s = inf\n", "tenants.team-a.max_age_s: Input should be a finite number"),
        ("max_age_s = nan\n", "tenants.team-a.max_age_s: Input should be a finite number"),
        ("max_age_s = true\n", "tenants.team-a.max_age_s: Input should be a valid number"),
    ],
)
def test_bad_retention_caps_are_refused_saying_where(text: str, error: str) -> None:
    with pytest.raises(TokensFileError) as refused:
        parse_tokens("[tenants.team-a]\n" + text, source="t.toml")
    assert error in str(refused.value)


# Through a real server process on real Ray.

A_CAP = "\n[tenants.team-a]\nmax_jobs = 3\n"
A_LOWER_CAP = "\n[tenants.team-a]\nmax_jobs = 1\n"
NO_CAPS = "\n[tenants.team-b]\nmax_running = 100\n"
SERVER_MAX_JOBS = 8
WAIT_S = 60.0


@pytest.fixture(scope="module")
def retention_server(
    ray_connection: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[TenantServer]:
    yield from run_tenant_server(
        ray_connection,
        tmp_path_factory.mktemp("tenant-retention"),
        A_CAP,
        extra_args=[
            "--retention-interval-s",
            "0.1",
            "--retention-max-jobs",
            str(SERVER_MAX_JOBS),
        ],
    )


async def listed(session: ClientSession, server: TenantServer, key: str) -> list[str]:
    response = await session.get("/api/jobs/", headers=server.headers(key))
    assert response.status == 200, await response.text()
    return [job["submission_id"] for job in await response.json()]


async def wait_for_listed(
    session: ClientSession, server: TenantServer, key: str, expected: list[str]
) -> None:
    deadline = time.monotonic() + WAIT_S
    while (jobs := await listed(session, server, key)) != expected:
        assert time.monotonic() < deadline, f"{key} lists {jobs}, waiting for {expected}"
        await asyncio.sleep(0.1)


async def finished_jobs(
    session: ClientSession, server: TenantServer, key: str, count: int
) -> list[str]:
    """`count` jobs of the key's tenant, one after the other, each ended before the next."""
    job_ids = []
    for _ in range(count):
        job_id = await submit_as(session, server, key, entrypoint="true")
        await wait_until_terminal(session, server, job_id)
        job_ids.append(job_id)
    return job_ids


def reload_caps(server: TenantServer, limits: str) -> None:
    server.tokens_file.write_text(tokens_toml(server.keys, KEY_SPECS, limits))
    os.kill(server.pid, signal.SIGHUP)


async def test_a_flood_keeps_to_its_tenant_and_a_sighup_moves_its_cap(
    retention_server: TenantServer,
) -> None:
    server = retention_server
    async with ClientSession(base_url=server.url) as session:
        b_jobs = await finished_jobs(session, server, "b-submit", 3)
        a_jobs = await finished_jobs(session, server, "a-submit", 6)
        # team-a's own cap: its 3 newest; team-b's older history is not touched.
        await wait_for_listed(session, server, "a-read", a_jobs[-3:])
        await wait_for_listed(session, server, "b-read", b_jobs)

        reload_caps(server, A_LOWER_CAP)
        await wait_for_listed(session, server, "a-read", a_jobs[-1:])
        await wait_for_listed(session, server, "b-read", b_jobs)

        # No cap of its own any more: the server's count (8) holds, from team-a first.
        reload_caps(server, NO_CAPS)
        a_jobs = a_jobs[-1:] + await finished_jobs(session, server, "a-submit", 8)
        await wait_for_listed(session, server, "a-read", a_jobs[-(SERVER_MAX_JOBS - 3) :])
        await wait_for_listed(session, server, "b-read", b_jobs)


# A 429 and a queued job's message, as a non-admin of another tenant reads them.

QUEUE_ARGS = ["--max-running-jobs", "2", "--max-queued-jobs", "4"]


@pytest.fixture(scope="module")
def queue_server(
    ray_connection: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[TenantServer]:
    yield from run_tenant_server(
        ray_connection,
        tmp_path_factory.mktemp("tenant-counts"),
        "\n[tenants.team-b]\nmax_queued = 1\n",
        extra_args=QUEUE_ARGS,
    )


def numbers_in(text: str) -> set[int]:
    return {int(number) for number in re.findall(r"\d+", text)}


async def test_a_non_admin_sees_its_own_tenant_s_counts_only(queue_server: TenantServer) -> None:
    server = queue_server
    submitted: list[str] = []
    async with ClientSession(base_url=server.url) as session:
        try:
            # team-a takes both slots and 3 of the 4 places in the queue.
            for _ in range(5):
                submitted.append(
                    await submit_as(session, server, "a-submit", entrypoint="sleep 600")
                )
            b_job = await submit_as(session, server, "b-submit", entrypoint="true")
            submitted.append(b_job)

            # Its place and what it waits behind, as team-b reads it: team-b's numbers (its 1st
            # of 1 queued, 0 running) and the server's cap (2 running), never team-a's (3 queued,
            # 2 running: the same as the cap, so it is not named as a count) nor the total (4).
            response = await session.get(f"/api/jobs/{b_job}", headers=server.headers("b-read"))
            own = await response.json()
            assert own["status"] == "PENDING", own
            assert own["message"].startswith("Queued: 1st of 1"), own["message"]
            assert numbers_in(own["message"]) <= {0, 1, 2}, own["message"]
            assert "team-a" not in own["message"]
            listed = await session.get("/api/jobs/", headers=server.headers("b-read"))
            (listed_b,) = await listed.json()
            assert listed_b["message"] == own["message"]
            # An admin sees the whole queue.
            response = await session.get(f"/api/jobs/{b_job}", headers=server.headers("ops-admin"))
            assert "of 4" in (await response.json())["message"]

            # The server's queue is full now: team-b's refusal names team-b's counts (0 running,
            # 1 queued) and the server's cap (4), never team-a's 2 running or 3 queued.
            refused = await session.post(
                "/api/jobs/", json={"entrypoint": "true"}, headers=server.headers("b-submit")
            )
            assert refused.status == 429, await refused.text()
            message = (await refused.json())["error"]["message"]
            assert numbers_in(message) <= {0, 1, 4}, message
            assert "team-a" not in message
            # team-a's own refusal gives its own counts.
            refused = await session.post(
                "/api/jobs/", json={"entrypoint": "true"}, headers=server.headers("a-submit")
            )
            assert refused.status == 429
            message = (await refused.json())["error"]["message"]
            assert "tenant 'team-a' has 3 jobs queued" in message, message
            assert "2 running" in message, message
        finally:
            for job_id in submitted:
                await session.post(f"/api/jobs/{job_id}/stop", headers=server.headers("ops-admin"))
