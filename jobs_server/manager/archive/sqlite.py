"""The job history on the head's disk: a SQLite database (WAL) at `<state-dir>/jobs.db`.

Every job accepted is a row from its submit on (before the POST is answered), and every status
the server learns is written to it, with its event in the same transaction (`EventLog`). The GCS
KV only coordinates live jobs with their supervisors; the archive is what survives a restart of
the server or of the whole cluster.

Two connections, each used from a dedicated thread of its own (sqlite3 objects are not shared
between threads); the event loop never waits on the disk. Writes are group-committed
(group_commit.py): those that arrive while a transaction commits share the next one, each
answered once it is durable. Reads have the other connection: in WAL mode a reader sees the
last commit and neither waits for a writer nor holds one up, so a slow list (a big page, a
cold disk) never delays a submit.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sqlite3
from collections.abc import AsyncIterator, Callable, Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from jobs_server.errors import DuplicateJobError
from jobs_server.manager.archive import outbox_rows, queries
from jobs_server.manager.archive.events import JobEvent, JobEventType
from jobs_server.manager.archive.group_commit import GroupCommit, NewRow, rollback
from jobs_server.manager.archive.leases import SQLITE_STATEMENTS, Fence, require_fence
from jobs_server.manager.archive.new_rows import insert_new_rows
from jobs_server.manager.archive.outbox import (
    DeliveryPlanner,
    DeliveryState,
    DisabledWebhookEndpoint,
    WebhookDelivery,
    no_deliveries,
)

# Re-exported: the archive's callers name them with it.
from jobs_server.manager.archive.queries import STREAM_BATCH_ROWS as STREAM_BATCH_ROWS
from jobs_server.manager.archive.queries import JobQuery as JobQuery
from jobs_server.manager.archive.queries import UnknownCursorError as UnknownCursorError
from jobs_server.manager.archive.schema_versions import (
    Migration,
    check_readable,
    min_reader_version,
)
from jobs_server.manager.records import (
    JobRecord,
    JobStatus,
    RecordParser,
    now_ms,
    parse_record,
)
from jobs_server.manager.webhook_events import WebhookEventType
from jobs_server.state_dir import make_private_file

logger = logging.getLogger(__name__)

ARCHIVE_FILE_NAME = "jobs.db"
# Events kept: the newest this many (a client further behind lists again, as after a 410).
DEFAULT_MAX_EVENTS = 100_000

_T = TypeVar("_T")

# Each entry moves the schema one version up (PRAGMA user_version); never edit a released one.
# Whether the release before reads the schema after it: schema_versions.py.
_MIGRATIONS: tuple[Migration[str], ...] = (
    Migration(
        """
    CREATE TABLE jobs (
        seq INTEGER PRIMARY KEY AUTOINCREMENT,
        submission_id TEXT NOT NULL UNIQUE,
        run_id TEXT NOT NULL,
        tenant TEXT,
        status TEXT NOT NULL,
        start_time INTEGER,
        end_time INTEGER,
        record TEXT NOT NULL
    );
    CREATE INDEX jobs_status_seq ON jobs (status, seq);
    CREATE INDEX jobs_start_time ON jobs (start_time);
    CREATE INDEX jobs_end_time ON jobs (end_time);
    CREATE TABLE job_metadata (
        seq INTEGER NOT NULL REFERENCES jobs (seq) ON DELETE CASCADE,
        key TEXT NOT NULL,
        value TEXT NOT NULL,
        PRIMARY KEY (seq, key)
    );
    CREATE INDEX job_metadata_key_value ON job_metadata (key, value, seq);
    CREATE TABLE events (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        type TEXT NOT NULL,
        submission_id TEXT NOT NULL,
        tenant TEXT,
        status TEXT,
        message TEXT,
        time INTEGER NOT NULL,
        record TEXT
    );
    """,
        readable_by_previous=False,  # the tables: nothing before reads them
    ),
    # Tenants: rows from before them are the default tenant's; lists and counts by tenant.
    Migration(
        """
    UPDATE jobs SET tenant = 'default' WHERE tenant IS NULL;
    UPDATE events SET tenant = 'default' WHERE tenant IS NULL;
    CREATE INDEX jobs_tenant_seq ON jobs (tenant, seq);
    CREATE INDEX jobs_tenant_status ON jobs (tenant, status);
    """,
        readable_by_previous=False,  # a server before tenants writes jobs of no tenant
    ),
    # The runs deleted (or withdrawn): a KV record that a failed delete left is never imported
    # again (recovery.py). The newest MAX_DELETED_RUNS are kept.
    Migration(
        """
    CREATE TABLE deleted_runs (
        seq INTEGER PRIMARY KEY AUTOINCREMENT,
        submission_id TEXT NOT NULL,
        run_id TEXT NOT NULL
    );
    CREATE UNIQUE INDEX deleted_runs_run ON deleted_runs (submission_id, run_id);
    """,
        readable_by_previous=False,  # a server before it deletes runs it does not remember
    ),
    # Leases of replicas sharing a history (leases.py); times in unix ms by the database's clock.
    Migration(
        """
    CREATE TABLE leases (
        name TEXT PRIMARY KEY,
        holder TEXT,
        epoch INTEGER NOT NULL,
        expires_at_ms INTEGER NOT NULL,
        previous_holder TEXT
    );
    """,
        # A new table; on SQLite (one server per state dir) no lease is taken against another.
        readable_by_previous=True,
    ),
    # Where a lease's holder serves (leases.py `holder_url`): the leader's, for the others.
    Migration(
        "ALTER TABLE leases ADD COLUMN holder_url TEXT",
        readable_by_previous=True,  # a nullable column: the release before never reads it
    ),
    # The webhooks' outbox (outbox.py): deliveries, and the endpoints that answered 410.
    Migration(
        "; ".join(outbox_rows.TABLES),
        # New tables: the release before writes changes without their deliveries, no more.
        readable_by_previous=True,
    ),
)
# Deleted runs remembered (recovery asks about what the KV still holds at a start).
MAX_DELETED_RUNS = 100_000
# The lowest schema version a server must know to use the file (schema_versions.py): one row.
_MIN_READER_TABLE = "schema_compatibility"


def _migrate(db: sqlite3.Connection, path: Path) -> None:
    """Move the schema up to this server's version, with the lowest version a server must know
    to use it, in one transaction; a newer schema is used as it is if this server can read it,
    else refused (SchemaTooNewError) before anything is written."""
    known = len(_MIGRATIONS)
    version = db.execute("PRAGMA user_version").fetchone()[0]
    recorded = _recorded_min_reader_version(db)
    check_readable(str(path), version, recorded, known)
    needed = min_reader_version(_MIGRATIONS, known)
    if version > known or (version == known and recorded == needed):
        return  # nothing to write: a newer schema stays as its release left it
    steps = "".join(
        f"{migration.change}; PRAGMA user_version = {number};"
        for number, migration in enumerate(_MIGRATIONS[version:], start=version + 1)
    )
    db.executescript(
        f"BEGIN; {steps} CREATE TABLE IF NOT EXISTS {_MIN_READER_TABLE}"
        f" (min_reader_version INTEGER NOT NULL); DELETE FROM {_MIN_READER_TABLE};"
        f" INSERT INTO {_MIN_READER_TABLE} (min_reader_version) VALUES ({needed}); COMMIT;"
    )
    if version < known:
        logger.info(
            "archive %s migrated from schema version %d to %d (servers that know versions"
            " below %d can no longer use it)",
            path,
            version,
            known,
            needed,
        )


def _recorded_min_reader_version(db: sqlite3.Connection) -> int | None:
    """None: a file of a release before the record (or a new one)."""
    if not db.execute(
        "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (_MIN_READER_TABLE,)
    ).fetchone():
        return None
    row = db.execute(f"SELECT min_reader_version FROM {_MIN_READER_TABLE}").fetchone()
    return None if row is None else int(row[0])


class Archive:
    """The jobs table and its events. Open with `open()`, close with `close()`."""

    lease_statements = SQLITE_STATEMENTS

    def __init__(
        self,
        path: Path,
        *,
        on_events: Callable[[list[JobEvent]], None] | None = None,
        max_events: int = DEFAULT_MAX_EVENTS,
        parse: RecordParser = parse_record,
        plan_deliveries: DeliveryPlanner = no_deliveries,
    ) -> None:
        self.path = path
        # What reads texts into records: the server's keeps parses (caching_record_parser),
        # and its KV reads use it too (a live job's text is the same in both).
        self.parse_record = parse
        self._on_events = on_events
        self._max_events = max_events
        # Called on the archive's thread, in the transaction of each change that is a webhook
        # event (outbox.py).
        self._plan_deliveries = plan_deliveries
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="archive")
        self._db: sqlite3.Connection | None = None
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="archive-reads")
        self._read_db: sqlite3.Connection | None = None
        self._writes = GroupCommit(
            run=self._run,
            connection=self._conn,
            after_each_batch=self._trim_events,
            add_rows=self._add_new_rows,
        )

    # -- lifecycle --------------------------------------------------------------------------

    async def open(self) -> None:
        await self._run(self._open)
        # After the writer's migrations: the reader sees the schema as this server knows it.
        await self._on_reader(self._open_reader)

    def _open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # 0600 before SQLite opens it: it makes the -wal and -shm files with the same mode.
        make_private_file(self.path)
        db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        db.execute("PRAGMA journal_mode=WAL")
        # WAL with NORMAL loses at most the last commits on a power cut, never consistency;
        # FULL: an accepted job is on disk before the POST is answered.
        db.execute("PRAGMA synchronous=FULL")
        db.execute("PRAGMA foreign_keys=ON")
        db.execute("PRAGMA busy_timeout=5000")
        try:
            _migrate(db, self.path)
        except BaseException:
            db.close()
            raise
        self._db = db

    def _open_reader(self) -> None:
        db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        db.execute("PRAGMA query_only=ON")  # a read can never write
        db.execute("PRAGMA busy_timeout=5000")
        self._read_db = db

    async def close(self) -> None:
        await self._writes.close()
        if self._read_db is not None:
            await self._on_reader(self._read_db.close)
            self._read_db = None
        self._reader.shutdown(wait=True)
        if self._db is not None:
            await self._run(self._db.close)
            self._db = None
        self._executor.shutdown(wait=True)

    async def abandoned_calls_ended(self) -> None:
        """At once: no call of this store is abandoned (none has a timeout)."""

    async def _run(self, function: Callable[..., _T], *args: Any) -> _T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, function, *args)

    async def _on_reader(self, function: Callable[..., _T], *args: Any) -> _T:
        return await asyncio.get_running_loop().run_in_executor(self._reader, function, *args)

    def _conn(self) -> sqlite3.Connection:
        if self._db is None:
            raise RuntimeError("the archive is not open")
        return self._db

    def _notify(self, events: list[JobEvent]) -> None:
        if events and self._on_events is not None:
            try:
                self._on_events(events)
            except Exception:
                logger.exception("an events subscriber failed")

    # -- writes -----------------------------------------------------------------------------

    async def insert(self, record: JobRecord) -> None:
        """Record a new job; DuplicateJobError if its submission_id is in the archive."""
        _, events = await self._writes.write(NewRow(record))
        self._notify(events)

    def _add_new_rows(
        self, db: sqlite3.Connection, records: list[JobRecord]
    ) -> list[tuple[bool, Any]]:
        """Add new jobs next to each other in a batch together (new_rows.py); if an id is
        taken, each on its own, so that only that one fails (with DuplicateJobError)."""
        db.execute("SAVEPOINT new_rows")
        try:
            events = insert_new_rows(db, records)
        except sqlite3.IntegrityError:
            db.execute("ROLLBACK TO new_rows")
            db.execute("RELEASE new_rows")
            return [self._add_new_row(db, record) for record in records]
        db.execute("RELEASE new_rows")
        return [(True, (None, own)) for own in events]

    def _add_new_row(self, db: sqlite3.Connection, record: JobRecord) -> tuple[bool, Any]:
        db.execute("SAVEPOINT new_row")
        try:
            events = self._insert_row(db, record)
        except DuplicateJobError as error:
            db.execute("ROLLBACK TO new_row")
            db.execute("RELEASE new_row")
            return False, error
        db.execute("RELEASE new_row")
        return True, (None, events)

    async def insert_many(self, records: list[JobRecord]) -> None:
        """Record many new jobs in one transaction (an import, a benchmark's history); all or
        none: DuplicateJobError if an id is taken."""
        self._notify(await self._run(self._insert_many, records))

    def _insert_many(self, records: list[JobRecord]) -> list[JobEvent]:
        db = self._conn()
        db.execute("BEGIN IMMEDIATE")
        try:
            events = [event for record in records for event in self._insert_row(db, record)]
            self._trim_events(db)
            db.execute("COMMIT")
        except BaseException:
            rollback(db)
            raise
        return events

    def _insert_row(self, db: sqlite3.Connection, record: JobRecord) -> list[JobEvent]:
        """One new job, as a batch adds several (new_rows.py); DuplicateJobError if its id is
        taken (its row is the first statement: nothing of it is left then)."""
        try:
            (events,) = insert_new_rows(db, [record])
        except sqlite3.IntegrityError:
            raise DuplicateJobError(record.submission_id) from None
        return events

    async def update(self, record: JobRecord, *, fence: Fence | None = None) -> JobRecord | None:
        """Store what the server learned of the run `record`; an event if its status changed.
        A terminal row never changes (the first terminal status wins, as in the KV). Returns
        the row as stored, None if the run is not in the archive (deleted, or another run).
        With a `fence`, only while its lease is still so held (else LeaseLostError)."""
        stored, events = await self._writes.write(lambda db: self._update(db, record, fence))
        self._notify(events)
        stored_record: JobRecord | None = stored
        return stored_record

    def _update(
        self, db: sqlite3.Connection, record: JobRecord, fence: Fence | None = None
    ) -> tuple[JobRecord | None, list[JobEvent]]:
        if fence is not None:  # one writer at a time: no takeover between this and the commit
            require_fence(
                db.execute(self.lease_statements.check_fence, fence.parameters()).fetchone(),
                fence,
            )
        row = db.execute(queries.RUN_STATE, (record.submission_id, record.run_id)).fetchone()
        if row is None:
            return None, []
        status, stored, tenant = row
        stored_status = JobStatus(status)
        if stored_status.is_terminal():
            return JobRecord.model_validate_json(stored), []
        changes = outbox_rows.events_of_change(stored_status, stored, record, self.parse_record)
        text = record.model_dump_json()
        db.execute(
            queries.UPDATE_RUN,
            (
                record.status.value,
                record.start_time,
                record.end_time,
                text,
                record.submission_id,
                record.run_id,
            ),
        )
        events = []
        # A retry (RUNNING still) is an event too: the stream shows it, its deliveries name it.
        # An end learnt late brings its start's deliveries (outbox_rows.events_of_change).
        for webhook_events in changes:
            event = self._event(db, JobEventType.STATUS, record, tenant, text)
            events.append(event)
            for webhook_event in webhook_events:
                self._add_deliveries(db, record, webhook_event, event, text)
        return record, events

    def _add_deliveries(
        self,
        db: sqlite3.Connection,
        record: JobRecord,
        event_type: WebhookEventType,
        event: JobEvent,
        text: str,
    ) -> None:
        """The deliveries of a change's webhook event, in its transaction (outbox.py)."""
        planned = self._plan_deliveries(record, event_type)
        if not planned:
            return
        disabled = {url for (url,) in db.execute(outbox_rows.DISABLED_URLS, (record.tenant,))}
        rows = outbox_rows.planned_rows(
            planned, record, event_type, event.id, event.time, text, disabled
        )
        if rows:
            db.executemany(outbox_rows.INSERT, rows)

    async def delete(self, submission_id: str, run_id: str | None = None) -> bool:
        """Forget a job (its run `run_id`, if given); whether there was one."""
        deleted, events = await self._writes.write(
            lambda db: self._delete(db, submission_id, run_id)
        )
        self._notify(events)
        return bool(deleted)

    def _delete(
        self, db: sqlite3.Connection, submission_id: str, run_id: str | None
    ) -> tuple[bool, list[JobEvent]]:
        row = db.execute(queries.JOB_RUN_AND_TENANT, (submission_id,)).fetchone()
        if row is None or (run_id is not None and row[0] != run_id):
            return False, []
        db.execute(queries.DELETE_JOB, (submission_id,))
        db.execute(
            "INSERT OR IGNORE INTO deleted_runs (submission_id, run_id) VALUES (?, ?)",
            (submission_id, row[0]),
        )
        db.execute(queries.TRIM_DELETED_RUNS, (MAX_DELETED_RUNS,))
        event = self._add_event(
            db, JobEventType.DELETED, submission_id, row[1], None, None, None, None
        )
        return True, [event]

    def _event(
        self,
        db: sqlite3.Connection,
        type_: JobEventType,
        record: JobRecord,
        tenant: str | None,
        text: str,
    ) -> JobEvent:
        """An event of `record`, whose JSON `text` the caller has made already."""
        return self._add_event(
            db, type_, record.submission_id, tenant, record.status, record.message, record, text
        )

    def _add_event(
        self,
        db: sqlite3.Connection,
        type_: JobEventType,
        submission_id: str,
        tenant: str | None,
        status: JobStatus | None,
        message: str | None,
        record: JobRecord | None,
        text: str | None,
    ) -> JobEvent:
        """Add an event; `text`: the JSON of `record` (None without one)."""
        time = now_ms()
        cursor = db.execute(
            f"INSERT INTO events ({queries.INSERT_EVENT_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?)",
            (
                type_.value,
                submission_id,
                tenant,
                None if status is None else status.value,
                message,
                time,
                text,
            ),
        )
        assert cursor.lastrowid is not None
        return JobEvent(
            id=cursor.lastrowid,
            type=type_,
            submission_id=submission_id,
            tenant=tenant,
            status=status,
            message=message,
            time=time,
            record=record,
        )

    def _trim_events(self, db: sqlite3.Connection) -> None:
        """The newest `max_events` events are kept, and the finished deliveries of those."""
        db.execute(queries.TRIM_EVENTS, (self._max_events,))
        db.execute(outbox_rows.TRIM_FINISHED, (self._max_events,))

    async def run_lease_statement(
        self, statement: str, parameters: Sequence[Any]
    ) -> list[tuple[Any, ...]]:
        """Run a statement of leases.py in a write transaction (through the group commit)."""
        rows, _ = await self._writes.write(
            lambda db: (db.execute(statement, parameters).fetchall(), [])
        )
        result: list[tuple[Any, ...]] = rows
        return result

    # -- Outbox (outbox.py) -----------------------------------------------------------------

    async def claim_due_deliveries(
        self, now_ms: int, limit: int, claim_ms: int, *, skip_tenants: Collection[str] = ()
    ) -> list[WebhookDelivery]:
        """Up to `limit` due PENDING deliveries, soonest due first, but `skip_tenants`' ones,
        each claimed until `now_ms + claim_ms` in the same transaction (the database's write
        lock: exclusive)."""
        skipped = json.dumps(sorted(skip_tenants))

        def claim(db: sqlite3.Connection) -> tuple[list[WebhookDelivery], list[JobEvent]]:
            rows = db.execute(outbox_rows.DUE, (now_ms, skipped, limit)).fetchall()
            until_ms = now_ms + claim_ms
            db.executemany(outbox_rows.CLAIM, [(until_ms, row[0]) for row in rows])
            claimed = [outbox_rows.delivery_of_row(row) for row in rows]
            return [
                delivery.model_copy(update={"next_attempt_ms": until_ms}) for delivery in claimed
            ], []

        claimed, _ = await self._writes.write(claim)
        result: list[WebhookDelivery] = claimed
        return result

    async def next_delivery_due_ms(self) -> int | None:
        """When the next PENDING delivery is due (None: none is pending)."""
        return await self._read(_next_delivery_due_ms)

    async def record_delivery_attempt(
        self,
        delivery_id: str,
        *,
        state: DeliveryState,
        at_ms: int,
        next_attempt_ms: int | None,
        status_code: int | None,
        error: str | None,
    ) -> bool:
        """Write one attempt's outcome; False if the delivery is no longer PENDING."""
        parameters = outbox_rows.attempt_parameters(
            delivery_id, state, at_ms, next_attempt_ms, status_code, error
        )
        changed, _ = await self._writes.write(
            lambda db: (db.execute(outbox_rows.RECORD_ATTEMPT, parameters).rowcount, [])
        )
        return bool(changed)

    async def disable_webhook_endpoint(self, tenant: str, url: str, at_ms: int) -> int:
        """No delivery is written for the endpoint again; its PENDING ones end DISABLED (how
        many did)."""

        def disable(db: sqlite3.Connection) -> tuple[int, list[JobEvent]]:
            db.execute(outbox_rows.DISABLE_ENDPOINT, (tenant, url, at_ms))
            return db.execute(outbox_rows.END_DISABLED, (tenant, url)).rowcount, []

        ended, _ = await self._writes.write(disable)
        return int(ended)

    async def disabled_webhook_endpoints(
        self, tenant: str | None = None
    ) -> list[DisabledWebhookEndpoint]:
        """The endpoints a 410 disabled, `tenant`'s only if given, by tenant then URL."""
        return await self._read(_disabled_webhook_endpoints, tenant)

    async def enable_webhook_endpoint(self, tenant: str, url: str) -> bool:
        """Deliveries are written for the endpoint again from the next event on; False if it
        was not disabled."""
        removed, _ = await self._writes.write(
            lambda db: (db.execute(outbox_rows.ENABLE_ENDPOINT, (tenant, url)).rowcount, [])
        )
        return bool(removed)

    async def deliveries_of(self, submission_id: str) -> list[WebhookDelivery]:
        """The job's deliveries, oldest first (one event's by URL)."""
        return await self._read(_deliveries_of, submission_id)

    async def count_deliveries(self) -> dict[DeliveryState, int]:
        """Deliveries kept, by state."""
        return await self._read(_count_deliveries)

    # -- reads (archive_queries.py) --------------------------------------------------------

    async def _read(self, read: Callable[..., _T], *args: Any) -> _T:
        """`read(connection, *args)` on the reads' thread and connection."""
        return await self._on_reader(lambda: read(self._read_conn(), *args))

    def _read_conn(self) -> sqlite3.Connection:
        if self._read_db is None:
            raise RuntimeError("the archive is not open")
        return self._read_db

    async def get(self, submission_id: str) -> JobRecord | None:
        return await self._read(queries.get_job, submission_id, self.parse_record)

    async def count_by_status(self) -> dict[JobStatus, int]:
        """How many jobs of each status (one scan of the status index, no record read)."""
        return await self._read(queries.count_by_status)

    async def count_by_tenant(self, tenant: str | None = None) -> dict[str, dict[JobStatus, int]]:
        """How many jobs of each status, by tenant (only `tenant`'s, if given): one scan of
        the tenant index, no record read."""
        return await self._read(queries.count_by_tenant, tenant)

    async def counts_and_unfinished_of(
        self, tenant: str | None, ids: frozenset[str]
    ) -> tuple[dict[str, dict[JobStatus, int]], list[JobRecord]]:
        """`count_by_tenant`, and the unfinished records of the jobs `ids` (of `tenant` only,
        if given), from one snapshot: only those records are read."""
        return await self._read(queries.counts_and_unfinished_of, tenant, ids, self.parse_record)

    async def was_deleted(self, submission_id: str, run_id: str) -> bool:
        """Whether the run was deleted here (or its submit withdrawn)."""
        return await self._read(_run_was_deleted, submission_id, run_id)

    async def unfinished(self) -> list[JobRecord]:
        """Every job not yet terminal, in submission order (what recovery reconciles)."""
        return await self._read(queries.unfinished_jobs)

    async def page(
        self, query: JobQuery, *, after: str | None = None, limit: int | None = None
    ) -> tuple[list[JobRecord], bool]:
        """Up to `limit` jobs matching `query` after the job `after` (UnknownCursorError if
        it is not here), and whether more follow."""
        return await self._read(queries.page_of_jobs, query, after, limit, self.parse_record)

    async def window(
        self, query: JobQuery, *, after_seq: int | None, limit: int
    ) -> tuple[list[JobRecord], bool, int | None]:
        """`page` from a position (`seq_of` one job, or the last seq of a window before):
        the jobs, whether more follow, and the last one's position."""
        return await self._read(queries.window_of_jobs, query, after_seq, limit, self.parse_record)

    async def seq_of(self, after: str, tenant: str | None) -> int:
        """The position of the job `after` (UnknownCursorError if it is not here)."""
        return await self._read(queries.seq_of, after, tenant)

    async def stream(
        self, query: JobQuery, *, after: str | None = None
    ) -> AsyncIterator[list[JobRecord]]:
        """Every job matching `query` (after the job `after`: UnknownCursorError, raised before
        any batch, if it is not here), in batches of STREAM_BATCH_ROWS (keyset pagination: each
        batch is one indexed read, and no batch holds the database)."""
        after_seq = None if after is None else await self._read(queries.seq_of, after, query.tenant)
        while True:
            rows = await self._read(queries.batch_of_jobs, query, after_seq)
            if not rows:
                return
            after_seq = rows[-1][0]
            yield [self.parse_record(row[1]) for row in rows]
            if len(rows) < STREAM_BATCH_ROWS:
                return

    async def expired_jobs(
        self,
        *,
        older_than_ms: int | None,
        keep_newest: int | None,
        limit: int,
        tenant: str | None = None,
    ) -> list[JobRecord]:
        """Finished jobs that retention may delete, oldest first, at most `limit`: those that
        ended before `older_than_ms`, and those beyond the newest `keep_newest` jobs (live
        ones count among the newest but are never returned); of `tenant` only, if given."""
        return await self._read(queries.expired_jobs, older_than_ms, keep_newest, limit, tenant)

    # -- EventLog ---------------------------------------------------------------------------

    async def events_after(self, after_id: int, limit: int) -> list[JobEvent]:
        return await self._read(queries.events_after, after_id, limit)

    async def event_id_range(self) -> tuple[int, int]:
        return await self._read(queries.event_id_range)


def _next_delivery_due_ms(db: sqlite3.Connection) -> int | None:
    (due,) = db.execute(outbox_rows.NEXT_DUE).fetchone()
    return None if due is None else int(due)


def _deliveries_of(db: sqlite3.Connection, submission_id: str) -> list[WebhookDelivery]:
    rows = db.execute(outbox_rows.DELIVERIES_OF, (submission_id,)).fetchall()
    return [outbox_rows.delivery_of_row(row) for row in rows]


def _disabled_webhook_endpoints(
    db: sqlite3.Connection, tenant: str | None
) -> list[DisabledWebhookEndpoint]:
    statement, parameters = outbox_rows.disabled_endpoints_query(tenant)
    rows = db.execute(statement, parameters).fetchall()
    return [outbox_rows.disabled_endpoint_of_row(row) for row in rows]


def _count_deliveries(db: sqlite3.Connection) -> dict[DeliveryState, int]:
    return outbox_rows.state_counts(db.execute(outbox_rows.COUNT_BY_STATE).fetchall())


def _run_was_deleted(db: sqlite3.Connection, submission_id: str, run_id: str) -> bool:
    return db.execute(queries.WAS_DELETED, (submission_id, run_id)).fetchone() is not None


def archive_path(state_dir: Path) -> Path:
    return state_dir / ARCHIVE_FILE_NAME
