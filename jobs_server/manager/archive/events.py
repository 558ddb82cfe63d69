"""Job events: one per change of a job (submitted, each status change, deleted), numbered.

The archive writes an event in the same transaction as the change it describes, so the numbered
sequence has no gap and survives a restart; the event stream (`GET /api/events`) reads it back.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Protocol

from pydantic import BaseModel, ConfigDict

from jobs_server.manager.records import JobRecord, JobStatus


class JobEventType(StrEnum):
    SUBMITTED = "submitted"
    STATUS = "status"
    DELETED = "deleted"


class JobEvent(BaseModel):
    """One change of one job. `id` increases by one per event, across restarts."""

    model_config = ConfigDict(frozen=True)

    id: int
    type: JobEventType
    submission_id: str
    tenant: str | None = None
    status: JobStatus | None = None
    message: str | None = None
    time: int
    """Unix milliseconds when the change was recorded."""
    record: JobRecord | None = None
    """The job as it is after the change (None for a deletion)."""


class EventLog(Protocol):
    """The archive's numbered events, read back in order."""

    async def events_after(self, after_id: int, limit: int) -> list[JobEvent]:
        """Up to `limit` events with an id greater than `after_id`, oldest first."""
        ...

    async def event_id_range(self) -> tuple[int, int]:
        """(oldest id still kept, newest id); (0, 0) when there has been none. An `after_id`
        below `oldest - 1` cannot be resumed without a gap."""
        ...
