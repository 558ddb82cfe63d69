"""The job history in PostgreSQL (`--database-url postgresql://...`): the same schema, queries
and semantics as the SQLite store (sqlite.py), for a history that outgrows one file and, later,
several servers sharing it.

The statements are those of queries.py and new_rows.py, with `%s` for `?` (`pyformat`); what
differs between the two databases is named here: identity columns for AUTOINCREMENT, `ON
CONFLICT DO NOTHING` for `INSERT OR IGNORE`, the schema version in a `schema_version` table for
`PRAGMA user_version`, the events' ids from their sequence, and the lock below.

Event ids in commit order. A sequence hands ids out when a row is inserted, not when its
transaction commits: two transactions that wrote events at once could commit out of id order,
and a reader that read "after id N" between the two commits (N the later transaction's id)
would never see the earlier one's smaller id. So every transaction that writes events holds a
transaction-level advisory lock (EVENTS_LOCK_KEY) from before its first id to its commit: ids
are taken one transaction after another, and a reader that sees id N sees every id below it.
(A rolled-back transaction leaves a gap in the ids, which the event feed reads as a skip.) Every
write transaction takes it first, so the jobs' `seq` (a list's cursor) follows commits too.

Writes are group-committed as on SQLite: the writes that arrive while a transaction commits
share the next one, each under its own savepoint when one of them fails, each caller answered
once its transaction is committed, the events published in call order. Reads take any
connection of the pool, so a slow list delays no write.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any, TypeVar

import psycopg
from psycopg import AsyncConnection
from psycopg.conninfo import conninfo_to_dict
from psycopg_pool import AsyncConnectionPool

from jobs_server.errors import DuplicateJobError
from jobs_server.manager.archive import outbox_rows, queries
from jobs_server.manager.archive.events import JobEvent, JobEventType
from jobs_server.manager.archive.group_commit import NewRow, answer_batch, new_rows_together
from jobs_server.manager.archive.leases import (
    LEASE_TTL_S,
    POSTGRES_NOW_MS,
    POSTGRES_STATEMENTS,
    Fence,
    require_fence,
)
from jobs_server.manager.archive.new_rows import (
    EVENT_COLUMNS,
    JOB_COLUMNS,
    METADATA_INSERT,
    ROWS_PER_STATEMENT,
    plan_new_rows,
    values_placeholders,
)
from jobs_server.manager.archive.outbox import (
    DeliveryPlanner,
    DeliveryState,
    DisabledWebhookEndpoint,
    WebhookDelivery,
    no_deliveries,
)
from jobs_server.manager.archive.pg_events import EventRelay, announce_events
from jobs_server.manager.archive.queries import STREAM_BATCH_ROWS, JobQuery
from jobs_server.manager.archive.schema_versions import (
    Migration,
    OlderServersRunningError,
    check_readable,
    min_reader_version,
)
from jobs_server.manager.archive.sqlite import DEFAULT_MAX_EVENTS, MAX_DELETED_RUNS
from jobs_server.manager.records import (
    JobRecord,
    JobStatus,
    RecordParser,
    now_ms,
    parse_record,
)
from jobs_server.manager.webhook_events import WebhookEventType

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
Connection = AsyncConnection[tuple[Any, ...]]
# A write: (its result, the events it recorded), run in the batch's transaction.
Write = Callable[[Connection], Awaitable[tuple[Any, list[JobEvent]]]]

# The advisory locks of this schema (any 64-bit keys no other user of the database takes):
# events are written under the first, one transaction at a time; migrations under the second,
# so servers that start together migrate once.
EVENTS_LOCK_KEY = 0x6A6F6273_6576656E  # "jobseven"
MIGRATIONS_LOCK_KEY = 0x6A6F6273_6D696772  # "jobsmigr"
LOCK = "SELECT pg_advisory_xact_lock(%s)"

# Connections kept open to the database: a batch of writes holds one, each read holds one.
POOL_MIN_CONNECTIONS = 1
POOL_MAX_CONNECTIONS = 8
CONNECT_TIMEOUT_S = 30.0
# While the database is away (outage.py): a request waits this long for a connection before it
# is answered 503, and a lost connection is retried (backoff from 1 s) this long before the pool
# gives that attempt up, so that the next request's attempt, not a backoff grown to minutes,
# finds the database back.
POOL_WAIT_S = 3.0
RECONNECT_GIVE_UP_S = 10.0
# A database that accepts connections and never answers (frozen, a lock held forever, a disk
# stall, a partition that drops packets) fails no call by itself: every call of the archive
# (its wait for a connection included) is answered within this bound, with DatabaseTimeoutError
# (an outage: 503 database_unavailable). Generous for a live database under load: its
# statements take milliseconds, a batch of 1,000 new jobs tens of them, the longest page of a
# list 100,000 jobs deep under 10 ms (benchmarks/results-history.md). The default of
# --database-timeout-s.
DATABASE_TIMEOUT_S = 5.0
# The database's own bounds, so that it gives up what its client gave up: a statement (each of
# a call's) as long as a call, and a transaction left open by a client that went away this many
# times as long (a batch runs its writes back to back: idle in one is a client that is gone).
IDLE_IN_TRANSACTION_TIMEOUTS = 4
# The connection's, so that a peer that vanished (a partition: no reset ever comes) is noticed
# by the kernel: a connection attempt's bound (libpq: whole seconds), TCP keepalives on an idle
# connection (probes after 10 s idle, every 3 s, 3 lost: gone), and unacknowledged data
# (tcp_user_timeout, ms). A frozen database's kernel still acknowledges: DATABASE_TIMEOUT_S.
CONNECTION_OPTIONS: dict[str, str] = {
    "connect_timeout": "5",
    "keepalives": "1",
    "keepalives_idle": "10",
    "keepalives_interval": "3",
    "keepalives_count": "3",
    "tcp_user_timeout": "15000",
}

# Each entry moves the schema one version up (the `schema_version` table); never edit a
# released one. Version 1 is the SQLite store's schema after its third migration. Whether the
# release before reads the schema after it: schema_versions.py.
_MIGRATIONS: tuple[Migration[tuple[str, ...]], ...] = (
    Migration(
        (
            """CREATE TABLE jobs (
            seq BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
            submission_id TEXT NOT NULL UNIQUE,
            run_id TEXT NOT NULL,
            tenant TEXT,
            status TEXT NOT NULL,
            start_time BIGINT,
            end_time BIGINT,
            record TEXT NOT NULL
        )""",
            "CREATE INDEX jobs_status_seq ON jobs (status, seq)",
            "CREATE INDEX jobs_start_time ON jobs (start_time)",
            "CREATE INDEX jobs_end_time ON jobs (end_time)",
            "CREATE INDEX jobs_tenant_seq ON jobs (tenant, seq)",
            "CREATE INDEX jobs_tenant_status ON jobs (tenant, status)",
            """CREATE TABLE job_metadata (
            seq BIGINT NOT NULL REFERENCES jobs (seq) ON DELETE CASCADE,
            key TEXT NOT NULL,
            value TEXT NOT NULL,
            PRIMARY KEY (seq, key)
        )""",
            "CREATE INDEX job_metadata_key_value ON job_metadata (key, value, seq)",
            # By default, not always: a batch of new jobs numbers its events from the sequence.
            """CREATE TABLE events (
            id BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,
            type TEXT NOT NULL,
            submission_id TEXT NOT NULL,
            tenant TEXT,
            status TEXT,
            message TEXT,
            time BIGINT NOT NULL,
            record TEXT
        )""",
            """CREATE TABLE deleted_runs (
            seq BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
            submission_id TEXT NOT NULL,
            run_id TEXT NOT NULL
        )""",
            "CREATE UNIQUE INDEX deleted_runs_run ON deleted_runs (submission_id, run_id)",
        ),
        readable_by_previous=False,  # the tables: nothing before reads them
    ),
    # Leases of replicas sharing the history (leases.py); times in unix ms by the database's.
    Migration(
        (
            """CREATE TABLE leases (
            name TEXT PRIMARY KEY,
            holder TEXT,
            epoch BIGINT NOT NULL,
            expires_at_ms BIGINT NOT NULL,
            previous_holder TEXT
        )""",
        ),
        # A server before it takes no `server` lease (sole_server.py): it would run beside one.
        readable_by_previous=False,
    ),
    # Where a lease's holder serves (leases.py `holder_url`): the leader's, for the others
    # (leadership.py). The release before takes the `server` lease as the sole server, never
    # as a leader beside followers: its rows just have none.
    Migration(
        ("ALTER TABLE leases ADD COLUMN holder_url TEXT",),
        readable_by_previous=True,
    ),
    # The webhooks' outbox (outbox.py): deliveries, and the endpoints that answered 410. New
    # tables: the release before writes changes without their deliveries, no more.
    Migration(outbox_rows.TABLES, readable_by_previous=True),
)

# The first of `%s` ids in a row: the sequence moved past them at once (its own statement
# first: nextval must run before setval reads the new value).
_RESERVE_EVENT_IDS = (
    "WITH reserved AS (SELECT nextval(pg_get_serial_sequence('events', 'id')) AS id)"
    " SELECT id, setval(pg_get_serial_sequence('events', 'id'), id + %s - 1) FROM reserved"
)
_REMEMBER_DELETED_RUN = (
    "INSERT INTO deleted_runs (submission_id, run_id) VALUES (%s, %s) ON CONFLICT DO NOTHING"
)
# queries.TRIM_EVENTS in two statements: its bound, a subquery's, is unknown when PostgreSQL
# plans the DELETE, which it then plans for a third of the table: a scan of every event (84 ms
# of each write with 100,000 events). A bound given as a value plans the index range.
_NEWEST_EVENT_ID = "SELECT MAX(id) FROM events"
_TRIM_EVENTS_UP_TO = "DELETE FROM events WHERE id <= %s"


class DatabaseTimeoutError(psycopg.OperationalError):
    """The database did not answer a call of the archive within its timeout: an outage
    as a refused connection is (outage.py), answered 503 database_unavailable."""


def connection_options(url: str, timeout_s: float = DATABASE_TIMEOUT_S) -> dict[str, Any]:
    """The pool's connection options: autocommit, CONNECTION_OPTIONS the URL does not set,
    and the database's bounds as startup options (no round trip), before the URL's own
    `options`, which win."""
    given = conninfo_to_dict(url)
    statement_timeout_ms = max(1, round(timeout_s * 1000))
    bounds = (
        f"-c statement_timeout={statement_timeout_ms}"
        " -c idle_in_transaction_session_timeout="
        f"{IDLE_IN_TRANSACTION_TIMEOUTS * statement_timeout_ms}"
    )
    own_options = given.get("options")
    return {
        "autocommit": True,
        **{key: value for key, value in CONNECTION_OPTIONS.items() if key not in given},
        "options": bounds if not own_options else f"{bounds} {own_options}",
    }


def pyformat(sql: str) -> str:
    """A statement of queries.py (`?` parameters) as psycopg takes it (`%s`)."""
    return sql.replace("?", "%s")


@dataclass
class _Pending:
    write: Write | NewRow
    answer: asyncio.Future[tuple[Any, list[JobEvent]]]


class _WriteFailed(Exception):
    """A write of a batch run without savepoints failed: the batch runs again with them."""


class PostgresArchive:
    """The jobs table and its events in PostgreSQL. Open with `open()`, close with `close()`."""

    lease_statements = POSTGRES_STATEMENTS

    def __init__(
        self,
        url: str,
        *,
        on_events: Callable[[list[JobEvent]], None] | None = None,
        max_events: int = DEFAULT_MAX_EVENTS,
        parse: RecordParser = parse_record,
        timeout_s: float = DATABASE_TIMEOUT_S,
        plan_deliveries: DeliveryPlanner = no_deliveries,
    ) -> None:
        self.parse_record = parse
        # Called in the transaction of each change that is a webhook event (outbox.py).
        self._plan_deliveries = plan_deliveries
        self._url = url
        self._timeout_s = timeout_s
        self._on_events = on_events
        self._max_events = max_events
        self._pool: AsyncConnectionPool[Connection] | None = None
        self._pending: list[_Pending] = []
        self._committing: asyncio.Task[None] | None = None
        # Calls whose caller was answered without them (their timeout): cancelled, they
        # end when psycopg gives their connection up (it asks the server to cancel, then
        # closes it: a connection left mid-transaction never goes back to the pool).
        self._abandoned: set[asyncio.Task[Any]] = set()
        # Other replicas' events, and this one's, to `on_events` in id order (pg_events.py).
        self._relay: EventRelay | None = None

    # -- lifecycle --------------------------------------------------------------------------

    async def open(self) -> None:
        pool: AsyncConnectionPool[Connection] = AsyncConnectionPool(
            self._url,
            min_size=POOL_MIN_CONNECTIONS,
            max_size=POOL_MAX_CONNECTIONS,
            kwargs=connection_options(self._url, self._timeout_s),
            open=False,
            name="archive",
            timeout=POOL_WAIT_S,
            reconnect_timeout=RECONNECT_GIVE_UP_S,
        )
        try:
            await pool.open(wait=True, timeout=CONNECT_TIMEOUT_S)
            async with pool.connection() as db:
                await _migrate(db)
        except BaseException:
            await pool.close()
            raise
        self._pool = pool
        if self._on_events is not None:
            relay = EventRelay(self._url, self, self._on_events)
            try:
                await relay.start()
            except BaseException:
                await self.close()
                raise
            self._relay = relay

    async def close(self) -> None:
        while self._committing is not None:
            await asyncio.shield(self._committing)
        if self._relay is not None:
            await self._relay.stop()
            self._relay = None
        if self._abandoned:
            await asyncio.gather(*self._abandoned, return_exceptions=True)
        if self._pool is not None:
            await self._pool.close()
            self._pool = None

    async def _bounded(self, call: Awaitable[_T]) -> _T:
        """The outcome of `call` (a call of the archive: its wait for a connection, its
        statements), or DatabaseTimeoutError once it has taken the archive's timeout. Its caller is
        answered at once then, or when cancelled: the call, cancelled, is left to end on its own
        (a cancelled psycopg query waits for the server's answer to the cancel request)."""
        task = asyncio.ensure_future(call)
        try:
            done, _ = await asyncio.wait({task}, timeout=self._timeout_s)
        except asyncio.CancelledError:
            self._abandon(task)
            raise
        if not done:
            self._abandon(task)
            logger.warning("the database did not answer within %g s", self._timeout_s)
            raise DatabaseTimeoutError(f"the database did not answer within {self._timeout_s:g} s")
        return task.result()

    def _abandon(self, task: asyncio.Task[Any]) -> None:
        if task.done():
            if not task.cancelled():
                task.exception()  # retrieved: its caller went away
            return
        task.cancel()
        self._abandoned.add(task)
        task.add_done_callback(self._abandoned_ended)

    async def abandoned_calls_ended(self) -> None:
        """Return once every call abandoned so far (answered at its timeout) has ended:
        committed, rolled back, or its connection closed. Bounded by psycopg: it waits 5 s
        for the server's answer to its cancel request, then closes the connection."""
        if self._abandoned:
            await asyncio.wait(set(self._abandoned))

    def _abandoned_ended(self, task: asyncio.Task[Any]) -> None:
        self._abandoned.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.debug("an abandoned call of the archive ended: %r", task.exception())

    def _connection(self) -> AbstractAsyncContextManager[Connection]:
        """A connection of the pool, for an `async with`."""
        if self._pool is None:
            raise RuntimeError("the archive is not open")
        return self._pool.connection()

    def _notify(self, events: list[JobEvent]) -> None:
        if events and self._relay is not None:
            self._relay.committed(events)
        elif events and self._on_events is not None:
            try:
                self._on_events(events)
            except Exception:
                logger.exception("an events subscriber failed")

    # -- group commit -----------------------------------------------------------------------

    async def _write(self, write: Write | NewRow) -> tuple[Any, list[JobEvent]]:
        """Run `write` in the next transaction; its result and events once it is committed."""
        answer: asyncio.Future[tuple[Any, list[JobEvent]]] = (
            asyncio.get_running_loop().create_future()
        )
        # Queued at once, in call order: the order of the rows is the order of the calls.
        self._pending.append(_Pending(write, answer))
        if self._committing is None:
            self._committing = asyncio.create_task(self._commit_pending(), name="archive-writes")
        return await answer

    async def _commit_pending(self) -> None:
        """Commit what is queued, batch after batch, until nothing is (the archive's task:
        `close` waits for it)."""
        try:
            while self._pending:
                batch, self._pending = self._pending, []
                try:
                    # Bounded: a batch that timed out answers each of its callers (503); its
                    # transaction, abandoned, is rolled back unless its COMMIT had reached the
                    # database (a retried submit then meets its own job).
                    outcomes: list[tuple[bool, Any]] | BaseException = await self._bounded(
                        self._commit([item.write for item in batch])
                    )
                except asyncio.CancelledError:
                    # The loop is going away: no caller waits for an answer that cannot come.
                    for item in [*batch, *self._pending]:
                        item.answer.cancel()
                    self._pending = []
                    raise
                except Exception as error:  # the whole transaction failed: each caller's
                    outcomes = error
                if isinstance(outcomes, DatabaseTimeoutError):
                    # The writes queued behind it would wait as long again for a connection
                    # to a database that does not answer: answered now (none of them ran).
                    batch, self._pending = [*batch, *self._pending], []
                answer_batch([item.answer for item in batch], outcomes)
        finally:
            self._committing = None

    async def _commit(self, writes: list[Write | NewRow]) -> list[tuple[bool, Any]]:
        """One transaction; if a write fails (a duplicate id: rare), the batch runs again with
        each write under a savepoint, so that the failing one is rolled back alone."""
        try:
            return await self._transaction(writes, savepoints=False)
        except _WriteFailed:
            return await self._transaction(writes, savepoints=True)

    async def _transaction(
        self, writes: list[Write | NewRow], *, savepoints: bool
    ) -> list[tuple[bool, Any]]:
        outcomes: list[tuple[bool, Any]] = []
        async with self._connection() as db, db.transaction():
            await db.execute(LOCK, (EVENTS_LOCK_KEY,))
            for write in new_rows_together(writes):
                if isinstance(write, list):  # new rows: each answered on its own
                    outcomes += await self._add_new_rows(db, [new.row for new in write])
                elif savepoints:
                    try:
                        async with db.transaction():
                            outcomes.append((True, await write(db)))
                    except Exception as error:
                        outcomes.append((False, error))
                else:
                    try:
                        outcomes.append((True, await write(db)))
                    except Exception as error:
                        raise _WriteFailed from error
            await self._trim_events(db)
            await announce_events(db, [e for ok, value in outcomes if ok for e in value[1]])
        return outcomes

    # -- writes -----------------------------------------------------------------------------

    async def insert(self, record: JobRecord) -> None:
        """Record a new job; DuplicateJobError if its submission_id is in the archive."""
        _, events = await self._write(NewRow(record))
        self._notify(events)

    async def insert_many(self, records: list[JobRecord]) -> None:
        """Record many new jobs in one transaction; all or none (DuplicateJobError)."""

        async def insert_many() -> list[JobEvent]:
            async with self._connection() as db, db.transaction():
                await db.execute(LOCK, (EVENTS_LOCK_KEY,))
                events = [e for own in await _insert_all_or_none(db, records) for e in own]
                await self._trim_events(db)
                await announce_events(db, events)
            return events

        self._notify(await self._bounded(insert_many()))

    async def _add_new_rows(
        self, db: Connection, records: list[JobRecord]
    ) -> list[tuple[bool, Any]]:
        """The new jobs of a batch together; if an id is taken, each on its own, so that only
        that one fails (with DuplicateJobError)."""
        try:
            async with db.transaction():
                events = await _insert_new_rows(db, records)
        except psycopg.errors.UniqueViolation:
            return [await self._add_new_row(db, record) for record in records]
        return [(True, (None, own)) for own in events]

    async def _add_new_row(self, db: Connection, record: JobRecord) -> tuple[bool, Any]:
        try:
            async with db.transaction():
                events = await self._insert_row(db, record)
        except DuplicateJobError as error:
            return False, error
        return True, (None, events)

    async def _insert_row(self, db: Connection, record: JobRecord) -> list[JobEvent]:
        try:
            (events,) = await _insert_new_rows(db, [record])
        except psycopg.errors.UniqueViolation:
            raise DuplicateJobError(record.submission_id) from None
        return events

    async def update(self, record: JobRecord, *, fence: Fence | None = None) -> JobRecord | None:
        """Store what the server learned of the run `record`; an event if its status changed.
        A terminal row never changes. The row as stored, None if the run is not here. With a
        `fence`, only while its lease is still so held (else LeaseLostError)."""

        async def update(db: Connection) -> tuple[JobRecord | None, list[JobEvent]]:
            if fence is not None:  # its row held FOR SHARE: no takeover before the commit
                cursor = await db.execute(
                    pyformat(self.lease_statements.check_fence), fence.parameters()
                )
                require_fence(await cursor.fetchone(), fence)
            return await self._update(db, record)

        stored, events = await self._write(update)
        self._notify(events)
        stored_record: JobRecord | None = stored
        return stored_record

    async def _update(
        self, db: Connection, record: JobRecord
    ) -> tuple[JobRecord | None, list[JobEvent]]:
        cursor = await db.execute(
            pyformat(queries.RUN_STATE + " FOR UPDATE"), (record.submission_id, record.run_id)
        )
        row = await cursor.fetchone()
        if row is None:
            return None, []
        status, stored, tenant = row
        stored_status = JobStatus(status)
        if stored_status.is_terminal():
            return JobRecord.model_validate_json(stored), []
        changes = outbox_rows.events_of_change(stored_status, stored, record, self.parse_record)
        text = record.model_dump_json()
        await db.execute(
            pyformat(queries.UPDATE_RUN),
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
            event = await _add_event(
                db,
                JobEventType.STATUS,
                record.submission_id,
                tenant,
                record.status,
                record.message,
                record,
                text,
            )
            events.append(event)
            for webhook_event in webhook_events:
                await self._add_deliveries(db, record, webhook_event, event, text)
        return record, events

    async def _add_deliveries(
        self,
        db: Connection,
        record: JobRecord,
        event_type: WebhookEventType,
        event: JobEvent,
        text: str,
    ) -> None:
        """The deliveries of a change's webhook event, in its transaction (outbox.py)."""
        planned = self._plan_deliveries(record, event_type)
        if not planned:
            return
        cursor = await db.execute(pyformat(outbox_rows.DISABLED_URLS), (record.tenant,))
        disabled = {url for (url,) in await cursor.fetchall()}
        rows = outbox_rows.planned_rows(
            planned, record, event_type, event.id, event.time, text, disabled
        )
        if rows:
            async with db.cursor() as deliveries:
                await deliveries.executemany(pyformat(outbox_rows.INSERT), rows)

    async def delete(self, submission_id: str, run_id: str | None = None) -> bool:
        """Forget a job (its run `run_id`, if given); whether there was one."""

        async def delete(db: Connection) -> tuple[bool, list[JobEvent]]:
            return await _delete(db, submission_id, run_id)

        deleted, events = await self._write(delete)
        self._notify(events)
        return bool(deleted)

    async def _trim_events(self, db: Connection) -> None:
        """The newest `max_events` events are kept, and the finished deliveries of those."""
        cursor = await db.execute(_NEWEST_EVENT_ID)
        row = await cursor.fetchone()
        if row is not None and row[0] is not None:
            oldest_gone = int(row[0]) - self._max_events
            await db.execute(_TRIM_EVENTS_UP_TO, (oldest_gone,))
            await db.execute(pyformat(outbox_rows.TRIM_FINISHED_UP_TO), (oldest_gone,))

    async def run_lease_statement(
        self, statement: str, parameters: Sequence[Any]
    ) -> list[tuple[Any, ...]]:
        """Run a statement of leases.py as a transaction of its own (autocommit: no events
        lock, no wait behind a batch of writes)."""
        return await self._rows(statement, parameters)

    # -- Outbox (outbox.py): transactions of their own, no events lock ----------------------

    async def claim_due_deliveries(
        self, now_ms: int, limit: int, claim_ms: int, *, skip_tenants: Collection[str] = ()
    ) -> list[WebhookDelivery]:
        """Up to `limit` due PENDING deliveries, soonest due first, but `skip_tenants`' ones,
        each claimed until `now_ms + claim_ms` in one statement (rows another claimer holds
        are skipped)."""
        rows = await self._rows(
            outbox_rows.CLAIM_DUE_SKIP_LOCKED,
            (now_ms + claim_ms, now_ms, sorted(skip_tenants), limit),
        )
        # RETURNING has no order: the claim's (their due times, now all the same, were).
        claimed = [outbox_rows.delivery_of_row(row) for row in rows]
        return sorted(claimed, key=lambda delivery: (delivery.created_ms, delivery.event_id))

    async def next_delivery_due_ms(self) -> int | None:
        """When the next PENDING delivery is due (None: none is pending)."""
        row = await self._row(outbox_rows.NEXT_DUE)
        return None if row is None or row[0] is None else int(row[0])

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

        async def record() -> int:
            async with self._connection() as db:
                cursor = await db.execute(pyformat(outbox_rows.RECORD_ATTEMPT), parameters)
                return cursor.rowcount

        return await self._bounded(record()) > 0

    async def disable_webhook_endpoint(self, tenant: str, url: str, at_ms: int) -> int:
        """No delivery is written for the endpoint again; its PENDING ones end DISABLED (how
        many did). A change committing meanwhile may still write one delivery to it, which
        its 410 ends again."""

        async def disable() -> int:
            async with self._connection() as db, db.transaction():
                await db.execute(pyformat(outbox_rows.DISABLE_ENDPOINT), (tenant, url, at_ms))
                cursor = await db.execute(pyformat(outbox_rows.END_DISABLED), (tenant, url))
                return cursor.rowcount

        return await self._bounded(disable())

    async def disabled_webhook_endpoints(
        self, tenant: str | None = None
    ) -> list[DisabledWebhookEndpoint]:
        """The endpoints a 410 disabled, `tenant`'s only if given, by tenant then URL."""
        rows = await self._rows(*outbox_rows.disabled_endpoints_query(tenant))
        return [outbox_rows.disabled_endpoint_of_row(row) for row in rows]

    async def enable_webhook_endpoint(self, tenant: str, url: str) -> bool:
        """Deliveries are written for the endpoint again from the next event on (a change
        committing meanwhile may still skip it); False if it was not disabled."""

        async def enable() -> int:
            async with self._connection() as db:
                cursor = await db.execute(pyformat(outbox_rows.ENABLE_ENDPOINT), (tenant, url))
                return cursor.rowcount

        return await self._bounded(enable()) > 0

    async def deliveries_of(self, submission_id: str) -> list[WebhookDelivery]:
        """The job's deliveries, oldest first (one event's by URL)."""
        rows = await self._rows(outbox_rows.DELIVERIES_OF, (submission_id,))
        return [outbox_rows.delivery_of_row(row) for row in rows]

    async def count_deliveries(self) -> dict[DeliveryState, int]:
        """Deliveries kept, by state."""
        return outbox_rows.state_counts(await self._rows(outbox_rows.COUNT_BY_STATE))

    # -- reads ------------------------------------------------------------------------------

    async def _rows(self, sql: str, parameters: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        return await self._bounded(self._read(pyformat(sql), parameters))

    async def _read(self, sql: str, parameters: Sequence[Any]) -> list[tuple[Any, ...]]:
        async with self._connection() as db:
            cursor = await db.execute(sql, parameters)
            return await cursor.fetchall()

    async def _row(self, sql: str, parameters: Sequence[Any] = ()) -> tuple[Any, ...] | None:
        rows = await self._rows(sql, parameters)
        return rows[0] if rows else None

    async def get(self, submission_id: str) -> JobRecord | None:
        row = await self._row(queries.GET_JOB, (submission_id,))
        return None if row is None else self.parse_record(row[0])

    async def count_by_status(self) -> dict[JobStatus, int]:
        """How many jobs of each status (no record read)."""
        return queries.status_counts(await self._rows(queries.COUNT_BY_STATUS))

    async def count_by_tenant(self, tenant: str | None = None) -> dict[str, dict[JobStatus, int]]:
        """How many jobs of each status, by tenant (only `tenant`'s, if given)."""
        rows = await self._rows(*queries.count_by_tenant_select(tenant))
        return queries.tenant_counts(rows)

    async def counts_and_unfinished_of(
        self, tenant: str | None, ids: frozenset[str]
    ) -> tuple[dict[str, dict[JobStatus, int]], list[JobRecord]]:
        """`count_by_tenant`, and the unfinished records of the jobs `ids` (of `tenant` only,
        if given), from one snapshot."""

        async def read() -> tuple[dict[str, dict[JobStatus, int]], list[JobRecord]]:
            async with self._connection() as db, db.transaction():
                await db.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
                cursor = await db.execute(*_pg(queries.count_by_tenant_select(tenant)))
                counts = queries.tenant_counts(await cursor.fetchall())
                records = []
                for select in queries.unfinished_of_selects(tenant, ids):
                    cursor = await db.execute(*_pg(select))
                    records += [self.parse_record(text) for (text,) in await cursor.fetchall()]
            return counts, records

        return await self._bounded(read())

    async def was_deleted(self, submission_id: str, run_id: str) -> bool:
        """Whether the run was deleted here (or its submit withdrawn)."""
        return await self._row(queries.WAS_DELETED, (submission_id, run_id)) is not None

    async def unfinished(self) -> list[JobRecord]:
        """Every job not yet terminal, in submission order (what recovery reconciles)."""
        rows = await self._rows(queries.UNFINISHED_JOBS, queries.UNFINISHED_JOBS_PARAMETERS)
        return [JobRecord.model_validate_json(text) for (text,) in rows]

    async def page(
        self, query: JobQuery, *, after: str | None = None, limit: int | None = None
    ) -> tuple[list[JobRecord], bool]:
        """Up to `limit` jobs matching `query` after the job `after` (UnknownCursorError if
        it is not here), and whether more follow."""
        read_limit = None if limit is None else limit + 1

        async def read() -> list[tuple[int, str]]:
            if after is None:
                async with self._connection() as db:
                    return await _job_rows(db, query, None, read_limit)
            async with self._connection() as db, db.transaction():
                # One snapshot for the cursor and the page, as SQLite's reader has.
                await db.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
                after_seq = await _seq_of(db, after, query.tenant)
                return await _job_rows(db, query, after_seq, read_limit)

        rows = await self._bounded(read())
        records, more, _ = queries.window_of_rows(rows, limit, self.parse_record)
        return records, more

    async def window(
        self, query: JobQuery, *, after_seq: int | None, limit: int
    ) -> tuple[list[JobRecord], bool, int | None]:
        """`page` from a position: the jobs, whether more follow, the last one's position."""
        rows = await self._bounded(self._job_rows(query, after_seq, limit + 1))
        return queries.window_of_rows(rows, limit, self.parse_record)

    async def _job_rows(
        self, query: JobQuery, after_seq: int | None, limit: int | None
    ) -> list[tuple[int, str]]:
        async with self._connection() as db:
            return await _job_rows(db, query, after_seq, limit)

    async def seq_of(self, after: str, tenant: str | None) -> int:
        """The position of the job `after` (UnknownCursorError if it is not here)."""

        async def read() -> int:
            async with self._connection() as db:
                return await _seq_of(db, after, tenant)

        return await self._bounded(read())

    async def stream(
        self, query: JobQuery, *, after: str | None = None
    ) -> AsyncIterator[list[JobRecord]]:
        """Every job matching `query` (after the job `after`), in batches of STREAM_BATCH_ROWS
        (keyset pagination: no connection is held between batches)."""
        after_seq = None if after is None else await self.seq_of(after, query.tenant)
        while True:
            rows = await self._bounded(self._job_rows(query, after_seq, STREAM_BATCH_ROWS))
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
        """Finished jobs that retention may delete, oldest first, at most `limit` (see the
        SQLite store's)."""
        newest_kept = None
        if keep_newest is not None:
            row = await self._row(*queries.newest_kept_select(keep_newest, tenant))
            newest_kept = None if row is None else int(row[0])
        select = queries.expired_select(older_than_ms, newest_kept, limit, tenant)
        if select is None:
            return []
        return [JobRecord.model_validate_json(text) for (text,) in await self._rows(*select)]

    # -- EventLog ---------------------------------------------------------------------------

    async def events_after(self, after_id: int, limit: int) -> list[JobEvent]:
        return queries.events_of_rows(await self._rows(queries.EVENTS_AFTER, (after_id, limit)))

    async def event_id_range(self) -> tuple[int, int]:
        row = await self._row(queries.EVENT_ID_RANGE)
        assert row is not None  # an aggregate has a row
        return queries.id_range((row[0], row[1]))


def _pg(select: tuple[str, list[Any]]) -> tuple[str, list[Any]]:
    return pyformat(select[0]), select[1]


async def _migrate(db: Connection) -> None:
    """Move the schema up to this server's version, with the lowest version a server must know
    to use it, in one transaction; a newer schema is used as it is if this server can read it,
    else refused (SchemaTooNewError) and the transaction rolled back. A migration the release
    before cannot read is refused (OlderServersRunningError) while a server holds a lease."""
    known = len(_MIGRATIONS)
    async with db.transaction():
        # Unbounded (not a call of a serving server): a migration may rebuild an index.
        await db.execute("SET LOCAL statement_timeout = 0")
        await db.execute(LOCK, (MIGRATIONS_LOCK_KEY,))
        # Both no-ops on a database that has them (a release before the column lacks it).
        await db.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
        await db.execute(
            "ALTER TABLE schema_version ADD COLUMN IF NOT EXISTS min_reader_version INTEGER"
        )
        cursor = await db.execute("SELECT version, min_reader_version FROM schema_version")
        row = await cursor.fetchone()
        if row is None:
            await db.execute("INSERT INTO schema_version (version) VALUES (0)")
        version, recorded = (0, None) if row is None else (int(row[0]), row[1])
        check_readable("the database", version, recorded, known)
        needed = min_reader_version(_MIGRATIONS, known)
        if version > known or (version == known and recorded == needed):
            return  # nothing to write: a newer schema stays as its release left it
        if needed > version:  # a migration to run that the release before cannot read
            holders = await _live_lease_holders(db)
            if holders:
                raise OlderServersRunningError(
                    f"the database has schema version {version}, which this server would"
                    f" migrate to {known}, and servers that know versions below {needed} cannot"
                    f" use that; servers still run on it ({', '.join(holders)}): stop them, then"
                    " start this server (a server killed without stopping holds its lease for"
                    f" {LEASE_TTL_S:g} s more)"
                )
        for migration in _MIGRATIONS[version:]:
            for statement in migration.change:
                await db.execute(statement)
        await db.execute(
            "UPDATE schema_version SET version = %s, min_reader_version = %s", (known, needed)
        )
        if version < known:
            logger.info(
                "archive database migrated from schema version %d to %d (servers that know"
                " versions below %d can no longer use it)",
                version,
                known,
                needed,
            )


async def _live_lease_holders(db: Connection) -> list[str]:
    """The servers that hold a lease on the database now, by its clock (none before the leases
    table: its releases took none)."""
    cursor = await db.execute("SELECT to_regclass('leases') IS NOT NULL")
    row = await cursor.fetchone()
    if row is None or not row[0]:
        return []
    cursor = await db.execute(
        "SELECT DISTINCT holder FROM leases"
        f" WHERE holder IS NOT NULL AND expires_at_ms > {POSTGRES_NOW_MS} ORDER BY holder"
    )
    return [str(holder) for (holder,) in await cursor.fetchall()]


async def _insert_all_or_none(db: Connection, records: Sequence[JobRecord]) -> list[list[JobEvent]]:
    """The new rows in a few multi-row statements (a few round trips, whatever their number:
    the whole call stays within the archive's timeout); if an id is taken, again one by one to
    name it: DuplicateJobError, and the caller's transaction writes nothing."""
    try:
        async with db.transaction():
            return await _insert_new_rows(db, records)
    except psycopg.errors.UniqueViolation:
        pass
    for record in records:
        try:
            async with db.transaction():
                await _insert_new_rows(db, [record])
        except psycopg.errors.UniqueViolation:
            raise DuplicateJobError(record.submission_id) from None
    raise AssertionError("a taken submission_id that no single insert takes")


async def _insert_new_rows(db: Connection, records: Sequence[JobRecord]) -> list[list[JobEvent]]:
    """new_rows.insert_new_rows for PostgreSQL: the same rows; the events' ids reserved from
    their sequence after the jobs' rows went in (a taken submission_id costs no number), one
    run of them (no other transaction takes ids meanwhile: EVENTS_LOCK_KEY)."""
    rows = plan_new_rows(records)
    await _insert_many_rows(db, "jobs", JOB_COLUMNS, rows.jobs)
    if rows.metadata:
        async with db.cursor() as metadata:
            await metadata.executemany(pyformat(METADATA_INSERT), rows.metadata)
    cursor = await db.execute(_RESERVE_EVENT_IDS, (rows.event_count,))
    reserved = await cursor.fetchone()
    assert reserved is not None
    event_rows, events = rows.numbered_events(int(reserved[0]))
    await _insert_many_rows(db, "events", EVENT_COLUMNS, event_rows)
    return events


async def _insert_many_rows(
    db: Connection, table: str, columns: str, rows: Sequence[tuple[Any, ...]]
) -> None:
    for start in range(0, len(rows), ROWS_PER_STATEMENT):
        chunk = rows[start : start + ROWS_PER_STATEMENT]
        placeholders = pyformat(values_placeholders(len(chunk), len(chunk[0])))
        await db.execute(
            f"INSERT INTO {table} ({columns}) VALUES {placeholders}",
            [value for row in chunk for value in row],
        )


async def _delete(
    db: Connection, submission_id: str, run_id: str | None
) -> tuple[bool, list[JobEvent]]:
    cursor = await db.execute(
        pyformat(queries.JOB_RUN_AND_TENANT + " FOR UPDATE"), (submission_id,)
    )
    row = await cursor.fetchone()
    if row is None or (run_id is not None and row[0] != run_id):
        return False, []
    await db.execute(pyformat(queries.DELETE_JOB), (submission_id,))
    await db.execute(_REMEMBER_DELETED_RUN, (submission_id, row[0]))
    await db.execute(pyformat(queries.TRIM_DELETED_RUNS), (MAX_DELETED_RUNS,))
    event = await _add_event(
        db, JobEventType.DELETED, submission_id, row[1], None, None, None, None
    )
    return True, [event]


async def _add_event(
    db: Connection,
    type_: JobEventType,
    submission_id: str,
    tenant: str | None,
    status: JobStatus | None,
    message: str | None,
    record: JobRecord | None,
    text: str | None,
) -> JobEvent:
    """Add an event (under EVENTS_LOCK_KEY); `text`: the JSON of `record` (None without one)."""
    time = now_ms()
    cursor = await db.execute(
        f"INSERT INTO events ({queries.INSERT_EVENT_COLUMNS})"
        " VALUES (%s, %s, %s, %s, %s, %s, %s) RETURNING id",
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
    row = await cursor.fetchone()
    assert row is not None
    return JobEvent(
        id=row[0],
        type=type_,
        submission_id=submission_id,
        tenant=tenant,
        status=status,
        message=message,
        time=time,
        record=record,
    )


async def _seq_of(db: Connection, after: str, tenant: str | None) -> int:
    cursor = await db.execute(*_pg(queries.seq_of_select(after, tenant)))
    return queries.seq_of_row(await cursor.fetchone(), after)


async def _job_rows(
    db: Connection, query: JobQuery, after_seq: int | None, limit: int | None
) -> list[tuple[int, str]]:
    """queries._rows for PostgreSQL: the (seq, record) rows of `query` after `after_seq`."""
    query = queries.bounded_live_ids(query)
    cursor = await db.execute(*_pg(queries.select_jobs(query, after_seq, limit)))
    rows: list[tuple[int, str]] = await cursor.fetchall()
    if query.statuses is None or not query.live_ids:
        return rows
    cursor = await db.execute(
        *_pg(queries.select_jobs(query, after_seq, limit, ids=query.live_ids))
    )
    live: list[tuple[int, str]] = await cursor.fetchall()
    return queries.merge_rows(query, rows, live, limit)
