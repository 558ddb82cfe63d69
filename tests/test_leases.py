"""Leases and fencing in the archive (issue 34, item 3, its foundation): replicas, each an
archive of its own on one history (two SQLite connections to one file, or two pools on one
PostgreSQL database), take, renew, release and lose named leases; a write fenced by a lease is
refused, and changes nothing, once another replica took the lease over. Expiry is by the
database's clock, whatever the replicas' process clocks say."""

from __future__ import annotations

import asyncio
import time

import pytest

from jobs_server.manager.archive.interface import JobArchive
from jobs_server.manager.archive.leases import (
    REPLICA_LEASE_PREFIX,
    LeaseLostError,
    ReplicaLeases,
)
from jobs_server.manager.records import JobRecord, JobSpec, JobStatus, new_run_id

WATCH = "watch:test-namespace"
LONG_TTL_S = 30.0
SHORT_TTL_S = 0.3
DEADLINE_S = 10.0
RACE_ROUNDS = 40


def record(submission_id: str) -> JobRecord:
    return JobRecord(
        spec=JobSpec(entrypoint="true", submission_id=submission_id), run_id=new_run_id()
    )


async def wait_until_expired(leases: ReplicaLeases, name: str) -> None:
    """Poll (by the database's clock) until the lease `name` has expired."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        lease = await leases.current(name)
        assert lease is not None
        if lease.expired:
            return
        assert time.monotonic() < deadline, f"{name} did not expire: {lease}"
        await asyncio.sleep(0.05)


async def test_a_lease_is_acquired_renewed_and_released(two_archives: list[JobArchive]) -> None:
    a, b = (ReplicaLeases(archive, ttl_s=LONG_TTL_S) for archive in two_archives)
    assert a.replica_id != b.replica_id
    assert await a.current(WATCH) is None

    taken = await a.acquire(WATCH)
    assert taken is not None
    assert (taken.name, taken.holder, taken.epoch) == (WATCH, a.replica_id, 1)
    assert 0 < taken.remaining_ms <= LONG_TTL_S * 1000
    seen = await b.current(WATCH)
    assert seen is not None
    assert (seen.holder, seen.epoch) == (a.replica_id, 1)

    renewed = await a.renew(WATCH)
    assert (renewed.holder, renewed.epoch) == (a.replica_id, 1)
    assert renewed.expires_at_ms >= taken.expires_at_ms
    assert a.fence(WATCH).epoch == 1
    assert (a.counters.held, a.counters.acquired, a.counters.taken_over) == (1, 1, 0)

    assert await a.release(WATCH)
    released = await b.current(WATCH)
    assert released is not None
    assert released.holder is None
    assert released.expired
    assert a.counters.held == 0
    assert a.counters.lost == 0
    with pytest.raises(LeaseLostError):
        await a.renew(WATCH)

    # A released lease is free: the next one takes it with the next epoch, not "taken over".
    again = await b.acquire(WATCH)
    assert again is not None
    assert (again.holder, again.epoch) == (b.replica_id, 2)
    assert (b.counters.acquired, b.counters.taken_over) == (1, 0)


async def test_a_live_lease_is_not_taken(two_archives: list[JobArchive]) -> None:
    a, b = (ReplicaLeases(archive, ttl_s=LONG_TTL_S) for archive in two_archives)
    assert await a.acquire(WATCH) is not None
    assert await b.acquire(WATCH) is None
    assert await a.acquire(WATCH) is None  # not even by its holder: it renews it
    with pytest.raises(LeaseLostError):
        await b.renew(WATCH)  # B holds nothing
    with pytest.raises(LeaseLostError):
        b.fence(WATCH)
    assert not await b.release(WATCH)
    lease = await b.current(WATCH)
    assert lease is not None
    assert (lease.holder, lease.epoch) == (a.replica_id, 1)
    assert not lease.expired


async def test_replicas_register_under_their_own_lease(two_archives: list[JobArchive]) -> None:
    a, b = (ReplicaLeases(archive, ttl_s=LONG_TTL_S) for archive in two_archives)
    await a.register()
    await b.register()
    registered = await a.with_prefix(REPLICA_LEASE_PREFIX)
    assert sorted(lease.holder or "" for lease in registered) == sorted(
        [a.replica_id, b.replica_id]
    )
    assert all(
        lease.name == REPLICA_LEASE_PREFIX + lease.holder for lease in registered if lease.holder
    )


async def test_a_frozen_replica_is_taken_over_and_changes_nothing(
    two_archives: list[JobArchive],
) -> None:
    """A holds the lease and stops renewing (frozen); past its expiry B takes it over with
    the next epoch. A's fenced write and A's renew are then refused, and the row is as B left
    it."""
    archive_a, archive_b = two_archives
    a = ReplicaLeases(archive_a, ttl_s=SHORT_TTL_S)
    b = ReplicaLeases(archive_b, ttl_s=LONG_TTL_S)
    job = record("owned")
    await archive_a.insert(job)

    assert await a.acquire(WATCH) is not None
    old_fence = a.fence(WATCH)
    async with a.fenced(WATCH) as fence:  # while A holds it, its fenced writes go in
        pending = job.with_changes(message="A saw it")
        assert await archive_a.update(pending, fence=fence) == pending
    assert await b.acquire(WATCH) is None

    await wait_until_expired(b, WATCH)
    taken = await b.acquire(WATCH)
    assert taken is not None
    assert (taken.holder, taken.epoch, taken.previous_holder) == (b.replica_id, 2, a.replica_id)
    assert b.counters.taken_over == 1
    running = job.with_changes(status=JobStatus.RUNNING, message="B watches it")
    async with b.fenced(WATCH) as fence:
        assert await archive_b.update(running, fence=fence) == running
    events_before = await archive_a.events_after(0, 100)

    # A wakes up, unaware: its write carries its old epoch, and is refused.
    failed = job.with_changes(status=JobStatus.FAILED, end_time=5, message="A's stale view")
    with pytest.raises(LeaseLostError):
        await archive_a.update(failed, fence=old_fence)
    with pytest.raises(LeaseLostError):
        async with a.fenced(WATCH) as fence:
            await archive_a.update(failed, fence=fence)
    assert a.counters.lost == 1
    assert a.counters.held == 0
    with pytest.raises(LeaseLostError):
        await a.renew(WATCH)
    assert a.counters.lost == 1  # already known lost: counted once

    assert await archive_a.get("owned") == running
    assert await archive_b.get("owned") == running
    assert await archive_a.events_after(0, 100) == events_before
    lease = await a.current(WATCH)
    assert lease is not None
    assert (lease.holder, lease.epoch) == (b.replica_id, 2)
    # An unfenced write (every caller today) is not affected.
    ended = running.with_changes(status=JobStatus.SUCCEEDED, end_time=9)
    assert await archive_a.update(ended) == ended


async def test_a_renew_after_a_takeover_is_refused(two_archives: list[JobArchive]) -> None:
    archive_a, archive_b = two_archives
    a = ReplicaLeases(archive_a, ttl_s=SHORT_TTL_S)
    b = ReplicaLeases(archive_b, ttl_s=LONG_TTL_S)
    assert await a.acquire(WATCH) is not None
    await wait_until_expired(a, WATCH)
    assert await b.acquire(WATCH) is not None
    with pytest.raises(LeaseLostError):
        await a.renew(WATCH)
    assert (a.counters.lost, a.counters.held) == (1, 0)
    lease = await b.current(WATCH)
    assert lease is not None
    assert (lease.holder, lease.epoch) == (b.replica_id, 2)
    assert not lease.expired


async def test_an_expired_lease_not_taken_yet_is_still_its_holders(
    two_archives: list[JobArchive],
) -> None:
    """Expiry only lets another replica take the lease: until one does, the holder renews it
    with the same epoch (nobody wrote under a newer one)."""
    a = ReplicaLeases(two_archives[0], ttl_s=SHORT_TTL_S)
    assert await a.acquire(WATCH) is not None
    await wait_until_expired(a, WATCH)
    renewed = await a.renew(WATCH)
    assert (renewed.holder, renewed.epoch, renewed.expired) == (a.replica_id, 1, False)


async def test_replicas_racing_for_an_expired_lease_one_wins(
    two_archives: list[JobArchive],
) -> None:
    """Each round the lease is expired (held by a third replica with no time left); A and B
    ask for it at once: exactly one gets it, with the next epoch. And so for leases never
    taken before (no row yet)."""
    archive_a, archive_b = two_archives
    a = ReplicaLeases(archive_a, ttl_s=LONG_TTL_S)
    b = ReplicaLeases(archive_b, ttl_s=LONG_TTL_S)
    expired_holder = ReplicaLeases(archive_a, ttl_s=0.0)
    epoch = 0
    for _ in range(RACE_ROUNDS):
        held = await expired_holder.acquire(WATCH)
        assert held is not None
        assert held.expired
        epoch = held.epoch
        won = [lease for lease in await asyncio.gather(a.acquire(WATCH), b.acquire(WATCH)) if lease]
        assert len(won) == 1, won
        assert won[0].epoch == epoch + 1
        winner = a if won[0].holder == a.replica_id else b
        assert await winner.release(WATCH)
    assert a.counters.taken_over + b.counters.taken_over == RACE_ROUNDS
    # A lease never taken before: both insert its row at once.
    for round_ in range(RACE_ROUNDS):
        fresh = f"fresh:{round_}"
        won = [lease for lease in await asyncio.gather(a.acquire(fresh), b.acquire(fresh)) if lease]
        assert len(won) == 1, won
        assert won[0].epoch == 1
        assert await (a if won[0].holder == a.replica_id else b).release(fresh)
    assert a.counters.held == b.counters.held == 0


async def test_expiry_is_by_the_databases_clock(
    two_archives: list[JobArchive], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A's process clock is an hour behind when it takes the lease, B's an hour ahead when it
    looks: both see the lease live for its whole TTL, and B cannot take it."""
    archive_a, archive_b = two_archives
    a = ReplicaLeases(archive_a, ttl_s=LONG_TTL_S)
    b = ReplicaLeases(archive_b, ttl_s=LONG_TTL_S)
    real_time, real_time_ns = time.time, time.time_ns

    def skew(seconds: float) -> None:
        monkeypatch.setattr(time, "time", lambda: real_time() + seconds)
        monkeypatch.setattr(time, "time_ns", lambda: real_time_ns() + int(seconds * 1e9))

    skew(-3600)
    taken = await a.acquire(WATCH)
    assert taken is not None
    assert not taken.expired
    skew(+3600)
    seen = await b.current(WATCH)
    assert seen is not None
    assert not seen.expired
    assert (LONG_TTL_S - 5) * 1000 < seen.remaining_ms <= LONG_TTL_S * 1000
    assert await b.acquire(WATCH) is None
    renewed = await a.renew(WATCH)
    assert (LONG_TTL_S - 5) * 1000 < renewed.remaining_ms <= LONG_TTL_S * 1000
