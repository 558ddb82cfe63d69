"""Admission: which job runs now, which waits in the queue, which is refused; plain logic, no I/O.

A job *runs* from the moment it is handed to a supervisor until its watcher sees its end (a job
handed over that waits for Ray's resources holds its slot). Caps: `max_running` jobs at once
(global, and each tenant's own), and `max_queued` jobs waiting (global, and each tenant's own).

A submit is
- *started* at once when a slot is free (below the global and its tenant's `max_running`) and
  no queued job could take that slot (none of a tenant below its own cap);
- else *queued*, unless the queue (global `max_queued`, or its tenant's) is full: then it is
  *refused* (429) and nothing of it is recorded.
The decision and the reservation (of the slot, or of the place in the queue) happen in one call,
with no await in between, so two submits racing for the last place cannot both win.

The order in which queued jobs are dispatched (when a slot frees):
1. Tenants take turns: of the tenants with a queued job that are below their own `max_running`,
   the one handed a job from the queue least recently goes next (ties, e.g. tenants never
   served yet: the one whose best job was submitted first). Each turn hands over one job, so
   with n tenants waiting each gets one slot in n, whatever the others submit or ask for.
2. Within its turn, a tenant's job of the highest `priority` goes first (higher first), and of
   equal priorities the one submitted first (first come, first served).
So with one tenant (or none configured) the order is priority, then submission. Priority orders
a tenant's own jobs: a tenant cannot push another tenant's jobs back by asking for a higher one.

A queued job's place ("3rd of 12") is its place in that order as the queue is now, computed when
it is read: the jobs of the tenants before it in the turn order up to its round, and of those
after it up to the round before.

What a client is told counts only what it may see. An admin reads a queued job's place in the
whole queue and the server's running jobs; a tenant's own key reads its place among its
tenant's queued jobs, its tenant's running jobs, and whether the server's slots are all taken,
never a number of another tenant's jobs (the place in the whole queue would tell how many
jobs other tenants have queued). A refused submit names its own tenant's counts only.
"""

from __future__ import annotations

import bisect
import math
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

from jobs_server.errors import QueueFullError
from jobs_server.manager.records import JobRecord
from jobs_server.manager.tenancy import NO_LIMITS, TenantLimits

# Retry-After of a refused submit: the time a place in the queue takes to free, estimated from
# the last dispatches (their mean interval, or the time since the last one if that is longer),
# within these bounds; without two dispatches to measure, the default.
RETRY_AFTER_MIN_S = 1
RETRY_AFTER_MAX_S = 60
RETRY_AFTER_DEFAULT_S = 10
DISPATCHES_MEASURED = 64


class Admission(Enum):
    """What a submit does, decided by `JobQueue.admit`."""

    START = "start"
    """A slot is reserved: hand the job over now."""
    QUEUE = "queue"
    """A place in the queue is reserved: archive the job, then `enqueue` it."""


@dataclass(frozen=True, slots=True)
class _Entry:
    """A queued job and its place in its tenant's order. The record is kept as its JSON: bytes
    are nothing the garbage collector walks, and a full queue of models would add 60,000
    objects to each of its full collections (a submit waits through them)."""

    submission_id: str
    run_id: str
    tenant: str
    key: tuple[int, int]
    """Its tenant's order: priority (higher first), then arrival."""
    record_json: bytes

    @classmethod
    def of(cls, record: JobRecord, arrival: int) -> _Entry:
        return cls(
            submission_id=record.submission_id,
            run_id=record.run_id,
            tenant=record.tenant,
            key=(-record.spec.priority, arrival),
            record_json=record.model_dump_json().encode(),
        )

    @property
    def arrival(self) -> int:
        return self.key[1]

    def record(self) -> JobRecord:
        return JobRecord.model_validate_json(self.record_json)


@dataclass
class _TenantQueue:
    """One tenant's queued jobs, in its order."""

    keys: list[tuple[int, int]] = field(default_factory=list)
    entries: dict[tuple[int, int], _Entry] = field(default_factory=dict)

    def add(self, entry: _Entry) -> None:
        bisect.insort(self.keys, entry.key)
        self.entries[entry.key] = entry

    def remove(self, key: tuple[int, int]) -> None:
        del self.keys[bisect.bisect_left(self.keys, key)]
        del self.entries[key]

    def rank(self, key: tuple[int, int]) -> int:
        return bisect.bisect_left(self.keys, key)

    def head(self) -> _Entry:
        return self.entries[self.keys[0]]


def ordinal(number: int) -> str:
    """1st, 2nd, 3rd, 4th, 11th, 12th, 13th, 21st, ..."""
    if 10 <= number % 100 <= 20:
        suffix = "th"
    else:
        suffix = {1: "st", 2: "nd", 3: "rd"}.get(number % 10, "th")
    return f"{number}{suffix}"


class JobQueue:
    """The running jobs' slots, the queued jobs and their order (see the module docstring)."""

    def __init__(
        self,
        *,
        max_running: int | None = None,
        max_queued: int | None = None,
        tenant_limits: Callable[[str], TenantLimits] = lambda _: NO_LIMITS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._max_running = max_running
        self._max_queued = max_queued
        self._tenant_limits = tenant_limits
        self._clock = clock
        # The runs holding a slot, (submission_id, run_id) -> tenant.
        self._running: dict[tuple[str, str], str] = {}
        self._running_by_tenant: Counter[str] = Counter()
        self._tenants: dict[str, _TenantQueue] = {}
        self._queued: dict[str, _Entry] = {}
        # Places reserved by submits whose rows are being archived, and by jobs whose
        # dependencies were met (dependency_waits.py) until their rows say so.
        self._reserved_by_tenant: Counter[str] = Counter()
        self._arrivals = 0
        # When each tenant was last handed a job from the queue (a turn counter).
        self._last_turn: dict[str, int] = {}
        self._turns = 0
        self._dispatched_at: deque[float] = deque(maxlen=DISPATCHES_MEASURED)
        self._dispatched_at_by_tenant: dict[str, deque[float]] = {}

    def clear(self) -> None:
        """Forget every slot and queued job (a replica that stepped down: the new leader's
        recovery has them); the caps and the measured dispatches stay."""
        self._running.clear()
        self._running_by_tenant.clear()
        self._tenants.clear()
        self._queued.clear()
        self._reserved_by_tenant.clear()
        self._last_turn.clear()

    # -- counts -----------------------------------------------------------------------------

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def queued(self) -> int:
        return len(self._queued)

    def __contains__(self, submission_id: object) -> bool:
        return submission_id in self._queued

    def occupancy(self) -> dict[str, tuple[int, int]]:
        """(jobs queued, jobs holding a running slot) by tenant, of the tenants with either."""
        tenants = set(self._tenants) | set(self._running_by_tenant) | set(self._reserved_by_tenant)
        occupancy = {
            tenant: (self._tenant_places(tenant), self._running_by_tenant[tenant])
            for tenant in tenants
        }
        return {tenant: counts for tenant, counts in occupancy.items() if counts != (0, 0)}

    def _queued_places(self) -> int:
        return len(self._queued) + sum(self._reserved_by_tenant.values())

    def _tenant_places(self, tenant: str) -> int:
        queue = self._tenants.get(tenant)
        return (0 if queue is None else len(queue.keys)) + self._reserved_by_tenant[tenant]

    def _tenant_has_slot(self, tenant: str) -> bool:
        cap = self._tenant_limits(tenant).max_running
        return cap is None or self._running_by_tenant[tenant] < cap

    def _global_has_slot(self) -> bool:
        return self._max_running is None or len(self._running) < self._max_running

    def _dispatchable_tenants(self) -> list[str]:
        """The tenants with a queued job that may take a free slot, in turn order."""
        eligible = [tenant for tenant in self._tenants if self._tenant_has_slot(tenant)]
        return sorted(eligible, key=self._turn_order)

    def _turn_order(self, tenant: str) -> tuple[int, int]:
        return (self._last_turn.get(tenant, 0), self._tenants[tenant].head().arrival)

    # -- admission --------------------------------------------------------------------------

    def admit(self, record: JobRecord) -> Admission:
        """Start, queue or refuse (QueueFullError) the new run `record`, and reserve its slot
        or its place; undo with `cancel` if it is not archived after all."""
        admission = self.try_admit(record)
        if admission is None:
            raise self._refusal(record.tenant)
        return admission

    def try_admit(self, record: JobRecord) -> Admission | None:
        """`admit`, but None (nothing reserved) where it would refuse: a job whose
        dependencies were just met, which waits on until there is room."""
        tenant = record.tenant
        # Queued jobs that could take a free slot go first (their dispatch is on its way).
        if (
            self._global_has_slot()
            and self._tenant_has_slot(tenant)
            and not self._dispatchable_tenants()
        ):
            self.hold(record)
            return Admission.START
        if not self._has_room(tenant):
            return None
        self._reserved_by_tenant[tenant] += 1
        return Admission.QUEUE

    def unreserve(self, record: JobRecord) -> None:
        """Give back a place reserved for a run that will not enter the queue."""
        if self._reserved_by_tenant[record.tenant] > 0:
            self._reserved_by_tenant[record.tenant] -= 1

    def _has_room(self, tenant: str) -> bool:
        if self._max_queued is not None and self._queued_places() >= self._max_queued:
            return False
        cap = self._tenant_limits(tenant).max_queued
        return cap is None or self._tenant_places(tenant) < cap

    def _refusal(self, tenant: str) -> QueueFullError:
        """Why the queue has no room for a job of `tenant`."""
        if self._max_queued is not None and self._queued_places() >= self._max_queued:
            # The submitter's own tenant's numbers: the others' are not its to know.
            return QueueFullError(
                f"The queue is full: tenant {tenant!r} has {self._tenant_places(tenant)} jobs"
                f" queued of at most {self._max_queued} (the server's --max-queued-jobs, for all"
                f" tenants), {self._running_by_tenant[tenant]} running. Nothing was recorded;"
                " try again later.",
                retry_after_s=self.retry_after_s(None),
            )
        cap = self._tenant_limits(tenant).max_queued
        return QueueFullError(
            f"The queue of tenant {tenant!r} is full: {self._tenant_places(tenant)} jobs"
            f" queued of at most {cap} (its max_queued). Nothing was recorded; try again"
            " later.",
            retry_after_s=self.retry_after_s(tenant),
        )

    def enqueue(self, record: JobRecord) -> None:
        """Queue an admitted run (its place was reserved by `admit`), now that it is archived."""
        self.unreserve(record)
        self.requeue(record)

    def requeue(self, record: JobRecord) -> None:
        """Queue a run without a reservation (recovery: a job accepted by an earlier server; its
        arrival is the order of the calls, so call in submission order)."""
        self._arrivals += 1
        entry = _Entry.of(record, self._arrivals)
        self._tenants.setdefault(record.tenant, _TenantQueue()).add(entry)
        self._queued[record.submission_id] = entry

    def cancel(self, record: JobRecord, admission: Admission) -> None:
        """Undo `admit` for a run that was not recorded (its archive row failed)."""
        if admission is Admission.START:
            self.free(record)
        else:
            self.unreserve(record)

    # -- slots ------------------------------------------------------------------------------

    def hold(self, record: JobRecord) -> None:
        """The run holds a slot (again, idempotent: a run adopted at a server's start)."""
        key = (record.submission_id, record.run_id)
        if key not in self._running:
            self._running[key] = record.tenant
            self._running_by_tenant[record.tenant] += 1

    def free(self, record: JobRecord) -> bool:
        """The run has ended: its slot is free; whether it held one."""
        tenant = self._running.pop((record.submission_id, record.run_id), None)
        if tenant is None:
            return False
        self._running_by_tenant[tenant] -= 1
        if self._running_by_tenant[tenant] <= 0:
            del self._running_by_tenant[tenant]
        return True

    def next_to_dispatch(self) -> JobRecord | None:
        """Take the next queued run that may run now (it holds its slot from here), if any."""
        if not self._global_has_slot():
            return None
        tenants = self._dispatchable_tenants()
        if not tenants:
            return None
        tenant = tenants[0]
        entry = self._tenants[tenant].head()
        self._remove(entry)
        self._turns += 1
        self._last_turn[tenant] = self._turns
        now = self._clock()
        self._dispatched_at.append(now)
        self._dispatched_at_by_tenant.setdefault(tenant, deque(maxlen=DISPATCHES_MEASURED)).append(
            now
        )
        record = entry.record()
        self.hold(record)
        return record

    def withdraw(self, submission_id: str, run_id: str) -> JobRecord | None:
        """Take the queued run out of the queue (it is stopped); None if it is not queued."""
        entry = self._queued.get(submission_id)
        if entry is None or entry.run_id != run_id:
            return None
        self._remove(entry)
        return entry.record()

    def _remove(self, entry: _Entry) -> None:
        tenant = entry.tenant
        queue = self._tenants[tenant]
        queue.remove(entry.key)
        if not queue.keys:
            del self._tenants[tenant]
        del self._queued[entry.submission_id]

    # -- what a client is told --------------------------------------------------------------

    def place(self, submission_id: str) -> tuple[int, int] | None:
        """The queued job's place in the dispatch order (1 is next) and the jobs queued."""
        entry = self._queued.get(submission_id)
        if entry is None:
            return None
        tenant = entry.tenant
        rank = self._tenants[tenant].rank(entry.key)
        before = rank
        turn_order = sorted(self._tenants, key=self._turn_order)
        ahead = True
        for other in turn_order:
            if other == tenant:
                ahead = False
                continue
            # A tenant before it in the turns is served in the job's own round too.
            before += min(len(self._tenants[other].keys), rank + 1 if ahead else rank)
        return before + 1, len(self._queued)

    def describe(self, submission_id: str, *, own_tenant_only: bool = False) -> str | None:
        """A queued job's status message: its place, and the cap it waits behind. For a reader
        who sees only the job's tenant (`own_tenant_only`), only that tenant's numbers."""
        if own_tenant_only:
            return self._describe_to_tenant(submission_id)
        place = self.place(submission_id)
        if place is None:
            return None
        tenant = self._queued[submission_id].tenant
        parts = [f"Queued: {ordinal(place[0])} of {place[1]}", self._describe_running()]
        tenant_cap = self._tenant_limits(tenant).max_running
        if tenant_cap is not None:
            parts.append(
                f"tenant {tenant}: {self._running_by_tenant[tenant]} of {tenant_cap} running"
            )
        return "; ".join(parts)

    def _describe_to_tenant(self, submission_id: str) -> str | None:
        entry = self._queued.get(submission_id)
        if entry is None:
            return None
        tenant = entry.tenant
        queue = self._tenants[tenant]
        running = self._running_by_tenant[tenant]
        tenant_cap = self._tenant_limits(tenant).max_running
        parts = [
            f"Queued: {ordinal(queue.rank(entry.key) + 1)} of {len(queue.keys)} in tenant"
            f" {tenant}'s queue",
            f"tenant {tenant}: {running} running"
            if tenant_cap is None
            else f"tenant {tenant}: {running} of {tenant_cap} running",
        ]
        if not self._global_has_slot():
            parts.append(f"the server's {self._max_running} running slots are all taken")
        return "; ".join(parts)

    def _describe_running(self) -> str:
        if self._max_running is None:
            return f"{len(self._running)} running"
        return f"{len(self._running)} of {self._max_running} running"

    def retry_after_s(self, tenant: str | None) -> int:
        """Seconds until a place in the queue (the tenant's, or the server's) likely frees."""
        times = (
            self._dispatched_at
            if tenant is None
            else self._dispatched_at_by_tenant.get(tenant, deque())
        )
        if len(times) < 2:
            return RETRY_AFTER_DEFAULT_S
        interval_s = max((times[-1] - times[0]) / (len(times) - 1), self._clock() - times[-1])
        return max(RETRY_AFTER_MIN_S, min(RETRY_AFTER_MAX_S, math.ceil(interval_s)))
