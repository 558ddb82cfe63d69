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


def get_job(
    db: sqlite3.Connection, submission_id: str, parse: RecordParser = parse_record
) -> JobRecord | None:
    row = db.execute("SELECT record FROM jobs WHERE submission_id = ?", (submission_id,)).fetchone()
    return None if row is None else parse(row[0])


def count_by_status(db: sqlite3.Connection) -> dict[JobStatus, int]:
    rows = db.execute("SELECT status, COUNT(*) FROM jobs GROUP BY status")
    return {JobStatus(status): count for status, count in rows.fetchall()}


def count_by_tenant(db: sqlite3.Connection, tenant: str | None) -> dict[str, dict[JobStatus, int]]:
    sql, parameters = "SELECT tenant, status, COUNT(*) FROM jobs", []
    if tenant is not None:
        sql, parameters = sql + " WHERE tenant = ?", [tenant]
    counts: dict[str, dict[JobStatus, int]] = {}
    for row_tenant, status, count in db.execute(sql + " GROUP BY tenant, status", parameters):
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
            records += [parse(text) for (text,) in db.execute(sql, parameters)]
    finally:
        db.execute("COMMIT")  # a read: nothing to write
    return counts, records


def unfinished_jobs(db: sqlite3.Connection) -> list[JobRecord]:
    rows = db.execute(
        "SELECT record FROM jobs WHERE status IN (?, ?) ORDER BY seq", _UNFINISHED
    ).fetchall()
    return [JobRecord.model_validate_json(text) for (text,) in rows]


def seq_of(db: sqlite3.Connection, after: str, tenant: str | None = None) -> int:
    # A cursor of another tenant's job is as unknown as one that never existed.
    sql, parameters = "SELECT seq FROM jobs WHERE submission_id = ?", [after]
    if tenant is not None:
        sql, parameters = sql + " AND tenant = ?", [after, tenant]
    row = db.execute(sql, parameters).fetchone()
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
    # Of one tenant: its own newest are kept (the tenant's index orders them by seq).
    of_tenant, tenant_parameters = ("", []) if tenant is None else (" AND tenant = ?", [tenant])
    clauses = []
    parameters: list[Any] = [*_TERMINAL, *tenant_parameters]
    if older_than_ms is not None:
        clauses.append("end_time < ?")
        parameters.append(older_than_ms)
    if keep_newest is not None:
        row = db.execute(
            f"SELECT seq FROM jobs WHERE 1 = 1{of_tenant} ORDER BY seq DESC LIMIT 1 OFFSET ?",
            [*tenant_parameters, keep_newest],
        ).fetchone()
        if row is not None:
            clauses.append("seq <= ?")
            parameters.append(row[0])
    if not clauses:
        return []
    parameters.append(limit)
    rows = db.execute(
        f"SELECT record FROM jobs WHERE status IN (?, ?, ?){of_tenant} AND"
        f" ({' OR '.join(clauses)}) ORDER BY seq LIMIT ?",
        parameters,
    ).fetchall()
    return [JobRecord.model_validate_json(text) for (text,) in rows]


def events_after(db: sqlite3.Connection, after_id: int, limit: int) -> list[JobEvent]:
    rows = db.execute(
        "SELECT id, type, submission_id, tenant, status, message, time, record"
        " FROM events WHERE id > ? ORDER BY id LIMIT ?",
        (after_id, limit),
    ).fetchall()
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
    oldest, newest = db.execute("SELECT MIN(id), MAX(id) FROM events").fetchone()
    if newest is None:
        return 0, 0
    return oldest, newest


def _rows(
    db: sqlite3.Connection, query: JobQuery, after_seq: int | None, limit: int | None
) -> list[tuple[int, str]]:
    """The (seq, record) rows of `query` after `after_seq`, in its order, at most `limit`."""
    if query.statuses is not None and len(query.live_ids) > MAX_LIVE_IDS:
        # Past what one statement may bind: every unfinished row instead (a superset).
        wider = query.statuses | {JobStatus(status) for status in _UNFINISHED}
        query = replace(query, statuses=frozenset(wider), live_ids=frozenset())
    rows: list[tuple[int, str]] = db.execute(*_select(query, after_seq, limit)).fetchall()
    if query.statuses is None or not query.live_ids:
        return rows
    # Two indexed reads merged, not one OR: SQLite plans that as a scan of the whole history.
    live = db.execute(*_select(query, after_seq, limit, ids=query.live_ids)).fetchall()
    merged = sorted(dict(rows + live).items(), reverse=query.descending)
    return merged if limit is None else merged[:limit]


def _select(
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
