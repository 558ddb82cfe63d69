"""One server per PostgreSQL database, until replicas can share one (issue 34, items 2-3).

Several servers on one database are not safe yet: each one's start-up recovery settles every
unfinished job of the database as its own (another server's running jobs would be failed as
"went away"), and each would hand the same queued jobs over. SQLite has the state dir's lock
(state_dir.py); a PostgreSQL database, which servers on several machines can reach, has a lease
(leases.py): the `server` lease, held while the server runs and renewed every
LEASE_RENEW_INTERVAL_S by the database's clock.

A second server waits for the lease as long as it takes a dead holder's to expire (a server
killed -9 and started again by systemd finds its own last life's lease), then is refused,
naming the holder. A holder that was paused past its lease (SIGSTOP, a frozen VM) while another
server took the database over finds it lost at its next renewal and must write nothing more:
`on_lost` ends it. A database that does not answer loses no lease by itself: a lease that
expired is still its holder's until another server takes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from jobs_server.manager.archive.leases import (
    LEASE_RENEW_INTERVAL_S,
    LeaseLostError,
    LeaseStore,
    ReplicaLeases,
)

logger = logging.getLogger(__name__)

SERVER_LEASE = "server"
# How often a waiting second server asks again for the lease.
_RETRY_S = 0.5


class DatabaseInUseError(Exception):
    """Another live server holds the database."""


class SoleServer:
    """This server's hold on its database: taken by `take`, renewed until `release`."""

    def __init__(self, leases: ReplicaLeases, on_lost: Callable[[str], None]) -> None:
        self._leases = leases
        self._on_lost = on_lost
        self._renewing: asyncio.Task[None] | None = None

    @property
    def leases(self) -> ReplicaLeases:
        """This server's leases (the `server` lease, its counters): what healthz and /metrics
        say of them."""
        return self._leases

    @classmethod
    async def take(cls, store: LeaseStore, on_lost: Callable[[str], None]) -> SoleServer:
        """Hold the database's `server` lease, waiting for a holder's to expire (at most its
        TTL and a renewal); DatabaseInUseError if a live server renews it meanwhile."""
        leases = ReplicaLeases(store)
        deadline = time.monotonic() + leases.ttl_s + LEASE_RENEW_INTERVAL_S
        while (await leases.acquire(SERVER_LEASE)) is None:
            holder = await leases.current(SERVER_LEASE)
            if time.monotonic() >= deadline:
                raise DatabaseInUseError(
                    f"the database is in use by the server {holder.holder if holder else '?'}:"
                    " one server per database (several servers sharing one are not supported yet)"
                )
            await asyncio.sleep(_RETRY_S)
        sole = cls(leases, on_lost)
        sole._renewing = asyncio.create_task(sole._renew(), name="database-lease")
        return sole

    async def _renew(self) -> None:
        unanswered = False
        while True:
            await asyncio.sleep(LEASE_RENEW_INTERVAL_S)
            try:
                await self._leases.renew(SERVER_LEASE)
            except LeaseLostError as error:
                self._on_lost(str(error))
                return
            except Exception as error:  # the database away: its requests answer 503 meanwhile
                if not unanswered:
                    logger.warning("the database lease could not be renewed: %s", error)
                unanswered = True
            else:
                unanswered = False

    async def release(self) -> None:
        """Stop renewing and give the lease up: the next server takes the database at once."""
        if self._renewing is not None:
            self._renewing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._renewing
        try:
            await self._leases.release(SERVER_LEASE)
        except Exception as error:  # the database away: the lease expires instead
            logger.warning("the database lease was not released: %s", error)
