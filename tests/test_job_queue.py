"""The queue's rules as plain logic (jobs_server/manager/queue/admission.py): caps, the order
(tenants take turns, priority then arrival within a tenant), places, refusals and Retry-After. The
same rules on a real manager and real Ray are in tests/test_queue.py."""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence

import pytest

from jobs_server.errors import QueueFullError
from jobs_server.manager.queue.admission import (
    RETRY_AFTER_DEFAULT_S,
    RETRY_AFTER_MAX_S,
    Admission,
    JobQueue,
    ordinal,
)
from jobs_server.manager.records import JobRecord, JobSpec, new_run_id
from jobs_server.manager.tenancy import NO_LIMITS, TenantLimits


def job(submission_id: str, *, tenant: str = "default", priority: int = 0) -> JobRecord:
    return JobRecord(
        spec=JobSpec(entrypoint="true", submission_id=submission_id, priority=priority),
        run_id=new_run_id(),
        tenant=tenant,
    )


def queued(queue: JobQueue, record: JobRecord) -> JobRecord:
    """Admit a job that must wait, and queue it (as the manager does once it is archived)."""
    assert queue.admit(record) is Admission.QUEUE
    queue.enqueue(record)
    return record


def dispatch_all(queue: JobQueue, running: Sequence[JobRecord] = ()) -> list[str]:
    """End the `running` jobs, then hand out every queued job, one slot at a time (each ends
    before the next starts)."""
    for record in running:
        assert queue.free(record)
    order = []
    while (record := queue.next_to_dispatch()) is not None:
        order.append(record.submission_id)
        assert queue.free(record)
    return order


def full_queue(max_running: int = 1) -> tuple[JobQueue, list[JobRecord]]:
    """A queue whose slots are all held by running jobs (returned) of a tenant with no queued
    work."""
    queue = JobQueue(max_running=max_running, max_queued=1000)
    running = [job(f"running-{number}", tenant="busy") for number in range(max_running)]
    for record in running:
        assert queue.admit(record) is Admission.START
    return queue, running


@pytest.mark.parametrize(
    ("number", "text"),
    [
        *[(1, "1st"), (2, "2nd"), (3, "3rd"), (4, "4th"), (11, "11th"), (12, "12th")],
        *[(13, "13th"), (21, "21st"), (22, "22nd"), (101, "101st"), (111, "111th")],
    ],
)
def test_ordinals(number: int, text: str) -> None:
    assert ordinal(number) == text


def test_jobs_start_while_slots_are_free_then_queue_then_are_refused() -> None:
    queue = JobQueue(max_running=2, max_queued=2)
    assert [queue.admit(job(f"j{n}")) for n in range(2)] == [Admission.START] * 2
    queued(queue, job("q1"))
    queued(queue, job("q2"))
    with pytest.raises(QueueFullError) as refused:
        queue.admit(job("q3"))
    assert refused.value.code == "queue_full"
    assert "2 jobs queued of at most 2" in refused.value.message
    assert refused.value.response_headers() == {"Retry-After": str(RETRY_AFTER_DEFAULT_S)}
    assert (queue.running, queue.queued) == (2, 2)


def test_a_reserved_place_counts_before_its_job_is_queued() -> None:
    """Two submits racing for the last place: the first admit reserves it, the second is
    refused, though the first job is not in the queue yet (its row is being archived)."""
    queue = JobQueue(max_running=1, max_queued=1)
    queue.admit(job("running"))
    first = job("first")
    assert queue.admit(first) is Admission.QUEUE
    with pytest.raises(QueueFullError):
        queue.admit(job("second"))
    queue.cancel(first, Admission.QUEUE)  # its archive row failed: the place is free again
    assert queue.admit(job("third")) is Admission.QUEUE


def test_no_queue_means_refused_when_every_slot_is_taken() -> None:
    queue = JobQueue(max_running=1, max_queued=0)
    queue.admit(job("running"))
    with pytest.raises(QueueFullError):
        queue.admit(job("refused"))


def test_a_freed_slot_goes_to_the_queue_before_a_new_submit() -> None:
    queue, running = full_queue()
    queued(queue, job("waiting"))
    assert queue.free(running[0])
    # The slot is free but the queued job's dispatch has not run yet: a newcomer waits.
    assert queue.admit(job("newcomer")) is Admission.QUEUE
    assert queue.next_to_dispatch() is not None
    assert queue.next_to_dispatch() is None  # max_running 1, held by "waiting" now


def test_priority_first_then_first_come_first_served() -> None:
    queue, running = full_queue()
    for name, priority in [("a", 0), ("b", 5), ("c", 0), ("d", 5), ("e", -3), ("f", 10)]:
        queued(queue, job(name, priority=priority))
    assert dispatch_all(queue, running) == ["f", "b", "d", "a", "c", "e"]


def test_tenants_take_turns_whatever_their_priorities() -> None:
    queue, running = full_queue()
    for number in range(4):
        queued(queue, job(f"a{number}", tenant="a", priority=100))
    queued(queue, job("b0", tenant="b"))
    queued(queue, job("b1", tenant="b", priority=1))
    queued(queue, job("c0", tenant="c"))
    # a's jobs were first, so a takes the first turn; then b (its priority-1 job first), c.
    assert dispatch_all(queue, running) == ["a0", "b1", "c0", "a1", "b0", "a2", "a3"]


def test_a_tenant_at_its_cap_lets_the_others_go_by() -> None:
    queue = JobQueue(
        max_running=10,
        max_queued=100,
        tenant_limits=lambda tenant: TenantLimits(max_running=1) if tenant == "a" else NO_LIMITS,
    )
    assert queue.admit(job("a-running", tenant="a")) is Admission.START
    a_waiting = queued(queue, job("a-waiting", tenant="a"))
    # a is at its own cap: b starts at once, though a has a job queued.
    assert queue.admit(job("b-now", tenant="b")) is Admission.START
    assert queue.next_to_dispatch() is None
    assert (
        queue.describe("a-waiting") == "Queued: 1st of 1; 2 of 10 running; tenant a: 1 of 1 running"
    )
    queue.free(job_like("a-running", queue, "a"))
    assert queue.next_to_dispatch() == a_waiting


def job_like(submission_id: str, queue: JobQueue, tenant: str) -> JobRecord:
    run_id = next(run for (job_id, run) in queue._running if job_id == submission_id)
    return JobRecord(
        spec=JobSpec(entrypoint="true", submission_id=submission_id), run_id=run_id, tenant=tenant
    )


def test_a_tenants_queue_has_its_own_cap() -> None:
    queue = JobQueue(
        max_running=1,
        max_queued=100,
        tenant_limits=lambda tenant: TenantLimits(max_queued=2) if tenant == "a" else NO_LIMITS,
    )
    queue.admit(job("running"))
    queued(queue, job("a0", tenant="a"))
    queued(queue, job("a1", tenant="a"))
    with pytest.raises(QueueFullError) as refused:
        queue.admit(job("a2", tenant="a"))
    assert "tenant 'a'" in refused.value.message
    queued(queue, job("b0", tenant="b"))


def test_the_message_gives_the_place_and_the_cap() -> None:
    queue, _ = full_queue(max_running=50)
    for number in range(12):
        queued(queue, job(f"q{number}"))
    assert queue.describe("q2") == "Queued: 3rd of 12; 50 of 50 running"
    assert queue.describe("running-0") is None
    queue.withdraw("q0", queue._queued["q0"].run_id)
    assert queue.describe("q2") == "Queued: 2nd of 11; 50 of 50 running"


def test_withdraw_needs_the_same_run() -> None:
    queue, _ = full_queue()
    record = queued(queue, job("q"))
    assert queue.withdraw("q", new_run_id()) is None
    assert queue.withdraw("q", record.run_id) == record
    assert queue.withdraw("q", record.run_id) is None
    assert queue.next_to_dispatch() is None


@pytest.mark.parametrize("seed", range(20))
def test_every_place_is_the_order_the_queue_hands_jobs_out_in(seed: int) -> None:
    rng = random.Random(seed)
    queue, running = full_queue()
    names = (f"job{n}" for n in itertools.count())
    for _ in range(rng.randint(1, 60)):
        queued(queue, job(next(names), tenant=rng.choice("abcd"), priority=rng.randint(-2, 2)))
    # Serve a few first, so tenants have taken turns before the places are read.
    queue.free(running[0])
    for _ in range(rng.randint(0, 5)):
        if (record := queue.next_to_dispatch()) is not None:
            queue.free(record)
    places = {}
    for job_id in list(queue._queued):
        place = queue.place(job_id)
        assert place is not None
        places[place[0]] = job_id
    order = dispatch_all(queue)
    assert len(order) == len(places)
    assert [places[number] for number in range(1, len(order) + 1)] == order


def test_retry_after_follows_the_pace_of_dispatches() -> None:
    now = [1000.0]
    queue = JobQueue(max_running=1, max_queued=1, clock=lambda: now[0])
    current = job("running")
    queue.admit(current)
    assert queue.retry_after_s(None) == RETRY_AFTER_DEFAULT_S
    for number in range(5):
        queued(queue, job(f"q{number}"))
        queue.free(current)
        dispatched = queue.next_to_dispatch()
        assert dispatched is not None
        current = dispatched
        now[0] += 3.0
    # Every 3 s a place freed; the last one 3 s ago.
    assert queue.retry_after_s(None) == 3
    now[0] += 500
    assert queue.retry_after_s(None) == RETRY_AFTER_MAX_S


def test_unlimited_by_default() -> None:
    queue = JobQueue()
    assert all(queue.admit(job(f"j{n}")) is Admission.START for n in range(1000))
    assert queue.running == 1000


def test_occupancy_counts_queued_places_and_held_slots_by_tenant() -> None:
    """What /metrics shows: a place reserved by a submit still being archived counts as queued
    (it is refused a place like any other), a slot as held until its run is freed; a tenant
    with neither is left out."""
    queue, running = full_queue(max_running=2)
    waiting = queued(queue, job("a-1", tenant="a"))
    reserved = job("a-2", tenant="a")
    assert queue.admit(reserved) is Admission.QUEUE  # its row is being archived
    other = queued(queue, job("b-1", tenant="b"))
    only_reserved = job("c-1", tenant="c")
    assert queue.admit(only_reserved) is Admission.QUEUE
    assert queue.occupancy() == {"busy": (0, 2), "a": (2, 0), "b": (1, 0), "c": (1, 0)}
    queue.cancel(only_reserved, Admission.QUEUE)
    assert queue.free(running[0])
    assert queue.next_to_dispatch() == waiting
    assert queue.occupancy() == {"busy": (0, 1), "a": (1, 1), "b": (1, 0)}
    queue.cancel(reserved, Admission.QUEUE)
    assert queue.withdraw(other.submission_id, other.run_id) == other
    assert queue.free(running[1])
    assert queue.free(waiting)
    assert queue.occupancy() == {}
