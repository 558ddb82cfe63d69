"""Leases and fencing in the archive: who owns a piece of work when several replicas (server
processes) share one history (issue 34, item 3). The `server` lease decides which replica leads
(leadership.py); the names below for finer grains are what the leases offer beyond it.

A lease is a row `(name, holder, epoch, expires_at_ms)` of the `leases` table. A replica takes
a lease that is free (never taken, or released) or expired, and the epoch goes up by one each
time it changes hands; only its holder, with its epoch, renews it (further from now) or
releases it. Expiry only lets another replica take the lease: until one does, the holder still
holds it and renews it with the same epoch (nobody can have written under a newer one).

Fencing. A write made on behalf of a lease carries a `Fence` (the lease's name, holder and
epoch); the store checks in the write's own transaction that the lease still has that holder
and epoch (on PostgreSQL holding the row `FOR SHARE` to the commit, so a takeover waits for the
write, and the write never commits after one), and refuses it with LeaseLostError otherwise. So
a replica that was paused (SIGSTOP, a long GC, a lost network) and lost its lease meanwhile can
change nothing once it wakes up, whatever its own view of time.

Time is the database's. Every expiry is computed and compared in SQL with the database's clock
(`now()` on PostgreSQL), never a replica's process clock, so replicas on machines whose clocks
disagree agree on who holds what. On SQLite the database's clock is the clock of the process
that opened the file (SQLite reads the system clock): there is one server per file
(state_dir.py's lock), so that is the only clock there is.

The grain. The leases are named, and the names are the later wiring's choice; what this module
offers for it: each replica registers under a lease of its own (`replica:<id>`, `register`),
and the work it owns is a set named by that lease (the jobs it watches), not a lease per job. A
replica renews one row every few seconds however many jobs it watches, and when it dies its
whole set changes hands in one acquire (of its `replica:` lease) instead of one per job; a
fenced write checks the one row its job's owner names. Work that needs one owner for a whole
namespace (handing over the queue, so that caps and tenants' turns stay exact) takes one lease
for it (e.g. `dispatch:<namespace>`).
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

logger = logging.getLogger(__name__)

# A lease not renewed for this long may be taken by another replica; its holder renews it
# every LEASE_RENEW_INTERVAL_S (a few renewals may fail before it is lost). A replica that dies
# has its work taken over when its lease expires, LEASE_TTL_S after its last renewal (the
# others wait for that moment: leadership.py), so 4-5 s after its death (issue 34: p50 <= 5 s,
# at most 10 s, with the recovery).
LEASE_TTL_S = 5.0
LEASE_RENEW_INTERVAL_S = 1.0
# The lease a replica registers under: `replica:<its id>`.
REPLICA_LEASE_PREFIX = "replica:"

# The current time in unix milliseconds, by each database's clock.
SQLITE_NOW_MS = "CAST((julianday('now') - 2440587.5) * 86400000.0 AS INTEGER)"
POSTGRES_NOW_MS = "CAST(extract(epoch FROM now()) * 1000 AS BIGINT)"


class LeaseLostError(Exception):
    """The lease is not (or no longer) held by this replica with this epoch: another replica
    took it over, or it was released. The write or renew that found it changed nothing."""

    def __init__(self, name: str, detail: str = "") -> None:
        super().__init__(f"the lease {name!r} is lost" + (f": {detail}" if detail else ""))
        self.name = name


@dataclass(frozen=True)
class Fence:
    """What a fenced write carries: it goes in only while `holder` holds `name` at `epoch`."""

    name: str
    holder: str
    epoch: int

    def parameters(self) -> tuple[str, str, int]:
        return (self.name, self.holder, self.epoch)


@dataclass(frozen=True)
class Lease:
    """A lease as the database had it when read; `remaining_ms` by the database's clock then
    (negative once expired). A free lease has no holder."""

    name: str
    holder: str | None
    epoch: int
    expires_at_ms: int
    remaining_ms: int
    previous_holder: str | None
    holder_url: str | None = None
    """Where its holder serves (`--advertise-url`), if it said: where the others forward the
    writes of the `server` lease's holder (leadership.py)."""

    @property
    def expired(self) -> bool:
        return self.holder is None or self.remaining_ms <= 0


_COLUMNS = "name, holder, epoch, expires_at_ms, expires_at_ms - {now}, previous_holder, holder_url"


@dataclass(frozen=True)
class LeaseStatements:
    """The statements of the leases, for one database's clock (`?` parameters)."""

    acquire: str
    renew: str
    release: str
    current: str
    with_prefix: str
    check_fence: str

    @classmethod
    def for_database(cls, now_ms: str, *, lock_row: str = "") -> LeaseStatements:
        """`now_ms`: the SQL of the database's time in unix ms; `lock_row`: what holds a
        fenced write's lease row to the commit ("FOR SHARE"; SQLite has one writer)."""
        columns = _COLUMNS.format(now=now_ms)
        return cls(
            # Taken if absent, free or expired; `previous_holder` (the old value, as every
            # right-hand side of a SET) says whether it was taken from a replica.
            acquire=(
                "INSERT INTO leases (name, holder, holder_url, epoch, expires_at_ms)"
                f" VALUES (?, ?, ?, 1, {now_ms} + ?)"
                " ON CONFLICT (name) DO UPDATE SET holder = excluded.holder,"
                " holder_url = excluded.holder_url,"
                " epoch = leases.epoch + 1, expires_at_ms = excluded.expires_at_ms,"
                " previous_holder = leases.holder"
                f" WHERE leases.holder IS NULL OR leases.expires_at_ms <= {now_ms}"
                f" RETURNING {columns}"
            ),
            renew=(
                f"UPDATE leases SET expires_at_ms = {now_ms} + ?"
                f" WHERE name = ? AND holder = ? AND epoch = ? RETURNING {columns}"
            ),
            release=(
                f"UPDATE leases SET holder = NULL, expires_at_ms = {now_ms}"
                " WHERE name = ? AND holder = ? AND epoch = ? RETURNING name"
            ),
            current=f"SELECT {columns} FROM leases WHERE name = ?",
            with_prefix=(
                f"SELECT {columns} FROM leases WHERE substr(name, 1, length(?)) = ? ORDER BY name"
            ),
            check_fence=(
                f"SELECT epoch FROM leases WHERE name = ? AND holder = ? AND epoch = ? {lock_row}"
            ).rstrip(),
        )


SQLITE_STATEMENTS = LeaseStatements.for_database(SQLITE_NOW_MS)
POSTGRES_STATEMENTS = LeaseStatements.for_database(POSTGRES_NOW_MS, lock_row="FOR SHARE")


def require_fence(row: Sequence[Any] | None, fence: Fence) -> None:
    """Refuse a fenced write whose check (`check_fence`, in the write's transaction) found no
    row: the lease changed hands or was released."""
    if row is None:
        raise LeaseLostError(fence.name, f"{fence.holder} no longer holds epoch {fence.epoch}")


class LeaseStore(Protocol):
    """What a store gives the leases: its statements, and a way to run one of them."""

    lease_statements: LeaseStatements

    async def run_lease_statement(
        self, statement: str, parameters: Sequence[Any]
    ) -> list[tuple[Any, ...]]:
        """Run one statement of `lease_statements` in a write transaction of its own,
        committed before it answers; its rows."""
        ...


def new_replica_id() -> str:
    """A replica's id: unique, and saying where it runs (host and pid) for whoever reads the
    leases."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:12]}"


@dataclass
class LeaseCounters:
    """What /metrics and healthz will show of a replica's leases (issue 34, item 6)."""

    held: int = 0  # now
    acquired: int = 0  # since the start, each take (free, expired, or taken over)
    taken_over: int = 0  # of those, taken from another replica whose lease had expired
    lost: int = 0  # held leases found taken over or gone (by a renew or a fenced write)


@dataclass
class ReplicaLeases:
    """One replica's leases: takes, renews, releases them and fences writes by them."""

    store: LeaseStore
    replica_id: str = field(default_factory=new_replica_id)
    # Where this replica serves, written with each lease it takes (None: it did not say).
    url: str | None = None
    ttl_s: float = LEASE_TTL_S
    counters: LeaseCounters = field(default_factory=LeaseCounters)
    _held: dict[str, Lease] = field(default_factory=dict, init=False, repr=False)

    async def register(self) -> Lease:
        """Take this replica's own lease (`replica:<id>`): its entry in the registry."""
        lease = await self.acquire(REPLICA_LEASE_PREFIX + self.replica_id)
        if lease is None:  # only this replica takes it, unless it is not unique
            raise RuntimeError(f"replica id {self.replica_id!r} is taken")
        return lease

    async def acquire(self, name: str, *, ttl_s: float | None = None) -> Lease | None:
        """Take `name` if it is free or expired, with the next epoch; None if another replica
        (or this one: renew it instead) holds it live."""
        ttl_ms = round((self.ttl_s if ttl_s is None else ttl_s) * 1000)
        rows = await self._run(
            self.store.lease_statements.acquire, (name, self.replica_id, self.url, ttl_ms)
        )
        if not rows:
            return None
        lease = _lease(rows[0])
        self._held[name] = lease
        self.counters.acquired += 1
        if lease.previous_holder is not None and lease.previous_holder != self.replica_id:
            self.counters.taken_over += 1
            logger.info(
                "took over lease %s from %s (epoch %d)", name, lease.previous_holder, lease.epoch
            )
        self._count_held()
        return lease

    async def renew(self, name: str) -> Lease:
        """Push the expiry of a lease this replica holds TTL from now (the database's);
        LeaseLostError if another replica took it over or it was released."""
        fence = self.fence(name)
        rows = await self._run(
            self.store.lease_statements.renew, (round(self.ttl_s * 1000), *fence.parameters())
        )
        if not rows:
            self._lost(name)
            raise LeaseLostError(name, f"taken over from epoch {fence.epoch}")
        lease = _lease(rows[0])
        self._held[name] = lease
        return lease

    async def release(self, name: str) -> bool:
        """Give up a lease this replica holds (free for the next at once); whether it still
        held it."""
        lease = self._held.pop(name, None)
        self._count_held()
        if lease is None:
            return False
        fence = Fence(name, self.replica_id, lease.epoch)
        return bool(await self._run(self.store.lease_statements.release, fence.parameters()))

    async def current(self, name: str) -> Lease | None:
        """The lease `name` as the database has it now (None if never taken)."""
        rows = await self._run(self.store.lease_statements.current, (name,))
        return _lease(rows[0]) if rows else None

    async def with_prefix(self, prefix: str) -> list[Lease]:
        """Every lease whose name starts with `prefix` (`REPLICA_LEASE_PREFIX`: the replicas
        registered, live and expired), by name."""
        rows = await self._run(self.store.lease_statements.with_prefix, (prefix, prefix))
        return [_lease(row) for row in rows]

    def held_names(self) -> tuple[str, ...]:
        """The names of the leases this replica holds now, sorted (healthz says them)."""
        return tuple(sorted(self._held))

    def fence(self, name: str) -> Fence:
        """The fence of a lease this replica holds, for the store's fenced writes
        (`archive.update(record, fence=...)`); LeaseLostError if it holds none."""
        lease = self._held.get(name)
        if lease is None:
            raise LeaseLostError(name, f"{self.replica_id} does not hold it")
        return Fence(name, self.replica_id, lease.epoch)

    @asynccontextmanager
    async def fenced(self, name: str) -> AsyncIterator[Fence]:
        """The fence of `name` for the writes in the block; a LeaseLostError from one of them
        forgets the lease and counts it lost, and goes on up."""
        fence = self.fence(name)
        try:
            yield fence
        except LeaseLostError as error:
            if error.name == name:
                self._lost(name)
            raise

    def _lost(self, name: str) -> None:
        if self._held.pop(name, None) is not None:
            self.counters.lost += 1
            logger.warning("lost lease %s: another replica took it over", name)
        self._count_held()

    def _count_held(self) -> None:
        self.counters.held = len(self._held)

    async def _run(self, statement: str, parameters: Sequence[Any]) -> list[tuple[Any, ...]]:
        return await self.store.run_lease_statement(statement, parameters)


def _lease(row: Sequence[Any]) -> Lease:
    name, holder, epoch, expires_at_ms, remaining_ms, previous_holder, holder_url = row
    return Lease(
        name=name,
        holder=holder,
        epoch=int(epoch),
        expires_at_ms=int(expires_at_ms),
        remaining_ms=int(remaining_ms),
        previous_holder=previous_holder,
        holder_url=holder_url,
    )
