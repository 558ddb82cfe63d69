"""The webhooks' outbox in the archive (issue 36), on both stores: a change's deliveries are
written with its event in one transaction (or neither), none for a disabled endpoint, claims
are exclusive and expire, an attempt is recorded only while its delivery is pending, a retry
is an event and a delivery, finished deliveries are bounded, and all of it survives a reopen."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

import pytest

from jobs_server.manager.archive.events import JobEventType
from jobs_server.manager.archive.interface import JobArchive
from jobs_server.manager.archive.outbox import (
    DeliveryState,
    PlannedDelivery,
    TargetSource,
    WebhookDelivery,
    webhook_events_of,
)
from jobs_server.manager.records import (
    JobAttempt,
    JobRecord,
    JobSpec,
    JobStatus,
    new_run_id,
    now_ms,
)
from jobs_server.manager.webhook_events import WebhookEventType
from tests.support.postgres import ArchiveFactory, committed_rows

RECEIVER = "https://receiver.example/hook"
TENANT_ENDPOINT = "https://tenant.example/hook"
CLAIM_MS = 60_000


class Planner:
    """Every event to RECEIVER (the job's own) and TENANT_ENDPOINT (its tenant's); what it was
    asked, in order."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, WebhookEventType]] = []
        self.fail = False
        self.failing: set[str] = set()

    def __call__(
        self, record: JobRecord, event_type: WebhookEventType
    ) -> Sequence[PlannedDelivery]:
        self.asked.append((record.submission_id, event_type))
        if self.fail or record.submission_id in self.failing:
            raise RuntimeError("the planner failed")
        return (
            PlannedDelivery(RECEIVER, TargetSource.JOB),
            PlannedDelivery(TENANT_ENDPOINT, TargetSource.TENANT),
        )


def record(submission_id: str) -> JobRecord:
    return JobRecord(
        spec=JobSpec(entrypoint="true", submission_id=submission_id, max_retries=2),
        start_time=1_000,
        run_id=new_run_id(),
    )


def running(job: JobRecord, ended_attempts: int = 0) -> JobRecord:
    attempts = [
        JobAttempt(start_time=1_000 + n, end_time=1_500 + n, exit_code=1, log_offset=0)
        for n in range(ended_attempts)
    ]
    attempts.append(JobAttempt(start_time=2_000 + ended_attempts, log_offset=0))
    return job.with_changes(status=JobStatus.RUNNING, attempts=tuple(attempts))


@pytest.fixture
def planner() -> Planner:
    return Planner()


@pytest.fixture
async def outbox(archive_factory: ArchiveFactory, planner: Planner) -> AsyncIterator[JobArchive]:
    archive = archive_factory(plan_deliveries=planner)
    await archive.open()
    yield archive
    await archive.close()


def urls(deliveries: list[WebhookDelivery]) -> list[tuple[WebhookEventType, str]]:
    return [(delivery.event_type, delivery.url) for delivery in deliveries]


async def test_a_change_writes_its_deliveries_with_its_event(
    outbox: JobArchive, planner: Planner
) -> None:
    job = record("a")
    await outbox.insert(job)
    assert await outbox.deliveries_of("a") == []  # a new row causes none
    started = running(job)
    await outbox.update(started)
    await outbox.update(started.with_changes(message="the same status: no event"))
    deliveries = await outbox.deliveries_of("a")
    assert urls(deliveries) == [
        (WebhookEventType.STARTED, RECEIVER),
        (WebhookEventType.STARTED, TENANT_ENDPOINT),
    ]
    events = await outbox.events_after(0, 100)
    assert [event.type for event in events] == [JobEventType.SUBMITTED, JobEventType.STATUS]
    for delivery, source in zip(deliveries, (TargetSource.JOB, TargetSource.TENANT), strict=True):
        assert delivery.id.startswith("msg_")
        assert delivery.event_id == events[1].id
        assert delivery.source is source
        assert delivery.tenant == job.tenant
        assert delivery.submission_id == "a"
        assert JobRecord.model_validate_json(delivery.record) == started
        assert delivery.state is DeliveryState.PENDING
        assert delivery.attempts == 0
        assert delivery.next_attempt_ms == delivery.created_ms == events[1].time
    assert deliveries[0].id != deliveries[1].id
    assert planner.asked == [("a", WebhookEventType.STARTED)]
    # Committed: another connection reads them.
    assert committed_rows(outbox, "SELECT COUNT(*) FROM webhook_deliveries") == [(2,)]


async def test_a_failing_planner_rolls_back_the_change_and_its_event(
    outbox: JobArchive, planner: Planner
) -> None:
    job = record("a")
    await outbox.insert(job)
    planner.fail = True
    with pytest.raises(RuntimeError, match="the planner failed"):
        await outbox.update(running(job))
    assert await outbox.get("a") == job
    assert [event.type for event in await outbox.events_after(0, 100)] == [JobEventType.SUBMITTED]
    assert await outbox.deliveries_of("a") == []
    planner.fail = False
    await outbox.update(running(job))
    assert len(await outbox.deliveries_of("a")) == 2


async def test_a_batch_with_a_failing_planner_commits_the_others(
    outbox: JobArchive, planner: Planner
) -> None:
    jobs = [record(name) for name in ("a", "b", "c")]
    for job in jobs:
        await outbox.insert(job)
    planner.failing = {"b"}
    # Called together: one batch, one transaction, where b's change alone is rolled back.
    outcomes = await asyncio.gather(
        *(outbox.update(running(job)) for job in jobs), return_exceptions=True
    )
    assert isinstance(outcomes[1], RuntimeError)
    assert outcomes[0] == running(jobs[0])
    assert outcomes[2] == running(jobs[2])
    assert [len(await outbox.deliveries_of(name)) for name in ("a", "b", "c")] == [2, 0, 2]
    assert await outbox.get("b") == jobs[1]


async def test_each_end_is_its_own_event_type(outbox: JobArchive) -> None:
    for name, status, expected in (
        ("s", JobStatus.SUCCEEDED, WebhookEventType.SUCCEEDED),
        ("f", JobStatus.FAILED, WebhookEventType.FAILED),
        ("x", JobStatus.STOPPED, WebhookEventType.STOPPED),
    ):
        job = record(name)
        await outbox.insert(job)
        await outbox.update(running(job))
        await outbox.update(running(job).with_changes(status=status, end_time=3_000))
        # A terminal row never changes, nor is it an event again.
        await outbox.update(running(job).with_changes(status=JobStatus.FAILED, end_time=4_000))
        types = [delivery.event_type for delivery in await outbox.deliveries_of(name)]
        assert types == [WebhookEventType.STARTED] * 2 + [expected] * 2


async def test_a_retry_writes_an_event_and_its_deliveries(outbox: JobArchive) -> None:
    job = record("a")
    await outbox.insert(job)
    await outbox.update(running(job))
    for ended in (1, 2):
        await outbox.update(running(job, ended))
        # Learnt twice (a watcher's retry): one event.
        await outbox.update(running(job, ended))
    await outbox.update(running(job, 2).with_changes(status=JobStatus.SUCCEEDED, end_time=9_000))
    events = await outbox.events_after(0, 100)
    assert [(event.type, event.status) for event in events] == [
        (JobEventType.SUBMITTED, JobStatus.PENDING),
        *[(JobEventType.STATUS, JobStatus.RUNNING)] * 3,
        (JobEventType.STATUS, JobStatus.SUCCEEDED),
    ]
    deliveries = await outbox.deliveries_of("a")
    assert [delivery.event_type for delivery in deliveries[::2]] == [
        WebhookEventType.STARTED,
        WebhookEventType.RETRYING,
        WebhookEventType.RETRYING,
        WebhookEventType.SUCCEEDED,
    ]
    assert [delivery.event_id for delivery in deliveries[::2]] == [event.id for event in events[1:]]


async def test_a_start_learnt_with_its_first_attempt_ended_is_a_start_and_a_retry(
    outbox: JobArchive,
) -> None:
    """A short first attempt's start is written with its end (and the wait before its retry)."""
    job = record("a")
    await outbox.insert(job)
    await outbox.update(running(job, 1))
    events = (await outbox.events_after(0, 100))[1:]
    assert [(event.type, event.status) for event in events] == [
        (JobEventType.STATUS, JobStatus.RUNNING)
    ] * 2
    deliveries = await outbox.deliveries_of("a")
    assert [(d.event_type, d.event_id) for d in deliveries[::2]] == [
        (WebhookEventType.STARTED, events[0].id),
        (WebhookEventType.RETRYING, events[1].id),
    ]


async def test_an_end_archived_without_its_start_still_delivers_the_start(
    outbox: JobArchive,
) -> None:
    """A job that ended before its start was written: one status event (the stream shows what
    was archived), and deliveries of its start, its retries and its end."""
    job = record("a")
    await outbox.insert(job)
    ended = running(job, 2).with_changes(status=JobStatus.FAILED, end_time=9_000)
    await outbox.update(ended.with_changes(attempts=ended.attempts[:-1]))
    [event] = (await outbox.events_after(0, 100))[1:]
    assert (event.type, event.status) == (JobEventType.STATUS, JobStatus.FAILED)
    deliveries = await outbox.deliveries_of("a")
    assert {d.event_id for d in deliveries} == {event.id}
    for url in (RECEIVER, TENANT_ENDPOINT):
        assert sorted(d.event_type for d in deliveries if d.url == url) == sorted(
            [WebhookEventType.STARTED, WebhookEventType.RETRYING, WebhookEventType.FAILED]
        )


STARTED = (WebhookEventType.STARTED,)
SUCCEEDED = (WebhookEventType.SUCCEEDED,)
FAILED = (WebhookEventType.FAILED,)


@pytest.mark.parametrize(
    ("stored", "stored_ended", "status", "ended", "expected"),
    [
        (None, 0, JobStatus.PENDING, 0, ()),
        (JobStatus.PENDING, 0, JobStatus.PENDING, 0, ()),
        (JobStatus.PENDING, 0, JobStatus.RUNNING, 0, (WebhookEventType.STARTED,)),
        (
            JobStatus.PENDING,
            0,
            JobStatus.RUNNING,
            1,
            (WebhookEventType.STARTED, WebhookEventType.RETRYING),
        ),
        (JobStatus.RUNNING, 0, JobStatus.RUNNING, 0, ()),
        (JobStatus.RUNNING, 1, JobStatus.RUNNING, 1, ()),
        (JobStatus.RUNNING, 1, JobStatus.RUNNING, 2, (WebhookEventType.RETRYING,)),
        # Learnt late (a server restarted meanwhile): a retry per attempt ended since.
        (JobStatus.RUNNING, 0, JobStatus.RUNNING, 2, (WebhookEventType.RETRYING,) * 2),
        (JobStatus.RUNNING, 1, JobStatus.SUCCEEDED, 2, (WebhookEventType.SUCCEEDED,)),
        (JobStatus.RUNNING, 0, JobStatus.FAILED, 1, (WebhookEventType.FAILED,)),
        (JobStatus.PENDING, 0, JobStatus.STOPPED, 0, (WebhookEventType.STOPPED,)),
        (JobStatus.RUNNING, 0, JobStatus.FAILED, 3, (WebhookEventType.RETRYING,) * 2 + FAILED),
        # Archived only at its end (it ended before its start was written): its start is sent.
        (JobStatus.PENDING, 0, JobStatus.SUCCEEDED, 1, STARTED + SUCCEEDED),
        (None, 0, JobStatus.SUCCEEDED, 1, STARTED + SUCCEEDED),
        (
            JobStatus.PENDING,
            0,
            JobStatus.FAILED,
            3,
            STARTED + (WebhookEventType.RETRYING,) * 2 + FAILED,
        ),
        # Never ran (stopped while queued, a dependency never satisfied): its end alone.
        (JobStatus.PENDING, 0, JobStatus.FAILED, 0, FAILED),
        # Written again once ended (a deletion's hold, say): nothing.
        (JobStatus.SUCCEEDED, 1, JobStatus.SUCCEEDED, 1, ()),
    ],
)
def test_which_webhook_events_a_change_is(
    stored: JobStatus | None,
    stored_ended: int,
    status: JobStatus,
    ended: int,
    expected: tuple[WebhookEventType, ...],
) -> None:
    changed = running(record("a"), ended).with_changes(status=status)
    if status.is_terminal():
        changed = changed.with_changes(attempts=changed.attempts[:-1])
    assert webhook_events_of(stored, stored_ended, changed) == expected


async def test_no_delivery_for_a_disabled_endpoint(outbox: JobArchive) -> None:
    job = record("a")
    await outbox.insert(job)
    await outbox.update(running(job))
    assert await outbox.disable_webhook_endpoint(job.tenant, TENANT_ENDPOINT, 5_000) == 1
    # Again: nothing left to disable, and no error.
    assert await outbox.disable_webhook_endpoint(job.tenant, TENANT_ENDPOINT, 5_001) == 0
    # Another tenant's endpoint at the same URL is not disabled.
    other = record("b").with_changes(tenant="other")
    await outbox.insert(other)
    await outbox.update(running(other))
    await outbox.update(running(job).with_changes(status=JobStatus.SUCCEEDED, end_time=6_000))
    states = [(d.event_type, d.url, d.state) for d in await outbox.deliveries_of("a")]
    assert states == [
        (WebhookEventType.STARTED, RECEIVER, DeliveryState.PENDING),
        (WebhookEventType.STARTED, TENANT_ENDPOINT, DeliveryState.DISABLED),
        (WebhookEventType.SUCCEEDED, RECEIVER, DeliveryState.PENDING),
    ]
    assert len(await outbox.deliveries_of("b")) == 2
    claimed = await outbox.claim_due_deliveries(10**15, 100, CLAIM_MS)
    assert TENANT_ENDPOINT not in [d.url for d in claimed if d.tenant == job.tenant]


async def test_claims_are_exclusive_and_expire(archive_factory: ArchiveFactory) -> None:
    planner = Planner()
    archives = [archive_factory(plan_deliveries=planner) for _ in range(2)]
    for archive in archives:
        await archive.open()
    try:
        writer = archives[0]
        for n in range(20):
            job = record(f"job-{n}")
            await writer.insert(job)
            await writer.update(running(job))
        now = now_ms() + 1
        claims = await asyncio.gather(
            *(archive.claim_due_deliveries(now, 7, CLAIM_MS) for archive in archives * 4)
        )
        ids = [delivery.id for claim in claims for delivery in claim]
        assert len(ids) == len(set(ids)) == 40
        for claim in claims:
            assert all(delivery.next_attempt_ms == now + CLAIM_MS for delivery in claim)
        assert await writer.claim_due_deliveries(now + 1, 100, CLAIM_MS) == []
        assert await writer.next_delivery_due_ms() == now + CLAIM_MS
        # Expired (its sender died mid-send): claimable again, by anyone.
        again = await archives[1].claim_due_deliveries(now + CLAIM_MS, 100, CLAIM_MS)
        assert sorted(delivery.id for delivery in again) == sorted(ids)
    finally:
        for archive in archives:
            await archive.close()


async def test_claims_skip_the_tenants_asked(outbox: JobArchive) -> None:
    """The sender skips the tenants whose sends fill their share, so that one tenant's slow
    receiver never holds the others' deliveries back."""
    for name, tenant in (("a", "hog"), ("b", "other"), ("c", "third")):
        job = record(name).with_changes(tenant=tenant)
        await outbox.insert(job)
        await outbox.update(running(job))
    now = now_ms() + 1
    claimed = await outbox.claim_due_deliveries(now, 100, CLAIM_MS, skip_tenants=["hog", "third"])
    assert {delivery.tenant for delivery in claimed} == {"other"}
    rest = await outbox.claim_due_deliveries(now, 100, CLAIM_MS, skip_tenants=[])
    assert sorted({delivery.tenant for delivery in rest}) == ["hog", "third"]


async def test_claims_take_the_oldest_due_first(outbox: JobArchive) -> None:
    for name in ("a", "b"):
        job = record(name)
        await outbox.insert(job)
        await outbox.update(running(job))
    [first, *_] = await outbox.deliveries_of("a")
    [second, *_] = await outbox.deliveries_of("b")
    now = second.next_attempt_ms
    assert now is not None
    claimed = await outbox.claim_due_deliveries(now, 1, CLAIM_MS)
    assert [delivery.submission_id for delivery in claimed] == ["a"]
    assert await outbox.claim_due_deliveries(first.created_ms - 1, 100, CLAIM_MS) == []


async def test_an_attempt_is_recorded_only_while_pending(outbox: JobArchive) -> None:
    job = record("a")
    await outbox.insert(job)
    await outbox.update(running(job))
    first, second = await outbox.deliveries_of("a")
    assert await outbox.record_delivery_attempt(
        first.id,
        state=DeliveryState.PENDING,
        at_ms=10_000,
        next_attempt_ms=20_000,
        status_code=503,
        error="503 Service Unavailable",
    )
    assert await outbox.record_delivery_attempt(
        first.id,
        state=DeliveryState.DELIVERED,
        at_ms=20_000,
        next_attempt_ms=None,
        status_code=204,
        error=None,
    )
    assert not await outbox.record_delivery_attempt(
        first.id,
        state=DeliveryState.FAILED,
        at_ms=30_000,
        next_attempt_ms=None,
        status_code=None,
        error="late",
    )
    assert not await outbox.record_delivery_attempt(
        "msg_unknown",
        state=DeliveryState.DELIVERED,
        at_ms=30_000,
        next_attempt_ms=None,
        status_code=200,
        error=None,
    )
    assert await outbox.record_delivery_attempt(
        second.id,
        state=DeliveryState.FAILED,
        at_ms=21_000,
        next_attempt_ms=None,
        status_code=None,
        error="refused: 10.0.0.1 is private",
    )
    delivered, failed = await outbox.deliveries_of("a")
    assert delivered.model_dump(exclude={"record"}) == {
        **first.model_dump(exclude={"record"}),
        "state": DeliveryState.DELIVERED,
        "attempts": 2,
        "next_attempt_ms": None,
        "last_attempt_ms": 20_000,
        "last_status_code": 204,
        "last_error": None,
        "delivered_ms": 20_000,
    }
    assert (failed.state, failed.attempts, failed.last_error, failed.delivered_ms) == (
        DeliveryState.FAILED,
        1,
        "refused: 10.0.0.1 is private",
        None,
    )
    assert await outbox.next_delivery_due_ms() is None
    assert await outbox.claim_due_deliveries(10**15, 100, CLAIM_MS) == []
    assert await outbox.count_deliveries() == {
        DeliveryState.DELIVERED: 1,
        DeliveryState.FAILED: 1,
    }


async def test_deliveries_of_a_job_in_order_and_counts(outbox: JobArchive) -> None:
    job = record("a")
    await outbox.insert(job)
    await outbox.update(running(job))
    await outbox.update(running(job, 1))
    await outbox.update(running(job, 1).with_changes(status=JobStatus.FAILED, end_time=5_000))
    deliveries = await outbox.deliveries_of("a")
    assert [delivery.event_type for delivery in deliveries] == [
        WebhookEventType.STARTED,
        WebhookEventType.STARTED,
        WebhookEventType.RETRYING,
        WebhookEventType.RETRYING,
        WebhookEventType.FAILED,
        WebhookEventType.FAILED,
    ]
    assert [delivery.url for delivery in deliveries] == [RECEIVER, TENANT_ENDPOINT] * 3
    assert await outbox.deliveries_of("unknown") == []
    assert await outbox.count_deliveries() == {DeliveryState.PENDING: 6}
    await outbox.disable_webhook_endpoint(job.tenant, RECEIVER, 6_000)
    assert await outbox.count_deliveries() == {
        DeliveryState.PENDING: 3,
        DeliveryState.DISABLED: 3,
    }


async def test_a_deleted_job_s_deliveries_are_still_sent(outbox: JobArchive) -> None:
    job = record("a")
    await outbox.insert(job)
    await outbox.update(running(job))
    assert await outbox.delete("a")
    assert len(await outbox.deliveries_of("a")) == 2
    assert len(await outbox.claim_due_deliveries(10**15, 100, CLAIM_MS)) == 2


async def test_finished_deliveries_are_kept_while_their_event_is(
    archive_factory: ArchiveFactory,
) -> None:
    archive = archive_factory(plan_deliveries=Planner(), max_events=4)
    await archive.open()
    try:
        old = record("old")
        await archive.insert(old)
        await archive.update(running(old))
        finished, pending = await archive.deliveries_of("old")
        await archive.record_delivery_attempt(
            finished.id,
            state=DeliveryState.DELIVERED,
            at_ms=1,
            next_attempt_ms=None,
            status_code=200,
            error=None,
        )
        for n in range(4):  # 4 events more: old's are no longer kept
            await archive.insert(record(f"new-{n}"))
        assert [d.id for d in await archive.deliveries_of("old")] == [pending.id]
    finally:
        await archive.close()


async def test_the_outbox_survives_a_reopen(archive_factory: ArchiveFactory) -> None:
    archive = archive_factory(plan_deliveries=Planner())
    await archive.open()
    job = record("a")
    await archive.insert(job)
    await archive.update(running(job))
    before = await archive.deliveries_of("a")
    await archive.disable_webhook_endpoint(job.tenant, TENANT_ENDPOINT, 5_000)
    await archive.close()
    reopened = archive_factory(plan_deliveries=Planner())
    await reopened.open()
    try:
        after = await reopened.deliveries_of("a")
        assert [d.id for d in after] == [d.id for d in before]
        assert [d.state for d in after] == [DeliveryState.PENDING, DeliveryState.DISABLED]
        await reopened.update(running(job).with_changes(status=JobStatus.SUCCEEDED, end_time=1))
        assert [d.url for d in (await reopened.deliveries_of("a"))[2:]] == [RECEIVER]
    finally:
        await reopened.close()


async def test_an_archive_without_a_planner_writes_no_delivery(archive: JobArchive) -> None:
    job = record("a")
    await archive.insert(job)
    await archive.update(running(job))
    await archive.update(running(job, 1))
    assert await archive.deliveries_of("a") == []
    assert await archive.count_deliveries() == {}
    assert await archive.next_delivery_due_ms() is None
    # The retry is an event all the same.
    assert len(await archive.events_after(0, 100)) == 3
