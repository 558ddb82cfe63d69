"""The submit's check of a job's own webhooks (`notify`): each URL by the target policy, and a
secret to sign them with (its tenant's, else the server's); a 400 naming the field."""

from __future__ import annotations

from collections.abc import Callable

from jobs_server.errors import InvalidRequestError
from jobs_server.manager.records import JobSpec
from jobs_server.webhooks.signing import WebhookSecrets
from jobs_server.webhooks.targets import TargetPolicy


def notify_validator(
    policy: TargetPolicy, secrets: WebhookSecrets
) -> Callable[[JobSpec, str], None]:
    """The manager's `validate_notify(spec, tenant)`: InvalidRequestError unless the job's
    `notify` targets may be sent to and signed."""

    def validate_notify(spec: JobSpec, tenant: str) -> None:
        if not spec.notify:
            return
        for index, target in enumerate(spec.notify):
            problem = policy.url_problem(target.url)
            if problem is not None:
                raise InvalidRequestError(f"notify[{index}].url: {problem}")
        if not secrets.for_notify(tenant):
            raise InvalidRequestError(
                "notify: no webhook secret signs this tenant's webhooks (the tokens file's"
                " webhook_secrets for the tenant, or the server's --webhook-secret-file)"
            )

    return validate_notify
