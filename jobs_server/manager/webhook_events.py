"""Webhooks as the records carry them: the events a receiver can ask for, and a target (a URL
and the events it wants), from a job's `notify` or a tenant's `webhooks` in the tokens file.

Which event a change of a job is (`webhook_events_of`) is decided where the change is written,
in the archive's transaction, so that its deliveries are written with it (archive/outbox.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

# A job's own targets, and the length of a target's URL.
MAX_NOTIFY_TARGETS = 10
MAX_WEBHOOK_URL_CHARS = 2048


class WebhookEventType(StrEnum):
    """The events a webhook receiver is sent (Standard Webhooks' `type`)."""

    STARTED = "job.started"
    SUCCEEDED = "job.succeeded"
    FAILED = "job.failed"
    STOPPED = "job.stopped"
    RETRYING = "job.retrying"
    """An attempt failed and another follows (the job stays RUNNING)."""


ALL_WEBHOOK_EVENTS: tuple[WebhookEventType, ...] = tuple(WebhookEventType)

WebhookUrl = Annotated[str, Field(min_length=1, max_length=MAX_WEBHOOK_URL_CHARS)]


class NotifyTarget(BaseModel):
    """Where a job's events go, and which of them (a job's `notify`, as stored)."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    url: WebhookUrl
    events: tuple[WebhookEventType, ...] = ALL_WEBHOOK_EVENTS


@dataclass(frozen=True)
class TenantWebhooks:
    """A tenant's webhooks, from the tokens file: its endpoints (each with its own secrets, or
    the tenant's) and its secrets (several while one is being rotated), which also sign its
    jobs' own `notify` targets."""

    endpoints: tuple[TenantWebhookEndpoint, ...] = ()
    secrets: tuple[str, ...] = ()


@dataclass(frozen=True)
class TenantWebhookEndpoint:
    url: str
    events: tuple[WebhookEventType, ...]
    secrets: tuple[str, ...] = ()
    """Its own `whsec_` secrets; empty: the tenant's."""


NO_WEBHOOKS = TenantWebhooks()
