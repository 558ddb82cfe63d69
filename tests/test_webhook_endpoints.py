"""Endpoints a 410 disabled, seen and enabled again: on both stores (disable, list, enable, the
next event writes deliveries again), and over HTTP with keys of two tenants and an admin (a
tenant sees and enables only its own, word for word as if another's did not exist; a `read`
key lists but never enables; every bad input a 4xx that changes nothing)."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from jobs_server.access.key_digest import digest_of, new_api_key
from jobs_server.app import create_app
from jobs_server.app_state import OUTBOX_KEY
from jobs_server.manager.archive.interface import JobArchive
from jobs_server.manager.archive.outbox import (
    DeliveryState,
    DisabledWebhookEndpoint,
    PlannedDelivery,
    TargetSource,
)
from jobs_server.manager.archive.sqlite import Archive, archive_path
from jobs_server.manager.records import JobAttempt, JobRecord, JobSpec, JobStatus, new_run_id
from jobs_server.manager.webhook_events import WebhookEventType
from jobs_server.settings import Settings
from tests.support.api import wait_for_status
from tests.support.fakes import FakeJobManager
from tests.support.postgres import ArchiveFactory
from tests.support.webhooks import (
    Receiver,
    eventually,
    eventually_async,
    new_secret,
    webhook_settings,
)

Client = TestClient[Any, Any]

# -- the stores ---------------------------------------------------------------------------------

RECEIVER = "https://receiver.example/hook"
TENANT_ENDPOINT = "https://tenant.example/hook"


def to_both(job: JobRecord, event_type: WebhookEventType) -> Sequence[PlannedDelivery]:
    """The planner: every event to RECEIVER (the job's own) and TENANT_ENDPOINT (its tenant's)."""
    return (
        PlannedDelivery(RECEIVER, TargetSource.JOB),
        PlannedDelivery(TENANT_ENDPOINT, TargetSource.TENANT),
    )


def record(submission_id: str) -> JobRecord:
    return JobRecord(
        spec=JobSpec(entrypoint="true", submission_id=submission_id),
        start_time=1_000,
        run_id=new_run_id(),
    )


def running(job: JobRecord) -> JobRecord:
    return job.with_changes(
        status=JobStatus.RUNNING, attempts=(JobAttempt(start_time=2_000, log_offset=0),)
    )


@pytest.fixture
async def outbox(archive_factory: ArchiveFactory) -> AsyncIterator[JobArchive]:
    archive = archive_factory(plan_deliveries=to_both)
    await archive.open()
    yield archive
    await archive.close()


async def test_a_disabled_endpoint_is_listed_and_enabled_again(outbox: JobArchive) -> None:
    job = record("a")
    await outbox.insert(job)
    await outbox.update(running(job))
    assert await outbox.disabled_webhook_endpoints() == []
    await outbox.disable_webhook_endpoint(job.tenant, TENANT_ENDPOINT, 5_000)
    await outbox.disable_webhook_endpoint("other", TENANT_ENDPOINT, 5_001)
    await outbox.disable_webhook_endpoint("other", RECEIVER, 5_002)
    mine = DisabledWebhookEndpoint(tenant=job.tenant, url=TENANT_ENDPOINT, disabled_ms=5_000)
    others = [
        DisabledWebhookEndpoint(tenant="other", url=TENANT_ENDPOINT, disabled_ms=5_001),
        DisabledWebhookEndpoint(tenant="other", url=RECEIVER, disabled_ms=5_002),
    ]
    # By tenant, then URL.
    assert await outbox.disabled_webhook_endpoints() == [mine, others[1], others[0]]
    assert await outbox.disabled_webhook_endpoints(job.tenant) == [mine]
    assert await outbox.disabled_webhook_endpoints("nobody") == []

    assert await outbox.enable_webhook_endpoint(job.tenant, TENANT_ENDPOINT) is True
    assert await outbox.disabled_webhook_endpoints() == [others[1], others[0]]
    # Enabled already, or never disabled: False, and nothing changes.
    assert await outbox.enable_webhook_endpoint(job.tenant, TENANT_ENDPOINT) is False
    assert await outbox.enable_webhook_endpoint(job.tenant, "https://never.example/") is False
    assert await outbox.disabled_webhook_endpoints() == [others[1], others[0]]

    # The next event is written for it again; the delivery it disabled stays ended.
    await outbox.update(running(job).with_changes(status=JobStatus.SUCCEEDED, end_time=6_000))
    states = [(d.event_type, d.url, d.state) for d in await outbox.deliveries_of("a")]
    assert states == [
        (WebhookEventType.STARTED, RECEIVER, DeliveryState.PENDING),
        (WebhookEventType.STARTED, TENANT_ENDPOINT, DeliveryState.DISABLED),
        (WebhookEventType.SUCCEEDED, RECEIVER, DeliveryState.PENDING),
        (WebhookEventType.SUCCEEDED, TENANT_ENDPOINT, DeliveryState.PENDING),
    ]


async def test_enabling_one_tenants_endpoint_leaves_anothers_disabled(outbox: JobArchive) -> None:
    mine, other = record("a"), record("b").with_changes(tenant="other")
    for job in (mine, other):
        await outbox.insert(job)
        await outbox.disable_webhook_endpoint(job.tenant, TENANT_ENDPOINT, 5_000)
    assert await outbox.enable_webhook_endpoint(mine.tenant, TENANT_ENDPOINT) is True
    for job in (mine, other):
        await outbox.update(running(job))
    assert [d.url for d in await outbox.deliveries_of("a")] == [RECEIVER, TENANT_ENDPOINT]
    assert [d.url for d in await outbox.deliveries_of("b")] == [RECEIVER]


# -- over HTTP ----------------------------------------------------------------------------------

TEAM_A, TEAM_B, ADMINS = "team-a", "team-b", "ops"
HOOK_A = "https://a.example/hooks/jobs"
HOOK_B = "https://b.example/hooks/jobs"
SHARED = "https://shared.example/in"  # disabled for both tenants


@dataclass
class Server:
    client: Client
    outbox: JobArchive
    keys: dict[str, str]

    def headers(self, who: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.keys[who]}"}

    async def call(
        self,
        method: str,
        path: str,
        who: str,
        expect: int,
        headers: dict[str, str] | None = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        headers = {**self.headers(who), **(headers or {})}
        response = await self.client.request(method, path, headers=headers, **kwargs)
        body = await response.text()
        assert response.status == expect, body
        assert response.content_type == "application/json", body
        answer: dict[str, Any] = json.loads(body)
        return answer

    async def disabled(self) -> list[tuple[str, str]]:
        """What the store holds disabled: (tenant, url)."""
        return [(e.tenant, e.url) for e in await self.outbox.disabled_webhook_endpoints()]


@pytest.fixture
async def server(
    aiohttp_client: Callable[..., Awaitable[Client]],
    fake_settings: Settings,
    fake: FakeJobManager,
    tmp_path: Path,
) -> AsyncIterator[Server]:
    """An app on the fake manager (no Ray) whose outbox is a real SQLite archive, with keys:
    a-submit, a-read (team-a), b-submit (team-b) and admin (an admin of the tenant `ops`)."""
    roles = {
        "a-submit": (TEAM_A, "submit"),
        "a-read": (TEAM_A, "read"),
        "b-submit": (TEAM_B, "submit"),
        "admin": (ADMINS, "admin"),
    }
    keys = {who: new_api_key() for who in roles}
    tokens_file = tmp_path / "tokens.toml"
    tokens_file.write_text(
        "".join(
            f'[[keys]]\ndigest = "{digest_of(keys[who])}"\ntenant = "{tenant}"\nrole = "{role}"\n'
            for who, (tenant, role) in roles.items()
        )
    )
    archive = Archive(archive_path(tmp_path / "outbox"))
    await archive.open()
    app = create_app(
        fake_settings.model_copy(update={"tokens_file": tokens_file}), backend=fake.backend()
    )
    app[OUTBOX_KEY] = archive
    client = await aiohttp_client(app)
    await archive.disable_webhook_endpoint(TEAM_A, HOOK_A, 1_000)
    await archive.disable_webhook_endpoint(TEAM_B, HOOK_B, 2_000)
    await archive.disable_webhook_endpoint(TEAM_A, SHARED, 3_000)
    await archive.disable_webhook_endpoint(TEAM_B, SHARED, 4_000)
    yield Server(client, archive, keys)
    await archive.close()


ALL_DISABLED = [(TEAM_A, HOOK_A), (TEAM_A, SHARED), (TEAM_B, HOOK_B), (TEAM_B, SHARED)]


def listed(answer: dict[str, Any]) -> list[tuple[str, str, int]]:
    return [(e["tenant"], e["url"], e["disabled_at"]) for e in answer["endpoints"]]


async def test_each_tenant_lists_its_own_and_an_admin_every_tenants(server: Server) -> None:
    team_a = [(TEAM_A, HOOK_A, 1_000), (TEAM_A, SHARED, 3_000)]
    team_b = [(TEAM_B, HOOK_B, 2_000), (TEAM_B, SHARED, 4_000)]
    path = "/api/webhooks/disabled"
    for who in ("a-submit", "a-read"):  # reading is enough
        assert listed(await server.call("GET", path, who, 200)) == team_a
        assert listed(await server.call("GET", f"{path}?tenant={TEAM_A}", who, 200)) == team_a
    assert listed(await server.call("GET", path, "b-submit", 200)) == team_b
    assert listed(await server.call("GET", path, "admin", 200)) == team_a + team_b
    assert listed(await server.call("GET", f"{path}?tenant={TEAM_B}", "admin", 200)) == team_b
    assert listed(await server.call("GET", f"{path}?tenant=nobody", "admin", 200)) == []


async def test_a_tenant_cannot_list_anothers(server: Server) -> None:
    refused = await server.call("GET", f"/api/webhooks/disabled?tenant={TEAM_B}", "a-read", 403)
    assert refused["error"]["code"] == "permission_denied"
    # The same for a tenant that does not exist: nothing is told.
    nobody = await server.call("GET", "/api/webhooks/disabled?tenant=nobody", "a-read", 403)
    assert nobody["error"]["message"].replace("nobody", TEAM_B) == refused["error"]["message"]


async def test_a_tenant_enables_its_own_and_the_next_enable_is_404(
    server: Server, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="jobs_server.audit")
    enabled = await server.call(
        "POST", "/api/webhooks/enable", "a-submit", 200, json={"url": HOOK_A}
    )
    assert enabled == {"enabled": True, "tenant": TEAM_A, "url": HOOK_A}
    assert await server.disabled() == [(TEAM_A, SHARED), (TEAM_B, HOOK_B), (TEAM_B, SHARED)]
    audits = [r.getMessage() for r in caplog.records if r.name == "jobs_server.audit"]
    assert len(audits) == 1
    assert audits[0].startswith(f"enable_webhook_endpoint {HOOK_A} ")
    assert f"tenant={TEAM_A} role=submit" in audits[0]
    assert f"endpoint_tenant='{TEAM_A}'" in audits[0]
    again = await server.call("POST", "/api/webhooks/enable", "a-submit", 404, json={"url": HOOK_A})
    assert again["error"]["code"] == "webhook_endpoint_not_found"
    assert HOOK_A in again["error"]["message"]
    # Naming its own tenant is the same as leaving it out.
    body = {"url": SHARED, "tenant": TEAM_A}
    await server.call("POST", "/api/webhooks/enable", "a-submit", 200, json=body)
    assert await server.disabled() == [(TEAM_B, HOOK_B), (TEAM_B, SHARED)]


async def test_another_tenants_endpoint_is_404_word_for_word_as_one_never_disabled(
    server: Server,
) -> None:
    enable = "/api/webhooks/enable"
    # Disabled for team-b only: team-a's key is told it is not disabled, as for any URL.
    while_disabled = await server.call("POST", enable, "a-submit", 404, json={"url": HOOK_B})
    assert await server.disabled() == ALL_DISABLED
    await server.call("POST", enable, "admin", 200, json={"url": HOOK_B, "tenant": TEAM_B})
    never = await server.call("POST", enable, "a-submit", 404, json={"url": HOOK_B})
    assert while_disabled == never
    # A shared URL: enabling team-a's leaves team-b's disabled.
    await server.call("POST", enable, "a-submit", 200, json={"url": SHARED})
    assert await server.disabled() == [(TEAM_A, HOOK_A), (TEAM_B, SHARED)]
    # A tenant key that names another tenant is refused before anything is looked up.
    for url in (SHARED, "https://never.example/"):
        refused = await server.call(
            "POST", enable, "a-submit", 403, json={"url": url, "tenant": TEAM_B}
        )
        assert refused["error"]["code"] == "permission_denied"
    assert await server.disabled() == [(TEAM_A, HOOK_A), (TEAM_B, SHARED)]


async def test_a_read_key_cannot_enable(server: Server) -> None:
    refused = await server.call("POST", "/api/webhooks/enable", "a-read", 403, json={"url": HOOK_A})
    assert refused["error"]["code"] == "permission_denied"
    assert await server.disabled() == ALL_DISABLED


async def test_an_admin_enables_any_tenants_and_its_own_by_default(server: Server) -> None:
    enable = "/api/webhooks/enable"
    body = {"url": SHARED, "tenant": TEAM_B}
    assert await server.call("POST", enable, "admin", 200, json=body) == {
        "enabled": True,
        "tenant": TEAM_B,
        "url": SHARED,
    }
    assert await server.disabled() == [(TEAM_A, HOOK_A), (TEAM_A, SHARED), (TEAM_B, HOOK_B)]
    # Without `tenant`: the admin key's own tenant, where nothing is disabled.
    missing = await server.call("POST", enable, "admin", 404, json={"url": HOOK_A})
    assert missing["error"]["code"] == "webhook_endpoint_not_found"
    await server.outbox.disable_webhook_endpoint(ADMINS, HOOK_A, 5_000)
    await server.call("POST", enable, "admin", 200, json={"url": HOOK_A})
    assert await server.disabled() == [(TEAM_A, HOOK_A), (TEAM_A, SHARED), (TEAM_B, HOOK_B)]


@pytest.mark.parametrize(
    ("body", "headers", "status", "says"),
    [
        (b"{not json", {"Content-Type": "application/json"}, 400, "not valid JSON"),
        (b"[]", {"Content-Type": "application/json"}, 400, "must be a JSON object"),
        (b"", {}, 400, "body is empty"),
        (b"{}", {}, 400, "url: Field required"),
        (json.dumps({"url": ""}).encode(), {}, 400, "url: String should have at least"),
        (json.dumps({"url": 5}).encode(), {}, 400, "url: Input should be a valid string"),
        (json.dumps({"url": "x" * 3000}).encode(), {}, 400, "url: String should have at most"),
        (json.dumps({"url": HOOK_A, "events": []}).encode(), {}, 400, "events: unknown field"),
        (json.dumps({"url": "https://a.example/\u0000"}).encode(), {}, 400, "control characters"),
        (
            json.dumps({"url": HOOK_A, "tenant": "team a!"}).encode(),
            {},
            400,
            "tenant: String should match pattern",
        ),
        (b"url=x", {"Content-Type": "application/x-www-form-urlencoded"}, 415, "application/json"),
        (b"{" + b" " * 2_000_000 + b"}", {}, 413, "limit"),
    ],
)
async def test_bad_enable_bodies_are_refused_and_change_nothing(
    server: Server, body: bytes, headers: dict[str, str], status: int, says: str
) -> None:
    for who in ("a-submit", "admin"):
        refused = await server.call(
            "POST",
            "/api/webhooks/enable",
            who,
            status,
            data=body,
            headers={"Content-Type": "application/json", **headers},
        )
        assert says in refused["error"]["message"], refused
    assert await server.disabled() == ALL_DISABLED


@pytest.mark.parametrize(
    ("query", "says"),
    [
        ("bogus=1", "bogus: unknown field"),
        (f"tenant={TEAM_A}&tenant={TEAM_B}", "tenant: given more than once"),
        ("tenant=team%20a!", "tenant: String should match pattern"),
    ],
)
async def test_bad_list_queries_are_400(server: Server, query: str, says: str) -> None:
    refused = await server.call("GET", f"/api/webhooks/disabled?{query}", "admin", 400)
    assert refused["error"]["code"] == "invalid_request"
    assert says in refused["error"]["message"]


# -- end to end: a real server on the session's Ray, a receiver on loopback ---------------------


async def test_a_receiver_that_answered_410_gets_the_next_events_once_enabled(
    aiohttp_client: Callable[..., Awaitable[Client]],
    settings: Settings,
    tmp_path: Path,
    receivers: Callable[..., Awaitable[Receiver]],
) -> None:
    secret = new_secret()
    receiver = await receivers([secret], answers=[410])
    (tmp_path / "secret").write_text(f"{secret}\n")
    client = await aiohttp_client(
        create_app(webhook_settings(settings, webhook_secret_file=tmp_path / "secret"))
    )

    async def run_job() -> str:
        body = {
            "entrypoint": "true",
            "notify": [{"url": receiver.url, "events": ["job.succeeded"]}],
        }
        response = await client.post("/api/jobs/", json=body)
        assert response.status == 200, await response.text()
        job_id = str((await response.json())["submission_id"])
        await wait_for_status(client, job_id)
        return job_id

    async def deliveries(job_id: str) -> list[tuple[str, str]]:
        answer = await (await client.get(f"/api/jobs/{job_id}/deliveries")).json()
        return [(row["event_type"], row["state"]) for row in answer["deliveries"]]

    async def disabled() -> list[str]:
        answer = await (await client.get("/api/webhooks/disabled")).json()
        return [f"{row['tenant']} {row['url']}" for row in answer["endpoints"]]

    first = await run_job()
    await eventually_async(
        lambda: _equals(disabled(), [f"default {receiver.url}"]), "the endpoint disabled"
    )
    assert await deliveries(first) == [("job.succeeded", "disabled")]
    second = await run_job()
    assert await deliveries(second) == []  # not written while disabled

    response = await client.post("/api/webhooks/enable", json={"url": receiver.url})
    assert response.status == 200, await response.text()
    assert await disabled() == []
    third = await run_job()
    await eventually(lambda: (third, "job.succeeded") in receiver.events(), "the third's event")
    assert await deliveries(third) == [("job.succeeded", "delivered")]
    # What ended disabled stays ended; what was never written is not sent.
    assert await deliveries(first) == [("job.succeeded", "disabled")]
    assert receiver.events() == {(first, "job.succeeded"), (third, "job.succeeded")}
    assert receiver.badly_signed == []


async def _equals(value: Awaitable[Any], expected: Any) -> bool:
    return await value == expected
