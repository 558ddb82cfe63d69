"""New jobs' rows, many in one statement per table.

A burst of submits commits a few dozen new jobs per transaction (group_commit.py). Inserted one
statement at a time, each job cost three statements, and the archive's thread waits for the
interpreter lock between two statements while the event loop holds it: that wait was most of a
batch's time before its COMMIT, and the submits of the batch wait for all of it. Here the jobs
table gets one statement per ROWS_PER_STATEMENT jobs, and so do their events.

The events' ids are given here, from the largest ever given (`sqlite_sequence`, which
AUTOINCREMENT keeps): the transaction holds the database's write lock, so no other writer takes
one meanwhile, and an explicit id moves `sqlite_sequence` on as an automatic one would.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator, Sequence
from typing import Any

from jobs_server.manager.archive.events import JobEvent, JobEventType
from jobs_server.manager.records import JobRecord, JobStatus, now_ms

# 100 rows of at most 8 columns: within the 999 variables of the oldest SQLite builds.
ROWS_PER_STATEMENT = 100

_JOB_COLUMNS = "submission_id, run_id, tenant, status, start_time, end_time, record"
_EVENT_COLUMNS = "id, type, submission_id, tenant, status, message, time, record"


def insert_new_rows(db: sqlite3.Connection, records: Sequence[JobRecord]) -> list[list[JobEvent]]:
    """Insert the rows of new jobs, their metadata and their events (SUBMITTED, and STATUS for
    one imported mid-life), in the order given; each record's events. sqlite3.IntegrityError if
    an id is taken: the caller rolls back to its savepoint (part may have been inserted)."""
    texts = [record.model_dump_json() for record in records]
    job_rows = [
        (
            record.submission_id,
            record.run_id,
            record.tenant,
            record.status.value,
            record.start_time,
            record.end_time,
            text,
        )
        for record, text in zip(records, texts, strict=True)
    ]
    _insert_many_rows(db, "jobs", _JOB_COLUMNS, job_rows)
    metadata = [
        (key, value, record.submission_id)
        for record in records
        for key, value in record.spec.metadata.items()
    ]
    if metadata:
        db.executemany(
            "INSERT INTO job_metadata (seq, key, value)"
            " SELECT seq, ?, ? FROM jobs WHERE submission_id = ?",
            metadata,
        )
    time = now_ms()
    next_id = _last_event_id(db) + 1
    events: list[list[JobEvent]] = []
    event_rows: list[tuple[Any, ...]] = []
    for record, text in zip(records, texts, strict=True):
        types = [JobEventType.SUBMITTED]
        if record.status is not JobStatus.PENDING:  # imported from the KV mid-life
            types.append(JobEventType.STATUS)
        own = []
        for type_ in types:
            own.append(
                JobEvent(
                    id=next_id,
                    type=type_,
                    submission_id=record.submission_id,
                    tenant=record.tenant,
                    status=record.status,
                    message=record.message,
                    time=time,
                    record=record,
                )
            )
            event_rows.append(
                (
                    next_id,
                    type_.value,
                    record.submission_id,
                    record.tenant,
                    record.status.value,
                    record.message,
                    time,
                    text,
                )
            )
            next_id += 1
        events.append(own)
    _insert_many_rows(db, "events", _EVENT_COLUMNS, event_rows)
    return events


def _insert_many_rows(
    db: sqlite3.Connection, table: str, columns: str, rows: Sequence[tuple[Any, ...]]
) -> None:
    for chunk in _chunks(rows, ROWS_PER_STATEMENT):
        placeholders = ", ".join(["(" + ", ".join("?" * len(chunk[0])) + ")"] * len(chunk))
        db.execute(
            f"INSERT INTO {table} ({columns}) VALUES {placeholders}",
            [value for row in chunk for value in row],
        )


def _chunks(rows: Sequence[tuple[Any, ...]], size: int) -> Iterator[Sequence[tuple[Any, ...]]]:
    for start in range(0, len(rows), size):
        yield rows[start : start + size]


def _last_event_id(db: sqlite3.Connection) -> int:
    """The largest event id ever given (0: none yet)."""
    row = db.execute("SELECT seq FROM sqlite_sequence WHERE name = 'events'").fetchone()
    return 0 if row is None else int(row[0])
