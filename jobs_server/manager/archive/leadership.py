"""Which replica does the work when several share one PostgreSQL database (issue 34, items 2-3).

Every replica (server process) on the same database, Ray cluster and namespace serves the whole
API, but one of them, the *leader*, owns all the work: it watches every live job, runs the queue
(its caps, priorities and tenants' turns, exact because one process decides them) and the
retention, as a single server does. The others are *followers*: they answer every read from
the shared database, Ray's GCS and the shared log directory, and forward every job write
(submit, stop, delete) to the leader (serving/leader_forwarding.py).

The leader is the holder of the database's `server` lease (leases.py: its epoch goes up at each
change of hands, its expiry is by the database's clock), renewed every LEASE_RENEW_INTERVAL_S.
A follower asks for it when the lease says it expires (and at least every interval); a leader
that dies (kill -9, or frozen past its lease) is replaced LEASE_TTL_S after its last renewal
(4-5 s after its death), and the new leader runs the recovery a restarted server runs: it
adopts the running jobs and queues again the queued ones.

Why one leader rather than an owner per job: the queue's order is one order over every tenant
(admission.py); with one process deciding it, a cap of 50 means 50 across the replicas without
a lock per decision, and a takeover is the restart path that the recovery tests already cover.

Fencing. A leader acts only while it is *sure* of its lease: for LEADER_SURE_S after the last
renewal it asked for (by its own monotonic clock, which runs on while the process is frozen),
which ends before the lease can expire for the others. Each irreversible step of a hand-over
(the KV record, the supervisor's start) and each end the leader decides itself first awaits
`confirmed()`: at once while sure, else after a renewal. A leader frozen past its lease finds
it taken at that renewal, before it starts or ends anything, so a job never runs twice; the
job writes it was asked for answer 503. It then steps down (`on_deposed`: its watchers,
queue, hand-overs and retention are dropped, writing nothing; the jobs run on and the new
leader watches them) and follows, as a new replica would; it may lead again later. What is left
is a freeze of more than the lease's TTL between a confirmation and the start call a few
microseconds later.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import NoReturn

from jobs_server.errors import LeaderUnavailableError
from jobs_server.manager.archive.leases import (
    LEASE_RENEW_INTERVAL_S,
    LEASE_TTL_S,
    LeaseLostError,
    LeaseStore,
    ReplicaLeases,
)

logger = logging.getLogger(__name__)

SERVER_LEASE = "server"
# How long after asking for a renewal the leader acts without asking again: the lease runs
# LEASE_TTL_S from the database's receipt of that request, later than the asking, so the
# leader's certainty ends a renewal interval before anyone else may take the lease.
LEADER_SURE_S = LEASE_TTL_S - LEASE_RENEW_INTERVAL_S
# The header of a write forwarded by a follower: the leader that gets one never forwards it
# again (a leader that just lost the lead answers 503 instead of a loop).
FORWARDED_BY_HEADER = "X-Jobs-Server-Forwarded-By"
# How soon a confirmation that the database did not answer asks again.
_CONFIRM_RETRY_S = 0.2
# How soon a leader whose renewal failed tries again: sooner than its interval, so that when
# the database is back it renews before a follower takes the lead.
_RENEW_RETRY_S = 0.25
# How long after the lease's expiry (by the database's clock) a follower asks for it.
_AFTER_EXPIRY_S = 0.05


class Leadership:
    """This replica's part: leader (holds `server`, does the work) or follower (forwards)."""

    def __init__(self, leases: ReplicaLeases) -> None:
        self._leases = leases
        self._leading = False
        # Until when (time.monotonic) the leader acts without a renewal.
        self._sure_until_s = 0.0
        self._lead_ready = False
        self._on_elected: Callable[[], Awaitable[None]] | None = None
        self._on_deposed: Callable[[], Awaitable[None]] | None = None
        self._running: asyncio.Task[None] | None = None
        self._electing: asyncio.Task[None] | None = None
        self._stepping_down: asyncio.Future[None] | None = None
        self._renewal: asyncio.Future[None] | None = None
        # When (from its last try) a follower asks for the lead again.
        self._next_try_s = LEASE_RENEW_INTERVAL_S

    @classmethod
    def of(cls, store: LeaseStore, *, url: str | None) -> Leadership:
        """A replica's leadership on `store`, advertising `url` to the others."""
        return cls(ReplicaLeases(store, url=url))

    @property
    def leases(self) -> ReplicaLeases:
        """This replica's leases (healthz and /metrics say them)."""
        return self._leases

    @property
    def leading(self) -> bool:
        """Whether this replica holds the lead (it may be waiting to be sure of it)."""
        return self._leading

    @property
    def ready_to_write(self) -> bool:
        """Whether this replica leads and has taken the work over (the recovery done): job
        writes are then taken here, once `confirmed`."""
        return self._leading and self._lead_ready

    async def start(
        self,
        on_elected: Callable[[], Awaitable[None]],
        on_deposed: Callable[[], Awaitable[None]],
    ) -> None:
        """Lead at once if nobody does (`on_elected` awaited before this returns: the first
        replica is ready when it serves, as a single server is), else follow; either way keep
        renewing, or asking for, the lead in the background. `on_deposed` drops the work,
        writing nothing, when the lead was lost to another replica."""
        self._on_elected = on_elected
        self._on_deposed = on_deposed
        elected = await self._try_to_lead()
        self._running = asyncio.create_task(self._run(), name="leadership")
        if elected:
            await self._take_the_work_over()

    async def close(self) -> None:
        """Stop renewing and give the lead up, so that a follower takes it at its next try."""
        for task in (self._running, self._electing, self._stepping_down, self._renewal):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        if not self._leading:
            return
        self._leading = False
        try:
            await self._leases.release(SERVER_LEASE)
        except Exception as error:  # the database away: the lease expires instead
            logger.warning("the lead was not released: %s", error)

    async def confirmed(self, *, wait_for_the_database: bool = True) -> None:
        """Return once this replica is sure it still leads (at once while it is);
        LeaderUnavailableError if it does not lead, or finds the lead lost (it then steps
        down). While the database does not answer it waits for it (a hand-over: it goes on
        once the database is back), or, without `wait_for_the_database` (a client's write,
        which must be answered), raises the database's error (503 database_unavailable)."""
        while not self._sure():
            if not self._leading:
                raise LeaderUnavailableError("This replica does not lead the jobs now.")
            try:
                await asyncio.shield(self._renewal_in_flight())
            except LeaderUnavailableError:
                raise
            except Exception as error:  # the database away
                if not wait_for_the_database:
                    raise
                logger.warning("the lead could not be confirmed: %s", error)
                await asyncio.sleep(_CONFIRM_RETRY_S)

    def _renewal_in_flight(self) -> asyncio.Future[None]:
        """The renewal under way, or a new one: the confirmations and the background loop
        share it, so a lost lead is found (and stepped down from) once."""
        if self._renewal is None or self._renewal.done():
            self._renewal = asyncio.ensure_future(self._renew())
        return self._renewal

    async def leader_url(self) -> str | None:
        """Where to send a job write: None to handle it here (this replica leads and is ready);
        the leader's advertised URL otherwise; LeaderUnavailableError while no replica leads
        (a takeover under way) or the leader said no URL."""
        if self._leading:
            if not self._lead_ready:
                raise LeaderUnavailableError(
                    "This replica is taking the jobs over from the replica before it."
                )
            await self.confirmed(wait_for_the_database=False)
            return None
        lease = await self._leases.current(SERVER_LEASE)
        if lease is None or lease.expired or lease.holder == self._leases.replica_id:
            raise LeaderUnavailableError("No replica leads the jobs now (a takeover is under way).")
        if lease.holder_url is None:
            raise LeaderUnavailableError(
                f"The replica that leads the jobs ({lease.holder}) said no address to forward"
                " writes to: give it --advertise-url."
            )
        return lease.holder_url

    async def leads_at(self, url: str) -> bool:
        """Whether the replica that advertises `url` holds the lead now (a live lease)."""
        lease = await self._leases.current(SERVER_LEASE)
        return lease is not None and not lease.expired and lease.holder_url == url

    def _sure(self) -> bool:
        return self._leading and time.monotonic() < self._sure_until_s

    async def _try_to_lead(self) -> bool:
        asked_s = time.monotonic()
        if await self._leases.acquire(SERVER_LEASE) is None:
            self._next_try_s = await self._until_the_lease_expires_s()
            return False
        self._sure_until_s = asked_s + LEADER_SURE_S
        self._leading = True
        logger.info("this replica leads the jobs (%s)", self._leases.replica_id)
        return True

    async def _until_the_lease_expires_s(self) -> float:
        """When a follower asks again: as the leader's lease expires (by the database's clock,
        so a dead leader is replaced as soon as it may be), at most an interval from now."""
        lease = await self._leases.current(SERVER_LEASE)
        if lease is None:
            return 0.0
        return min(max(lease.remaining_ms / 1000 + _AFTER_EXPIRY_S, 0.0), LEASE_RENEW_INTERVAL_S)

    async def _take_the_work_over(self) -> None:
        assert self._on_elected is not None
        await self._on_elected()
        self._lead_ready = True

    async def _take_the_work_over_or_give_up(self) -> None:
        """A follower's takeover; one that fails (the GCS away during the recovery) drops
        what it took and gives the lead up, to be asked for again, rather than hold a lead it
        cannot serve (every write would answer 503 until it stops)."""
        try:
            await self._take_the_work_over()
        except Exception:
            logger.exception("taking the jobs over failed; giving the lead up to try again")
            self._leading = False
            assert self._on_deposed is not None
            with contextlib.suppress(Exception):
                await self._on_deposed()
            try:
                await self._leases.release(SERVER_LEASE)
            except Exception as error:  # the database away: the lease expires instead
                logger.warning("the lead was not released: %s", error)

    async def _run(self) -> None:
        unanswered = False
        while True:
            # A leader whose renewal failed (the database away) asks again sooner than the
            # followers try to take the lead: when the database is back, it keeps its lead.
            if self._leading:
                await asyncio.sleep(_RENEW_RETRY_S if unanswered else LEASE_RENEW_INTERVAL_S)
            else:
                await asyncio.sleep(LEASE_RENEW_INTERVAL_S if unanswered else self._next_try_s)
            if self._stepping_down is not None:
                # Its work dropped before it may lead again.
                await asyncio.shield(self._stepping_down)
            try:
                if self._leading:
                    await asyncio.shield(self._renewal_in_flight())
                elif await self._try_to_lead():
                    # Beside the renewals: a recovery of many jobs may outlast the lease.
                    self._electing = asyncio.create_task(
                        self._take_the_work_over_or_give_up(), name="taking-the-work-over"
                    )
            except LeaderUnavailableError:
                unanswered = False  # lost: stepping down, and following from now on
            except Exception as error:  # the database away: reads answer 503 meanwhile
                if not unanswered:
                    logger.warning("the lead could not be renewed or asked for: %s", error)
                unanswered = True
            else:
                unanswered = False

    async def _renew(self) -> None:
        asked_s = time.monotonic()
        try:
            await self._leases.renew(SERVER_LEASE)
        except LeaseLostError as error:
            self._lose(str(error))
        self._sure_until_s = asked_s + LEADER_SURE_S

    def _lose(self, reason: str) -> NoReturn:
        """Another replica took the lead over (this one was frozen, or its database away,
        past the lease): follow, and drop the work, writing nothing more of it."""
        logger.warning("this replica lost the lead, and follows: %s", reason)
        self._leading = False
        self._lead_ready = False
        self._stepping_down = asyncio.ensure_future(self._step_down(self._electing))
        raise LeaderUnavailableError("This replica lost the lead of the jobs; retry shortly.")

    async def _step_down(self, electing: asyncio.Task[None] | None) -> None:
        if electing is not None and not electing.done():
            electing.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await electing
        assert self._on_deposed is not None
        try:
            await self._on_deposed()
        except Exception:
            logger.exception("dropping the work of a lost lead failed")
