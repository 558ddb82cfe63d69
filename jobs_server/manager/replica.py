"""What one replica (server process) knows of itself, for `/api/healthz` and `/metrics` (issue 34,
item 6): its id, its database and whether it answers, the jobs it owns and its leases."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from jobs_server.manager.archive.leases import LeaseCounters, ReplicaLeases

DatabaseBackend = Literal["sqlite", "postgresql"]
ReplicaRole = Literal["leader", "follower"]


@dataclass(frozen=True)
class ReplicaState:
    """One replica as a probe or a scrape sees it."""

    replica_id: str
    """The id it holds its leases under (host:pid:random); on SQLite, where it has none, one
    of the same form made at its start."""
    role: ReplicaRole
    """`leader`: it does the work (watches the live jobs, runs the queue); `follower`: it
    serves reads and forwards job writes to the leader (leadership.py). SQLite: leader."""
    database_backend: DatabaseBackend
    database_connected: bool
    """Whether its database answered a trivial read just now (SQLite: a file on this disk,
    always)."""
    jobs_owned: int
    """The live jobs it answers for: those it watches (handed to a supervisor, not yet ended)
    and those waiting in its queue."""
    leases_held: tuple[str, ...]
    lease_counters: LeaseCounters

    @classmethod
    def of(
        cls,
        *,
        replica_id: str,
        leases: ReplicaLeases | None,
        role: ReplicaRole,
        database_backend: DatabaseBackend,
        database_connected: bool,
        jobs_owned: int,
    ) -> ReplicaState:
        """The state with the leases as they are now (none without `leases`: SQLite)."""
        return cls(
            replica_id=replica_id,
            role=role,
            database_backend=database_backend,
            database_connected=database_connected,
            jobs_owned=jobs_owned,
            leases_held=() if leases is None else leases.held_names(),
            # A copy: the counters go on while the scrape is rendered.
            lease_counters=(
                LeaseCounters() if leases is None else dataclasses.replace(leases.counters)
            ),
        )
