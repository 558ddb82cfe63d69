"""Signed webhooks (issue 36, items 1-3): receivers on loopback that check every signature with
`standardwebhooks` get a job's events from its own `notify` and its tenant's endpoints; a failed
attempt is tried again under the same id, 410 disables the endpoint, every attempt shows in
GET /api/jobs/{id}/deliveries; deliveries outlive a receiver away and a server killed twice
meanwhile; a receiver that hangs never holds the API.

The sender's rules first, on an outbox in memory (the Outbox protocol's semantics), then the
server's: in-process on the session's Ray, and a real server process killed with SIGKILL."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client import generate_latest

from jobs_server.access.key_digest import digest_of, new_api_key
from jobs_server.app import create_app
from jobs_server.manager.archive.events import JobEvent, JobEventType
from jobs_server.manager.archive.outbox import (
    DeliveryState,
    PlannedDelivery,
    TargetSource,
    WebhookDelivery,
)
from jobs_server.manager.records import JobRecord, JobSpec, JobStatus, now_ms
from jobs_server.manager.webhook_events import (
    ALL_WEBHOOK_EVENTS,
    NO_WEBHOOKS,
    NotifyTarget,
    TenantWebhookEndpoint,
    TenantWebhooks,
    WebhookEventType,
)
from jobs_server.metrics import ServerMetrics
from jobs_server.settings import Settings
from jobs_server.webhooks.planner import delivery_planner, may_have_deliveries
from jobs_server.webhooks.sender import SenderOptions, WebhookSender, payload_of, retry_delay_s
from jobs_server.webhooks.signing import WebhookSecretError, WebhookSecrets, read_secret_file
from jobs_server.webhooks.targets import TargetPolicy
from tests.support.api import Client, wait_for_status
from tests.support.processes import free_port
from tests.support.ray_nodes import kill_actors_in_namespace
from tests.support.replicas import ReplicaGroup
from tests.support.servers import is_healthy, start_jobs_server
from tests.support.sse import SseReader
from tests.support.webhooks import (
    DEADLINE_S,
    LOOPBACK_HTTP,
    MemoryOutbox,
    Receiver,
    eventually,
    eventually_async,
    new_secret,
    webhook_settings,
)

# Long enough for any test's deliveries; the window's end has a test of its own.
RETRY_WINDOW_S = 600.0


# -- secrets and plans -------------------------------------------------------------------------


def test_the_secret_file_holds_one_secret_a_line(tmp_path: Path) -> None:
    old, new = new_secret(), new_secret()
    path = tmp_path / "secret"
    path.write_text(f"# rotating\n{old}\n\n  {new}  \n")
    assert read_secret_file(path) == (old, new)


@pytest.mark.parametrize(
    ("content", "error"),
    [
        ("", "no secret in it"),
        ("# only a comment\n", "no secret in it"),
        ("the-secret-itself\n", "line 1: expected 'whsec_'"),
        (
            "whsec_MDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3ODlhYmNkZWY=\nwhsec_the-secret-itself\n",
            "line 2: expected 'whsec_'",
        ),
        (None, "cannot read the webhook secret file"),
    ],
)
def test_a_bad_secret_file_is_refused_naming_the_line_never_the_secret(
    tmp_path: Path, content: str | None, error: str
) -> None:
    path = tmp_path / "secret"
    if content is not None:
        path.write_text(content)
    with pytest.raises(WebhookSecretError) as raised:
        read_secret_file(path)
    assert error in str(raised.value)
    assert "secret-itself" not in str(raised.value)


def test_the_secrets_of_a_delivery() -> None:
    server, tenant_secret, endpoint_secret = new_secret(), new_secret(), new_secret()
    webhooks = TenantWebhooks(
        endpoints=(
            TenantWebhookEndpoint("https://own.example/", ALL_WEBHOOK_EVENTS, (endpoint_secret,)),
            TenantWebhookEndpoint("https://shared.example/", ALL_WEBHOOK_EVENTS),
        ),
        secrets=(tenant_secret,),
    )
    secrets = WebhookSecrets(
        server=(server,), webhooks_for=lambda name: webhooks if name == "a" else NO_WEBHOOKS
    )
    tenant = TargetSource.TENANT
    assert secrets.for_delivery("a", "https://own.example/", tenant) == (endpoint_secret,)
    assert secrets.for_delivery("a", "https://shared.example/", tenant) == (tenant_secret,)
    # A job's own target: its tenant's secrets, else the server's.
    assert secrets.for_delivery("a", "https://own.example/", TargetSource.JOB) == (tenant_secret,)
    assert secrets.for_delivery("b", "https://any.example/", TargetSource.JOB) == (server,)
    # A tenant endpoint is never signed with the server's secret.
    assert secrets.for_delivery("b", "https://any.example/", tenant) == ()


def test_the_planner_names_the_targets_that_want_the_event() -> None:
    webhooks = TenantWebhooks(
        endpoints=(
            TenantWebhookEndpoint("https://all.example/", ALL_WEBHOOK_EVENTS),
            TenantWebhookEndpoint("https://failures.example/", (WebhookEventType.FAILED,)),
        ),
        secrets=(new_secret(),),
    )
    plan = delivery_planner(lambda name: webhooks if name == "a" else NO_WEBHOOKS)
    spec = JobSpec(
        submission_id="j",
        entrypoint="true",
        notify=(
            NotifyTarget(url="https://mine.example/", events=(WebhookEventType.SUCCEEDED,)),
            NotifyTarget(url="https://all.example/"),
        ),
    )
    record = JobRecord(spec=spec, status=JobStatus.SUCCEEDED, tenant="a")
    assert list(plan(record, WebhookEventType.SUCCEEDED)) == [
        PlannedDelivery("https://mine.example/", TargetSource.JOB),
        PlannedDelivery("https://all.example/", TargetSource.JOB),
        PlannedDelivery("https://all.example/", TargetSource.TENANT),
    ]
    assert list(plan(record, WebhookEventType.FAILED)) == [
        PlannedDelivery("https://all.example/", TargetSource.JOB),
        PlannedDelivery("https://all.example/", TargetSource.TENANT),
        PlannedDelivery("https://failures.example/", TargetSource.TENANT),
    ]
    other = record.with_changes(tenant="b")
    assert list(plan(other, WebhookEventType.STARTED)) == [
        PlannedDelivery("https://all.example/", TargetSource.JOB)
    ]


def test_only_events_that_may_have_deliveries_wake_the_sender() -> None:
    endpoints = TenantWebhooks(
        endpoints=(TenantWebhookEndpoint("https://all.example/", ALL_WEBHOOK_EVENTS),)
    )

    def webhooks_for(tenant: str) -> TenantWebhooks:
        return endpoints if tenant == "a" else NO_WEBHOOKS

    plain = JobRecord(spec=JobSpec(submission_id="j", entrypoint="true"), tenant="b")
    notifying = plain.with_changes(
        spec=plain.spec.model_copy(update={"notify": (NotifyTarget(url="https://x.example/"),)})
    )

    def event(kind: JobEventType, record: JobRecord | None) -> JobEvent:
        return JobEvent(id=1, type=kind, submission_id="j", time=0, record=record)

    assert not may_have_deliveries([event(JobEventType.STATUS, plain)], webhooks_for)
    assert not may_have_deliveries([event(JobEventType.SUBMITTED, notifying)], webhooks_for)
    assert may_have_deliveries([event(JobEventType.STATUS, notifying)], webhooks_for)
    tenants = plain.with_changes(tenant="a")
    assert may_have_deliveries([event(JobEventType.STATUS, tenants)], webhooks_for)
    assert may_have_deliveries([event(JobEventType.STATUS, None)], webhooks_for)


async def test_an_empty_outbox_is_read_never_claimed() -> None:
    """A claim is a write: a server whose outbox has nothing due makes none, however often its
    sender is woken."""
    outbox = MemoryOutbox()
    claims = 0
    claim = outbox.claim_due_deliveries

    async def counted(now_ms: int, limit: int, claim_ms: int) -> list[WebhookDelivery]:
        nonlocal claims
        claims += 1
        return await claim(now_ms, limit, claim_ms)

    outbox.claim_due_deliveries = counted  # type: ignore[method-assign]
    sender = WebhookSender(
        outbox,
        policy=LOOPBACK_HTTP,
        secrets=WebhookSecrets(server=(new_secret(),)),
        options=SenderOptions(timeout_s=1, max_in_flight=1, retry_max_s=60),
    )
    task = asyncio.create_task(sender.run())
    try:
        for _ in range(20):
            sender.wake()
            await asyncio.sleep(0.01)
        assert claims == 0
        outbox.add("http://127.0.0.1:9/hook", created_ms=now_ms() + 3_600_000)
        sender.wake()
        await asyncio.sleep(0.05)
        assert claims == 0  # pending, not due
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def test_the_backoff_doubles_to_its_cap_with_full_jitter() -> None:
    assert [retry_delay_s(attempt, 3600.0, lambda: 1.0) for attempt in (1, 2, 3, 13, 500)] == [
        1.0,
        2.0,
        4.0,
        3600.0,
        3600.0,
    ]
    assert retry_delay_s(5, 3600.0, lambda: 0.25) == 4.0
    assert SenderOptions(timeout_s=10, max_in_flight=1, retry_max_s=86_400).backoff_cap_s == 3600
    assert SenderOptions(timeout_s=10, max_in_flight=1, retry_max_s=60).backoff_cap_s == 6.0
    # A claim outlasts an attempt.
    assert SenderOptions(timeout_s=10, max_in_flight=1, retry_max_s=60).claim_ms > 10_000


# -- the sender, on an outbox in memory --------------------------------------------------------


@dataclass
class RunningSender:
    outbox: MemoryOutbox
    sender: WebhookSender
    metrics: ServerMetrics

    def outcomes(self) -> dict[str, float]:
        counts = {}
        for metric in self.metrics.webhook_deliveries.collect():
            for sample in metric.samples:
                if sample.name.endswith("_total"):
                    counts[sample.labels["outcome"]] = sample.value
        return counts


@pytest.fixture
async def run_sender(
    receivers: Callable[..., Awaitable[Receiver]],
) -> AsyncIterator[Callable[..., Awaitable[RunningSender]]]:
    """Senders on outboxes in memory; stopped before the receivers (which they may still be
    sending to) are."""
    tasks: list[asyncio.Task[None]] = []

    async def run(
        secrets: WebhookSecrets,
        *,
        policy: TargetPolicy = LOOPBACK_HTTP,
        timeout_s: float = 5.0,
        max_in_flight: int = 8,
        retry_max_s: float = RETRY_WINDOW_S,
        uniform: Callable[[], float] = lambda: 0.0,
    ) -> RunningSender:
        outbox = MemoryOutbox()
        metrics = ServerMetrics()
        sender = WebhookSender(
            outbox,
            policy=policy,
            secrets=secrets,
            options=SenderOptions(
                timeout_s=timeout_s, max_in_flight=max_in_flight, retry_max_s=retry_max_s
            ),
            metrics=metrics,
            uniform=uniform,
        )
        tasks.append(asyncio.create_task(sender.run()))
        return RunningSender(outbox, sender, metrics)

    yield run
    for task in tasks:
        task.cancel()
    # A cancelled sender ends at once, its sends in flight with it.
    await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 10)


async def test_a_delivery_is_signed_and_its_body_is_the_event_and_the_jobs_details(
    receivers: Callable[..., Awaitable[Receiver]],
    run_sender: Callable[..., Awaitable[RunningSender]],
) -> None:
    secret = new_secret()
    receiver = await receivers([secret])
    running = await run_sender(WebhookSecrets(server=(secret,)))
    delivery = running.outbox.add(receiver.url)
    running.sender.wake()
    await eventually(
        lambda: running.outbox.state_of(delivery).state is DeliveryState.DELIVERED, "delivered"
    )
    [received] = receiver.received
    assert received.headers["webhook-id"] == delivery.id
    assert received.headers["Content-Type"] == "application/json"
    assert abs(int(received.headers["webhook-timestamp"]) - time.time()) < 60
    assert received.body == payload_of(delivery)
    payload = received.payload
    assert payload["type"] == "job.succeeded"
    assert payload["event_id"] == delivery.event_id
    assert payload["data"]["submission_id"] == delivery.submission_id
    assert payload["data"]["status"] == "SUCCEEDED"
    assert payload["timestamp"].endswith("+00:00")
    stored = running.outbox.state_of(delivery)
    assert (stored.attempts, stored.last_status_code, stored.last_error) == (1, 200, None)
    assert running.outcomes() == {"delivered": 1.0}


async def test_a_rotated_secret_signs_twice_and_each_receiver_verifies(
    receivers: Callable[..., Awaitable[Receiver]],
    run_sender: Callable[..., Awaitable[RunningSender]],
) -> None:
    old, new = new_secret(), new_secret()
    knows_old = await receivers([old])
    knows_new = await receivers([new])
    knows_neither = await receivers([new_secret()])
    tenant = TenantWebhooks(secrets=(old, new))
    running = await run_sender(
        WebhookSecrets(server=(), webhooks_for=lambda name: tenant if name == "a" else NO_WEBHOOKS),
        uniform=lambda: 1.0,  # the stranger's refusals are retried, not at once
    )
    for receiver in (knows_old, knows_new, knows_neither):
        running.outbox.add(receiver.url, tenant="a")
    running.sender.wake()
    await eventually(lambda: knows_old.received and knows_new.received, "both verified")
    await eventually(lambda: knows_neither.badly_signed, "the stranger's refusal")
    assert knows_old.badly_signed == knows_new.badly_signed == []
    assert len(knows_old.received[0].headers["webhook-signature"].split(" ")) == 2


async def test_a_failed_attempt_is_tried_again_under_the_same_id(
    receivers: Callable[..., Awaitable[Receiver]],
    run_sender: Callable[..., Awaitable[RunningSender]],
) -> None:
    secret = new_secret()
    receiver = await receivers([secret], answers=[500, 503])
    running = await run_sender(WebhookSecrets(server=(secret,)))
    delivery = running.outbox.add(receiver.url)
    running.sender.wake()
    await eventually(
        lambda: running.outbox.state_of(delivery).state is DeliveryState.DELIVERED, "delivered"
    )
    assert [received.headers["webhook-id"] for received in receiver.received] == [delivery.id] * 3
    assert len({received.body for received in receiver.received}) == 1
    assert running.outbox.state_of(delivery).attempts == 3
    assert running.outcomes() == {"retried": 2.0, "delivered": 1.0}


async def test_a_410_disables_the_endpoint_and_its_pending_deliveries(
    receivers: Callable[..., Awaitable[Receiver]],
    run_sender: Callable[..., Awaitable[RunningSender]],
) -> None:
    secret = new_secret()
    gone = await receivers([secret], default_status=410)
    running = await run_sender(WebhookSecrets(server=(secret,)), max_in_flight=1)
    first = running.outbox.add(gone.url)
    # Not due for a while: still pending when the first is answered 410.
    second = running.outbox.add(gone.url, created_ms=now_ms() + 3_600_000)
    running.sender.wake()
    await eventually(
        lambda: running.outbox.state_of(second).state is DeliveryState.DISABLED, "disabled"
    )
    assert running.outbox.state_of(first).state is DeliveryState.DISABLED
    assert running.outbox.state_of(first).last_status_code == 410
    assert len(gone.received) == 1
    assert running.outcomes() == {"disabled": 2.0}
    # None is written for it again (the archive's side: here, the memory's).
    running.outbox.add(gone.url)
    assert len(running.outbox.rows) == 2


async def test_the_pending_gauge_counts_the_outbox(
    run_sender: Callable[..., Awaitable[RunningSender]],
) -> None:
    running = await run_sender(WebhookSecrets(server=(new_secret(),)))
    later = now_ms() + 3_600_000
    for _ in range(3):
        running.outbox.add("http://127.0.0.1:9/hook", created_ms=later)
    # Counted at the sender's first look (then at most every 10 s).
    running.sender.wake()
    await eventually(
        lambda: (
            b"jobs_server_webhook_deliveries_pending 3.0"
            in generate_latest(running.metrics.registry)
        ),
        "counted",
    )


async def test_a_busy_sender_stops_when_cancelled(
    receivers: Callable[..., Awaitable[Receiver]],
) -> None:
    """Woken all the time (every send that ends wakes it), it still ends at its cancellation:
    asyncio.wait_for on 3.11 lost about one in six here."""
    secret = new_secret()
    failing = await receivers([secret], default_status=500)
    for _ in range(10):
        outbox = MemoryOutbox()
        sender = WebhookSender(
            outbox,
            policy=LOOPBACK_HTTP,
            secrets=WebhookSecrets(server=(secret,)),
            options=SenderOptions(timeout_s=5, max_in_flight=4, retry_max_s=RETRY_WINDOW_S),
            uniform=lambda: 0.0,  # retried at once: as busy as it gets
        )
        for _ in range(4):
            outbox.add(failing.url)
        task = asyncio.create_task(sender.run())
        busy_at = len(failing.received) + 20
        await eventually(lambda: len(failing.received) > busy_at, "a busy sender")  # noqa: B023
        task.cancel()
        await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), 5)


async def test_retries_end_failed_past_the_retry_window(
    receivers: Callable[..., Awaitable[Receiver]],
    run_sender: Callable[..., Awaitable[RunningSender]],
) -> None:
    secret = new_secret()
    failing = await receivers([secret], default_status=500)
    # A window of 2 s: backoff capped at 0.2 s, the full ceiling each time.
    running = await run_sender(
        WebhookSecrets(server=(secret,)), retry_max_s=2.0, uniform=lambda: 1.0
    )
    delivery = running.outbox.add(failing.url)
    running.sender.wake()
    await eventually(
        lambda: running.outbox.state_of(delivery).state is DeliveryState.FAILED, "failed"
    )
    stored = running.outbox.state_of(delivery)
    assert stored.attempts == len(failing.received) >= 3
    assert (stored.last_status_code, stored.last_error) == (500, "HTTP 500")
    assert stored.next_attempt_ms is None


async def test_a_receiver_that_hangs_times_out_and_holds_only_its_own_slots(
    receivers: Callable[..., Awaitable[Receiver]],
    run_sender: Callable[..., Awaitable[RunningSender]],
) -> None:
    secret = new_secret()
    hanging = await receivers([secret], hang=True)
    answering = await receivers([secret])
    running = await run_sender(
        WebhookSecrets(server=(secret,)), timeout_s=1.0, max_in_flight=4, uniform=lambda: 1.0
    )
    stuck = [running.outbox.add(hanging.url) for _ in range(4)]
    running.sender.wake()
    await eventually(lambda: hanging.hanging == 2, "two sends in flight")
    late = running.outbox.add(answering.url)
    running.sender.wake()
    # At most two at once (the tenant's share of four): the answering receiver, the same
    # tenant's, waits for one of its slots, freed by the timeout.
    await eventually(
        lambda: running.outbox.state_of(late).state is DeliveryState.DELIVERED, "delivered"
    )
    assert hanging.max_hanging == 2
    timed_out = [running.outbox.state_of(delivery) for delivery in stuck]
    assert any(row.last_error == "timed out after 1 s" for row in timed_out), timed_out
    assert all(row.state is DeliveryState.PENDING for row in timed_out)


@pytest.mark.parametrize(
    ("secrets", "policy", "url", "error"),
    [
        (WebhookSecrets(server=()), LOOPBACK_HTTP, None, "refused: no webhook secret signs it now"),
        (
            WebhookSecrets(server=(new_secret(),)),
            TargetPolicy(allow_http=True),
            "http://127.0.0.1:9/hook",
            "refused: 127.0.0.1 is a loopback address",
        ),
    ],
)
async def test_what_cannot_be_sent_safely_is_given_up_unsent(
    receivers: Callable[..., Awaitable[Receiver]],
    run_sender: Callable[..., Awaitable[RunningSender]],
    secrets: WebhookSecrets,
    policy: TargetPolicy,
    url: str | None,
    error: str,
) -> None:
    receiver = await receivers([new_secret()])
    running = await run_sender(secrets, policy=policy)
    delivery = running.outbox.add(url or receiver.url)
    running.sender.wake()
    await eventually(
        lambda: running.outbox.state_of(delivery).state is DeliveryState.FAILED, "failed"
    )
    assert running.outbox.state_of(delivery).last_error is not None
    assert error in (running.outbox.state_of(delivery).last_error or "")
    assert receiver.received == receiver.badly_signed == []


# -- the server: in process, on the session's Ray ----------------------------------------------


@dataclass
class TenantKeys:
    key: str
    tokens_file: Path
    secrets: list[str]

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}


def write_tokens(tmp_path: Path, secrets: list[str], endpoints: list[str]) -> TenantKeys:
    """A key of tenant `team-a`, its webhook secrets, and its endpoints (every event)."""
    key = new_api_key()
    quoted = ", ".join(f'"{secret}"' for secret in secrets)
    webhooks = ", ".join(f'{{ url = "{url}" }}' for url in endpoints)
    tokens_file = tmp_path / "tokens.toml"
    tokens_file.write_text(
        f'[[keys]]\ndigest = "{digest_of(key)}"\ntenant = "team-a"\nrole = "submit"\n'
        f"[tenants.team-a]\nwebhook_secrets = [{quoted}]\nwebhooks = [{webhooks}]\n"
    )
    return TenantKeys(key, tokens_file, secrets)


@dataclass(frozen=True)
class SecretFile:
    """A fresh webhook secret and the `--webhook-secret-file` that holds it."""

    secret: str
    path: Path


@pytest.fixture
def secret_file(tmp_path: Path) -> SecretFile:
    secret = new_secret()
    path = tmp_path / "secret"
    path.write_text(f"{secret}\n")
    return SecretFile(secret, path)


@pytest.fixture
async def secret_file_app(
    aiohttp_client: Callable[..., Awaitable[Client]], settings: Settings, secret_file: SecretFile
) -> Callable[..., Awaitable[Client]]:
    """Starts the app in process, signing with `secret_file`, loopback targets allowed, and the
    settings changed as given."""

    async def start(**changes: Any) -> Client:
        return await aiohttp_client(
            create_app(webhook_settings(settings, webhook_secret_file=secret_file.path, **changes))
        )

    return start


async def deliveries(client: Client, job_id: str, headers: dict[str, str]) -> list[dict[str, Any]]:
    response = await client.get(f"/api/jobs/{job_id}/deliveries", headers=headers)
    assert response.status == 200, await response.text()
    return list((await response.json())["deliveries"])


async def test_a_jobs_notify_and_its_tenants_endpoint_get_its_start_and_end_signed(
    aiohttp_client: Callable[..., Awaitable[Client]],
    settings: Settings,
    tmp_path: Path,
    receivers: Callable[..., Awaitable[Receiver]],
) -> None:
    # The tenant rotates its secret: both sign, each receiver checks with both, one by one.
    secrets = [new_secret(), new_secret()]
    own = await receivers(secrets)
    tenants = await receivers(secrets)
    tenant = write_tokens(tmp_path, secrets, [tenants.url])
    client = await aiohttp_client(
        create_app(webhook_settings(settings, tokens_file=tenant.tokens_file))
    )
    response = await client.post(
        "/api/jobs/",
        json={
            # Long enough to be seen RUNNING: see the test after this one.
            "entrypoint": "sleep 1; echo webhook",
            "notify": [{"url": own.url, "events": ["job.started", "job.succeeded"]}],
        },
        headers=tenant.headers,
    )
    assert response.status == 200, await response.text()
    job_id = (await response.json())["submission_id"]
    await wait_for_status_with(client, job_id, tenant.headers)
    expected = {(job_id, "job.started"), (job_id, "job.succeeded")}
    await eventually(
        lambda: own.events() == tenants.events() == expected,
        lambda: f"four deliveries: {own.events()}, {tenants.events()}",
    )
    assert own.badly_signed == tenants.badly_signed == []
    details = await (await client.get(f"/api/jobs/{job_id}", headers=tenant.headers)).json()
    for receiver in (own, tenants):
        by_type = {received.payload["type"]: received.payload for received in receiver.received}
        assert by_type["job.started"]["data"]["status"] == "RUNNING"
        # The end's body is the job's details as GET gives them.
        assert by_type["job.succeeded"]["data"] == details
    listed = await deliveries(client, job_id, tenant.headers)
    assert sorted((row["event_type"], row["url"], row["state"]) for row in listed) == sorted(
        (event, url, "delivered")
        for event in ("job.started", "job.succeeded")
        for url in (own.url, tenants.url)
    )
    assert {row["id"] for row in listed} == {
        received.headers["webhook-id"] for received in own.received + tenants.received
    }
    assert all(row["attempts"] == 1 and row["last_status_code"] == 200 for row in listed)
    # Another tenant's key, and no key for an unknown job: the same 404 as the job's.
    missing = await client.get("/api/jobs/nope/deliveries", headers=tenant.headers)
    assert missing.status == 404
    assert (await missing.json())["error"]["code"] == "job_not_found"


async def test_a_job_too_short_to_be_archived_running_still_sends_its_start(
    secret_file: SecretFile,
    secret_file_app: Callable[..., Awaitable[Client]],
    receivers: Callable[..., Awaitable[Receiver]],
) -> None:
    receiver = await receivers([secret_file.secret])
    client = await secret_file_app()
    job_id = await submit_with_notify(client, [receiver.url])
    await wait_for_status(client, job_id)
    await eventually(lambda: (job_id, "job.succeeded") in receiver.events(), "the end's delivery")
    # Its start: written with its end, at the latest.
    await eventually(lambda: len(receiver.received) >= 2, "the start's delivery", timeout_s=5)
    assert receiver.events() == {(job_id, "job.started"), (job_id, "job.succeeded")}


async def wait_for_status_with(
    client: Client, job_id: str, headers: dict[str, str], status: str = "SUCCEEDED"
) -> None:
    async def status_now() -> str:
        response = await client.get(f"/api/jobs/{job_id}", headers=headers)
        return str((await response.json())["status"])

    deadline = time.monotonic() + DEADLINE_S
    while (now := await status_now()) != status:
        assert time.monotonic() < deadline, f"{job_id} still {now}"
        await asyncio.sleep(0.05)


async def test_a_500_then_200_is_sent_again_under_its_id_and_a_410_disables_the_endpoint(
    secret_file: SecretFile,
    secret_file_app: Callable[..., Awaitable[Client]],
    receivers: Callable[..., Awaitable[Receiver]],
) -> None:
    flaky = await receivers([secret_file.secret], answers=[500])
    gone = await receivers([secret_file.secret], default_status=410)
    client = await secret_file_app()
    first = await submit_with_notify(client, [flaky.url, gone.url], events=["job.succeeded"])
    await wait_for_status(client, first)
    by_url: dict[str, dict[str, Any]] = {}

    async def settled() -> bool:
        by_url.update({row["url"]: row for row in await deliveries(client, first, {})})
        return {row["state"] for row in by_url.values()} == {"delivered", "disabled"}

    await eventually_async(settled, "both deliveries settled")
    assert len(flaky.received) == 2
    assert len(gone.received) == 1
    assert flaky.received[0].headers["webhook-id"] == flaky.received[1].headers["webhook-id"]
    assert by_url[flaky.url]["state"] == "delivered"
    assert by_url[flaky.url]["attempts"] == 2
    assert by_url[flaky.url]["last_status_code"] == 200
    assert by_url[gone.url]["state"] == "disabled"
    assert by_url[gone.url]["last_status_code"] == 410
    # Disabled: the next job's events are not even written for it.
    second = await submit_with_notify(client, [flaky.url, gone.url], events=["job.succeeded"])
    await wait_for_status(client, second)
    await eventually(lambda: len(flaky.received) == 3, "the second job's delivery")
    assert [row["url"] for row in await deliveries(client, second, {})] == [flaky.url]
    assert len(gone.received) == 1
    metrics = await (await client.get("/metrics")).text()
    assert 'jobs_server_webhook_deliveries_total{outcome="retried"} 1.0' in metrics
    assert 'jobs_server_webhook_deliveries_total{outcome="disabled"} 1.0' in metrics


async def submit_with_notify(
    client: Client, urls: list[str], events: list[str] | None = None, entrypoint: str = "true"
) -> str:
    targets = [{"url": url} if events is None else {"url": url, "events": events} for url in urls]
    response = await client.post("/api/jobs/", json={"entrypoint": entrypoint, "notify": targets})
    assert response.status == 200, await response.text()
    return str((await response.json())["submission_id"])


async def test_a_receiver_that_hangs_never_holds_the_api(
    secret_file: SecretFile,
    secret_file_app: Callable[..., Awaitable[Client]],
    receivers: Callable[..., Awaitable[Receiver]],
) -> None:
    hanging = await receivers([secret_file.secret], hang=True)
    client = await secret_file_app(webhook_max_in_flight=4, webhook_timeout_s=120.0)
    for job_id in [await submit_with_notify(client, [hanging.url]) for _ in range(2)]:
        await wait_for_status(client, job_id)
    await eventually(lambda: hanging.hanging == 2, "the receiver holding its tenant's share")
    # While it holds every slot its tenant may: submits, reads and ends go on.
    later = [await submit_with_notify(client, [hanging.url]) for _ in range(5)]
    for job_id in later:
        assert (await wait_for_status(client, job_id))["status"] == "SUCCEEDED"
    assert hanging.max_hanging == 2
    pending = await deliveries(client, later[-1], {})
    assert {row["state"] for row in pending} == {"pending"}
    assert (await client.get("/api/healthz")).status == 200


# -- a real server process, killed twice while its receiver is away ---------------------------


@dataclass
class ServerProcess:
    args: list[str]
    log_path: Path
    port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        self.process = start_jobs_server([*self.args, "--port", str(self.port)], self.log_path)
        deadline = time.monotonic() + 120
        while not await asyncio.to_thread(is_healthy, self.url):
            assert self.process.poll() is None, self.log_path.read_text()
            assert time.monotonic() < deadline, "the server did not start"
            await asyncio.sleep(0.2)

    def kill(self) -> None:
        """SIGKILL of the server (alone in its process group: the session's Ray is not)."""
        assert self.process is not None
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()


@pytest.mark.slow
async def test_every_delivery_arrives_after_the_receiver_and_two_server_kills(
    ray_connection: str,
    tmp_path: Path,
    secret_file: SecretFile,
    receivers: Callable[..., Awaitable[Receiver]],
) -> None:
    namespace = f"test_webhooks_{uuid.uuid4().hex[:8]}"
    server = ServerProcess(
        [
            *("--ray-address", ray_connection, "--namespace", namespace),
            *("--state-dir", str(tmp_path / "state"), "--log-dir", str(tmp_path / "logs")),
            *("--webhook-secret-file", str(secret_file.path)),
            "--webhook-allow-http",
            "--webhook-allow-private",
            *("--webhook-timeout-s", "2", "--webhook-retry-max-s", "300"),
            *("--stop-grace-s", "1"),
        ],
        tmp_path / "server.log",
    )
    receiver = await receivers([secret_file.secret])
    gone = await receivers([secret_file.secret], default_status=410)
    jobs: list[str] = []
    try:
        await server.start()
        async with aiohttp.ClientSession(base_url=server.url) as api:

            async def run_jobs(count: int, gone_events: list[str] | None = None) -> None:
                for _ in range(count):
                    to_gone: dict[str, Any] = {"url": gone.url}
                    if gone_events is not None:
                        to_gone["events"] = gone_events
                    response = await api.post(
                        "/api/jobs/",
                        json={"entrypoint": "true", "notify": [{"url": receiver.url}, to_gone]},
                    )
                    assert response.status == 200, await response.text()
                    jobs.append((await response.json())["submission_id"])
                for job_id in jobs[-count:]:
                    await wait_for_status(api, job_id, timeout_s=120)

            # One delivery to the endpoint that answers 410, and it is disabled before more.
            await run_jobs(1, gone_events=["job.succeeded"])
            await eventually(
                lambda: (jobs[0], "job.succeeded") in receiver.events(), "the first job's end"
            )

            async def gone_disabled() -> bool:
                response = await api.get(f"/api/jobs/{jobs[0]}/deliveries")
                rows = (await response.json())["deliveries"]
                return [row["state"] for row in rows if row["url"] == gone.url] == ["disabled"]

            await eventually_async(gone_disabled, "the endpoint disabled")
            await receiver.stop()
            await run_jobs(3)
            server.kill()
            await server.start()
            await run_jobs(2)
            server.kill()
            await server.start()
            await run_jobs(1)
            await receiver.start()  # the same port
            written: dict[str, list[dict[str, Any]]] = {}

            async def all_delivered() -> bool:
                for job_id in jobs:
                    response = await api.get(f"/api/jobs/{job_id}/deliveries")
                    written[job_id] = (await response.json())["deliveries"]
                return all(
                    row["state"] == "delivered"
                    for rows in written.values()
                    for row in rows
                    if row["url"] == receiver.url
                )

            await eventually_async(all_delivered, "every delivery delivered", 180)
            ids = {received.headers["webhook-id"] for received in receiver.received}
            for job_id, rows in written.items():
                mine = [row for row in rows if row["url"] == receiver.url]
                assert "job.succeeded" in {row["event_type"] for row in mine}, rows
                # Each arrived (at least once), signed: the receiver checked it.
                assert {row["id"] for row in mine} <= ids
                assert {(job_id, row["event_type"]) for row in mine} <= receiver.events()
                # The 410 endpoint: disabled, none written for it after.
                assert [row["state"] for row in rows if row["url"] == gone.url] == (
                    ["disabled"] if job_id == jobs[0] else []
                )
            assert receiver.badly_signed == gone.badly_signed == []
            assert len(gone.received) == 1
    finally:
        server.stop()
        kill_actors_in_namespace(namespace)


@pytest.mark.slow
@pytest.mark.postgres
async def test_replicas_share_the_outbox_and_a_dead_ones_deliveries_are_sent_by_the_other(
    ray_connection: str,
    postgres_url: str,
    tmp_path: Path,
    secret_file: SecretFile,
    receivers: Callable[..., Awaitable[Receiver]],
) -> None:
    """Two replicas on one PostgreSQL database, each with a sender: the deliveries written while
    the receiver is away are all sent once it is back, though the leader that wrote them was
    killed meanwhile; none twice (a claim keeps the senders apart), none badly signed."""
    receiver = await receivers([secret_file.secret])
    await receiver.stop()  # away from the start: every delivery waits in the outbox
    group = ReplicaGroup(
        tmp_path,
        ray_connection,
        postgres_url,
        2,
        extra_args=[
            *("--webhook-secret-file", str(secret_file.path)),
            "--webhook-allow-http",
            "--webhook-allow-private",
            *("--webhook-timeout-s", "2", "--webhook-retry-max-s", "300"),
        ],
    )
    try:
        await asyncio.to_thread(group.start)
        leader = await asyncio.to_thread(group.leader)
        [survivor] = [replica for replica in group.replicas if replica is not leader]
        async with aiohttp.ClientSession(base_url=survivor.url) as api:
            jobs = []
            for _ in range(6):
                response = await api.post(
                    "/api/jobs/",
                    json={
                        "entrypoint": "true",
                        "notify": [{"url": receiver.url, "events": ["job.succeeded"]}],
                    },
                )
                assert response.status == 200, await response.text()
                jobs.append((await response.json())["submission_id"])
            for job_id in jobs:
                await wait_for_status(api, job_id, timeout_s=120)
            await asyncio.to_thread(leader.kill)
            await receiver.start()
            rows: list[dict[str, Any]] = []

            async def all_delivered() -> bool:
                rows.clear()
                for job_id in jobs:
                    response = await api.get(f"/api/jobs/{job_id}/deliveries")
                    rows.extend((await response.json())["deliveries"])
                return len(rows) == len(jobs) and all(row["state"] == "delivered" for row in rows)

            await eventually_async(all_delivered, "every delivery delivered", 120)
        ids = [received.headers["webhook-id"] for received in receiver.received]
        assert sorted(ids) == sorted(row["id"] for row in rows)
        assert receiver.badly_signed == []
    finally:
        await asyncio.to_thread(group.stop)


async def archived_end(api: aiohttp.ClientSession, job_id: str) -> None:
    """Wait for the archive's event of the job's end (the event stream is the archive's)."""
    async with api.get("/api/events", params={"after": "0"}) as stream:
        assert stream.status == 200, await stream.text()
        reader = SseReader(stream)
        while True:
            event = json.loads((await reader.next_event()).data)
            if event["submission_id"] == job_id and event["status"] in ("SUCCEEDED", "FAILED"):
                return


@pytest.mark.slow
async def test_a_tenant_endpoint_added_by_sighup_gets_the_next_jobs_events(
    ray_connection: str, tmp_path: Path, receivers: Callable[..., Awaitable[Receiver]]
) -> None:
    """The planner reads the tokens file as the last SIGHUP left it: no restart. Another
    tenant's key gets the job's deliveries as it gets the job: 404."""
    secret = new_secret()
    receiver = await receivers([secret])
    key, other_key = new_api_key(), new_api_key()
    keys = (
        f'[[keys]]\ndigest = "{digest_of(key)}"\ntenant = "team-a"\nrole = "submit"\n'
        f'[[keys]]\ndigest = "{digest_of(other_key)}"\ntenant = "team-b"\nrole = "submit"\n'
        f'[tenants.team-a]\nwebhook_secrets = ["{secret}"]\n'
    )
    tokens_file = tmp_path / "tokens.toml"
    tokens_file.write_text(keys)
    namespace = f"test_webhooks_{uuid.uuid4().hex[:8]}"
    server = ServerProcess(
        [
            *("--ray-address", ray_connection, "--namespace", namespace),
            *("--state-dir", str(tmp_path / "state"), "--log-dir", str(tmp_path / "logs")),
            *("--tokens-file", str(tokens_file)),
            "--webhook-allow-http",
            "--webhook-allow-private",
        ],
        tmp_path / "server.log",
    )
    headers = {"Authorization": f"Bearer {key}"}
    try:
        await server.start()
        async with aiohttp.ClientSession(base_url=server.url, headers=headers) as api:

            async def run_job() -> str:
                response = await api.post("/api/jobs/", json={"entrypoint": "true"})
                assert response.status == 200, await response.text()
                job_id = str((await response.json())["submission_id"])
                await wait_for_status(api, job_id, timeout_s=120)
                return job_id

            before = await run_job()
            # Its end archived: the planner is asked then, and GET may see the end before.
            await archived_end(api, before)
            tokens_file.write_text(
                keys + f'webhooks = [{{ url = "{receiver.url}", events = ["job.succeeded"] }}]\n'
            )
            assert server.process is not None
            os.kill(server.process.pid, signal.SIGHUP)
            await eventually(
                lambda: "reloaded" in server.log_path.read_text(), "the tokens file reloaded"
            )
            after = await run_job()
            await eventually(lambda: (after, "job.succeeded") in receiver.events(), "delivered")
            assert receiver.events() == {(after, "job.succeeded")}
            assert (await (await api.get(f"/api/jobs/{before}/deliveries")).json()) == {
                "deliveries": []
            }
            other = await api.get(
                f"/api/jobs/{after}/deliveries",
                headers={"Authorization": f"Bearer {other_key}"},
            )
            assert other.status == 404
            assert (await other.json())["error"]["code"] == "job_not_found"
    finally:
        server.stop()
        kill_actors_in_namespace(namespace)
