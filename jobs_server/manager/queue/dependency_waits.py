"""Jobs that wait for others to end (`depends_on`): plain logic, no I/O.

A job submitted with dependencies is archived PENDING and held here (by the leader) until each
job it depends on has ended as its condition asks; then it enters the queue. If one can no
longer hold (the job ended otherwise, or was deleted before it held) it never will: the waiting
job ends FAILED (`DEPENDENCY_NEVER_SATISFIED`). An index from each job waited for to the jobs
that wait for it makes an end cost only its own dependents.

A waiting job holds no running slot and no place in the queue: it takes one (or a slot) only
when its conditions all hold, as a job submitted then would. If there is none then, it stays
here, *ready*, until one frees (the dispatcher admits the ready ones in the order they were
met). The waiting jobs of each tenant are bounded (`MAX_WAITING_JOBS`): past it the tenant's
submit is refused, 429.

`learn` may be told the same end twice (an event, and a read of the statuses made after the
registration): a condition that held stays held (a terminal status is final), and a job is
resolved once, when it leaves the waits.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum

from jobs_server.errors import QueueFullError
from jobs_server.manager.records import (
    DependencyCondition,
    JobDependency,
    JobErrorType,
    JobRecord,
    JobStatus,
)

# A waiting job's message names at most this many of the jobs it waits for (ids are bounded
# too, so the message is).
NAMED_IN_MESSAGE = 5

# The most jobs of one tenant waiting (or ready) at once: each is held in memory by the leader.
# A tenant's own, so that one tenant filling it refuses nobody else; tenants are the tokens
# file's, so the whole is bounded too.
MAX_WAITING_JOBS = 10_000
# Retry-After of a submit refused because too many jobs wait: they wait for other jobs' ends.
WAITING_RETRY_AFTER_S = 10
# A ready job's message: its conditions hold, but the queue had no place for it.
READY_MESSAGE = (
    "Its dependencies are met; waiting for a place in the queue (it is full) or a free slot"
)

_WANTED = {
    DependencyCondition.SUCCEEDED: "to succeed",
    DependencyCondition.FAILED: "to fail or stop",
    DependencyCondition.ENDED: "to end",
}


class Outcome(Enum):
    MET = "met"
    """Every condition holds: the job enters the queue."""
    NEVER = "never"
    """One can no longer hold: the job ends FAILED, DEPENDENCY_NEVER_SATISFIED."""


@dataclass(frozen=True)
class Resolution:
    """A waiting job decided, taken out of the waits."""

    record: JobRecord
    outcome: Outcome
    reason: str = ""
    """Why it never will (the job's message), for NEVER."""


@dataclass
class _Wait:
    record: JobRecord
    pending: dict[str, DependencyCondition] = field(default_factory=dict)
    """The conditions that do not hold yet, by the id of the job they are on."""


def needs_wait(record: JobRecord) -> bool:
    """Whether an unfinished job still waits for its dependencies (none met yet)."""
    return bool(record.spec.depends_on) and record.dependencies_met_time is None


def waiting_message(dependencies: Iterable[JobDependency], of_total: int | None = None) -> str:
    """'Waiting for prepare-1 to succeed', or 'Waiting for 3 of 10 jobs: a to succeed, b to
    end, ...' (at most NAMED_IN_MESSAGE named)."""
    waiting = list(dependencies)
    total = len(waiting) if of_total is None else of_total
    named = ", ".join(
        f"{dependency.submission_id} {_WANTED[dependency.condition]}"
        for dependency in waiting[:NAMED_IN_MESSAGE]
    )
    if len(waiting) > NAMED_IN_MESSAGE:
        named += f" and {len(waiting) - NAMED_IN_MESSAGE} more"
    if total == 1 and len(waiting) == 1:
        return f"Waiting for {named}"
    count = f"{len(waiting)} jobs" if len(waiting) == total else f"{len(waiting)} of {total} jobs"
    return f"Waiting for {count}: {named}"


def never_message(
    submission_id: str, status: JobStatus | None, condition: DependencyCondition
) -> str:
    """Why a dependency on `submission_id` can no longer hold."""
    what = "was deleted" if status is None else f"ended {status}"
    return f"{submission_id} {what}; this job needed it {_WANTED[condition]}"


def names_as_never(message: str, submission_id: str) -> bool:
    """Whether a never-satisfied job's `message` (`never_message`) names `submission_id`."""
    return message.startswith((f"{submission_id} ended ", f"{submission_id} was deleted;"))


def met_by_record(record: JobRecord) -> dict[str, bool]:
    """What the job's record alone tells of its dependencies, by id: every one met once it
    entered the queue; one held before its deletion met; the one a job that ended
    DEPENDENCY_NEVER_SATISFIED names (its `never_message`) not met. The others are left out
    (not known without their statuses)."""
    dependencies = record.spec.depends_on
    if record.dependencies_met_time is not None:
        return {dependency.submission_id: True for dependency in dependencies}
    met = {job_id: True for job_id in record.dependencies_held}
    if record.error_type == JobErrorType.DEPENDENCY_NEVER_SATISFIED and record.message:
        for dependency in dependencies:
            if names_as_never(record.message, dependency.submission_id):
                met[dependency.submission_id] = False
                break
    return met


class DependencyWaits:
    """The waiting jobs, and by each job waited for, the jobs waiting for it."""

    def __init__(self, *, max_waiting: int = MAX_WAITING_JOBS) -> None:
        self._max_waiting = max_waiting
        self._waits: dict[str, _Wait] = {}
        self._ready: dict[str, JobRecord] = {}
        """Met, waiting for a place in the queue: in the order they were met."""
        self._reserved: Counter[str] = Counter()
        """By tenant, places taken by submits whose rows are being written."""
        self._held: Counter[str] = Counter()
        """By tenant, the jobs waiting or ready."""
        self._dependents: dict[str, set[str]] = {}
        """Pending conditions: by the job waited for, the jobs waiting for it."""
        self._unrecorded: dict[str, set[str]] = {}
        """Every condition, pending or held, that its waiting job's record does not yet list
        held (`dependencies_held`): by the job waited for, the jobs that depend on it. A
        deletion visits only its own dependents."""

    def __contains__(self, submission_id: object) -> bool:
        return submission_id in self._waits or submission_id in self._ready

    def __len__(self) -> int:
        return len(self._waits) + len(self._ready)

    def reserve(self, record: JobRecord) -> None:
        """Take a place among the waiting jobs for a submit (its row not yet written);
        QueueFullError if there is none. `release` gives it back, before the job is added
        (or if it is not recorded)."""
        tenant = record.tenant
        if self._held[tenant] + self._reserved[tenant] >= self._max_waiting:
            raise QueueFullError(
                f"Too many jobs of tenant {tenant!r} wait for others to end:"
                f" {self._max_waiting}, the most a tenant may have. Nothing was recorded;"
                " try again later.",
                retry_after_s=WAITING_RETRY_AFTER_S,
            )
        self._reserved[tenant] += 1

    def release(self, record: JobRecord) -> None:
        """Give back a place `reserve` took for a submit (recorded: it is added now)."""
        if self._reserved[record.tenant] > 0:
            self._reserved[record.tenant] -= 1

    def waiting_ids(self) -> list[str]:
        return list(self._waits)

    def dependents_of(self, submission_id: str) -> frozenset[str]:
        """The waiting jobs that wait for `submission_id`."""
        return frozenset(self._dependents.get(submission_id, ()))

    def add(self, record: JobRecord) -> None:
        """Hold a job that waits (again: its conditions pending until learnt, but for those its
        record says held)."""
        self.remove(record.submission_id)
        self._held[record.tenant] += 1
        wait = _Wait(
            record,
            {
                dependency.submission_id: dependency.condition
                for dependency in record.spec.depends_on
                if dependency.submission_id not in record.dependencies_held
            },
        )
        self._waits[record.submission_id] = wait
        for parent in wait.pending:
            self._dependents.setdefault(parent, set()).add(record.submission_id)
            self._unrecorded.setdefault(parent, set()).add(record.submission_id)

    def remove(self, submission_id: str, run_id: str | None = None) -> JobRecord | None:
        """Take a waiting job out (the run `run_id`, if given): its record, None if it is not
        waiting."""
        ready = self._ready.get(submission_id)
        if ready is not None:
            if run_id is not None and ready.run_id != run_id:
                return None
            self._held[ready.tenant] -= 1
            return self._ready.pop(submission_id)
        wait = self._waits.get(submission_id)
        if wait is None or (run_id is not None and wait.record.run_id != run_id):
            return None
        del self._waits[submission_id]
        self._held[wait.record.tenant] -= 1
        for parent in wait.pending:
            _unindex(self._dependents, parent, submission_id)
        for dependency in wait.record.spec.depends_on:
            _unindex(self._unrecorded, dependency.submission_id, submission_id)
        return wait.record

    def park(self, record: JobRecord) -> None:
        """Hold a job whose conditions all hold (a resolution MET, out of the waits) until
        the queue has a place for it: after those parked before it."""
        if record.submission_id not in self._ready:
            self._held[record.tenant] += 1
        self._ready[record.submission_id] = record

    def has_ready(self) -> bool:
        return bool(self._ready)

    def ready(self) -> list[JobRecord]:
        """The parked jobs, in the order they were met."""
        return list(self._ready.values())

    def clear(self) -> None:
        self._waits.clear()
        self._ready.clear()
        self._reserved.clear()
        self._held.clear()
        self._dependents.clear()
        self._unrecorded.clear()

    def learn(self, submission_id: str, status: JobStatus | None) -> list[Resolution]:
        """The job `submission_id` is now `status` (None: deleted): the waiting jobs it
        decides, taken out of the waits."""
        return [
            resolution
            for child in self.dependents_of(submission_id)
            if (resolution := self._learn_for(child, submission_id, status)) is not None
        ]

    def learn_statuses(
        self, submission_id: str, statuses: Mapping[str, JobStatus | None]
    ) -> Resolution | None:
        """What the statuses now (read after the job was added) of the jobs it waits for
        decide of the waiting job `submission_id`; None: it waits on (or waits no longer)."""
        wait = self._waits.get(submission_id)
        if wait is not None and not wait.pending:
            # Every condition recorded held (it was ready when its server stopped).
            self.remove(submission_id)
            return Resolution(wait.record, Outcome.MET)
        for parent, status in statuses.items():
            resolution = self._learn_for(submission_id, parent, status)
            if resolution is not None:
                return resolution
        return None

    def _learn_for(self, child: str, parent: str, status: JobStatus | None) -> Resolution | None:
        wait = self._waits.get(child)
        if wait is None:
            return None
        condition = wait.pending.get(parent)
        if condition is None:
            return None  # held already (or not a dependency)
        if status is not None and condition.holds(status):
            del wait.pending[parent]
            _unindex(self._dependents, parent, child)
            if wait.pending:
                return None
            self.remove(child)
            return Resolution(wait.record, Outcome.MET)
        if condition.can_still_hold(status):
            return None
        self.remove(child)
        return Resolution(wait.record, Outcome.NEVER, never_message(parent, status, condition))

    def held_before_deletion(self, deleted: JobRecord) -> list[JobRecord]:
        """The job `deleted` is about to be deleted: each waiting job whose condition on it
        holds (learnt already, or by its status now) but that is not yet decided, as it must
        be recorded (`dependencies_held`) before the deletion, so that a recovery that finds
        it gone knows it held. The waits keep the new records."""
        parent = deleted.submission_id
        updated = []
        for child in sorted(self._unrecorded.get(parent, ())):
            wait = self._waits[child]
            condition = wait.pending.get(parent)
            if condition is not None and not condition.holds(deleted.status):
                continue
            record = wait.record
            wait.record = record.with_changes(dependencies_held=(*record.dependencies_held, parent))
            updated.append(wait.record)
            _unindex(self._unrecorded, parent, child)
        return updated

    def record(self, submission_id: str) -> JobRecord | None:
        wait = self._waits.get(submission_id)
        return self._ready.get(submission_id) if wait is None else wait.record

    def describe(self, submission_id: str) -> str | None:
        """A waiting job's message now: what it still waits for (a ready one: a place)."""
        if submission_id in self._ready:
            return READY_MESSAGE
        wait = self._waits.get(submission_id)
        if wait is None:
            return None
        pending = [
            dependency
            for dependency in wait.record.spec.depends_on
            if dependency.submission_id in wait.pending
        ]
        return waiting_message(pending, len(wait.record.spec.depends_on))


def _unindex(index: dict[str, set[str]], parent: str, child: str) -> None:
    children = index.get(parent)
    if children is not None:
        children.discard(child)
        if not children:
            del index[parent]
