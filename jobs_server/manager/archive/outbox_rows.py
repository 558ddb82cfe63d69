"""The outbox's tables and statements (outbox.py), shared by both stores: the deliveries a
change plans, written with its event; claims; attempts; disabled endpoints; the bound on
finished deliveries.

Statements use `?` (PostgreSQL's store writes them as `%s`: postgres.pyformat). The states in
the statements are literals, not parameters: SQLite uses the index of due deliveries only for a
`state = 'pending'` it can read in the statement."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from jobs_server.manager.archive.outbox import (
    DeliveryState,
    DisabledWebhookEndpoint,
    PlannedDelivery,
    TargetSource,
    WebhookDelivery,
    ended_attempts,
    webhook_events_of,
)
from jobs_server.manager.records import JobRecord, JobStatus, RecordParser
from jobs_server.manager.webhook_events import WebhookEventType

# The migration of both stores (BIGINT is an integer in SQLite too). Deliveries keep no key to
# their job: a job deleted meanwhile is still told of (at least once).
TABLES: tuple[str, ...] = (
    """CREATE TABLE webhook_deliveries (
        id TEXT PRIMARY KEY,
        event_id BIGINT NOT NULL,
        event_type TEXT NOT NULL,
        submission_id TEXT NOT NULL,
        tenant TEXT NOT NULL,
        url TEXT NOT NULL,
        source TEXT NOT NULL,
        record TEXT NOT NULL,
        created_ms BIGINT NOT NULL,
        state TEXT NOT NULL,
        attempts INTEGER NOT NULL DEFAULT 0,
        next_attempt_ms BIGINT,
        last_attempt_ms BIGINT,
        last_status_code INTEGER,
        last_error TEXT,
        delivered_ms BIGINT
    )""",
    # Claims (the due pending ones, soonest first), counts by state, an endpoint's disabling.
    "CREATE INDEX webhook_deliveries_due ON webhook_deliveries (state, next_attempt_ms)",
    "CREATE INDEX webhook_deliveries_submission ON webhook_deliveries (submission_id, event_id)",
    # The trim of finished ones visits only those it deletes (pending ones are never trimmed).
    "CREATE INDEX webhook_deliveries_finished ON webhook_deliveries (event_id)"
    " WHERE state <> 'pending'",
    """CREATE TABLE webhook_endpoints_disabled (
        tenant TEXT NOT NULL,
        url TEXT NOT NULL,
        disabled_ms BIGINT NOT NULL,
        PRIMARY KEY (tenant, url)
    )""",
)

COLUMNS = (
    "id, event_id, event_type, submission_id, tenant, url, source, record, created_ms, state,"
    " attempts, next_attempt_ms, last_attempt_ms, last_status_code, last_error, delivered_ms"
)
INSERT = (
    "INSERT INTO webhook_deliveries (id, event_id, event_type, submission_id, tenant, url,"
    " source, record, created_ms, state, next_attempt_ms)"
    " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, 'pending', ?)"
)
DISABLED_URLS = "SELECT url FROM webhook_endpoints_disabled WHERE tenant = ?"
# The tenants to skip (their sends fill their share: sender.py) are a JSON array in SQLite, an
# array in PostgreSQL; an empty one skips none.
DUE = (
    f"SELECT {COLUMNS} FROM webhook_deliveries WHERE state = 'pending' AND next_attempt_ms <= ?"
    " AND tenant NOT IN (SELECT value FROM json_each(?))"
    " ORDER BY next_attempt_ms LIMIT ?"
)
CLAIM = "UPDATE webhook_deliveries SET next_attempt_ms = ? WHERE id = ?"
# PostgreSQL's claim in one statement: rows another claimer holds are skipped, not waited for.
CLAIM_DUE_SKIP_LOCKED = (
    "UPDATE webhook_deliveries SET next_attempt_ms = ? WHERE id IN"
    " (SELECT id FROM webhook_deliveries WHERE state = 'pending' AND next_attempt_ms <= ?"
    " AND tenant <> ALL(?) ORDER BY next_attempt_ms LIMIT ? FOR UPDATE SKIP LOCKED)"
    f" RETURNING {COLUMNS}"
)
NEXT_DUE = "SELECT MIN(next_attempt_ms) FROM webhook_deliveries WHERE state = 'pending'"
RECORD_ATTEMPT = (
    "UPDATE webhook_deliveries SET state = ?, attempts = attempts + 1, next_attempt_ms = ?,"
    " last_attempt_ms = ?, last_status_code = ?, last_error = ?, delivered_ms = ?"
    " WHERE id = ? AND state = 'pending'"
)
DISABLE_ENDPOINT = (
    "INSERT INTO webhook_endpoints_disabled (tenant, url, disabled_ms) VALUES (?, ?, ?)"
    " ON CONFLICT DO NOTHING"
)
END_DISABLED = (
    "UPDATE webhook_deliveries SET state = 'disabled', next_attempt_ms = NULL"
    " WHERE state = 'pending' AND tenant = ? AND url = ?"
)
DISABLED_ENDPOINTS = (
    "SELECT tenant, url, disabled_ms FROM webhook_endpoints_disabled ORDER BY tenant, url"
)
DISABLED_ENDPOINTS_OF = (
    "SELECT tenant, url, disabled_ms FROM webhook_endpoints_disabled WHERE tenant = ? ORDER BY url"
)
# Deliveries that ended DISABLED stay ended: only the next events' are written for it again.
ENABLE_ENDPOINT = "DELETE FROM webhook_endpoints_disabled WHERE tenant = ? AND url = ?"
# One event's deliveries by URL: the order is stable, whatever the planner's.
DELIVERIES_OF = (
    f"SELECT {COLUMNS} FROM webhook_deliveries WHERE submission_id = ?"
    " ORDER BY event_id, url, source"
)
COUNT_BY_STATE = "SELECT state, COUNT(*) FROM webhook_deliveries GROUP BY state"
# Finished deliveries are kept while their event is (the newest `max_events`: queries.py
# TRIM_EVENTS' bound); pending ones until they finish, however old.
TRIM_FINISHED = (
    "DELETE FROM webhook_deliveries WHERE state <> 'pending'"
    " AND event_id <= (SELECT MAX(id) FROM events) - ?"
)
# PostgreSQL's, with the bound as a value (postgres.py says why): event ids at or below `?`.
TRIM_FINISHED_UP_TO = "DELETE FROM webhook_deliveries WHERE state <> 'pending' AND event_id <= ?"


def new_delivery_id() -> str:
    """A delivery's `webhook-id`: `msg_` and 128 random bits."""
    return f"msg_{uuid.uuid4().hex}"


def may_have_retried(record: JobRecord) -> bool:
    if record.status is JobStatus.RUNNING:
        return ended_attempts(record) > 0
    return record.status.is_terminal() and len(record.attempts) > 1


def events_of_change(
    stored_status: JobStatus, stored_text: str, record: JobRecord, parse: RecordParser
) -> list[tuple[WebhookEventType, ...]]:
    """The status events a change of the stored row (its status, its record's text) to `record`
    is, each with the webhook events it causes (`webhook_events_of`): one per change of status
    (a start, an end; back to PENDING causes none), and one per retry learnt while the job runs.
    What an end brings that was never written (a start, retries) rides on the end's event: the
    stream shows the job's changes as they were archived, once each.

    The stored record is parsed only where a retry may be (RUNNING learnt again with an attempt
    ended, or an end after more than one attempt): a start or an end of a job that ran once, the
    common changes, needs no parse."""
    stored_ended = 0
    if stored_status is JobStatus.RUNNING and may_have_retried(record):
        stored_ended = ended_attempts(parse(stored_text))
    webhook_events = webhook_events_of(stored_status, stored_ended, record)
    if record.status is JobStatus.RUNNING:
        return [(event,) for event in webhook_events]
    return [webhook_events] if record.status is not stored_status else []


def planned_rows(
    planned: Sequence[PlannedDelivery],
    record: JobRecord,
    event_type: WebhookEventType,
    event_id: int,
    time_ms: int,
    text: str,
    disabled_urls: set[str],
) -> list[tuple[Any, ...]]:
    """The rows (`INSERT`'s parameters) of the `planned` deliveries of an event, but to the
    tenant's `disabled_urls`; due at once."""
    return [
        (
            new_delivery_id(),
            event_id,
            event_type.value,
            record.submission_id,
            record.tenant,
            url,
            source.value,
            text,
            time_ms,
            time_ms,
        )
        for url, source in planned
        if url not in disabled_urls
    ]


def attempt_parameters(
    delivery_id: str,
    state: DeliveryState,
    at_ms: int,
    next_attempt_ms: int | None,
    status_code: int | None,
    error: str | None,
) -> tuple[Any, ...]:
    """`RECORD_ATTEMPT`'s parameters."""
    delivered_ms = at_ms if state is DeliveryState.DELIVERED else None
    return (state.value, next_attempt_ms, at_ms, status_code, error, delivered_ms, delivery_id)


def delivery_of_row(row: Sequence[Any]) -> WebhookDelivery:
    """A row of `COLUMNS` as a WebhookDelivery."""
    (
        id_,
        event_id,
        event_type,
        submission_id,
        tenant,
        url,
        source,
        record,
        created_ms,
        state,
        attempts,
        next_attempt_ms,
        last_attempt_ms,
        last_status_code,
        last_error,
        delivered_ms,
    ) = row
    return WebhookDelivery(
        id=id_,
        event_id=event_id,
        event_type=WebhookEventType(event_type),
        submission_id=submission_id,
        tenant=tenant,
        url=url,
        source=TargetSource(source),
        record=record,
        created_ms=created_ms,
        state=DeliveryState(state),
        attempts=attempts,
        next_attempt_ms=next_attempt_ms,
        last_attempt_ms=last_attempt_ms,
        last_status_code=last_status_code,
        last_error=last_error,
        delivered_ms=delivered_ms,
    )


def disabled_endpoints_query(tenant: str | None) -> tuple[str, tuple[Any, ...]]:
    """The statement and parameters that list the disabled endpoints (`tenant`'s, if given)."""
    if tenant is None:
        return DISABLED_ENDPOINTS, ()
    return DISABLED_ENDPOINTS_OF, (tenant,)


def disabled_endpoint_of_row(row: Sequence[Any]) -> DisabledWebhookEndpoint:
    tenant, url, disabled_ms = row
    return DisabledWebhookEndpoint(tenant=tenant, url=url, disabled_ms=disabled_ms)


def state_counts(rows: Sequence[tuple[str, int]]) -> dict[DeliveryState, int]:
    return {DeliveryState(state): int(count) for state, count in rows}
