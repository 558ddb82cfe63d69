"""A job's effective limits, resolved at submit (issue 35, item 1): per field, what the submit
asked for, else (with --enforce-entrypoint-memory) its entrypoint_memory, else the tenant's
default, else the server's, else the tenant's ceiling; above the ceiling, a 400 naming the field.
The resolution as a pure function, then through a real server process with a tokens file."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from aiohttp import ClientSession

from jobs_server.manager.limits import JobLimits, LimitRefusedError, effective_limits
from tests.support.tenant_server import KEY_SPECS, TenantServer, run_tenant_server, tokens_toml

MIB = 1 << 20
GIB = 1 << 30


def resolve(
    requested: JobLimits | None = None,
    *,
    entrypoint_memory: int | None = None,
    enforce_entrypoint_memory: bool = False,
    tenant_default: JobLimits | None = None,
    tenant_ceiling: JobLimits | None = None,
    server_default: JobLimits | None = None,
) -> JobLimits | None:
    return effective_limits(
        requested,
        entrypoint_memory=entrypoint_memory,
        enforce_entrypoint_memory=enforce_entrypoint_memory,
        tenant_default=tenant_default,
        tenant_ceiling=tenant_ceiling,
        server_default=server_default,
    )


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        pytest.param({}, None, id="nothing-anywhere"),
        pytest.param({"requested": JobLimits()}, None, id="an-empty-request"),
        pytest.param(
            {"server_default": JobLimits(), "tenant_default": JobLimits()},
            None,
            id="empty-defaults",
        ),
        pytest.param(
            {"requested": JobLimits(memory_bytes=GIB, cpu_cores=0.5, max_processes=64)},
            JobLimits(memory_bytes=GIB, cpu_cores=0.5, max_processes=64),
            id="the-request",
        ),
        pytest.param(
            {
                "requested": JobLimits(cpu_cores=0.5),
                "tenant_default": JobLimits(memory_bytes=GIB, cpu_cores=1.0),
                "server_default": JobLimits(max_processes=100, cpu_cores=4.0),
            },
            JobLimits(memory_bytes=GIB, cpu_cores=0.5, max_processes=100),
            id="per-field-request-then-tenant-then-server",
        ),
        pytest.param(
            {"server_default": JobLimits(memory_bytes=GIB)},
            JobLimits(memory_bytes=GIB),
            id="the-servers-default",
        ),
        pytest.param(
            {"tenant_ceiling": JobLimits(memory_bytes=GIB, max_processes=50)},
            JobLimits(memory_bytes=GIB, max_processes=50),
            id="a-ceiling-without-a-default-caps-every-job",
        ),
        pytest.param(
            {
                "tenant_ceiling": JobLimits(memory_bytes=GIB),
                "server_default": JobLimits(memory_bytes=256 * MIB),
            },
            JobLimits(memory_bytes=256 * MIB),
            id="the-servers-default-below-the-ceiling",
        ),
        pytest.param(
            {
                "tenant_ceiling": JobLimits(memory_bytes=GIB),
                "server_default": JobLimits(memory_bytes=4 * GIB),
            },
            JobLimits(memory_bytes=GIB),
            id="the-servers-default-above-the-ceiling-is-capped",
        ),
        pytest.param(
            {
                "requested": JobLimits(memory_bytes=GIB, cpu_cores=2.0),
                "tenant_ceiling": JobLimits(memory_bytes=GIB, cpu_cores=2.0),
            },
            JobLimits(memory_bytes=GIB, cpu_cores=2.0),
            id="at-the-ceiling",
        ),
        pytest.param(
            {
                "entrypoint_memory": 512 * MIB,
                "enforce_entrypoint_memory": True,
                "tenant_default": JobLimits(memory_bytes=GIB),
            },
            JobLimits(memory_bytes=512 * MIB),
            id="entrypoint-memory-enforced-over-the-tenants-default",
        ),
        pytest.param(
            {"entrypoint_memory": 512 * MIB, "tenant_default": JobLimits(memory_bytes=GIB)},
            JobLimits(memory_bytes=GIB),
            id="entrypoint-memory-not-enforced",
        ),
        pytest.param(
            {
                "requested": JobLimits(memory_bytes=256 * MIB),
                "entrypoint_memory": 512 * MIB,
                "enforce_entrypoint_memory": True,
            },
            JobLimits(memory_bytes=256 * MIB),
            id="the-requests-memory-over-entrypoint-memory",
        ),
        pytest.param(
            {
                "entrypoint_memory": 0,
                "enforce_entrypoint_memory": True,
                "server_default": JobLimits(memory_bytes=GIB),
            },
            JobLimits(memory_bytes=GIB),
            id="entrypoint-memory-zero-is-none",
        ),
    ],
)
def test_the_effective_limits_per_field(given: dict[str, Any], expected: JobLimits | None) -> None:
    limits = resolve(**given)
    assert limits == expected
    # A plain JobLimits (not the boundary's subclass): what the record stores and shows.
    assert limits is None or type(limits) is JobLimits


@pytest.mark.parametrize(
    ("given", "field", "message"),
    [
        pytest.param(
            {"requested": JobLimits(memory_bytes=2 * GIB)},
            "limits.memory_bytes",
            "limits.memory_bytes: 2147483648 is above its tenant's ceiling, 1073741824",
            id="memory",
        ),
        pytest.param(
            {"requested": JobLimits(cpu_cores=2.5)},
            "limits.cpu_cores",
            "limits.cpu_cores: 2.5 is above its tenant's ceiling, 2.0",
            id="cpu",
        ),
        pytest.param(
            {"requested": JobLimits(max_processes=51)},
            "limits.max_processes",
            "limits.max_processes: 51 is above its tenant's ceiling, 50",
            id="processes",
        ),
        pytest.param(
            {"entrypoint_memory": 2 * GIB, "enforce_entrypoint_memory": True},
            "entrypoint_memory",
            "entrypoint_memory: 2147483648 is above its tenant's ceiling, 1073741824",
            id="entrypoint-memory-enforced",
        ),
        pytest.param(
            {"entrypoint_memory": 1000, "enforce_entrypoint_memory": True},
            "entrypoint_memory",
            "entrypoint_memory: 1000 is below the least memory limit, 1048576",
            id="entrypoint-memory-below-a-mib",
        ),
    ],
)
def test_a_limit_above_the_tenants_ceiling_is_refused_naming_the_field(
    given: dict[str, Any], field: str, message: str
) -> None:
    ceiling = JobLimits(memory_bytes=GIB, cpu_cores=2.0, max_processes=50)
    with pytest.raises(LimitRefusedError) as refused:
        resolve(**given, tenant_ceiling=ceiling, tenant_default=JobLimits(memory_bytes=GIB))
    assert refused.value.field == field
    assert str(refused.value).startswith(message), str(refused.value)


def test_entrypoint_memory_above_the_ceiling_is_taken_when_not_enforced() -> None:
    """Only reserved then (Ray's meaning): the limit is the tenant's, within its ceiling."""
    limits = resolve(entrypoint_memory=2 * GIB, tenant_ceiling=JobLimits(memory_bytes=GIB))
    assert limits == JobLimits(memory_bytes=GIB)


# Through a server: team-a has a memory default and ceilings, team-b none (the server's
# defaults apply), and entrypoint_memory is enforced.
TENANTS_TOML = """
[tenants.team-a.default_limits]
memory_bytes = 268435456
[tenants.team-a.max_limits]
memory_bytes = 1073741824
max_processes = 200
"""
SERVER_ARGS = (
    "--job-memory-max-bytes",
    str(512 * MIB),
    "--job-cpu-max-cores",
    "2",
    "--enforce-entrypoint-memory",
)


@pytest.fixture(scope="module")
def server(ray_connection: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TenantServer]:
    yield from run_tenant_server(
        ray_connection, tmp_path_factory.mktemp("limits-policy"), TENANTS_TOML, SERVER_ARGS
    )


def limits(memory_bytes: int | None, cpu_cores: float | None, max_processes: int | None) -> Any:
    return {"memory_bytes": memory_bytes, "cpu_cores": cpu_cores, "max_processes": max_processes}


async def job_details(session: ClientSession, server: TenantServer, job_id: str) -> Any:
    response = await session.get(f"/api/jobs/{job_id}", headers=server.headers("ops-admin"))
    assert response.status == 200, await response.text()
    return await response.json()


@pytest.mark.parametrize(
    ("key", "body", "expected"),
    [
        pytest.param("a-submit", {}, limits(256 * MIB, 2.0, 200), id="tenant-default"),
        pytest.param(
            "a-submit",
            {"limits": {"memory_bytes": GIB, "cpu_cores": 0.5}},
            limits(GIB, 0.5, 200),
            id="asked-at-the-ceiling",
        ),
        pytest.param(
            "a-submit",
            {"entrypoint_memory": 64 * MIB},
            limits(64 * MIB, 2.0, 200),
            id="entrypoint-memory",
        ),
        pytest.param(
            "a-submit",
            {"entrypoint_memory": 64 * MIB, "limits": {"memory_bytes": 128 * MIB}},
            limits(128 * MIB, 2.0, 200),
            id="limits-over-entrypoint-memory",
        ),
        pytest.param("b-submit", {}, limits(512 * MIB, 2.0, None), id="server-default"),
        pytest.param(
            "b-submit",
            {"limits": {"memory_bytes": None, "max_processes": 10}},
            limits(512 * MIB, 2.0, 10),
            id="null-is-the-default",
        ),
    ],
)
async def test_a_jobs_limits_are_what_it_asked_then_its_tenants_then_the_servers(
    session: ClientSession,
    server: TenantServer,
    key: str,
    body: dict[str, Any],
    expected: dict[str, Any],
) -> None:
    response = await session.post(
        "/api/jobs/", json={"entrypoint": "true", **body}, headers=server.headers(key)
    )
    assert response.status == 200, await response.text()
    job_id = (await response.json())["submission_id"]
    assert (await job_details(session, server, job_id))["limits"] == expected


@pytest.mark.parametrize(
    ("body", "message"),
    [
        pytest.param(
            {"limits": {"memory_bytes": 2 * GIB}},
            "limits.memory_bytes: 2147483648 is above its tenant's ceiling, 1073741824",
            id="memory-above-the-ceiling",
        ),
        pytest.param(
            {"limits": {"max_processes": 201}},
            "limits.max_processes: 201 is above its tenant's ceiling, 200",
            id="processes-above-the-ceiling",
        ),
        pytest.param(
            {"entrypoint_memory": 2 * GIB},
            "entrypoint_memory: 2147483648 is above its tenant's ceiling, 1073741824",
            id="entrypoint-memory-above-the-ceiling",
        ),
        pytest.param(
            {"limits": {"memory": GIB}}, "limits.memory: unknown field", id="unknown-field"
        ),
        pytest.param(
            {"limits": {"memory_bytes": "1GiB"}}, "limits.memory_bytes: ", id="memory-a-string"
        ),
        pytest.param(
            {"limits": {"memory_bytes": -1}}, "limits.memory_bytes: ", id="memory-negative"
        ),
        pytest.param({"limits": {"cpu_cores": True}}, "limits.cpu_cores: ", id="cpu-true"),
        pytest.param({"limits": {"cpu_cores": 0}}, "limits.cpu_cores: ", id="cpu-zero"),
        pytest.param(
            {"limits": {"max_processes": True}}, "limits.max_processes: ", id="processes-true"
        ),
        pytest.param({"limits": 1024}, "limits: ", id="limits-a-number"),
    ],
)
async def test_a_refused_limit_is_a_400_naming_the_field_and_records_nothing(
    session: ClientSession, server: TenantServer, body: dict[str, Any], message: str
) -> None:
    job_id = f"refused-{uuid.uuid4().hex[:8]}"
    response = await session.post(
        "/api/jobs/",
        json={"entrypoint": "true", "submission_id": job_id, **body},
        headers=server.headers("a-submit"),
    )
    assert response.status == 400, await response.text()
    error = (await response.json())["error"]
    assert error["code"] == "invalid_request", error
    assert message in error["message"], error
    gone = await session.get(f"/api/jobs/{job_id}", headers=server.headers("ops-admin"))
    assert gone.status == 404, await gone.text()


async def test_a_reloaded_tokens_file_applies_to_the_next_submit(
    session: ClientSession, server: TenantServer
) -> None:
    """Read at each submit, as the caps are: a SIGHUP gives team-b a default at once."""
    raised = TENANTS_TOML + "[tenants.team-b.default_limits]\nmax_processes = 7\n"
    server.tokens_file.write_text(tokens_toml(server.keys, KEY_SPECS, raised))
    try:
        os.kill(server.pid, signal.SIGHUP)
        deadline = time.monotonic() + 30
        while True:
            response = await session.post(
                "/api/jobs/", json={"entrypoint": "true"}, headers=server.headers("b-submit")
            )
            assert response.status == 200, await response.text()
            job = await job_details(session, server, (await response.json())["submission_id"])
            if job["limits"]["max_processes"] == 7:
                break
            assert time.monotonic() < deadline, f"the reloaded default never applied: {job}"
            await asyncio.sleep(0.1)
        assert job["limits"] == limits(512 * MIB, 2.0, 7)
    finally:
        server.tokens_file.write_text(tokens_toml(server.keys, KEY_SPECS, TENANTS_TOML))
        os.kill(server.pid, signal.SIGHUP)
