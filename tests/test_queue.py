"""The queue on a real server and real Ray (issue 15, items 3-5): caps on running and queued jobs,
the place a queued job is told, 429 with Retry-After when the queue is full, the order (tenants
taking turns, priority then arrival within a tenant), stopping a queued job (and the race of a
stop against its dispatch), and submits racing for the last place. Tenants are exercised through
the manager (`submit_job(..., tenant=...)`, `tenant_limits`), as keys are not part of this
branch. The queue across a killed server: tests/test_queue_restarts.py."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from jobs_server.errors import JobNotFoundError, QueueFullError
from jobs_server.manager import JobRecord, JobStatus
from jobs_server.manager.supervisor.job_run import NEVER_STARTED_MESSAGE
from jobs_server.manager.tenancy import NO_LIMITS, TenantLimits
from jobs_server.settings import Settings
from tests.support.api import Client, submit, wait_for_status
from tests.support.openapi_contract import Contract, Exchange
from tests.support.queue import TERMINAL, WAIT_S, gate, queue_manager, spec, until_status


@pytest.fixture
def settings(settings: Settings) -> Settings:
    return settings.model_copy(update={"max_running_jobs": 1, "max_queued_jobs": 2})


async def test_over_the_cap_a_job_waits_with_its_place_and_a_full_queue_is_429(
    client: Client, tmp_path: Path
) -> None:
    api = Exchange(client, Contract.load())
    running = await submit(client, entrypoint=gate(tmp_path / "go"))
    await wait_for_status(client, running, {"RUNNING"})
    first = await submit(client, entrypoint=f"echo first > {tmp_path / 'first'}")
    second = await submit(client, entrypoint=f"echo second > {tmp_path / 'second'}")
    job = await api.call("GET", f"/api/jobs/{first}", expect=200)
    assert (job["status"], job["message"]) == ("PENDING", "Queued: 1st of 2; 1 of 1 running")
    job = await api.call("GET", f"/api/jobs/{second}", expect=200)
    assert job["message"] == "Queued: 2nd of 2; 1 of 1 running"
    listed = {job["submission_id"]: job for job in await (await client.get("/api/jobs/")).json()}
    assert listed[second]["message"] == "Queued: 2nd of 2; 1 of 1 running"

    refused = await api.call(
        "POST", "/api/jobs/", json={"entrypoint": "true", "submission_id": "over"}, expect=429
    )
    assert refused["error"]["code"] == "queue_full"
    assert "at most 2" in refused["error"]["message"]
    response = await client.post("/api/jobs/", json={"entrypoint": "true"})
    assert response.status == 429
    assert 1 <= int(response.headers["Retry-After"]) <= 60
    # Nothing of a refused submit is recorded.
    assert (await client.get("/api/jobs/over")).status == 404
    assert len(await (await client.get("/api/jobs/")).json()) == 3

    # Stopping a queued job is immediate; its command never runs, and it can be deleted.
    stopped = await api.call("POST", f"/api/jobs/{first}/stop", expect=200)
    assert stopped == {"stopped": True}
    job = await api.call("GET", f"/api/jobs/{first}", expect=200)
    assert (job["status"], job["message"]) == ("STOPPED", NEVER_STARTED_MESSAGE)
    assert (await api.call("GET", f"/api/jobs/{second}", expect=200))["message"].startswith(
        "Queued: 1st of 1;"
    )
    await api.call("DELETE", f"/api/jobs/{first}", expect=200)

    # The slot frees when the running job ends: the queued one runs.
    (tmp_path / "go").touch()
    assert (await wait_for_status(client, running, timeout_s=WAIT_S))["status"] == "SUCCEEDED"
    assert (await wait_for_status(client, second, timeout_s=WAIT_S))["status"] == "SUCCEEDED"
    assert (tmp_path / "second").read_text() == "second\n"
    assert not (tmp_path / "first").exists()


async def test_the_message_says_whether_a_job_waits_for_a_slot_or_for_resources(
    client: Client, tmp_path: Path
) -> None:
    holder = await submit(client, entrypoint="true", entrypoint_resources={"unobtainium": 1})
    waiting = await wait_for_status(client, holder, {"PENDING"}, message_part="Waiting for")
    assert waiting["message"].startswith("Waiting for resources no node has: ")
    queued = await submit(client, entrypoint=f"echo ran > {tmp_path / 'ran'}")
    job = await (await client.get(f"/api/jobs/{queued}")).json()
    assert (job["status"], job["message"]) == ("PENDING", "Queued: 1st of 1; 1 of 1 running")
    # The handed-over job held the slot while it waited for Ray; stopped, it frees it.
    assert (await (await client.post(f"/api/jobs/{holder}/stop")).json())["stopped"] is True
    assert (await wait_for_status(client, queued, timeout_s=WAIT_S))["status"] == "SUCCEEDED"
    assert (tmp_path / "ran").read_text() == "ran\n"


async def test_a_priority_goes_first_and_ray_clients_need_not_send_one(
    client: Client, tmp_path: Path
) -> None:
    order = tmp_path / "order"
    blocker = await submit(client, entrypoint=gate(tmp_path / "go"))
    await wait_for_status(client, blocker, {"RUNNING"})
    low = await submit(client, entrypoint=f"echo low >> {order}")
    high = await submit(client, entrypoint=f"echo high >> {order}", priority=5)
    assert (await (await client.get(f"/api/jobs/{high}")).json())["message"].startswith(
        "Queued: 1st of 2;"
    )
    assert (await (await client.get(f"/api/jobs/{high}")).json())["priority"] == 5
    (tmp_path / "go").touch()
    for job_id in (high, low):
        assert (await wait_for_status(client, job_id, timeout_s=WAIT_S))["status"] == "SUCCEEDED"
    assert order.read_text() == "high\nlow\n"


async def test_tenants_take_turns_and_priority_orders_each_tenants_jobs(
    ray_connection: str, tmp_path: Path
) -> None:
    order = tmp_path / "order"
    async with queue_manager(ray_connection, tmp_path / "state", max_running=1) as manager:
        await manager.submit_job(spec("blocker", gate(tmp_path / "go")), tenant="c")
        await until_status(manager, "blocker", {JobStatus.RUNNING})
        for name in ("a0", "a1", "a2", "a3"):
            await manager.submit_job(spec(name, f"echo {name} >> {order}"), tenant="a")
        await manager.submit_job(spec("b0", f"echo b0 >> {order}"), tenant="b")
        await manager.submit_job(spec("b1", f"echo b1 >> {order}", priority=5), tenant="b")
        expected = ["a0", "b1", "a1", "b0", "a2", "a3"]
        for place, name in enumerate(expected, start=1):
            message = (await manager.get_job(name)).message or ""
            assert message.startswith(f"Queued: {place}"), (name, message)
        (tmp_path / "go").touch()
        for name in expected:
            assert (await until_status(manager, name, TERMINAL)).status is JobStatus.SUCCEEDED
        assert order.read_text().split() == expected


async def test_a_tenant_at_its_caps_waits_or_is_refused_while_others_run(
    ray_connection: str, tmp_path: Path
) -> None:
    def limits(tenant: str) -> TenantLimits:
        return TenantLimits(max_running=1, max_queued=1) if tenant == "a" else NO_LIMITS

    async with queue_manager(
        ray_connection, tmp_path / "state", max_queued=100, tenant_limits=limits
    ) as manager:
        await manager.submit_job(spec("a-running", gate(tmp_path / "go")), tenant="a")
        await until_status(manager, "a-running", {JobStatus.RUNNING})
        await manager.submit_job(spec("a-queued"), tenant="a")
        record = await manager.get_job("a-queued")
        assert record.status is JobStatus.PENDING
        assert record.message == "Queued: 1st of 1; 1 running; tenant a: 1 of 1 running"
        # Queued: an archive row only, nothing in the KV (no supervisor knows of it).
        with pytest.raises(JobNotFoundError):
            await manager._store.get("a-queued")
        with pytest.raises(QueueFullError) as refused:
            await manager.submit_job(spec("a-refused"), tenant="a")
        assert "tenant 'a'" in refused.value.message
        # Another tenant is not held up by a's caps.
        await manager.submit_job(spec("b-now"), tenant="b")
        assert (await until_status(manager, "b-now", TERMINAL)).status is JobStatus.SUCCEEDED
        assert (await manager.get_job("a-queued")).status is JobStatus.PENDING
        (tmp_path / "go").touch()
        assert (await until_status(manager, "a-queued", TERMINAL)).status is JobStatus.SUCCEEDED
        assert [r.submission_id for r in (await manager.list_jobs()).records] == [
            "a-running",
            "a-queued",
            "b-now",
        ]


async def test_submits_racing_for_the_last_places_win_exactly_as_many(
    ray_connection: str, tmp_path: Path
) -> None:
    async with queue_manager(
        ray_connection, tmp_path / "state", max_running=1, max_queued=5
    ) as manager:
        await manager.submit_job(spec("blocker", gate(tmp_path / "go")))
        outcomes = await asyncio.gather(
            *(manager.submit_job(spec(f"racer-{n}")) for n in range(20)), return_exceptions=True
        )
        accepted = [o for o in outcomes if isinstance(o, JobRecord)]
        refused = [o for o in outcomes if isinstance(o, QueueFullError)]
        assert (len(accepted), len(refused)) == (5, 15), outcomes
        listed = {r.submission_id for r in (await manager.list_jobs()).records}
        assert listed == {"blocker"} | {r.submission_id for r in accepted}
        (tmp_path / "go").touch()
        for record in accepted:
            final = await until_status(manager, record.submission_id, TERMINAL)
            assert final.status is JobStatus.SUCCEEDED


async def until(predicate: Callable[[], bool], what: str) -> None:
    """Poll `predicate` on every turn of the event loop (a state that lasts a few turns)."""
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0)


@pytest.mark.parametrize("moment", ["queued", "handing_over", "handed_over"])
async def test_a_stop_racing_the_dispatch_stops_the_job_and_frees_its_slot(
    ray_connection: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, moment: str
) -> None:
    marker = tmp_path / "ran"
    state_dir = tmp_path / "state"
    async with queue_manager(ray_connection, state_dir, max_running=1) as manager:
        queue, dispatcher, launcher = manager._queue, manager._dispatcher, manager._launcher
        await manager.submit_job(spec("blocker", gate(tmp_path / "go")))
        await until_status(manager, "blocker", {JobStatus.RUNNING})
        # It runs until stopped: a command that ended first would rightly end SUCCEEDED.
        await manager.submit_job(spec("queued", f"echo ran > {marker} && sleep 300"))
        # The hand-over waits, before its supervisor is asked to run the job, until released.
        released = asyncio.Event()
        supervisor_for = launcher.supervisor_for

        async def held(record: JobRecord) -> Any:
            await released.wait()
            return await supervisor_for(record)

        monkeypatch.setattr(launcher, "supervisor_for", held)
        if moment == "queued":
            released.set()
            assert await manager.stop_job("queued") is True
        else:
            (tmp_path / "go").touch()  # the blocker ends; its watcher dispatches the job
            await until(lambda: "queued" in dispatcher._handing_over, "the hand-over")
            if moment == "handing_over":
                stop = asyncio.create_task(manager.stop_job("queued"))
                await until(lambda: "queued" in dispatcher._called_off, "the stop to wait")
                released.set()
                assert await stop is True
            else:
                released.set()
                await until(lambda: "queued" not in dispatcher._handing_over, "the hand-over")
                assert await manager.stop_job("queued") is True
        record = await until_status(manager, "queued", TERMINAL)
        assert record.status is JobStatus.STOPPED
        if moment != "handed_over":
            # Never started: its command never ran, so it has no log.
            assert record.message == NEVER_STARTED_MESSAGE
            assert not (state_dir / "logs" / "job-driver-queued.log").exists()
            assert not marker.exists()
        await manager.delete_job("queued")
        # Its slot is free again: the next job runs.
        (tmp_path / "go").touch()
        await manager.submit_job(spec("after"))
        assert (await until_status(manager, "after", TERMINAL)).status is JobStatus.SUCCEEDED
        await until(lambda: queue.running == 0, "every slot to be free")
        assert queue.queued == 0


async def test_counts_read_the_live_jobs_records_not_the_queued_ones(
    ray_connection: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`/metrics` and the summaries count by status: the archive's counts, with the live jobs
    as the KV has them now. A deep queue's jobs are PENDING in both, so their records are not
    read: a scrape with 10,000 jobs queued parsed every one of them (0.3 s of the server's CPU,
    every scrape)."""
    async with queue_manager(ray_connection, tmp_path / "state", max_running=1) as manager:
        history, archive = manager._history, manager._archive
        release = asyncio.Event()
        learn_started = history.learn_started

        async def held_start(record: JobRecord, **known: Any) -> None:
            await release.wait()
            await learn_started(record, **known)

        # The archive does not learn that the blocker runs: only the KV knows.
        monkeypatch.setattr(history, "learn_started", held_start)
        await manager.submit_job(spec("blocker", gate(tmp_path / "go")))
        for index in range(30):
            await manager.submit_job(spec(f"queued-{index}"))
        await until_status(manager, "blocker", {JobStatus.RUNNING})
        archived = await archive.get("blocker")
        assert archived is not None
        assert archived.status is JobStatus.PENDING

        read: list[int] = []
        archive_read = archive._read

        async def counted_read(query: Callable[..., Any], *args: Any) -> Any:
            found = await archive_read(query, *args)
            if isinstance(found, list):
                read.append(len(found))
            return found

        monkeypatch.setattr(archive, "_read", counted_read)
        counts = await manager.count_by_status()
        assert counts.get(JobStatus.RUNNING) == 1
        assert counts.get(JobStatus.PENDING) == 30
        assert sum(read) <= 1, f"records read to count: {read}"
        release.set()
        (tmp_path / "go").touch()
        assert (await until_status(manager, "queued-29", TERMINAL)).status is JobStatus.SUCCEEDED
        monkeypatch.setattr(archive, "_read", archive_read)
        assert (await manager.count_by_status()) == {JobStatus.SUCCEEDED: 31}
