"""How many jobs each supervisor holds, in /metrics (issue 32, item 24), and the limit it shows:
the jobs on one shared supervisor share its fate. A real app on loopback, real Ray."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import ray
from prometheus_client.parser import text_string_to_metric_families

from jobs_server.access.key_digest import digest_of
from jobs_server.app import create_app
from jobs_server.settings import Settings
from tests.support.api import Client, submit, wait_for_status

SHARED_SUPERVISOR_PREFIX = "jobs_server_shared_supervisor:"
ADMIN_KEY = "supervisor-metrics-admin-key"
READ_KEY = "supervisor-metrics-read-key"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
READER = {"Authorization": f"Bearer {READ_KEY}"}


def tokens_file(directory: Path) -> Path:
    """An admin key of tenant `ops` and a read key of tenant `team-a`."""
    path = directory / "tokens.toml"
    path.write_text(
        f'[[keys]]\ndigest = "{digest_of(ADMIN_KEY)}"\ntenant = "ops"\nrole = "admin"\n\n'
        f'[[keys]]\ndigest = "{digest_of(READ_KEY)}"\ntenant = "team-a"\nrole = "read"\n'
    )
    return path


async def supervisor_series(
    client: Client, headers: dict[str, str] | None = None
) -> dict[str, float]:
    """The scrape's supervisor series: `jobs_server_supervisor_jobs` by its `supervisor` label,
    and `jobs_server_own_supervisor_jobs` under its own name."""
    response = await client.get("/metrics", headers=headers)
    assert response.status == 200, await response.text()
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(await response.text()):
        for sample in family.samples:
            if sample.name == "jobs_server_supervisor_jobs":
                found[sample.labels["supervisor"]] = sample.value
            elif sample.name == "jobs_server_own_supervisor_jobs":
                found[sample.name] = sample.value
    return found


async def scrape_until(
    client: Client, wanted: dict[str, float], timeout_s: float = 60
) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        found = await supervisor_series(client)
        if found == wanted:
            return found
        assert time.monotonic() < deadline, f"supervisor series never became {wanted}: {found}"
        await asyncio.sleep(0.1)


def shared_supervisor_name(namespace: str) -> str:
    """The one shared supervisor's actor name, as the server named it in Ray."""
    (name,) = [
        actor["name"]
        for actor in ray.util.list_named_actors(all_namespaces=True)
        if actor["namespace"] == namespace and actor["name"].startswith(SHARED_SUPERVISOR_PREFIX)
    ]
    return str(name)


async def test_metrics_show_the_jobs_each_supervisor_holds_and_a_shared_ones_death_ends_them(
    aiohttp_client: Callable[..., Awaitable[Client]], settings: Settings, tmp_path: Path
) -> None:
    # The admin's key on every request but the read key's scrape.
    client = await aiohttp_client(
        create_app(settings.model_copy(update={"tokens_file": tokens_file(tmp_path)})),
        headers=ADMIN,
    )
    shared = await asyncio.to_thread(shared_supervisor_name, settings.namespace)
    # The configured shared supervisor has its series before its first job: 0, not absent.
    assert await supervisor_series(client) == {
        shared: 0,
        "jobs_server_own_supervisor_jobs": 0,
    }

    # Five unrelated jobs on the shared supervisor, one with a supervisor of its own.
    on_shared = [
        await submit(client, entrypoint="sleep 600", metadata={"n": str(n)}) for n in range(5)
    ]
    own = await submit(client, entrypoint="sleep 600", entrypoint_num_cpus=0.1)
    for job_id in [*on_shared, own]:
        await wait_for_status(client, job_id, {"RUNNING"})
    await scrape_until(client, {shared: 5, "jobs_server_own_supervisor_jobs": 1})

    # Counted on the server, across tenants: a key that is not an admin's sees none of it.
    assert await supervisor_series(client, READER) == {}

    # It changes as jobs end.
    stopped = await client.post(f"/api/jobs/{on_shared[0]}/stop", json={"grace_period_s": 0})
    assert await stopped.json() == {"stopped": True}
    await scrape_until(client, {shared: 4, "jobs_server_own_supervisor_jobs": 1})

    # The limit: the shared supervisor's death ends every job it held, FAILED, saying so.
    supervisor = await asyncio.to_thread(ray.get_actor, shared, namespace=settings.namespace)
    await asyncio.to_thread(ray.kill, supervisor)
    for job_id in on_shared[1:]:
        job = await wait_for_status(client, job_id)
        assert job["status"] == "FAILED", job
        assert job["error_type"] == "JOB_SUPERVISOR_ACTOR_DIED", job
        assert "supervisor died" in job["message"], job
    # The job with a supervisor of its own runs on; the shared one's name (its replacement's)
    # holds nothing.
    assert (await wait_for_status(client, own, {"RUNNING"}))["status"] == "RUNNING"
    await scrape_until(client, {shared: 0, "jobs_server_own_supervisor_jobs": 1})

    await client.post(f"/api/jobs/{own}/stop", json={"grace_period_s": 0})
    assert (await wait_for_status(client, own))["status"] == "STOPPED"
    await scrape_until(client, {shared: 0, "jobs_server_own_supervisor_jobs": 0})
