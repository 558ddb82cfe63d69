"""The archive's `plan_deliveries`: for a job's webhook event, the targets that want it (the
job's own `notify`, its tenant's endpoints in the tokens file as it is now). Called inside the
archive's write transaction, on its writing thread: it reads memory only (the tokens file is
read at start and on SIGHUP, by the key ring) and never blocks."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from jobs_server.manager.archive.events import JobEvent, JobEventType
from jobs_server.manager.archive.outbox import DeliveryPlanner, PlannedDelivery, TargetSource
from jobs_server.manager.records import JobRecord
from jobs_server.manager.webhook_events import TenantWebhooks, WebhookEventType


def delivery_planner(webhooks_for: Callable[[str], TenantWebhooks]) -> DeliveryPlanner:
    """The planner of a server whose tenants' webhooks are `webhooks_for(tenant)`."""

    def plan_deliveries(
        record: JobRecord, event_type: WebhookEventType
    ) -> Sequence[PlannedDelivery]:
        planned: list[PlannedDelivery] = []
        for target in record.spec.notify:
            if event_type in target.events:
                planned.append(PlannedDelivery(target.url, TargetSource.JOB))
        for endpoint in webhooks_for(record.tenant).endpoints:
            if event_type in endpoint.events:
                planned.append(PlannedDelivery(endpoint.url, TargetSource.TENANT))
        # A target listed twice is sent to once per source.
        return list(dict.fromkeys(planned))

    return plan_deliveries


def may_have_deliveries(
    events: Iterable[JobEvent], webhooks_for: Callable[[str], TenantWebhooks]
) -> bool:
    """Whether any of `events` (committed) may have written deliveries: a status change of a
    job with `notify` targets or of a tenant with endpoints. The sender is woken for those
    only: a server without webhooks never looks at its outbox for a job's change."""
    for event in events:
        if event.type is not JobEventType.STATUS:
            continue
        record = event.record
        if record is None:  # not known here: look
            return True
        if record.spec.notify or webhooks_for(record.tenant).endpoints:
            return True
    return False
