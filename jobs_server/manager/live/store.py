"""Live job records in the GCS KV store, where the server and the supervisors coordinate: the
first terminal status wins. The history is the archive's (archive.py), which also decides that a
submission_id is new; once a run's end is archived, its keys here are removed.

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

from pydantic import ValidationError

from jobs_server.errors import JobNotFoundError
from jobs_server.manager.live.kv import GcsKv, retried
from jobs_server.manager.records import (
    JobRecord,
    JobStatus,
    RecordParser,
    now_ms,
    parse_record,
)

logger = logging.getLogger(__name__)

_JOB_KEY_PREFIX = "job:"
_END_KEY_PREFIX = "end:"
# A delete the GCS did not answer is tried this often in all, the first wait this long (doubled
# after each): a run left here would come back at the next start, were the archive not to say
# that it was deleted (recovery.py).
DELETE_ATTEMPTS = 3
DELETE_RETRY_INITIAL_S = 0.25


def _job_key(submission_id: str) -> str:
    return f"{_JOB_KEY_PREFIX}{submission_id}"


def _end_key(submission_id: str, run_id: str) -> str:
    return f"{_END_KEY_PREFIX}{submission_id}:{run_id}"


class JobStore:
    """Reads and writes the live records of jobs; the server and every supervisor share one
    namespace. It keeps no record in memory: the history is the archive's
    (manager/archive/sqlite.py), and the KV holds only jobs that have not ended yet (and, briefly,
    the end of those that just did, until the server has archived it and forgets it here). It
    remembers only which run of a job it created last, until that run is deleted."""

    def __init__(self, kv: GcsKv, *, parse: RecordParser = parse_record) -> None:
        self._kv = kv
        # The server's store keeps parses (caching_record_parser); a supervisor's need not.
        self._parse = parse
        # The server's store creates every run of its jobs. Per job, the run it created last,
        # until that run is deleted: a delete of it needs no read to know that the live record
        # is not a newer run's.
        self._created_runs: dict[str, str] = {}
        # Per job, the deletes on their way: a create waits for them, so a slow delete (the
        # GCS retried) never removes the record of a run created after it.
        self._deleting: dict[str, set[asyncio.Future[None]]] = {}

    def _overlay(self, live: JobRecord, end: bytes | None) -> JobRecord:
        """The record as it is: its end, if it has one, else its live state."""
        return live if end is None else self._parse(end)

    async def create(self, record: JobRecord) -> None:
        """Store a new run's live record. The archive decided that the id is free (its row is
        unique); a record left here by an earlier run (a late write after it was forgotten)
        is replaced."""
        submission_id = record.submission_id
        while self._deleting.get(submission_id):
            await asyncio.wait(self._deleting[submission_id])
        self._created_runs[submission_id] = record.run_id
        await self._kv.put(_job_key(submission_id), _encode(record))

    async def get(self, submission_id: str, run_id: str | None = None) -> JobRecord:
        """The job's record, its end (if it has ended) over its live state. `run_id`, if the
        caller knows it, saves a round trip."""
        if run_id is None:
            live = await self._kv.get(_job_key(submission_id))
            if live is None:
                raise JobNotFoundError(submission_id)
            return await self._with_end(self._parse(live))
        # One round trip: the live record and the end of the run named.
        values = await self._kv.get_many([_job_key(submission_id), _end_key(submission_id, run_id)])
        live = values.get(_job_key(submission_id))
        if live is None:
            raise JobNotFoundError(submission_id)
        record = self._parse(live)
        if record.run_id != run_id:
            return await self._with_end(record)
        return self._overlay(record, values.get(_end_key(submission_id, run_id)))

    async def _with_end(self, record: JobRecord) -> JobRecord:
        end = await self._kv.get(_end_key(record.submission_id, record.run_id))
        return self._overlay(record, end)

    async def current(self, records: list[JobRecord]) -> dict[str, JobRecord]:
        """What the KV says now of each of `records` (the same runs), in one round trip; a run
        the KV no longer has is left out."""
        # Each key made once: a list of every live job reads a thousand of them.
        runs = [(record.submission_id, record.run_id) for record in records]
        job_keys = [_job_key(job_id) for job_id, _ in runs]
        end_keys = [_end_key(job_id, run_id) for job_id, run_id in runs]
        values = await self._kv.get_many(job_keys + end_keys)
        found = {}
        for (job_id, run_id), job_key, end_key in zip(runs, job_keys, end_keys, strict=True):
            live = values.get(job_key)
            if live is None:
                continue
            current = self._parse(live)
            if current.run_id == run_id:
                found[job_id] = self._overlay(current, values.get(end_key))
        return found

    async def live_records(self) -> list[JobRecord]:
        """Every record in the KV, with its end over it (bounded: the KV holds live jobs, and
        the ends not yet archived). Only recovery reads this, once at start."""
        keys = await self._kv.keys_with_prefix(_JOB_KEY_PREFIX)
        values = await self._kv.get_many(keys)
        records = []
        for key, value in values.items():
            try:
                records.append(JobRecord.model_validate_json(value))
            except ValidationError as error:
                # Nothing of it can be run or failed (not even its id is sure): it is left
                # where it is, for a person to look at, and the other jobs are recovered.
                logger.error(
                    "the KV's %s is not a job record this server can read; left as it is: %s",
                    key,
                    str(error).splitlines()[0],
                )
        return list((await self.current(records)).values()) if records else []

    async def delete(self, record: JobRecord) -> None:
        """Forget the job's run `record` here: its live record (if it is still this run's) and
        its end. The archive keeps its history. Tried again while the GCS does not answer
        (each failure logged); ClusterUnavailableError if it still does not."""
        job_id, run_id = record.submission_id, record.run_id
        deleting = asyncio.get_running_loop().create_future()
        self._deleting.setdefault(job_id, set()).add(deleting)
        try:
            await retried(
                f"forgetting job {job_id}'s run {run_id} in the KV",
                lambda: self._delete_run(job_id, run_id),
                attempts=DELETE_ATTEMPTS,
                initial_delay_s=DELETE_RETRY_INITIAL_S,
            )
        finally:
            deletes = self._deleting[job_id]
            deletes.discard(deleting)
            if not deletes:
                del self._deleting[job_id]
            deleting.set_result(None)

    async def _delete_run(self, job_id: str, run_id: str) -> None:
        # The end is deleted even when the live record's delete fails: each key a try gets rid
        # of is one fewer for the next start to find and reconcile.
        try:
            await self._delete_live_record(job_id, run_id)
        finally:
            await self._kv.delete(_end_key(job_id, run_id))

    async def _delete_live_record(self, job_id: str, run_id: str) -> None:
        created = self._created_runs.get(job_id)
        if created == run_id:
            # A try again after a failure (or another delete meanwhile) reads the record first.
            del self._created_runs[job_id]
            # This run's record, or a late write of an older run's: no newer run's.
            await self._kv.delete(_job_key(job_id))
        elif created is None:  # a run of an earlier server: the record says whose it is
            live = await self._kv.get(_job_key(job_id))
            if live is not None and self._parse(live).run_id == run_id:
                await self._kv.delete(_job_key(job_id))
        # Else a newer run was created since: its record stays.

    async def delete_end(self, record: JobRecord) -> None:
        """Forget the end of the run `record` (its live key may be another run's by now)."""
        await self._kv.delete(_end_key(record.submission_id, record.run_id))

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
        return await self.update_from(current, **changes)

    async def update_from(self, current: JobRecord, **changes: Any) -> JobRecord:
        """`update`, for a writer that holds the run's live record as it is, with no read
        first: a run's supervisor, the only writer of its live record once it is handed over
        (the server writes only ends, which are keys of their own and win over this)."""
        submission_id = current.submission_id
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
        return self._overlay(updated, end)

    async def _end(self, current: JobRecord, **changes: Any) -> JobRecord:
        changes.setdefault("end_time", now_ms())
        ended = current.with_changes(**changes)
        key = _end_key(current.submission_id, current.run_id)
        if await self._kv.create(key, _encode(ended)):
            return ended
        winner = await self._kv.get(key)
        if winner is None:  # deleted right after it was written
            raise JobNotFoundError(current.submission_id)
        logger.debug("job %s had already ended; not applying %s", current.submission_id, changes)
        return self._parse(winner)


def _encode(record: JobRecord) -> bytes:
    return record.model_dump_json().encode()
