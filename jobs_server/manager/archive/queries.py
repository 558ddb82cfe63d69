"""The read side of the archive: JobQuery, the SQL a query becomes, and the reads of the jobs
table and of the events (EventLog). Plain functions of a connection: the archive runs them on
its own thread."""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass, replace
from typing import Any

from jobs_server.manager.archive.events import JobEvent, JobEventType
from jobs_server.manager.records import JobRecord, JobStatus, RecordParser, parse_record

# Rows read per batch when the whole list is streamed.
STREAM_BATCH_ROWS = 500
# Live jobs read by id beside a status filter, at most (SQLite binds up to 32,766 values).
MAX_LIVE_IDS = 10_000
# Ids bound in one statement where a read takes any number of them in chunks.
_IDS_PER_STATEMENT = 500

_TERMINAL = tuple(status.value for status in JobStatus if status.is_terminal())
# Named, not "NOT IN terminal": only an IN list uses the status index (a full scan of a long
# history took 2.5 s of every start).
_UNFINISHED = tuple(status.value for status in JobStatus if not status.is_terminal())


@dataclass(frozen=True)
class JobQuery:
    """A filtered, ordered page of the history."""

    statuses: frozenset[JobStatus] | None = None
    submitted_after: int | None = None
    """Unix ms, exclusive."""
    submitted_before: int | None = None
    """Unix ms, exclusive."""
    metadata: tuple[tuple[str, str], ...] = ()
    """Exact matches, all of them."""
    descending: bool = False
    tenant: str | None = None
    """Only this tenant's jobs; None: every tenant's."""
    live_ids: frozenset[str] = frozenset()
    """Jobs listed whatever their archived status, with `statuses` (the live ones: the
    archive learns their status a moment after the KV, so the caller checks it)."""


class UnknownCursorError(Exception):
    """The `after` job of a page is not in the archive."""


# The statements both stores run, with `?` for each parameter (PostgreSQL's store writes them
# as `%s`: postgres.pyformat). A statement that depends on the query is built by a function
# here (`select_jobs`, ...), and run by the store's own thin function.
GET_JOB = "SELECT record FROM jobs WHERE submission_id = ?"
COUNT_BY_STATUS = "SELECT status, COUNT(*) FROM jobs GROUP BY status"
UNFINISHED_JOBS = (
    f"SELECT record FROM jobs WHERE status IN ({', '.join('?' * len(_UNFINISHED))}) ORDER BY seq"
)
UNFINISHED_JOBS_PARAMETERS = _UNFINISHED
EVENTS_AFTER = (
    "SELECT id, type, submission_id, tenant, status, message, time, record"
    " FROM events WHERE id > ? ORDER BY id LIMIT ?"
)
EVENT_ID_RANGE = "SELECT MIN(id), MAX(id) FROM events"
WAS_DELETED = "SELECT 1 FROM deleted_runs WHERE submission_id = ? AND run_id = ?"
# The oldest events beyond the newest `?` (the id is the primary key: a range delete).
TRIM_EVENTS = "DELETE FROM events WHERE id <= (SELECT MAX(id) FROM events) - ?"
# The runs deleted are remembered, the newest `?` of them.
TRIM_DELETED_RUNS = "DELETE FROM deleted_runs WHERE seq <= (SELECT MAX(seq) FROM deleted_runs) - ?"
# What an update reads and writes of the run (submission_id, run_id).
RUN_STATE = "SELECT status, record, tenant FROM jobs WHERE submission_id = ? AND run_id = ?"
UPDATE_RUN = (
    "UPDATE jobs SET status = ?, start_time = ?, end_time = ?, record = ?"
    " WHERE submission_id = ? AND run_id = ?"
)
DELETE_JOB = "DELETE FROM jobs WHERE submission_id = ?"
JOB_RUN_AND_TENANT = "SELECT run_id, tenant FROM jobs WHERE submission_id = ?"
INSERT_EVENT_COLUMNS = "type, submission_id, tenant, status, message, time, record"


def get_job(
    db: sqlite3.Connection, submission_id: str, parse: RecordParser = parse_record
) -> JobRecord | None:
    row = db.execute(GET_JOB, (submission_id,)).fetchone()
    return None if row is None else parse(row[0])


def count_by_status(db: sqlite3.Connection) -> dict[JobStatus, int]:
    return status_counts(db.execute(COUNT_BY_STATUS).fetchall())


def status_counts(rows: list[tuple[str, int]]) -> dict[JobStatus, int]:
    return {JobStatus(status): count for status, count in rows}


def count_by_tenant(db: sqlite3.Connection, tenant: str | None) -> dict[str, dict[JobStatus, int]]:
    return tenant_counts(db.execute(*count_by_tenant_select(tenant)).fetchall())


def count_by_tenant_select(tenant: str | None) -> tuple[str, list[Any]]:
    sql, parameters = "SELECT tenant, status, COUNT(*) FROM jobs", []
    if tenant is not None:
        sql, parameters = sql + " WHERE tenant = ?", [tenant]
    return sql + " GROUP BY tenant, status", parameters


def tenant_counts(rows: list[tuple[str, str, int]]) -> dict[str, dict[JobStatus, int]]:
    counts: dict[str, dict[JobStatus, int]] = {}
    for row_tenant, status, count in rows:
        counts.setdefault(row_tenant, {})[JobStatus(status)] = count
    return counts


def counts_and_unfinished_of(
    db: sqlite3.Connection,
    tenant: str | None,
    ids: frozenset[str],
    parse: RecordParser = parse_record,
) -> tuple[dict[str, dict[JobStatus, int]], list[JobRecord]]:
    """`count_by_tenant`, and the unfinished records of `ids` (of `tenant`, if given), read
    from one snapshot: a job the archive learns about meanwhile is not counted twice."""
    db.execute("BEGIN")
    try:
        counts = count_by_tenant(db, tenant)
        records = []
        for select in unfinished_of_selects(tenant, ids):
            records += [parse(text) for (text,) in db.execute(*select)]
    finally:
        db.execute("COMMIT")  # a read: nothing to write
    return counts, records


def unfinished_of_selects(tenant: str | None, ids: frozenset[str]) -> list[tuple[str, list[Any]]]:
    """The SELECTs of the records of the unfinished jobs `ids` (of `tenant`, if given), a chunk
    of ids each."""
    selects = []
    ordered = sorted(ids)
    for start in range(0, len(ordered), _IDS_PER_STATEMENT):
        chunk = ordered[start : start + _IDS_PER_STATEMENT]
        sql = (
            f"SELECT record FROM jobs WHERE submission_id IN ({', '.join('?' * len(chunk))})"
            f" AND status IN ({', '.join('?' * len(_UNFINISHED))})"
        )
        parameters: list[Any] = [*chunk, *_UNFINISHED]
        if tenant is not None:
            sql, parameters = sql + " AND tenant = ?", [*parameters, tenant]
        selects.append((sql, parameters))
    return selects


def unfinished_jobs(db: sqlite3.Connection) -> list[JobRecord]:
    rows = db.execute(UNFINISHED_JOBS, UNFINISHED_JOBS_PARAMETERS).fetchall()
    return [JobRecord.model_validate_json(text) for (text,) in rows]


def seq_of(db: sqlite3.Connection, after: str, tenant: str | None = None) -> int:
    return seq_of_row(db.execute(*seq_of_select(after, tenant)).fetchone(), after)


def seq_of_select(after: str, tenant: str | None) -> tuple[str, list[Any]]:
    # A cursor of another tenant's job is as unknown as one that never existed.
    sql, parameters = "SELECT seq FROM jobs WHERE submission_id = ?", [after]
    if tenant is not None:
        sql, parameters = sql + " AND tenant = ?", [after, tenant]
    return sql, parameters


def seq_of_row(row: tuple[Any, ...] | None, after: str) -> int:
    if row is None:
        raise UnknownCursorError(after)
    return int(row[0])


def page_of_jobs(
    db: sqlite3.Connection,
    query: JobQuery,
    after: str | None,
    limit: int | None,
    parse: RecordParser = parse_record,
) -> tuple[list[JobRecord], bool]:
    after_seq = None if after is None else seq_of(db, after, query.tenant)
    records, more, _ = window_of_jobs(db, query, after_seq, limit, parse)
    return records, more


def window_of_jobs(
    db: sqlite3.Connection,
    query: JobQuery,
    after_seq: int | None,
    limit: int | None,
    parse: RecordParser = parse_record,
) -> tuple[list[JobRecord], bool, int | None]:
    """Up to `limit` jobs of `query` after `after_seq`, whether more follow, and the seq of
    the last one (where the next window starts; None if none was read)."""
    rows = _rows(db, query, after_seq, None if limit is None else limit + 1)
    return window_of_rows(rows, limit, parse)


def window_of_rows(
    rows: list[tuple[int, str]], limit: int | None, parse: RecordParser
) -> tuple[list[JobRecord], bool, int | None]:
    """A window of `rows` read with `limit + 1` (the one beyond says whether more follow)."""
    more = limit is not None and len(rows) > limit
    rows = rows[:limit]
    last_seq = rows[-1][0] if rows else None
    return [parse(row[1]) for row in rows], more, last_seq


def batch_of_jobs(
    db: sqlite3.Connection, query: JobQuery, after_seq: int | None
) -> list[tuple[int, str]]:
    return _rows(db, query, after_seq, STREAM_BATCH_ROWS)


def expired_jobs(
    db: sqlite3.Connection,
    older_than_ms: int | None,
    keep_newest: int | None,
    limit: int,
    tenant: str | None = None,
) -> list[JobRecord]:
    newest_kept = None
    if keep_newest is not None:
        row = db.execute(*newest_kept_select(keep_newest, tenant)).fetchone()
        newest_kept = None if row is None else int(row[0])
    select = expired_select(older_than_ms, newest_kept, limit, tenant)
    if select is None:
        return []
    return [JobRecord.model_validate_json(text) for (text,) in db.execute(*select).fetchall()]


def _of_tenant(tenant: str | None) -> tuple[str, list[Any]]:
    # Of one tenant: its own newest are kept (the tenant's index orders them by seq).
    return ("", []) if tenant is None else (" AND tenant = ?", [tenant])


def newest_kept_select(keep_newest: int, tenant: str | None) -> tuple[str, list[Any]]:
    """The SELECT of the seq of the oldest job beyond the newest `keep_newest` (no row: none)."""
    of_tenant, tenant_parameters = _of_tenant(tenant)
    return (
        f"SELECT seq FROM jobs WHERE 1 = 1{of_tenant} ORDER BY seq DESC LIMIT 1 OFFSET ?",
        [*tenant_parameters, keep_newest],
    )


def expired_select(
    older_than_ms: int | None, newest_kept: int | None, limit: int, tenant: str | None
) -> tuple[str, list[Any]] | None:
    """The SELECT of the finished jobs that ended before `older_than_ms` or are at or before
    the seq `newest_kept` (None: nothing expires)."""
    of_tenant, tenant_parameters = _of_tenant(tenant)
    clauses = []
    parameters: list[Any] = [*_TERMINAL, *tenant_parameters]
    if older_than_ms is not None:
        clauses.append("end_time < ?")
        parameters.append(older_than_ms)
    if newest_kept is not None:
        clauses.append("seq <= ?")
        parameters.append(newest_kept)
    if not clauses:
        return None
    parameters.append(limit)
    return (
        f"SELECT record FROM jobs WHERE status IN ({', '.join('?' * len(_TERMINAL))}){of_tenant}"
        f" AND ({' OR '.join(clauses)}) ORDER BY seq LIMIT ?",
        parameters,
    )


def events_after(db: sqlite3.Connection, after_id: int, limit: int) -> list[JobEvent]:
    return events_of_rows(db.execute(EVENTS_AFTER, (after_id, limit)).fetchall())


def events_of_rows(rows: list[tuple[Any, ...]]) -> list[JobEvent]:
    return [
        JobEvent(
            id=id_,
            type=JobEventType(type_),
            submission_id=submission_id,
            tenant=tenant,
            status=None if status is None else JobStatus(status),
            message=message,
            time=time,
            record=None if record is None else JobRecord.model_validate_json(record),
        )
        for id_, type_, submission_id, tenant, status, message, time, record in rows
    ]


def event_id_range(db: sqlite3.Connection) -> tuple[int, int]:
    return id_range(db.execute(EVENT_ID_RANGE).fetchone())


def id_range(row: tuple[int | None, int | None]) -> tuple[int, int]:
    oldest, newest = row
    if oldest is None or newest is None:
        return 0, 0
    return oldest, newest


def _rows(
    db: sqlite3.Connection, query: JobQuery, after_seq: int | None, limit: int | None
) -> list[tuple[int, str]]:
    """The (seq, record) rows of `query` after `after_seq`, in its order, at most `limit`."""
    query = bounded_live_ids(query)
    rows: list[tuple[int, str]] = db.execute(*select_jobs(query, after_seq, limit)).fetchall()
    if query.statuses is None or not query.live_ids:
        return rows
    live = db.execute(*select_jobs(query, after_seq, limit, ids=query.live_ids)).fetchall()
    return merge_rows(query, rows, live, limit)


def bounded_live_ids(query: JobQuery) -> JobQuery:
    """`query`, or past what one statement may bind, every unfinished row instead of the live
    ids (a superset)."""
    if query.statuses is not None and len(query.live_ids) > MAX_LIVE_IDS:
        wider = query.statuses | {JobStatus(status) for status in _UNFINISHED}
        return replace(query, statuses=frozenset(wider), live_ids=frozenset())
    return query


def merge_rows(
    query: JobQuery, rows: list[tuple[int, str]], live: list[tuple[int, str]], limit: int | None
) -> list[tuple[int, str]]:
    """The rows of a status filter and of its live ids, merged in the query's order. Two
    indexed reads merged, not one OR: SQLite plans that as a scan of the whole history."""
    merged = sorted(dict(rows + live).items(), reverse=query.descending)
    return merged if limit is None else merged[:limit]


def select_jobs(
    query: JobQuery, after_seq: int | None, limit: int | None, ids: frozenset[str] | None = None
) -> tuple[str, list[Any]]:
    """The SELECT of (seq, record) for `query` (for the jobs `ids` whatever their status, if
    given), after `after_seq` in the query's order."""
    clauses: list[str] = []
    parameters: list[Any] = []
    if ids is not None:
        clauses.append(f"submission_id IN ({', '.join('?' * len(ids))})")
        parameters += sorted(ids)
    elif query.statuses is not None:
        statuses = sorted(status.value for status in query.statuses)
        clauses.append(f"status IN ({', '.join('?' * len(statuses))})")
        parameters += statuses
    if query.tenant is not None:
        clauses.append("tenant = ?")
        parameters.append(query.tenant)
    if query.submitted_after is not None:
        clauses.append("start_time > ?")
        parameters.append(query.submitted_after)
    if query.submitted_before is not None:
        clauses.append("start_time < ?")
        parameters.append(query.submitted_before)
    for key, value in query.metadata:
        clauses.append("seq IN (SELECT seq FROM job_metadata WHERE key = ? AND value = ?)")
        parameters += [key, value]
    if after_seq is not None:
        clauses.append("seq < ?" if query.descending else "seq > ?")
        parameters.append(after_seq)
    sql = "SELECT seq, record FROM jobs"
    if clauses:
        sql += " WHERE " + " AND ".join(clauses)
    sql += " ORDER BY seq DESC" if query.descending else " ORDER BY seq"
    if limit is not None:
        sql += " LIMIT ?"
        parameters.append(limit)
    return sql, parameters
