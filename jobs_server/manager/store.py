"""Job records in the GCS KV store: atomic create, and a terminal status is never overwritten."""

from __future__ import annotations

import logging
from typing import Any

from jobs_server.errors import DuplicateJobError, JobNotFoundError
from jobs_server.manager.kv import GcsKv
from jobs_server.manager.records import JobRecord, JobStatus, now_ms

logger = logging.getLogger(__name__)

_JOB_KEY_PREFIX = "job:"


def _job_key(submission_id: str) -> str:
    return f"{_JOB_KEY_PREFIX}{submission_id}"


class JobStore:
    """Reads and writes job records; the server and every supervisor share one namespace."""

    def __init__(self, kv: GcsKv) -> None:
        self._kv = kv

    async def create(self, record: JobRecord) -> None:
        """Store a new record; raise DuplicateJobError if the submission_id is taken."""
        created = await self._kv.create(_job_key(record.submission_id), _encode(record))
        if not created:
            raise DuplicateJobError(record.submission_id)

    async def get(self, submission_id: str) -> JobRecord:
        data = await self._kv.get(_job_key(submission_id))
        if data is None:
            raise JobNotFoundError(submission_id)
        return JobRecord.model_validate_json(data)

    async def list(self) -> list[JobRecord]:
        """Every record, in submission_id order."""
        return [
            JobRecord.model_validate_json(data)
            for data in await self._kv.values_with_prefix(_JOB_KEY_PREFIX)
        ]

    async def delete(self, submission_id: str) -> None:
        await self._kv.delete(_job_key(submission_id))

    async def update(self, submission_id: str, **changes: Any) -> JobRecord:
        """Apply `changes` unless the record is already terminal; return the record as stored.

        The GCS KV store has no compare-and-set. Writers never race on one job in practice: the
        supervisor writes while it lives, and the manager writes only what the supervisor cannot
        (it never started, it died). Checking before writing keeps terminal status final.
        """
        current = await self.get(submission_id)
        if current.status.is_terminal():
            logger.debug(
                "job %s is already %s; not applying %s", submission_id, current.status, changes
            )
            return current
        status = changes.get("status")
        if status is not None and JobStatus(status).is_terminal():
            changes.setdefault("end_time", now_ms())
        updated = current.with_changes(**changes)
        await self._kv.put(_job_key(submission_id), _encode(updated))
        return updated


def _encode(record: JobRecord) -> bytes:
    return record.model_dump_json().encode()
