"""Which servers may use a database whose schema another release migrated (issue 34, item 5).

During a rolling upgrade replicas of release N and N+1 share one database: N+1 migrates it at
its start, and N must go on with it, or stop, but never misread it. So each migration says
whether a server that knows only the versions before it still uses the database correctly after
it (`readable_by_previous`: a new table, index or nullable column: yes; a rename, a type change,
a dropped column, a new meaning of a value: no), and a database records, beside its schema
version, the lowest version a server must know to use it: the last migration applied that the
release before could not read. A server that knows less refuses to start, naming both versions;
one that knows less than the database's version but at least that minimum runs on as it is.

A server running when such a migration would land is not told, so a server does not apply one
while another holds a live lease on the database (PostgreSQL; SQLite has one server per file):
it refuses to start until the older servers are stopped.

Both stores record it in the same way: SQLite in the `schema_compatibility` table (its version
is `PRAGMA user_version`), PostgreSQL in the `min_reader_version` column of `schema_version`.
Once released, neither place may change: older servers read it there.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from jobs_server import __version__

logger = logging.getLogger(__name__)

_Change = TypeVar("_Change")


@dataclass(frozen=True)
class Migration(Generic[_Change]):
    """One step of a store's schema up: its statements, and whether a server of the release
    before it (which knows only the versions below) reads and writes the database correctly
    after it."""

    change: _Change
    readable_by_previous: bool


class SchemaUpgradeError(Exception):
    """This server must not start on the database's schema now (the message says why and what
    to do)."""


class SchemaTooNewError(SchemaUpgradeError):
    """A newer release migrated the database to a schema this server cannot read."""


class OlderServersRunningError(SchemaUpgradeError):
    """This server would apply a migration that the servers running on the database cannot
    read."""


def min_reader_version(migrations: Sequence[Migration[Any]], version: int) -> int:
    """The lowest schema version a server must know to use a database at `version` (of these
    migrations, numbered from 1): the last one up to it that the release before could not read."""
    return max(
        (
            number
            for number, migration in enumerate(migrations[:version], start=1)
            if not migration.readable_by_previous
        ),
        default=0,
    )


def check_readable(database: str, version: int, min_reader: int | None, known_version: int) -> None:
    """Refuse (SchemaTooNewError) a database at a schema `version` above `known_version` (the
    newest this server knows) unless it records a `min_reader` no higher; a newer database this
    server can read is used as it is, with one line in the log. A newer database that records
    no minimum is read only by a server that knows its version."""
    if version <= known_version:
        return
    needed = version if min_reader is None else min_reader
    if needed > known_version:
        raise SchemaTooNewError(
            f"{database} has schema version {version}, migrated by a newer jobs-server, and"
            f" needs a server that knows schema version {needed} or later; this server"
            f" (jobs-server {__version__}) knows versions up to {known_version}: upgrade this"
            " server to the release that migrated the database"
        )
    logger.warning(
        "%s has schema version %d, migrated by a newer jobs-server; this server knows versions"
        " up to %d, which is enough to use it (a rolling upgrade): upgrade this server too",
        database,
        version,
        known_version,
    )
