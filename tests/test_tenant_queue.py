"""A tenant's caps come from the tokens file, through the server (issue 15, items 1 and 3): they
hold one tenant back without holding back another, and a SIGHUP that raises them hands over
what they now allow."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from aiohttp import ClientSession

from tests.support.tenant_server import KEY_SPECS, TenantServer, run_tenant_server, tokens_toml

LIMITS = "\n[tenants.team-b]\nmax_running = 1\nmax_queued = 1\n"
RAISED_LIMITS = "\n[tenants.team-b]\nmax_running = 2\nmax_queued = 1\n"


@pytest.fixture(scope="module")
def server(ray_connection: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TenantServer]:
    yield from run_tenant_server(ray_connection, tmp_path_factory.mktemp("tenant-queue"), LIMITS)


async def submit(session: ClientSession, server: TenantServer, key: str) -> aiohttp.ClientResponse:
    return await session.post(
        "/api/jobs/", json={"entrypoint": "sleep 600"}, headers=server.headers(key)
    )


async def job(session: ClientSession, server: TenantServer, job_id: str) -> dict[str, Any]:
    response = await session.get(f"/api/jobs/{job_id}", headers=server.headers("ops-admin"))
    assert response.status == 200, await response.text()
    details: dict[str, Any] = await response.json()
    return details


async def wait_for_status(
    session: ClientSession, server: TenantServer, job_id: str, status: str, timeout_s: float = 60
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        details = await job(session, server, job_id)
        if details["status"] == status:
            return details
        assert time.monotonic() < deadline, f"{job_id} never {status}: {details}"
        await asyncio.sleep(0.05)


async def test_a_tenants_caps_from_the_tokens_file_hold_it_back_and_a_sighup_raises_them(
    session: ClientSession, server: TenantServer
) -> None:
    submitted: list[str] = []
    try:
        first = await submit(session, server, "b-submit")
        assert first.status == 200, await first.text()
        submitted.append((await first.json())["submission_id"])
        await wait_for_status(session, server, submitted[0], "RUNNING")

        # team-b's one slot is taken: its next job waits, and says why.
        second = await submit(session, server, "b-submit")
        assert second.status == 200, await second.text()
        submitted.append((await second.json())["submission_id"])
        waiting = await job(session, server, submitted[1])
        assert waiting["status"] == "PENDING"
        assert waiting["message"].startswith("Queued: 1st of 1"), waiting["message"]
        assert "tenant team-b: 1 of 1 running" in waiting["message"], waiting["message"]

        # Its one queued place is taken too: a 429, and nothing recorded.
        refused = await submit(session, server, "b-submit")
        assert refused.status == 429, await refused.text()
        assert (await refused.json())["error"]["code"] == "queue_full"
        assert int(refused.headers["Retry-After"]) >= 1
        listed = await session.get("/api/jobs/", headers=server.headers("b-read"))
        assert len(await listed.json()) == 2

        # team-b's caps do not hold team-a back.
        other = await submit(session, server, "a-submit")
        assert other.status == 200, await other.text()
        submitted.append((await other.json())["submission_id"])
        await wait_for_status(session, server, submitted[2], "RUNNING")
        assert (await job(session, server, submitted[1]))["status"] == "PENDING"

        # A second slot for team-b, by SIGHUP: the queued job is handed over.
        keys = server.keys
        server.tokens_file.write_text(tokens_toml(keys, KEY_SPECS, RAISED_LIMITS))
        os.kill(server.pid, signal.SIGHUP)
        await wait_for_status(session, server, submitted[1], "RUNNING", timeout_s=30)
    finally:
        for job_id in submitted:
            await session.post(f"/api/jobs/{job_id}/stop", headers=server.headers("ops-admin"))
