"""Standard Webhooks 1.0 signatures: the `whsec_` secrets (their form, the server's file), the
secrets that sign a delivery, and the headers of one attempt. The HMAC is the
`standardwebhooks` library's, never our own."""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from standardwebhooks.webhooks import Webhook

from jobs_server.manager.archive.outbox import TargetSource
from jobs_server.manager.webhook_events import NO_WEBHOOKS, TenantWebhooks

SECRET_PREFIX = "whsec_"
# Standard Webhooks: "secret keys SHOULD be between 24 bytes and 64 bytes".
MIN_SECRET_BYTES = 24
MAX_SECRET_BYTES = 64


class WebhookSecretError(ValueError):
    """A secret is not a `whsec_` secret; the message never holds the secret."""


def secret_problem(secret: str) -> str | None:
    """Why `secret` is not a usable `whsec_` secret (None: it is). Never quotes the secret."""
    if not secret.startswith(SECRET_PREFIX):
        return f"expected '{SECRET_PREFIX}' and the secret's base64"
    try:
        key = base64.b64decode(secret[len(SECRET_PREFIX) :], validate=True)
    except (binascii.Error, ValueError):
        return f"expected '{SECRET_PREFIX}' and the secret's base64 (padded, no spaces)"
    if not MIN_SECRET_BYTES <= len(key) <= MAX_SECRET_BYTES:
        return (
            f"expected a key of {MIN_SECRET_BYTES} to {MAX_SECRET_BYTES} bytes,"
            f" got {len(key)} (Standard Webhooks)"
        )
    return None


def read_secret_file(path: Path) -> tuple[str, ...]:
    """The secrets of `--webhook-secret-file`: one a line (several while one is rotated),
    blank lines and `#` comments skipped; WebhookSecretError names the line, not the secret."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise WebhookSecretError(f"cannot read the webhook secret file {path}: {error}") from None
    secrets = []
    for number, line in enumerate(text.splitlines(), start=1):
        secret = line.strip()
        if not secret or secret.startswith("#"):
            continue
        problem = secret_problem(secret)
        if problem is not None:
            raise WebhookSecretError(f"webhook secret file {path}, line {number}: {problem}")
        secrets.append(secret)
    if not secrets:
        raise WebhookSecretError(f"webhook secret file {path}: no secret in it")
    return tuple(secrets)


@dataclass(frozen=True)
class WebhookSecrets:
    """Which secrets sign a delivery: a tenant endpoint's own, else its tenant's; a job's own
    `notify` target its tenant's, else the server's (`--webhook-secret-file`)."""

    server: tuple[str, ...]
    webhooks_for: Callable[[str], TenantWebhooks] = lambda tenant: NO_WEBHOOKS
    """A tenant's webhooks in the tokens file as it is now (re-read on SIGHUP)."""

    def for_delivery(self, tenant: str, url: str, source: TargetSource) -> tuple[str, ...]:
        """The secrets that sign a delivery to `url` now (empty: none; it is not sent)."""
        webhooks = self.webhooks_for(tenant)
        if source is TargetSource.TENANT:
            for endpoint in webhooks.endpoints:
                if endpoint.url == url and endpoint.secrets:
                    return endpoint.secrets
            return webhooks.secrets
        return self.for_notify(tenant)

    def for_notify(self, tenant: str) -> tuple[str, ...]:
        """The secrets that sign the jobs' own `notify` targets of `tenant`."""
        return self.webhooks_for(tenant).secrets or self.server


def signed_headers(
    delivery_id: str, at: datetime, body: bytes, secrets: Sequence[str]
) -> dict[str, str]:
    """The headers of one attempt: a signature by each secret (space separated, as receivers
    that rotate a secret accept any one of them)."""
    if not secrets:
        raise WebhookSecretError("a webhook is never sent unsigned")
    at = at.astimezone(UTC)
    signatures = " ".join(Webhook(secret).sign(delivery_id, at, body) for secret in secrets)
    return {
        "webhook-id": delivery_id,
        "webhook-timestamp": str(int(at.timestamp())),
        "webhook-signature": signatures,
        "content-type": "application/json",
    }
