"""When the archive's database does not answer (PostgreSQL down, restarting, unreachable, or
hung: it accepts connections and never answers): which errors say so, and the probe
`/api/healthz` makes. A hung database fails no call by itself: the PostgreSQL store bounds each
of its calls (postgres.py, --database-timeout-s) and raises DatabaseTimeoutError, an
OperationalError, so that it is an outage here as a refused connection is.

psycopg is imported by a server on PostgreSQL only, so its errors are recognised through the
module already loaded: a server on SQLite never loads it here, and none of its errors is one of
these. A full disk on the database's server is not an outage: the disk guard's 507 (disk_guard.py).
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Awaitable

from jobs_server.disk_guard import is_disk_full
from jobs_server.errors import DatabaseUnavailableError

logger = logging.getLogger(__name__)

# How long the probe waits for the database: a probe's own timeout is often a second
# (Kubernetes' default), and a database that takes longer to answer a trivial read is no help.
PROBE_TIMEOUT_S = 1.0

UNAVAILABLE_MESSAGE = (
    "The job database does not answer now (it may be down, restarting or unreachable); "
    "try again in a few seconds."
)


def is_database_unavailable(error: BaseException) -> bool:
    """Whether `error`, or what it was raised from or while handling, says that the database
    cannot be reached or does not answer now: psycopg's OperationalError (connection refused or
    lost, the server shutting down or starting up, the pool's wait for a connection over, a call
    over its bound), other than a full disk."""
    psycopg = sys.modules.get("psycopg")
    if psycopg is None or is_disk_full(error):
        return False
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, psycopg.OperationalError):
            return True
        current = current.__cause__ or current.__context__
    return False


def first_line(error: BaseException) -> str:
    """What the driver said, in a line (for the server's log: it names the database's host)."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


async def probe_database(read: Awaitable[object]) -> None:
    """Await `read` (a trivial read of the archive) at most PROBE_TIMEOUT_S;
    DatabaseUnavailableError if it does not answer in time or fails as an outage does."""
    try:
        await asyncio.wait_for(read, PROBE_TIMEOUT_S)
    except TimeoutError:
        logger.warning("the database did not answer the probe within %g s", PROBE_TIMEOUT_S)
        raise DatabaseUnavailableError(UNAVAILABLE_MESSAGE) from None
    except Exception as error:
        if not is_database_unavailable(error):
            raise
        logger.warning("the database does not answer the probe: %s", first_line(error))
        raise DatabaseUnavailableError(UNAVAILABLE_MESSAGE) from error
