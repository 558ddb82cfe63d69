"""The audit trail: one line per submit, stop, upload and delete, without secrets."""

from __future__ import annotations

import logging
from typing import Any

from aiohttp import web

from jobs_server.app_state import AUTHENTICATED_KEY, PRINCIPAL_KEY
from jobs_server.manager.tenancy import ANONYMOUS_ADMIN

audit_logger = logging.getLogger("jobs_server.audit")


def audit(request: web.Request, action: str, target: str, **details: Any) -> None:
    """Log who (remote address, authenticated or not, the key's tenant, role and name: never
    the key) did `action` to `target`, and when."""
    extra = " ".join(f"{name}={value!r}" for name, value in sorted(details.items()))
    principal = request.get(PRINCIPAL_KEY, ANONYMOUS_ADMIN)
    audit_logger.info(
        "%s %s remote=%s authenticated=%s tenant=%s role=%s key=%s%s",
        action,
        target,
        request.remote,
        request.get(AUTHENTICATED_KEY, False),
        principal.tenant,
        principal.role.value,
        principal.key_name or "-",
        f" {extra}" if extra else "",
    )


def redacted_runtime_env(runtime_env: dict[str, Any]) -> dict[str, Any]:
    """The runtime env's shape without its values (env_vars may hold credentials)."""
    shown: dict[str, Any] = {}
    for name, value in runtime_env.items():
        if isinstance(value, dict):
            shown[name] = {key: "<redacted>" for key in value}
        else:
            shown[name] = "<redacted>"
    return shown
