"""A webhook's body names whose job it is: a receiver shared by tenants, or one that checks the
server's own secret (which signs the `notify` of every tenant without secrets of its own), must
not take one tenant's job for another's, since submission ids are chosen by their submitters."""

from __future__ import annotations

import json

from jobs_server.manager.archive.outbox import TargetSource, WebhookDelivery
from jobs_server.manager.records import JobRecord, JobSpec, JobStatus
from jobs_server.manager.webhook_events import WebhookEventType
from jobs_server.webhooks.sender import payload_of


def delivery_of(tenant: str) -> WebhookDelivery:
    record = JobRecord(
        spec=JobSpec(submission_id="nightly-report", entrypoint="true"),
        status=JobStatus.SUCCEEDED,
        tenant=tenant,
        start_time=1_000,
        end_time=2_000,
    )
    return WebhookDelivery(
        id="msg_1",
        event_id=7,
        event_type=WebhookEventType.SUCCEEDED,
        submission_id=record.submission_id,
        tenant=tenant,
        url="https://receiver.example/hook",
        source=TargetSource.JOB,
        record=record.model_dump_json(),
        created_ms=2_000,
    )


def test_the_body_names_the_job_s_tenant() -> None:
    bodies = {tenant: json.loads(payload_of(delivery_of(tenant))) for tenant in ("a", "b")}
    # The same job id of two tenants: only the tenant tells them apart.
    assert [bodies[tenant]["data"]["tenant"] for tenant in ("a", "b")] == ["a", "b"]
    assert bodies["a"]["data"]["submission_id"] == bodies["b"]["data"]["submission_id"]
    assert (bodies["a"]["type"], bodies["a"]["event_id"]) == ("job.succeeded", 7)
