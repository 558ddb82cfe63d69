"""The webhooks' outbox: each delivery a change of a job causes is a row of the archive, written
in the same transaction as the change and its event, so a delivery is never lost between the
change and its sending (a server killed in between finds it at its start).

Deliveries are sent (jobs_server/webhooks/) by whichever server or replica claims them first: a
claim moves the delivery's `next_attempt_ms` past the time a send may take (a visibility
timeout), so a replica that dies mid-send leaves its claims to the others once they expire.
Each attempt's outcome is written back; a receiver's 2xx ends the delivery, a 410 disables its
endpoint (its pending deliveries end DISABLED, and no more are written for it) until it is
enabled again (`enable_webhook_endpoint`: from the next event on; what ended DISABLED stays so).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from enum import StrEnum
from typing import NamedTuple, Protocol

from pydantic import BaseModel, ConfigDict

from jobs_server.manager.records import JobRecord, JobStatus
from jobs_server.manager.webhook_events import WebhookEventType


class DeliveryState(StrEnum):
    PENDING = "pending"
    """Not yet accepted: its next attempt is at `next_attempt_ms`."""
    DELIVERED = "delivered"
    """A receiver answered 2xx."""
    FAILED = "failed"
    """Given up: its retries ran past `--webhook-retry-max-s` (or its target was refused)."""
    DISABLED = "disabled"
    """Its endpoint answered 410 Gone (to it or to another delivery): never sent again."""


class TargetSource(StrEnum):
    """Where a delivery's target came from, and so which secrets sign it."""

    TENANT = "tenant"
    """The tenant's `webhooks` in the tokens file: the endpoint's secrets, else the tenant's."""
    JOB = "job"
    """The job's own `notify`: its tenant's secrets, else `--webhook-secret-file`'s."""


class PlannedDelivery(NamedTuple):
    url: str
    source: TargetSource


# What the archive asks, inside the transaction of a change, for each webhook event the change
# is: the targets to deliver it to (the job's `notify`, its tenant's endpoints). Called on the
# archive's writing thread: it must not block, nor touch the event loop.
DeliveryPlanner = Callable[[JobRecord, WebhookEventType], Sequence[PlannedDelivery]]


def no_deliveries(record: JobRecord, event_type: WebhookEventType) -> Sequence[PlannedDelivery]:
    """The planner of an archive without webhooks."""
    return ()


class WebhookDelivery(BaseModel):
    """One event of one job to one target, and what became of its attempts so far."""

    model_config = ConfigDict(frozen=True)

    id: str
    """Its `webhook-id` (`msg_...`): the same at every attempt, so receivers can deduplicate."""
    event_id: int
    """The archive's event (`GET /api/events`) that caused it."""
    event_type: WebhookEventType
    submission_id: str
    tenant: str
    url: str
    source: TargetSource
    record: str
    """The job as it was at the event (JSON of its JobRecord): the body's `data`."""
    created_ms: int
    state: DeliveryState = DeliveryState.PENDING
    attempts: int = 0
    next_attempt_ms: int | None = None
    last_attempt_ms: int | None = None
    last_status_code: int | None = None
    last_error: str | None = None
    delivered_ms: int | None = None


class DisabledWebhookEndpoint(BaseModel):
    """A tenant's endpoint that answered 410 Gone: no delivery is written for it until enabled."""

    model_config = ConfigDict(frozen=True)

    tenant: str
    url: str
    disabled_ms: int


def ended_attempts(record: JobRecord) -> int:
    return sum(1 for attempt in record.attempts if attempt.end_time is not None)


def webhook_events_of(
    stored_status: JobStatus | None, stored_ended_attempts: int, record: JobRecord
) -> tuple[WebhookEventType, ...]:
    """The webhook events that writing `record` over a row of `stored_status` (None: a new row)
    with `stored_ended_attempts` is, in order: a start, a retry for each attempt ended since
    that another attempt followed, and an end. What was never written is sent still: a start
    learnt with its first attempt ended already (a short attempt's start is written with its
    end) is a start and a retry; a job that ran but was archived only at its end (it ended
    before its start was written) is a start, its retries and its end."""
    status = record.status
    if (stored_status is not None and stored_status.is_terminal()) or not (
        status is JobStatus.RUNNING or status.is_terminal()
    ):
        return ()
    changed = status is not stored_status
    learnt_running = stored_status is JobStatus.RUNNING
    if status is JobStatus.RUNNING:
        started = changed
        retried = ended_attempts(record)
    else:
        started = bool(record.attempts) and not learnt_running
        retried = len(record.attempts) - 1  # its last attempt is its end, not a retry
    before = stored_ended_attempts if learnt_running else 0
    events: tuple[WebhookEventType, ...] = (WebhookEventType.STARTED,) if started else ()
    events += (WebhookEventType.RETRYING,) * max(0, retried - before)
    if changed and status.is_terminal():
        events += (_END_OF_STATUS[status],)
    return events


_END_OF_STATUS = {
    JobStatus.SUCCEEDED: WebhookEventType.SUCCEEDED,
    JobStatus.FAILED: WebhookEventType.FAILED,
    JobStatus.STOPPED: WebhookEventType.STOPPED,
}


class Outbox(Protocol):
    """The archive's side of webhook deliveries (both stores)."""

    async def claim_due_deliveries(
        self, now_ms: int, limit: int, claim_ms: int, *, skip_tenants: Collection[str] = ()
    ) -> list[WebhookDelivery]:
        """Up to `limit` PENDING deliveries due by `now_ms`, oldest first, but those of
        `skip_tenants`, each claimed (its `next_attempt_ms` moved to `now_ms + claim_ms`) in
        the same transaction, so no other sender takes them meanwhile."""
        ...

    async def next_delivery_due_ms(self) -> int | None:
        """When the next PENDING delivery is due (None: none is pending)."""
        ...

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
        """Write one attempt's outcome (attempts + 1); False if the delivery is no longer
        PENDING (another sender finished it, or its endpoint was disabled)."""
        ...

    async def disable_webhook_endpoint(self, tenant: str, url: str, at_ms: int) -> int:
        """The endpoint answered 410: no delivery is written for it again, and its PENDING ones
        end DISABLED; how many did."""
        ...

    async def disabled_webhook_endpoints(
        self, tenant: str | None = None
    ) -> list[DisabledWebhookEndpoint]:
        """The endpoints a 410 disabled, `tenant`'s only if given, by tenant then URL."""
        ...

    async def enable_webhook_endpoint(self, tenant: str, url: str) -> bool:
        """Deliveries are written for the endpoint again from the next event on (those that
        ended DISABLED stay ended); False if it was not disabled."""
        ...

    async def deliveries_of(self, submission_id: str) -> list[WebhookDelivery]:
        """The job's deliveries, oldest first."""
        ...

    async def count_deliveries(self) -> dict[DeliveryState, int]:
        """Deliveries kept, by state (for /metrics)."""
        ...
