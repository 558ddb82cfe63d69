"""Tenants and roles on a real server process and real Ray: two tenants (team-a, team-b), three
roles (admin, submit, read), and what each key may see and do on every route."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import ClientSession
from prometheus_client.parser import text_string_to_metric_families

from tests.support.tenant_server import (
    KEY_SPECS,
    TenantServer,
    run_tenant_server,
    submit_as,
    wait_until_terminal,
)

# The caller of each role is of team-a (the admin of a tenant of its own: it sees all).
CALLER_BY_ROLE = {"admin": "ops-admin", "submit": "a-submit", "read": "a-read"}
# Who submitted the job the caller acts on: its own tenant, or the other one.
SUBMITTER_BY_OWNER = {"own": "a-submit", "other": "b-submit"}
READ_ROUTES = ["get_job", "logs", "logs_text", "logs_range", "logs_sse", "logs_tail"]
CHANGING_ROUTES = ["stop", "delete"]


@pytest.fixture(scope="module")
def server(ray_connection: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TenantServer]:
    yield from run_tenant_server(ray_connection, tmp_path_factory.mktemp("tenants"))


async def call_route(
    session: ClientSession, route: str, job_id: str, headers: dict[str, str]
) -> tuple[int, Any]:
    """Call `route` for the job; its status and body (JSON, or text for the text forms; for an
    error, the error object)."""
    path = f"/api/jobs/{job_id}"
    if route == "logs_tail":
        try:
            async with session.ws_connect(f"{path}/logs/tail", headers=headers) as websocket:
                return 200, "".join([message.data async for message in websocket])
        except aiohttp.WSServerHandshakeError as error:
            return error.status, None
    method, url, kind = {
        "get_job": ("GET", path, "json"),
        "logs": ("GET", f"{path}/logs", "json"),
        "logs_text": ("GET", f"{path}/logs?format=text", "text"),
        "logs_range": ("GET", f"{path}/logs?offset=0&limit=100", "json"),
        "logs_sse": ("GET", f"{path}/logs/stream", "text"),
        "stop": ("POST", f"{path}/stop", "json"),
        "delete": ("DELETE", path, "json"),
    }[route]
    async with session.request(method, url, headers=headers) as response:
        if response.status >= 400:
            return response.status, (await response.json())["error"]
        if kind == "text":
            return response.status, await response.text()
        return response.status, await response.json()


async def stop_as_admin(session: ClientSession, server: TenantServer, job_id: str) -> None:
    """Leave no job running (one that ended or was deleted answers too)."""
    async with session.post(f"/api/jobs/{job_id}/stop", headers=server.headers("ops-admin")):
        pass


def expected_answer(route: str, role: str, owner: str, job_id: str) -> tuple[int, Any]:
    if route in CHANGING_ROUTES and role == "read":
        message = "This key (a-read) may only read: submit, stop, delete and package uploads"
        return 403, {"code": "permission_denied", "message": message}
    if role != "admin" and owner == "other":
        # Word for word what an id that never existed gets.
        return 404, {"code": "job_not_found", "message": f"Job {job_id} does not exist"}
    output = f"output of {owner}\n"
    return 200, {
        "get_job": {"submission_id": job_id, "tenant": KEY_SPECS[SUBMITTER_BY_OWNER[owner]][0]},
        "logs": {"logs": output},
        "logs_text": output,
        "logs_range": {"offset": 0, "logs": output, "next_offset": len(output)},
        "logs_sse": json.dumps(output),
        "logs_tail": output,
        "stop": {"stopped": True},
        "delete": {"deleted": True},
    }[route]


def _comparable(route: str, status: int, body: Any, expected: Any) -> Any:
    """The parts of `body` that `expected` names (a permission error's message: its start)."""
    if status == 403:
        return {"code": body["code"], "message": body["message"][: len(expected["message"])]}
    if route == "logs_sse" and status == 200:  # the log text is in one data line
        return next(line[len("data: ") :] for line in body.splitlines() if "output" in line)
    if isinstance(expected, dict):
        return {name: body.get(name) for name in expected}
    return body


@pytest.mark.parametrize("owner", ["own", "other"])
@pytest.mark.parametrize("role", ["admin", "submit", "read"])
@pytest.mark.parametrize("route", READ_ROUTES + CHANGING_ROUTES)
async def test_route_by_role_and_owner(
    server: TenantServer, session: ClientSession, route: str, role: str, owner: str
) -> None:
    submitter = SUBMITTER_BY_OWNER[owner]
    if route == "stop":
        job_id = await submit_as(session, server, submitter, entrypoint="sleep 60")
    else:
        job_id = await submit_as(session, server, submitter, entrypoint=f"echo output of {owner}")
        await wait_until_terminal(session, server, job_id)
    try:
        status, body = await call_route(
            session, route, job_id, server.headers(CALLER_BY_ROLE[role])
        )
        expected_status, expected = expected_answer(route, role, owner, job_id)
        assert status == expected_status, body
        if route != "logs_tail" or status == 200:
            assert _comparable(route, status, body, expected) == expected
        # A refused change changed nothing.
        admin = server.headers("ops-admin")
        async with session.get(f"/api/jobs/{job_id}", headers=admin) as after:
            if route == "delete":
                assert after.status == (404 if status == 200 else 200)
            elif route == "stop" and status != 200:
                assert (await after.json())["status"] in {"PENDING", "RUNNING"}
    finally:
        await stop_as_admin(session, server, job_id)


@pytest.mark.parametrize(
    ("caller", "status", "tenant"),
    [
        ("ops-admin", 200, "ops"),
        ("a-submit", 200, "team-a"),
        ("b-submit", 200, "team-b"),
        ("auth-token", 200, "default"),
        ("a-read", 403, None),
        ("b-read", 403, None),
    ],
)
async def test_submit_records_the_tenant_of_the_key(
    server: TenantServer, session: ClientSession, caller: str, status: int, tenant: str | None
) -> None:
    submission_id = f"submit-{caller}-{uuid.uuid4().hex[:8]}"
    response = await session.post(
        "/api/jobs/",
        json={"entrypoint": "true", "submission_id": submission_id},
        headers=server.headers(caller),
    )
    assert response.status == status, await response.text()
    stored = await session.get(f"/api/jobs/{submission_id}", headers=server.headers("ops-admin"))
    if tenant is None:
        assert (await response.json())["error"]["code"] == "permission_denied"
        assert stored.status == 404  # nothing was recorded
        assert (await stored.json())["error"]["code"] == "job_not_found"
        return
    assert (await stored.json())["tenant"] == tenant
    own = await session.get(f"/api/jobs/{submission_id}", headers=server.headers(caller))
    assert (await own.json())["tenant"] == tenant


async def list_ids(
    session: ClientSession, server: TenantServer, caller: str, query: str = ""
) -> list[str]:
    response = await session.get(f"/api/jobs/{query}", headers=server.headers(caller))
    assert response.status == 200, await response.text()
    return [job["submission_id"] for job in await response.json()]


async def test_lists_show_only_the_callers_tenant(
    server: TenantServer, session: ClientSession
) -> None:
    run = uuid.uuid4().hex[:8]
    metadata = {"run": run}
    job_a = await submit_as(session, server, "a-submit", entrypoint="true", metadata=metadata)
    job_b = await submit_as(session, server, "b-submit", entrypoint="true", metadata=metadata)
    by_run = f"?metadata.run={run}"
    assert await list_ids(session, server, "a-read", by_run) == [job_a]
    assert await list_ids(session, server, "a-submit", by_run + "&limit=10") == [job_a]
    assert await list_ids(session, server, "b-read", by_run) == [job_b]
    assert await list_ids(session, server, "ops-admin", by_run) == [job_a, job_b]
    assert await list_ids(session, server, "auth-token", by_run) == [job_a, job_b]
    # The whole list, streamed: every job of team-a, none of another tenant.
    everything = await session.get("/api/jobs/", headers=server.headers("a-read"))
    tenants = {job["tenant"] for job in await everything.json()}
    assert tenants == {"team-a"}
    # Another tenant's job as a page cursor is as unknown as an id that never existed.
    for cursor in (job_b, f"never-{run}"):
        response = await session.get(
            f"/api/jobs/?limit=1&after={cursor}", headers=server.headers("a-read")
        )
        assert response.status == 400
        assert (await response.json())["error"] == {
            "code": "invalid_request",
            "message": f"after: no job {cursor!r} to continue after.",
        }


async def read_events_until(
    session: ClientSession, server: TenantServer, caller: str, last_job: str
) -> list[dict[str, Any]]:
    """Every event from the first one on, as `caller` sees them, until `last_job` has ended."""
    events: list[dict[str, Any]] = []
    deadline = time.monotonic() + 60
    async with session.get(
        "/api/events?after=0&format=ndjson", headers=server.headers(caller)
    ) as response:
        assert response.status == 200
        while time.monotonic() < deadline:
            line = json.loads(await response.content.readline())
            if line["type"] == "heartbeat":
                continue
            events.append(line)
            if line["submission_id"] == last_job and line["status"] in {"SUCCEEDED", "FAILED"}:
                return events
    raise AssertionError(f"{last_job} did not end in {caller}'s events: {events[-5:]}")


async def test_events_show_only_the_callers_tenant(
    server: TenantServer, session: ClientSession
) -> None:
    job_b = await submit_as(session, server, "b-submit", entrypoint="true")
    await wait_until_terminal(session, server, job_b)
    job_a = await submit_as(session, server, "a-submit", entrypoint="true")
    await wait_until_terminal(session, server, job_a)
    seen_by_a = await read_events_until(session, server, "a-read", job_a)
    assert {event["tenant"] for event in seen_by_a} == {"team-a"}
    assert job_b not in {event["submission_id"] for event in seen_by_a}
    assert [e["type"] for e in seen_by_a if e["submission_id"] == job_a][:1] == ["submitted"]
    seen_by_admin = await read_events_until(session, server, "ops-admin", job_a)
    assert {job_a, job_b} <= {event["submission_id"] for event in seen_by_admin}
    assert {"team-a", "team-b"} <= {event["tenant"] for event in seen_by_admin}


def metric_samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


async def scrape(session: ClientSession, server: TenantServer, caller: str) -> Any:
    response = await session.get("/metrics", headers=server.headers(caller))
    assert response.status == 200
    return metric_samples(await response.text())


async def test_metrics_show_only_the_callers_tenant(
    server: TenantServer, session: ClientSession
) -> None:
    job_b = await submit_as(session, server, "b-submit", entrypoint="exit 3")
    await wait_until_terminal(session, server, job_b)
    job_a = await submit_as(session, server, "a-submit", entrypoint="true")
    await wait_until_terminal(session, server, job_a)
    admin = await scrape(session, server, "ops-admin")
    for caller in ("a-read", "a-submit"):
        found = await scrape(session, server, caller)
        # Its tenant's series, and the server's caps (without labels, the same for every key);
        # nothing of another tenant's, nor the server-wide traffic series.
        assert {dict(labels)["tenant"] for _, labels in found if labels} == {"team-a"}
        assert {name for name, labels in found if not labels} == {
            "jobs_server_max_running_jobs",
            "jobs_server_max_queued_jobs",
        }
        # Its tenant's job series, all statuses, counted as the admin counts them.
        samples = {key: value for key, value in found.items() if key[0] == "jobs_server_jobs"}
        assert len(samples) == 5
        # Every team-a job counted once, whatever its status now (a status may change between
        # two reads; the number of jobs does not).
        assert sum(samples.values()) == len(await list_ids(session, server, caller))
        assert samples[("jobs_server_jobs", (("status", "SUCCEEDED"), ("tenant", "team-a")))] >= 1
    # An admin sees every tenant's series (those of keys without jobs too), and the server's.
    tenants = {dict(labels).get("tenant") for name, labels in admin if name == "jobs_server_jobs"}
    assert tenants == {"default", "ops", "team-a", "team-b"}
    assert admin[("jobs_server_jobs", (("status", "FAILED"), ("tenant", "team-b")))] >= 1
    assert any(name == "jobs_server_http_requests_total" for name, _ in admin)


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/api/jobs/"),
        ("POST", "/api/jobs/{job}/stop"),
        ("DELETE", "/api/jobs/{job}"),
        ("POST", "/api/jobs/never-submitted/stop"),
        ("DELETE", "/api/jobs/never-submitted"),
        ("PUT", "/api/packages/gcs/_ray_pkg_0123456789abcdef.zip"),
    ],
)
async def test_a_read_key_changes_nothing(
    server: TenantServer, session: ClientSession, method: str, path: str
) -> None:
    """403 for every change, whether the job exists or not (ids do not leak), and nothing is
    changed: the job still runs, no job is added, no package is stored."""
    job_id = await submit_as(session, server, "a-submit", entrypoint="sleep 60")
    admin = server.headers("ops-admin")
    try:
        before = await session.get("/api/jobs/", headers=admin)
        count_before = len(await before.json())
        response = await session.request(
            method,
            path.format(job=job_id),
            headers=server.headers("a-read"),
            json={"entrypoint": "touch /tmp/never"} if method == "POST" else None,
            data=b"PK\x05\x06" + bytes(18) if method == "PUT" else None,
        )
        assert response.status == 403
        assert (await response.json())["error"]["code"] == "permission_denied"
        job = await (await session.get(f"/api/jobs/{job_id}", headers=admin)).json()
        assert job["status"] in {"PENDING", "RUNNING"}
        after = await session.get("/api/jobs/", headers=admin)
        assert len(await after.json()) == count_before
        if method == "PUT":
            async with session.get(path, headers=admin) as package:
                assert package.status == 404
    finally:
        await stop_as_admin(session, server, job_id)


async def test_the_audit_log_names_tenant_role_and_key(
    server: TenantServer, session: ClientSession
) -> None:
    job_id = await submit_as(session, server, "b-submit", entrypoint="true")
    await wait_until_terminal(session, server, job_id)
    deleted = await session.delete(f"/api/jobs/{job_id}", headers=server.headers("ops-admin"))
    assert await deleted.json() == {"deleted": True}
    lines = [line for line in _read(server.log_path).splitlines() if f" {job_id} " in line]
    assert any(
        "submit" in line and "tenant=team-b role=submit key=b-submit" in line for line in lines
    ), lines
    assert any(
        "delete" in line and "tenant=ops role=admin key=ops-admin" in line for line in lines
    ), lines
    assert not any(key in _read(server.log_path) for key in server.keys.values())


def _read(path: Path) -> str:
    return path.read_text(errors="replace")
