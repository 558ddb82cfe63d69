"""Webhook receivers and an in-memory outbox for the webhook tests: a receiver is a real aiohttp
server on loopback that checks every signature it is sent, as a product's would."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Collection
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from standardwebhooks.webhooks import Webhook, WebhookVerificationError

from jobs_server.manager.archive.outbox import (
    DeliveryState,
    DisabledWebhookEndpoint,
    TargetSource,
    WebhookDelivery,
)
from jobs_server.manager.records import JobRecord, JobSpec, JobStatus, now_ms
from jobs_server.manager.webhook_events import WebhookEventType
from jobs_server.settings import Settings
from jobs_server.webhooks.targets import TargetPolicy

LOOPBACK_HTTP = TargetPolicy(allow_http=True, allow_private=True)
DEADLINE_S = 60.0


def new_secret() -> str:
    return "whsec_" + base64.b64encode(os.urandom(32)).decode()


# -- receivers ---------------------------------------------------------------------------------


@dataclass
class Received:
    headers: dict[str, str]
    body: bytes

    @property
    def payload(self) -> dict[str, Any]:
        return dict(json.loads(self.body))

    @property
    def event(self) -> tuple[str, str]:
        """(submission id, event type)."""
        return self.payload["data"]["submission_id"], self.payload["type"]


@dataclass
class Receiver:
    """An aiohttp server on 127.0.0.1 that checks each request's signature with each of
    `secrets` (each must verify it), answers `answers` in turn then `default_status`; with `hang`,
    holds each request until `released` (or the sender gives up and closes the connection)."""

    secrets: list[str]
    answers: list[int] = field(default_factory=list)
    default_status: int = 200
    hang: bool = False
    received: list[Received] = field(default_factory=list)
    badly_signed: list[Received] = field(default_factory=list)
    hanging: int = 0
    max_hanging: int = 0
    released: asyncio.Event = field(default_factory=asyncio.Event)
    server: TestServer | None = None
    port: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"

    async def handle(self, request: web.Request) -> web.Response:
        received = Received(dict(request.headers), await request.read())
        for secret in self.secrets:
            try:
                Webhook(secret).verify(received.body, received.headers)
            except WebhookVerificationError:
                self.badly_signed.append(received)
                return web.Response(status=401)
        self.received.append(received)
        if self.hang:
            self.hanging += 1
            self.max_hanging = max(self.max_hanging, self.hanging)
            try:
                await self.released.wait()
            finally:
                self.hanging -= 1
        status = self.answers.pop(0) if self.answers else self.default_status
        return web.Response(status=status)

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/hook", self.handle)
        # A request whose sender gave up (closed the connection) ends its handler.
        self.server = TestServer(
            app, host="127.0.0.1", port=self.port or None, handler_cancellation=True
        )
        await self.server.start_server()
        self.port = self.server.port or 0

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.close()
            self.server = None

    def events(self) -> set[tuple[str, str]]:
        return {received.event for received in self.received}


@pytest.fixture
async def receivers() -> AsyncIterator[Callable[..., Awaitable[Receiver]]]:
    started: list[Receiver] = []

    async def receiver(secrets: list[str], **options: Any) -> Receiver:
        made = Receiver(secrets, **options)
        await made.start()
        started.append(made)
        return made

    yield receiver
    for made in started:
        made.released.set()
        await made.stop()


async def eventually_async(
    predicate: Callable[[], Awaitable[bool]], what: str, timeout_s: float = DEADLINE_S
) -> None:
    deadline = time.monotonic() + timeout_s
    while not await predicate():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        await asyncio.sleep(0.05)


async def eventually(
    predicate: Callable[[], Any], what: str | Callable[[], str], timeout_s: float = DEADLINE_S
) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() >= deadline:
            raise AssertionError(
                f"not within {timeout_s} s: {what if isinstance(what, str) else what()}"
            )
        await asyncio.sleep(0.05)


def webhook_settings(settings: Settings, **changes: Any) -> Settings:
    return settings.model_copy(
        update={"webhook_allow_http": True, "webhook_allow_private": True, **changes}
    )


# -- an outbox in memory ---------------------------------------------------------------------


class MemoryOutbox:
    """The Outbox protocol's semantics (archive/outbox.py) in memory."""

    def __init__(self) -> None:
        self.rows: dict[str, WebhookDelivery] = {}
        self.disabled: dict[tuple[str, str], int] = {}
        """When each (tenant, URL) was disabled."""

    def add(
        self,
        url: str,
        *,
        tenant: str = "default",
        source: TargetSource = TargetSource.JOB,
        created_ms: int | None = None,
    ) -> WebhookDelivery:
        record = JobRecord(
            spec=JobSpec(submission_id=f"job-{uuid.uuid4().hex[:6]}", entrypoint="true"),
            status=JobStatus.SUCCEEDED,
            tenant=tenant,
            start_time=now_ms(),
            end_time=now_ms(),
        )
        created = now_ms() if created_ms is None else created_ms
        delivery = WebhookDelivery(
            id=f"msg_{uuid.uuid4().hex}",
            event_id=len(self.rows) + 1,
            event_type=WebhookEventType.SUCCEEDED,
            submission_id=record.submission_id,
            tenant=tenant,
            url=url,
            source=source,
            record=record.model_dump_json(),
            created_ms=created,
            next_attempt_ms=created,
        )
        if (tenant, url) not in self.disabled:
            self.rows[delivery.id] = delivery
        return delivery

    async def claim_due_deliveries(
        self, now_ms: int, limit: int, claim_ms: int, *, skip_tenants: Collection[str] = ()
    ) -> list[WebhookDelivery]:
        due = sorted(
            (
                row
                for row in self.rows.values()
                if row.state is DeliveryState.PENDING
                and row.tenant not in skip_tenants
                and row.next_attempt_ms is not None
                and row.next_attempt_ms <= now_ms
            ),
            key=lambda row: row.next_attempt_ms or 0,
        )[:limit]
        claimed = []
        for row in due:
            self.rows[row.id] = row.model_copy(update={"next_attempt_ms": now_ms + claim_ms})
            claimed.append(self.rows[row.id])
        return claimed

    async def next_delivery_due_ms(self) -> int | None:
        due = [
            row.next_attempt_ms
            for row in self.rows.values()
            if row.state is DeliveryState.PENDING and row.next_attempt_ms is not None
        ]
        return min(due, default=None)

    async def record_delivery_attempt(
        self,
        delivery_id: str,
        *,
        state: DeliveryState,
        at_ms: int,
        next_attempt_ms: int | None,
        status_code: int | None,
        error: str | None,
    ) -> bool:
        row = self.rows[delivery_id]
        if row.state is not DeliveryState.PENDING:
            return False
        self.rows[delivery_id] = row.model_copy(
            update={
                "state": state,
                "attempts": row.attempts + 1,
                "next_attempt_ms": next_attempt_ms,
                "last_attempt_ms": at_ms,
                "last_status_code": status_code,
                "last_error": error,
                "delivered_ms": at_ms if state is DeliveryState.DELIVERED else None,
            }
        )
        return True

    async def disable_webhook_endpoint(self, tenant: str, url: str, at_ms: int) -> int:
        self.disabled.setdefault((tenant, url), at_ms)
        ended = 0
        for row in list(self.rows.values()):
            if (row.tenant, row.url) == (tenant, url) and row.state is DeliveryState.PENDING:
                self.rows[row.id] = row.model_copy(update={"state": DeliveryState.DISABLED})
                ended += 1
        return ended

    async def disabled_webhook_endpoints(
        self, tenant: str | None = None
    ) -> list[DisabledWebhookEndpoint]:
        return [
            DisabledWebhookEndpoint(tenant=owner, url=url, disabled_ms=at_ms)
            for (owner, url), at_ms in sorted(self.disabled.items())
            if tenant is None or owner == tenant
        ]

    async def enable_webhook_endpoint(self, tenant: str, url: str) -> bool:
        return self.disabled.pop((tenant, url), None) is not None

    async def deliveries_of(self, submission_id: str) -> list[WebhookDelivery]:
        return [row for row in self.rows.values() if row.submission_id == submission_id]

    async def count_deliveries(self) -> dict[DeliveryState, int]:
        counts: dict[DeliveryState, int] = {}
        for row in self.rows.values():
            counts[row.state] = counts.get(row.state, 0) + 1
        return counts

    def state_of(self, delivery: WebhookDelivery) -> WebhookDelivery:
        return self.rows[delivery.id]
