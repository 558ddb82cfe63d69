"""Query parameters more than one route reads the same way."""

from __future__ import annotations

from jobs_server.errors import InvalidRequestError
from jobs_server.manager import JobStatus


def parse_statuses(value: str | None) -> frozenset[JobStatus] | None:
    """`status=RUNNING,pending`: the statuses named (any case); None when not given; a 400 for
    a name that is not a status, or for none at all."""
    if value is None:
        return None
    names = [name.strip().upper() for name in value.split(",") if name.strip()]
    unknown = [name for name in names if name not in JobStatus.__members__]
    if unknown or not names:
        raise InvalidRequestError(
            f"status: expected statuses among {', '.join(JobStatus)}, got {value!r}"
        )
    return frozenset(JobStatus[name] for name in names)
