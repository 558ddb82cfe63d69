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
    """Reads and writes job records; the server and every supervisor share one namespace.

    A terminal record never changes again, so the server keeps it in memory once read (listing
    many finished jobs then costs neither a GCS round trip nor parsing per job). Only the store
    that deletes records may cache them: a supervisor's cache could outlive a deleted job whose
    id is then submitted again.
    """

    def __init__(self, kv: GcsKv, *, cache_terminal: bool = False) -> None:
        self._kv = kv
        self._cache_terminal = cache_terminal
        self._terminal: dict[str, JobRecord] = {}
        # Job ids in submission order, read from the GCS once. Like the cache, it is right only
        # in the store that creates and deletes the records (the server's). None until listed.
        self._ids: dict[str, None] | None = None

    async def create(self, record: JobRecord) -> None:
        """Store a new record; raise DuplicateJobError if the submission_id is taken."""
        created = await self._kv.create(_job_key(record.submission_id), _encode(record))
        if not created:
            raise DuplicateJobError(record.submission_id)
        if self._ids is not None:
            self._ids[record.submission_id] = None

    async def get(self, submission_id: str) -> JobRecord:
        if submission_id in self._terminal:
            return self._terminal[submission_id]
        data = await self._kv.get(_job_key(submission_id))
        if data is None:
            raise JobNotFoundError(submission_id)
        return self._remember(JobRecord.model_validate_json(data))

    async def _load_all(self) -> list[JobRecord]:
        """Read every record once and index them (the only full read of the namespace)."""
        keys = await self._kv.keys_with_prefix(_JOB_KEY_PREFIX)
        records = sorted(
            map(JobRecord.model_validate_json, (await self._kv.get_many(keys)).values()),
            key=lambda record: (record.start_time or 0, record.submission_id),
        )
        self._ids = {self._remember(record).submission_id: None for record in records}
        return records

    async def list(self) -> list[JobRecord]:
        """Every record, in submission order; once indexed, only jobs still running are read."""
        if self._ids is None:
            return await self._load_all()
        unknown = [_job_key(job_id) for job_id in self._ids if job_id not in self._terminal]
        fetched = {
            record.submission_id: self._remember(record)
            for record in map(
                JobRecord.model_validate_json, (await self._kv.get_many(unknown)).values()
            )
        }
        records = []
        for job_id in list(self._ids):
            record = self._terminal.get(job_id) or fetched.get(job_id)
            if record is None:  # deleted meanwhile
                del self._ids[job_id]
            else:
                records.append(record)
        return records

    async def delete(self, submission_id: str) -> None:
        await self._kv.delete(_job_key(submission_id))
        self._terminal.pop(submission_id, None)
        if self._ids is not None:
            self._ids.pop(submission_id, None)

    def _remember(self, record: JobRecord) -> JobRecord:
        if self._cache_terminal and record.status.is_terminal():
            self._terminal[record.submission_id] = record
        return record

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
        return self._remember(updated)


def _encode(record: JobRecord) -> bytes:
    return record.model_dump_json().encode()
