"""The queue in /metrics (issue 15): jobs queued and holding a slot, the caps, the refused
submits and the retries, per tenant, on a real server; a key of another tenant sees none of them."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Iterator

import pytest
from aiohttp import ClientSession
from prometheus_client.parser import text_string_to_metric_families

from tests.support.tenant_server import (
    TenantServer,
    run_tenant_server,
    submit_as,
    wait_until_terminal,
)

LIMITS = "\n[tenants.team-a]\nmax_running = 1\nmax_queued = 5\n"
SERVER_ARGS = ("--max-running-jobs", "1", "--max-queued-jobs", "2", "--retry-backoff-s", "0")

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@pytest.fixture(scope="module")
def server(ray_connection: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TenantServer]:
    yield from run_tenant_server(
        ray_connection, tmp_path_factory.mktemp("queue-metrics"), LIMITS, SERVER_ARGS
    )


async def scrape(session: ClientSession, server: TenantServer, key: str) -> Samples:
    response = await session.get("/metrics", headers=server.headers(key))
    assert response.status == 200, await response.text()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(await response.text())
        for sample in family.samples
    }


def of_tenant(name: str, tenant: str) -> tuple[str, tuple[tuple[str, str], ...]]:
    return (name, (("tenant", tenant),))


def tenants_in(found: Samples) -> set[str]:
    return {value for (_, labels) in found for key, value in labels if key == "tenant"}


async def scrape_until(
    session: ClientSession, server: TenantServer, key: str, wanted: dict[tuple[str, str], float]
) -> Samples:
    """Scrape until the (metric, tenant) series have the `wanted` values."""
    deadline = time.monotonic() + 60
    while True:
        found = await scrape(session, server, key)
        now = {series: found.get(of_tenant(*series)) for series in wanted}
        if now == wanted:
            return found
        assert time.monotonic() < deadline, f"metrics never became {wanted}: {now}"
        await asyncio.sleep(0.1)


async def test_queue_gauges_caps_refusals_and_retries_per_tenant(
    session: ClientSession, server: TenantServer
) -> None:
    running = await submit_as(session, server, "a-submit", entrypoint="sleep 600")
    queued = [
        await submit_as(session, server, "a-submit", entrypoint="sleep 600") for _ in range(2)
    ]
    refused = await session.post(
        "/api/jobs/", json={"entrypoint": "true"}, headers=server.headers("a-submit")
    )
    assert refused.status == 429, await refused.text()
    assert (await refused.json())["error"]["code"] == "queue_full"

    found = await scrape_until(
        session,
        server,
        "ops-admin",
        {
            ("jobs_server_slot_holding_jobs", "team-a"): 1,
            ("jobs_server_queued_jobs", "team-a"): 2,
        },
    )
    assert found[of_tenant("jobs_server_queued_jobs", "team-b")] == 0
    assert found[of_tenant("jobs_server_slot_holding_jobs", "team-b")] == 0
    assert found[of_tenant("jobs_server_queue_full_refusals_total", "team-a")] == 1
    assert found[of_tenant("jobs_server_queue_full_refusals_total", "team-b")] == 0
    assert found[("jobs_server_max_running_jobs", ())] == 1
    assert found[("jobs_server_max_queued_jobs", ())] == 2
    assert found[of_tenant("jobs_server_tenant_max_running_jobs", "team-a")] == 1
    assert found[of_tenant("jobs_server_tenant_max_queued_jobs", "team-a")] == 5
    # No cap of its own: +Inf, so `used / cap` is 0.
    assert found[of_tenant("jobs_server_tenant_max_running_jobs", "team-b")] == math.inf

    # team-a's read key sees its tenant's numbers; team-b's sees none of team-a's series.
    own = await scrape(session, server, "a-read")
    assert own[of_tenant("jobs_server_queued_jobs", "team-a")] == 2
    assert own[of_tenant("jobs_server_slot_holding_jobs", "team-a")] == 1
    assert own[of_tenant("jobs_server_queue_full_refusals_total", "team-a")] == 1
    assert tenants_in(own) == {"team-a"}
    other = await scrape(session, server, "b-read")
    assert tenants_in(other) == {"team-b"}
    assert other[of_tenant("jobs_server_queued_jobs", "team-b")] == 0
    assert other[("jobs_server_max_running_jobs", ())] == 1

    for job_id in [running, *queued]:
        stopped = await session.post(f"/api/jobs/{job_id}/stop", headers=server.headers("a-submit"))
        assert stopped.status == 200, await stopped.text()
        await wait_until_terminal(session, server, job_id)
    await scrape_until(
        session,
        server,
        "ops-admin",
        {
            ("jobs_server_slot_holding_jobs", "team-a"): 0,
            ("jobs_server_queued_jobs", "team-a"): 0,
        },
    )

    # Three attempts: two retries, counted for team-b when the job has ended.
    failing = await submit_as(
        session, server, "b-submit", entrypoint="exit 3", max_retries=2, retry_on_exit_codes=[3]
    )
    details = await wait_until_terminal(session, server, failing)
    assert details["status"] == "FAILED"
    assert len(details["attempts"]) == 3
    found = await scrape_until(
        session, server, "b-read", {("jobs_server_job_retries_total", "team-b"): 2}
    )
    assert tenants_in(found) == {"team-b"}
    admin = await scrape(session, server, "ops-admin")
    assert admin[of_tenant("jobs_server_job_retries_total", "team-a")] == 0
