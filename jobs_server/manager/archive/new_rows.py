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

import itertools
import sqlite3
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from jobs_server.manager.archive.events import JobEvent, JobEventType
from jobs_server.manager.records import JobRecord, JobStatus, now_ms

# 100 rows of at most 8 columns: within the 999 variables of the oldest SQLite builds.
ROWS_PER_STATEMENT = 100

JOB_COLUMNS = "submission_id, run_id, tenant, status, start_time, end_time, record"
EVENT_COLUMNS = "id, type, submission_id, tenant, status, message, time, record"
# A job's metadata rows, by its submission_id (its row is inserted first, in the same statement
# batch).
METADATA_INSERT = (
    "INSERT INTO job_metadata (seq, key, value) SELECT seq, ?, ? FROM jobs WHERE submission_id = ?"
)


@dataclass(frozen=True)
class NewRows:
    """The rows of new jobs and of their metadata, as both stores insert them (`JOB_COLUMNS`,
    `METADATA_INSERT`), and their events once the store has numbered them (`numbered_events`):
    PostgreSQL's takes the ids after the jobs' rows went in, so a taken id costs no number."""

    records: Sequence[JobRecord]
    texts: list[str]
    jobs: list[tuple[Any, ...]]
    metadata: list[tuple[Any, ...]]

    @property
    def event_count(self) -> int:
        """SUBMITTED for each, and STATUS for one imported mid-life."""
        return sum(1 if record.status is JobStatus.PENDING else 2 for record in self.records)

    def numbered_events(
        self, first_event_id: int
    ) -> tuple[list[tuple[Any, ...]], list[list[JobEvent]]]:
        """The events' rows (`EVENT_COLUMNS`), numbered on from `first_event_id` in the order
        given, and each record's events."""
        time = now_ms()
        event_ids = itertools.count(first_event_id)
        events: list[list[JobEvent]] = []
        event_rows: list[tuple[Any, ...]] = []
        for record, text in zip(self.records, self.texts, strict=True):
            types = [JobEventType.SUBMITTED]
            if record.status is not JobStatus.PENDING:  # imported from the KV mid-life
                types.append(JobEventType.STATUS)
            own = []
            for type_ in types:
                event_id = next(event_ids)
                own.append(
                    JobEvent(
                        id=event_id,
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
                        event_id,
                        type_.value,
                        record.submission_id,
                        record.tenant,
                        record.status.value,
                        record.message,
                        time,
                        text,
                    )
                )
            events.append(own)
        return event_rows, events


def plan_new_rows(records: Sequence[JobRecord]) -> NewRows:
    """The rows of new jobs and their metadata, in the order given."""
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
    metadata = [
        (key, value, record.submission_id)
        for record in records
        for key, value in record.spec.metadata.items()
    ]
    return NewRows(records=records, texts=texts, jobs=job_rows, metadata=metadata)


def insert_new_rows(db: sqlite3.Connection, records: Sequence[JobRecord]) -> list[list[JobEvent]]:
    """Insert the rows of new jobs, their metadata and their events (SUBMITTED, and STATUS for
    one imported mid-life), in the order given; each record's events. sqlite3.IntegrityError if
    an id is taken: the caller rolls back to its savepoint (part may have been inserted)."""
    rows = plan_new_rows(records)
    _insert_many_rows(db, "jobs", JOB_COLUMNS, rows.jobs)
    if rows.metadata:
        db.executemany(METADATA_INSERT, rows.metadata)
    event_rows, events = rows.numbered_events(_last_event_id(db) + 1)
    _insert_many_rows(db, "events", EVENT_COLUMNS, event_rows)
    return events


def values_placeholders(row_count: int, column_count: int) -> str:
    """`(?, ?), (?, ?)`: the VALUES of a multi-row INSERT."""
    return ", ".join(["(" + ", ".join("?" * column_count) + ")"] * row_count)


def _insert_many_rows(
    db: sqlite3.Connection, table: str, columns: str, rows: Sequence[tuple[Any, ...]]
) -> None:
    for chunk in _chunks(rows, ROWS_PER_STATEMENT):
        placeholders = values_placeholders(len(chunk), len(chunk[0]))
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
