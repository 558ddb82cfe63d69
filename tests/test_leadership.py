"""Which replica leads (manager/archive/leadership.py), on both stores, with two replicas' real
archives of one history and callbacks in place of the job manager: the first leads at its
start, the other follows and forwards to it; a leader that stops is replaced within a second; a
takeover that fails gives the lead up and is tried again; a leader whose lease another replica
took steps down (its work dropped) and follows, and its confirmations fail from then on."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from jobs_server.errors import LeaderUnavailableError
from jobs_server.manager.archive.interface import JobArchive
from jobs_server.manager.archive.leadership import SERVER_LEASE, Leadership
from jobs_server.manager.archive.leases import LEASE_RENEW_INTERVAL_S, ReplicaLeases

DEADLINE_S = 10.0
# A lease that expires long before its holder's next renewal (every LEASE_RENEW_INTERVAL_S):
# the holder is, to the others, a leader frozen past its lease.
EXPIRING_TTL_S = 0.2


@dataclass
class Work:
    """What the manager would do when a replica is elected and deposed, recorded."""

    failures_left: int = 0
    events: list[str] = field(default_factory=list)

    async def elected(self) -> None:
        if self.failures_left:
            self.failures_left -= 1
            self.events.append("takeover failed")
            raise RuntimeError("the GCS did not answer during the recovery")
        self.events.append("elected")

    async def deposed(self) -> None:
        self.events.append("deposed")


async def eventually(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.02)


async def start(
    archive: JobArchive, url: str, work: Work, *, ttl_s: float | None = None
) -> Leadership:
    leases = ReplicaLeases(archive, url=url)
    if ttl_s is not None:
        leases.ttl_s = ttl_s
    leadership = Leadership(leases)
    await leadership.start(work.elected, work.deposed)
    return leadership


async def test_the_first_leads_the_other_follows_and_takes_over_when_it_stops(
    two_archives: list[JobArchive],
) -> None:
    first_work, second_work = Work(), Work()
    first = await start(two_archives[0], "http://first:1", first_work)
    second = await start(two_archives[1], "http://second:2", second_work)
    try:
        assert first_work.events == ["elected"]  # before its start returned: ready to serve
        assert (first.leading, first.ready_to_write) == (True, True)
        assert await first.leader_url() is None
        assert (second.leading, second_work.events) == (False, [])
        assert await second.leader_url() == "http://first:1"
        await first.confirmed()

        stopped = time.monotonic()
        await first.close()  # gives the lease up
        await eventually(lambda: second.ready_to_write, "the follower to lead")
        assert time.monotonic() - stopped < LEASE_RENEW_INTERVAL_S + 1
        assert second_work.events == ["elected"]
        assert await second.leader_url() is None
    finally:
        await first.close()
        await second.close()


async def test_a_takeover_that_fails_gives_the_lead_up_and_is_tried_again(
    two_archives: list[JobArchive],
) -> None:
    first = await start(two_archives[0], "http://first:1", Work())
    second_work = Work(failures_left=1)
    second = await start(two_archives[1], "http://second:2", second_work)
    try:
        await first.close()
        await eventually(lambda: second.ready_to_write, "the follower to lead at its second try")
        # The failed takeover dropped what it had taken before the lead was asked for again.
        assert second_work.events == ["takeover failed", "deposed", "elected"]
        lease = await second.leases.current(SERVER_LEASE)
        assert lease is not None
        assert lease.holder == second.leases.replica_id
    finally:
        await second.close()


async def test_a_leader_whose_lease_was_taken_steps_down_and_follows(
    two_archives: list[JobArchive],
) -> None:
    old_work, new_work = Work(), Work()
    # Its lease expires between its renewals: another replica takes it, as from a frozen one.
    old = await start(two_archives[0], "http://old:1", old_work, ttl_s=EXPIRING_TTL_S)
    new = await start(two_archives[1], "http://new:2", new_work)
    try:
        await eventually(lambda: new.ready_to_write, "the other replica to take the lead")
        await eventually(lambda: old_work.events == ["elected", "deposed"], "the old to step down")
        assert not old.leading
        with pytest.raises(LeaderUnavailableError):
            await old.confirmed()
        assert await old.leader_url() == "http://new:2"
        assert old.leases.counters.lost == 1
        assert new.leases.counters.taken_over == 1
    finally:
        await old.close()
        await new.close()
