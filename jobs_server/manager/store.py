"""Job records in the GCS KV store: atomic create, and the first terminal status wins.

A job has two keys. `job:<id>` is its live record (PENDING, then RUNNING), written by whoever
knows (put, last writer wins). `end:<id>:<run_id>` is its end, written once with put-if-absent:
the GCS KV has no compare-and-set, but put-if-absent is atomic, so of two writers that race to
end a job exactly one wins. Every read overlays the end over the live record, so nothing written
to the live record after the end (a late RUNNING) is ever seen. The end key names the run: a
deleted and resubmitted id never sees the old run's end.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from jobs_server.errors import DuplicateJobError, JobNotFoundError
from jobs_server.manager.kv import GcsKv
from jobs_server.manager.records import JobRecord, JobStatus, now_ms

logger = logging.getLogger(__name__)

_JOB_KEY_PREFIX = "job:"
_END_KEY_PREFIX = "end:"


def _job_key(submission_id: str) -> str:
    return f"{_JOB_KEY_PREFIX}{submission_id}"


def _end_key(submission_id: str, run_id: str) -> str:
    return f"{_END_KEY_PREFIX}{submission_id}:{run_id}"


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
        # Job ids in submission order, with their run ids, read from the GCS once and kept by
        # this store's creates and deletes. Like the cache, it is right only in the store that
        # creates and deletes the records (the server's).
        self._runs: dict[str, str] = {}
        self._indexed = False
        self._index_lock = asyncio.Lock()
        # Ids deleted while the index is being read: the read may still have seen them.
        self._deleted_while_indexing: set[str] = set()

    async def create(self, record: JobRecord) -> None:
        """Store a new record; raise DuplicateJobError if the submission_id is taken."""
        created = await self._kv.create(_job_key(record.submission_id), _encode(record))
        if not created:
            raise DuplicateJobError(record.submission_id)
        self._terminal.pop(record.submission_id, None)
        self._runs.pop(record.submission_id, None)  # a resubmitted id goes last
        self._runs[record.submission_id] = record.run_id
        self._deleted_while_indexing.discard(record.submission_id)

    async def get(self, submission_id: str, run_id: str | None = None) -> JobRecord:
        """The job's record, its end (if it has ended) over its live state. `run_id`, if the
        caller knows it, saves a round trip."""
        cached = self._terminal.get(submission_id)
        if cached is not None and run_id in (None, cached.run_id):
            return cached
        if run_id is None:
            run_id = self._runs.get(submission_id)
        if run_id is None:
            live = await self._kv.get(_job_key(submission_id))
            if live is None:
                raise JobNotFoundError(submission_id)
            return await self._with_end(JobRecord.model_validate_json(live))
        # One round trip: the live record and the end of the run named.
        values = await self._kv.get_many([_job_key(submission_id), _end_key(submission_id, run_id)])
        live = values.get(_job_key(submission_id))
        if live is None:
            raise JobNotFoundError(submission_id)
        record = JobRecord.model_validate_json(live)
        if record.run_id != run_id:
            return await self._with_end(record)
        return self._remember(_overlay(record, values.get(_end_key(submission_id, run_id))))

    async def _with_end(self, record: JobRecord) -> JobRecord:
        end = await self._kv.get(_end_key(record.submission_id, record.run_id))
        return self._remember(_overlay(record, end))

    async def list(self) -> list[JobRecord]:
        """Every record, in submission order; once indexed, only jobs still running are read."""
        if not self._indexed:
            await self._index()
        # Ids created while the KV is read are not in this list (it began before their
        # creation was answered), and are not dropped from the index either.
        runs = self._runs.copy()
        terminal = self._terminal
        unknown = [job_id for job_id in runs if job_id not in terminal]
        values = await self._kv.get_many(
            [_job_key(job_id) for job_id in unknown]
            + [_end_key(job_id, runs[job_id]) for job_id in unknown]
        )
        fetched: dict[str, JobRecord] = {}
        for job_id in unknown:
            live = values.get(_job_key(job_id))
            if live is None:
                if self._runs.get(job_id) == runs[job_id]:  # deleted meanwhile
                    del self._runs[job_id]
                continue
            record = JobRecord.model_validate_json(live)
            if record.run_id == runs[job_id]:
                record = self._remember(
                    _overlay(record, values.get(_end_key(job_id, runs[job_id])))
                )
            fetched[job_id] = record
        return [
            listed
            for job_id in runs
            if (listed := terminal.get(job_id) or fetched.get(job_id)) is not None
        ]

    async def _index(self) -> None:
        """Read every record once and index them (the only full read of the namespace)."""
        async with self._index_lock:
            if self._indexed:
                return
            self._deleted_while_indexing.clear()
            keys = await self._kv.keys_with_prefix(_JOB_KEY_PREFIX)
            keys += await self._kv.keys_with_prefix(_END_KEY_PREFIX)
            values = await self._kv.get_many(keys)
            ends = {
                (record.submission_id, record.run_id): record
                for record in (
                    JobRecord.model_validate_json(value)
                    for key, value in values.items()
                    if key.startswith(_END_KEY_PREFIX)
                )
            }
            records = sorted(
                (
                    ends.get((record.submission_id, record.run_id), record)
                    for record in (
                        JobRecord.model_validate_json(value)
                        for key, value in values.items()
                        if key.startswith(_JOB_KEY_PREFIX)
                    )
                ),
                key=lambda record: (record.start_time or 0, record.submission_id),
            )
            runs = {
                record.submission_id: record.run_id
                for record in records
                if record.submission_id not in self._deleted_while_indexing
            }
            # Jobs created while the namespace was read come after those it found.
            for job_id, run_id in self._runs.items():
                runs[job_id] = run_id
            self._runs = runs
            self._indexed = True
            for record in records:
                self._remember(record)

    async def delete(self, record: JobRecord) -> None:
        """Forget the job's run `record`: its live record and its end."""
        job_id = record.submission_id
        if self._runs.get(job_id, record.run_id) == record.run_id:
            await self._kv.delete(_job_key(job_id))
            self._terminal.pop(job_id, None)
            self._runs.pop(job_id, None)
            if not self._indexed:
                self._deleted_while_indexing.add(job_id)
        await self._kv.delete(_end_key(job_id, record.run_id))

    def _remember(self, record: JobRecord) -> JobRecord:
        if (
            self._cache_terminal
            and record.status.is_terminal()
            # A read that raced with a delete (and a resubmit) must not cache the old run.
            and self._runs.get(record.submission_id) == record.run_id
        ):
            self._terminal[record.submission_id] = record
        return record

    async def update(
        self, submission_id: str, run_id: str | None = None, **changes: Any
    ) -> JobRecord:
        """Apply `changes` to the job's run `run_id` (None: whichever run it is) unless it has
        ended; return the record as stored. A terminal status is compare-and-set: the first
        writer wins and the record returned is the winner's. Raises JobNotFoundError if the run
        is gone (deleted, or replaced by a resubmission)."""
        current = await self.get(submission_id, run_id)
        if run_id is not None and current.run_id != run_id:
            raise JobNotFoundError(submission_id)
        if current.status.is_terminal():
            logger.debug(
                "job %s is already %s; not applying %s", submission_id, current.status, changes
            )
            return current
        status = changes.get("status")
        if status is not None and JobStatus(status).is_terminal():
            return await self._end(current, **changes)
        updated = current.with_changes(**changes)
        await self._kv.put(_job_key(submission_id), _encode(updated))
        # An end written since `current` was read wins over this write; whoever wrote the live
        # state learns of it now (a supervisor stops the command it just started).
        end = await self._kv.get(_end_key(submission_id, current.run_id))
        return self._remember(_overlay(updated, end))

    async def _end(self, current: JobRecord, **changes: Any) -> JobRecord:
        changes.setdefault("end_time", now_ms())
        ended = current.with_changes(**changes)
        key = _end_key(current.submission_id, current.run_id)
        if await self._kv.create(key, _encode(ended)):
            return self._remember(ended)
        winner = await self._kv.get(key)
        if winner is None:  # deleted right after it was written
            raise JobNotFoundError(current.submission_id)
        logger.debug("job %s had already ended; not applying %s", current.submission_id, changes)
        return self._remember(JobRecord.model_validate_json(winner))


def _overlay(live: JobRecord, end: bytes | None) -> JobRecord:
    """The record as it is: its end, if it has one, else its live state."""
    return live if end is None else JobRecord.model_validate_json(end)


def _encode(record: JobRecord) -> bytes:
    return record.model_dump_json().encode()
