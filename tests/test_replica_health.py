"""What a replica says of itself (issue 34, item 6): `/api/healthz` names the replica, says
whether it holds its database connection, how many jobs it owns and which leases it holds;
`/metrics` has the same as gauges and the leases' counters, on SQLite (no leases: zeros, so a
dashboard does not break when the store changes) and on PostgreSQL. Real servers on loopback on
the session's Ray cluster, a real PostgreSQL (stopped and started again for the outage)."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from aiohttp.test_utils import TestClient
from prometheus_client.parser import text_string_to_metric_families
from pydantic import SecretStr

from jobs_server.access.key_digest import digest_of
from jobs_server.app import create_app
from jobs_server.manager.archive.interface import create_archive
from jobs_server.manager.archive.leadership import SERVER_LEASE
from jobs_server.manager.archive.leases import ReplicaLeases
from jobs_server.manager.records import JobSpec
from jobs_server.settings import Settings
from tests.support.api import wait_for_status
from tests.support.fakes import FakeJobManager
from tests.support.openapi_contract import Contract, Exchange
from tests.support.postgres import PostgresServer, running_postgres, start_again, stop_immediately

Client = TestClient[Any, Any]

DEADLINE_S = 60.0
REPLICA_SERIES = (
    "jobs_server_jobs_owned",
    "jobs_server_database_connected",
    "jobs_server_leases_held",
    "jobs_server_leases_acquired_total",
    "jobs_server_leases_taken_over_total",
    "jobs_server_leases_lost_total",
)


def replica_samples(text: str) -> dict[str, float]:
    """The replica's series of a scrape, by sample name (each has one sample, no labels)."""
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in REPLICA_SERIES:
                assert sample.labels == {}, sample
                samples[sample.name] = sample.value
    return samples


async def scrape(api: Exchange) -> dict[str, float]:
    text: str = await api.call("GET", "/metrics", expect=200)
    return replica_samples(text)


async def until(check: Callable[[], Awaitable[bool]], what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not await check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


def blocking_job(release: Path) -> dict[str, str]:
    """A job that runs until the test creates `release`."""
    return {"entrypoint": f"while [ ! -e {release} ]; do sleep 0.05; done; echo released"}


async def owns_one_job_then_none(client: Client, api: Exchange, tmp_path: Path) -> dict[str, Any]:
    """Submit a job that runs until released: the replica owns it (healthz and metrics), then,
    once it ended, owns none. The replica section of the last healthz."""
    release = tmp_path / "release"
    job_id = (await api.call("POST", "/api/jobs/", json=blocking_job(release), expect=200))[
        "job_id"
    ]
    await wait_for_status(client, job_id, {"RUNNING"})
    replica = (await api.call("GET", "/api/healthz", expect=200))["replica"]
    assert replica["jobs_owned"] == 1
    assert (await scrape(api))["jobs_server_jobs_owned"] == 1
    release.touch()
    assert (await wait_for_status(client, job_id))["status"] == "SUCCEEDED"

    async def owns_none() -> bool:
        health = await api.call("GET", "/api/healthz", expect=200)
        return bool(health["replica"]["jobs_owned"] == 0)

    await until(owns_none, "the ended job to be owned no more")
    assert (await scrape(api))["jobs_server_jobs_owned"] == 0
    replica = (await api.call("GET", "/api/healthz", expect=200))["replica"]
    assert isinstance(replica, dict)
    return replica


@pytest.mark.ray
async def test_a_replica_on_sqlite_says_what_it_owns_and_holds_no_lease(
    client: Client, tmp_path: Path
) -> None:
    api = Exchange(client, Contract.load())
    health = await api.call("GET", "/api/healthz", expect=200)
    assert health["status"] == "ok"
    assert set(health["disk"]) == {"free_bytes", "min_free_bytes", "low"}
    replica = health["replica"]
    assert replica["database"] == {"backend": "sqlite", "connected": True}
    assert replica["leases_held"] == []
    assert replica["jobs_owned"] == 0
    # Where it runs, and which process: host:pid:...
    host, pid, _ = replica["id"].split(":")
    assert host
    assert int(pid) > 0
    assert await scrape(api) == {
        "jobs_server_jobs_owned": 0,
        "jobs_server_database_connected": 1,
        "jobs_server_leases_held": 0,
        "jobs_server_leases_acquired_total": 0,
        "jobs_server_leases_taken_over_total": 0,
        "jobs_server_leases_lost_total": 0,
    }

    last = await owns_one_job_then_none(client, api, tmp_path)
    assert last["id"] == replica["id"], "the id is the replica's for as long as it runs"


async def leave_an_expired_server_lease(database_url: str, state_dir: Path) -> None:
    """The `server` lease held by a server that died (not renewed, expired): the next server's
    take is a takeover."""
    archive = create_archive(database_url, state_dir)
    await archive.open()
    try:
        ghost = ReplicaLeases(archive, replica_id="ghost:1:dead", ttl_s=0.001)
        assert await ghost.acquire(SERVER_LEASE) is not None
    finally:
        await archive.close()


def server_lease_holder(database_url: str) -> str:
    with psycopg.connect(database_url) as db:
        row = db.execute("SELECT holder FROM leases WHERE name = %s", (SERVER_LEASE,)).fetchone()
    assert row is not None
    return str(row[0])


@pytest.mark.ray
@pytest.mark.postgres
async def test_a_replica_on_postgresql_says_which_lease_it_took_over_and_what_it_owns(
    aiohttp_client: Callable[..., Awaitable[Client]],
    settings: Settings,
    postgres_url: str,
    tmp_path: Path,
) -> None:
    await leave_an_expired_server_lease(postgres_url, tmp_path / "ghost")
    on_postgres = settings.model_copy(update={"database_url": SecretStr(postgres_url)})
    client = await aiohttp_client(create_app(on_postgres))
    api = Exchange(client, Contract.load())

    replica = (await api.call("GET", "/api/healthz", expect=200))["replica"]
    assert replica["database"] == {"backend": "postgresql", "connected": True}
    assert replica["leases_held"] == [SERVER_LEASE]
    assert replica["jobs_owned"] == 0
    assert replica["id"] == server_lease_holder(postgres_url)
    assert await scrape(api) == {
        "jobs_server_jobs_owned": 0,
        "jobs_server_database_connected": 1,
        "jobs_server_leases_held": 1,
        "jobs_server_leases_acquired_total": 1,
        "jobs_server_leases_taken_over_total": 1,  # from the dead server
        "jobs_server_leases_lost_total": 0,
    }
    await owns_one_job_then_none(client, api, tmp_path)


@pytest.fixture
def own_postgres() -> Iterator[PostgresServer]:
    """A PostgreSQL of this test's own (it stops it), durable as a real one."""
    with running_postgres(durable=True) as server:
        yield server


@pytest.mark.ray
@pytest.mark.postgres
async def test_a_database_outage_shows_as_not_connected_until_it_is_back(
    aiohttp_client: Callable[..., Awaitable[Client]],
    settings: Settings,
    own_postgres: PostgresServer,
) -> None:
    database_url = own_postgres.create_database()
    on_postgres = settings.model_copy(update={"database_url": SecretStr(database_url)})
    client = await aiohttp_client(create_app(on_postgres))
    api = Exchange(client, Contract.load())
    replica_id = (await api.call("GET", "/api/healthz", expect=200))["replica"]["id"]

    await asyncio.to_thread(stop_immediately, own_postgres)
    # The probe's 503 as before (code, Retry-After), and what the replica knows of itself.
    health = await api.call("GET", "/api/healthz", expect=503)
    assert health["error"]["code"] == "database_unavailable"
    assert health["replica"]["id"] == replica_id
    assert health["replica"]["database"] == {"backend": "postgresql", "connected": False}
    # An outage takes no lease: it is still this replica's until another takes it.
    assert health["replica"]["leases_held"] == [SERVER_LEASE]
    assert health["replica"]["jobs_owned"] == 0
    # The scrape answers (what the server knows without the database), saying it is away.
    during = await scrape(api)
    assert during["jobs_server_database_connected"] == 0
    assert during["jobs_server_leases_held"] == 1
    assert during["jobs_server_leases_lost_total"] == 0

    await asyncio.to_thread(start_again, own_postgres)

    async def connected_again() -> bool:
        response = await client.get("/api/healthz")
        return response.status == 200

    await until(connected_again, "the probe to answer 200 again")
    replica = (await api.call("GET", "/api/healthz", expect=200))["replica"]
    assert replica["database"] == {"backend": "postgresql", "connected": True}
    assert replica["id"] == replica_id
    assert (await scrape(api))["jobs_server_database_connected"] == 1


async def test_only_who_sees_every_tenant_learns_how_many_jobs_a_replica_owns(
    aiohttp_client: Callable[..., Awaitable[Client]],
    fake_settings: Settings,
    fake: FakeJobManager,
    tmp_path: Path,
) -> None:
    """The probe answers without a key, and a tenant sees none of another's work: the jobs a
    replica owns count every tenant's, so only an admin key (or a server without keys) learns
    their number, from healthz as from /metrics."""
    admin_key, read_key = secrets.token_urlsafe(32), secrets.token_urlsafe(32)
    tokens_file = tmp_path / "tokens.toml"
    tokens_file.write_text(
        f'[[keys]]\ndigest = "{digest_of(admin_key)}"\ntenant = "ops"\nrole = "admin"\n'
        f'[[keys]]\ndigest = "{digest_of(read_key)}"\ntenant = "team-a"\nrole = "read"\n'
    )
    with_keys = fake_settings.model_copy(update={"tokens_file": tokens_file})
    api = Exchange(
        await aiohttp_client(create_app(with_keys, backend=fake.backend())), Contract.load()
    )
    await fake.submit_job(JobSpec(entrypoint="sleep 60", submission_id="owned"), tenant="team-a")

    def as_key(key: str | None) -> dict[str, dict[str, str]]:
        return {} if key is None else {"headers": {"Authorization": f"Bearer {key}"}}

    for key, jobs_owned in [(None, None), ("nope", None), (read_key, None), (admin_key, 1)]:
        replica = (await api.call("GET", "/api/healthz", expect=200, **as_key(key)))["replica"]
        assert replica["jobs_owned"] == jobs_owned, key
        assert replica["database"] == {"backend": "sqlite", "connected": True}
    admin_scrape = await api.call("GET", "/metrics", expect=200, **as_key(admin_key))
    assert replica_samples(admin_scrape)["jobs_server_jobs_owned"] == 1
    tenant_scrape = await api.call("GET", "/metrics", expect=200, **as_key(read_key))
    assert replica_samples(tenant_scrape) == {}
