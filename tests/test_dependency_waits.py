"""The waits of jobs on others (manager/queue/dependency_waits.py) as plain logic: conditions
met one by one, a condition that can no longer hold, a deletion, the same end learnt twice,
the index by job waited for, the messages, the bound on waiting jobs, and a met job that waits
for a place in the queue."""

from __future__ import annotations

import pytest

from jobs_server.errors import QueueFullError
from jobs_server.manager.queue.dependency_waits import (
    READY_MESSAGE,
    DependencyWaits,
    Outcome,
    needs_wait,
    waiting_message,
)
from jobs_server.manager.records import (
    DependencyCondition,
    JobDependency,
    JobRecord,
    JobSpec,
    JobStatus,
)

S, F, E = DependencyCondition.SUCCEEDED, DependencyCondition.FAILED, DependencyCondition.ENDED


def child(submission_id: str, *on: tuple[str, DependencyCondition]) -> JobRecord:
    return JobRecord(
        spec=JobSpec(
            entrypoint="true",
            submission_id=submission_id,
            depends_on=tuple(JobDependency(submission_id=p, condition=c) for p, c in on),
        ),
        run_id=f"run-{submission_id}",
    )


def test_a_job_is_met_once_every_condition_holds_and_leaves_the_waits() -> None:
    waits = DependencyWaits()
    waits.add(child("c", ("a", S), ("b", E)))
    assert waits.dependents_of("a") == {"c"}
    assert waits.learn("a", JobStatus.RUNNING) == []
    assert waits.learn("a", JobStatus.SUCCEEDED) == []
    assert waits.describe("c") == "Waiting for 1 of 2 jobs: b to end"
    # The same end again (an event after the read that saw it): nothing more.
    assert waits.learn("a", JobStatus.SUCCEEDED) == []
    (resolution,) = waits.learn("b", JobStatus.STOPPED)
    assert (resolution.record.submission_id, resolution.outcome) == ("c", Outcome.MET)
    assert "c" not in waits
    assert len(waits) == 0
    assert waits.dependents_of("a") == frozenset()
    assert waits.dependents_of("b") == frozenset()
    assert waits.learn("b", JobStatus.STOPPED) == []


@pytest.mark.parametrize(
    ("condition", "status", "reason"),
    [
        (S, JobStatus.FAILED, "a ended FAILED; this job needed it to succeed"),
        (S, JobStatus.STOPPED, "a ended STOPPED; this job needed it to succeed"),
        (F, JobStatus.SUCCEEDED, "a ended SUCCEEDED; this job needed it to fail or stop"),
        (S, None, "a was deleted; this job needed it to succeed"),
        (E, None, "a was deleted; this job needed it to end"),
    ],
)
def test_a_condition_that_can_no_longer_hold_ends_the_wait(
    condition: DependencyCondition, status: JobStatus | None, reason: str
) -> None:
    waits = DependencyWaits()
    waits.add(child("c", ("a", condition), ("b", S)))
    (resolution,) = waits.learn("a", status)
    assert (resolution.outcome, resolution.reason) == (Outcome.NEVER, reason)
    assert "c" not in waits
    assert waits.dependents_of("b") == frozenset()


@pytest.mark.parametrize(
    ("condition", "status"),
    [
        (S, JobStatus.SUCCEEDED),
        (F, JobStatus.FAILED),
        (F, JobStatus.STOPPED),
        (E, JobStatus.FAILED),
    ],
)
def test_each_condition_holds_for_its_statuses(
    condition: DependencyCondition, status: JobStatus
) -> None:
    waits = DependencyWaits()
    waits.add(child("c", ("a", condition)))
    (resolution,) = waits.learn("a", status)
    assert resolution.outcome is Outcome.MET


def test_a_held_condition_stays_held_when_its_job_is_deleted_later() -> None:
    waits = DependencyWaits()
    waits.add(child("c", ("a", S), ("b", S)))
    assert waits.learn("a", JobStatus.SUCCEEDED) == []
    assert waits.learn("a", None) == []
    assert "c" in waits


def test_a_deletion_records_held_conditions_of_its_own_dependents_only_and_once() -> None:
    waits = DependencyWaits()
    waits.add(child("c", ("a", S), ("b", S)))
    waits.add(child("d", ("a", F), ("b", S)))  # its condition on a does not hold
    waits.add(child("e", ("x", S)))  # not a dependent of a
    waits.add(child("f", ("a", E), ("b", S)))  # held by the status the deleted job has
    assert waits.learn("b", JobStatus.PENDING) == []
    deleted = JobRecord(
        spec=JobSpec(entrypoint="true", submission_id="a"), status=JobStatus.SUCCEEDED
    )
    updated = waits.held_before_deletion(deleted)
    assert [(r.submission_id, r.dependencies_held) for r in updated] == [
        ("c", ("a",)),
        ("f", ("a",)),
    ]
    assert waits.record("c") == updated[0]
    # Recorded: a second deletion of the same id (another run) records nothing again.
    assert waits.held_before_deletion(deleted) == []
    # A job taken out of the waits is in no index; one added since is.
    waits.remove("f")
    waits.add(child("g", ("a", S)))
    assert [r.submission_id for r in waits.held_before_deletion(deleted)] == ["g"]
    assert "d" in waits  # its end (never satisfied) comes with the deletion's event


def test_statuses_read_after_the_registration_decide_at_once() -> None:
    waits = DependencyWaits()
    waits.add(child("c", ("a", S), ("b", S)))
    met = waits.learn_statuses("c", {"a": JobStatus.SUCCEEDED, "b": JobStatus.SUCCEEDED})
    assert met is not None
    assert met.outcome is Outcome.MET
    waits.add(child("d", ("a", S), ("b", S)))
    assert waits.learn_statuses("d", {"a": JobStatus.SUCCEEDED, "b": JobStatus.PENDING}) is None
    never = waits.learn_statuses("d", {"a": JobStatus.SUCCEEDED, "b": JobStatus.FAILED})
    assert never is not None
    assert never.outcome is Outcome.NEVER
    # A job no longer waiting (stopped, or decided by an event first) is not decided again.
    assert waits.learn_statuses("d", {"b": JobStatus.FAILED}) is None


def test_fan_in_resolves_on_the_last_end_and_one_end_resolves_every_dependent() -> None:
    waits = DependencyWaits()
    parents = [f"p{i}" for i in range(10)]
    waits.add(child("c", *((p, S) for p in parents)))
    for sibling in ("x", "y"):
        waits.add(child(sibling, ("p0", F)))
    assert waits.dependents_of("p0") == {"c", "x", "y"}
    resolutions = waits.learn("p0", JobStatus.SUCCEEDED)
    assert {(r.record.submission_id, r.outcome) for r in resolutions} == {
        ("x", Outcome.NEVER),
        ("y", Outcome.NEVER),
    }
    for parent in parents[1:-1]:
        assert waits.learn(parent, JobStatus.SUCCEEDED) == []
    assert waits.describe("c") == "Waiting for 1 of 10 jobs: p9 to succeed"
    (resolution,) = waits.learn("p9", JobStatus.SUCCEEDED)
    assert resolution.outcome is Outcome.MET


def test_remove_takes_the_run_out_of_the_index() -> None:
    waits = DependencyWaits()
    record = child("c", ("a", S))
    waits.add(record)
    assert waits.remove("c", "another-run") is None
    assert waits.remove("c", record.run_id) == record
    assert waits.learn("a", JobStatus.SUCCEEDED) == []
    assert waits.remove("c") is None


def test_messages_name_what_is_waited_for_within_a_bound() -> None:
    one = JobDependency(submission_id="prepare-1")
    assert waiting_message([one]) == "Waiting for prepare-1 to succeed"
    many = [JobDependency(submission_id=f"j{i}", condition=E) for i in range(8)]
    assert waiting_message(many) == (
        "Waiting for 8 jobs: j0 to end, j1 to end, j2 to end, j3 to end, j4 to end and 3 more"
    )
    assert (
        waiting_message(many[:3], 10) == "Waiting for 3 of 10 jobs: j0 to end, j1 to end, j2 to end"
    )
    assert len(waiting_message([JobDependency(submission_id="x" * 100)] * 100)) < 700


def test_only_a_job_with_dependencies_not_yet_met_waits() -> None:
    waiting = child("c", ("a", S))
    assert needs_wait(waiting)
    assert not needs_wait(waiting.with_changes(dependencies_met_time=1))
    assert not needs_wait(child("d"))


def test_waiting_jobs_are_bounded_per_tenant_and_a_refusal_names_the_cause() -> None:
    waits = DependencyWaits(max_waiting=2)
    first, second, third = (child(job_id, ("a", S)) for job_id in ("c", "d", "e"))
    waits.reserve(first)
    waits.release(first)  # recorded: added now
    waits.add(first)
    waits.reserve(second)  # a submit whose row is being written
    with pytest.raises(QueueFullError) as refused:
        waits.reserve(third)
    assert str(refused.value) == (
        "Too many jobs of tenant 'default' wait for others to end: 2, the most a tenant may"
        " have. Nothing was recorded; try again later."
    )
    # Another tenant's are its own: one tenant filling its bound refuses nobody else.
    other = child("g", ("a", S)).with_changes(tenant="other")
    waits.reserve(other)
    waits.release(other)
    waits.add(other)
    waits.release(second)  # its row was not written after all
    waits.reserve(third)
    # A recovered job (accepted before) is held whatever the bound.
    waits.add(child("f", ("a", S)))
    assert len(waits) == 3
    # A ready job (met, no place in the queue yet) holds its place; one that leaves frees it.
    waits.release(third)
    assert waits.remove("f") is not None
    assert waits.remove("c") is not None
    waits.park(first)
    waits.reserve(child("h", ("a", S)))
    with pytest.raises(QueueFullError):
        waits.reserve(child("i", ("a", S)))
    assert waits.remove("c") is not None
    waits.reserve(child("i", ("a", S)))


def test_a_met_job_without_a_place_waits_on_in_order_and_says_so() -> None:
    waits = DependencyWaits()
    for job_id in ("c", "d"):
        waits.add(child(job_id, ("a", S)))
    resolutions = waits.learn("a", JobStatus.SUCCEEDED)
    assert {r.outcome for r in resolutions} == {Outcome.MET}
    for resolution in sorted(resolutions, key=lambda r: r.record.submission_id):
        waits.park(resolution.record)
    assert [record.submission_id for record in waits.ready()] == ["c", "d"]
    assert "c" in waits
    assert len(waits) == 2
    assert waits.describe("c") == READY_MESSAGE
    assert waits.record("c") is not None
    assert waits.learn("a", JobStatus.SUCCEEDED) == []
    assert waits.remove("c") is not None
    assert [record.submission_id for record in waits.ready()] == ["d"]
    waits.clear()
    assert waits.ready() == []


def test_a_job_whose_conditions_all_held_is_met_at_its_first_read() -> None:
    """A job recorded met but not yet queued (it waited for a place) when its server stopped:
    its record lists them all held, and the next server's first read queues it."""
    waits = DependencyWaits()
    waits.add(child("c", ("a", S), ("b", S)).with_changes(dependencies_held=("a", "b")))
    met = waits.learn_statuses("c", {})
    assert met is not None
    assert met.outcome is Outcome.MET
    assert "c" not in waits
