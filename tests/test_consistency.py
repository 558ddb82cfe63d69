"""Concurrency and faults: no job stuck, vanished or misreported (issue 12, items 1-5)."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import ray

from jobs_server.app_state import JOB_MANAGER_KEY
from jobs_server.errors import JobNotFoundError
from jobs_server.manager.archive.sqlite import Archive, JobQuery, archive_path
from jobs_server.manager.job_manager import JobManager
from jobs_server.manager.live.kv import GcsKv
from jobs_server.manager.live.store import JobStore
from jobs_server.manager.records import JobRecord, JobSpec, JobStatus, new_run_id, now_ms
from tests.support.api import Client, job_logs, submit, wait_for_status
from tests.support.managers import running_manager
from tests.support.processes import free_port, stop_process_group
from tests.support.queue import until_status
from tests.support.ray_nodes import kill_actors_in_namespace
from tests.support.servers import start_jobs_server, wait_for_server

# Among the longest modules: started first when tests run in parallel (tests/conftest.py).
pytestmark = pytest.mark.slow

SHARED_SUPERVISOR_PREFIX = "jobs_server_shared_supervisor:"


def _actors(namespace: str) -> list[str]:
    return [
        actor["name"]
        for actor in ray.util.list_named_actors(all_namespaces=True)
        if actor["namespace"] == namespace
    ]


async def _wait_until_gone(name: str, namespace: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while name in _actors(namespace):
        assert time.monotonic() < deadline, f"actor {name} still alive"
        await asyncio.sleep(0.1)


def _kill_supervisor_process(name: str, namespace: str) -> None:
    supervisor = ray.get_actor(name, namespace=namespace)
    pid = ray.get(supervisor.pid.remote(), timeout=30)
    os.kill(pid, signal.SIGKILL)


async def test_jobs_of_a_supervisor_killed_while_no_server_ran_end_failed(
    ray_connection: str, tmp_path: Path
) -> None:
    """Item 1: a new shared supervisor under the old name does not adopt the dead one's jobs."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    namespace = f"stuck_{uuid.uuid4().hex[:8]}"
    args = [
        *("--port", str(port), "--ray-address", ray_connection),
        *("--log-dir", str(tmp_path / "logs"), "--namespace", namespace),
        *("--state-dir", str(tmp_path / "state")),
    ]
    log_path = tmp_path / "server.log"
    first = start_jobs_server(args, log_path)
    second: subprocess.Popen[bytes] | None = None
    try:
        wait_for_server(url, first, log_path)
        async with aiohttp.ClientSession(base_url=url) as http:
            job_ids = [await submit(http, entrypoint="echo up; sleep 1000") for _ in range(3)]
            for job_id in job_ids:
                await wait_for_status(http, job_id, {"RUNNING"})
        os.kill(first.pid, signal.SIGKILL)
        first.wait()
        (shared,) = [
            name for name in _actors(namespace) if name.startswith(SHARED_SUPERVISOR_PREFIX)
        ]
        _kill_supervisor_process(shared, namespace)
        await _wait_until_gone(shared, namespace)

        second = start_jobs_server(args, log_path)
        wait_for_server(url, second, log_path)
        async with aiohttp.ClientSession(base_url=url) as http:
            for job_id in job_ids:
                job = await wait_for_status(http, job_id, {"FAILED"}, timeout_s=30)
                assert job["error_type"] == "JOB_SUPERVISOR_ACTOR_DIED", job
                assert "supervisor" in job["message"], job
                assert await job_logs(http, job_id) == "up\n"
            # The new shared supervisor runs new jobs.
            fresh = await submit(http, entrypoint="echo fresh")
            assert (await wait_for_status(http, fresh))["status"] == "SUCCEEDED"
    finally:
        stop_process_group(first)
        if second is not None:
            stop_process_group(second)
        kill_actors_in_namespace(namespace)


async def test_every_accepted_job_is_in_every_later_list_and_in_metrics(client: Client) -> None:
    """Item 2: a job created while a list awaits the KV is not dropped from the index."""
    answered_at: dict[str, float] = {}
    lists: list[tuple[float, set[str]]] = []
    submitting = True

    async def submit_one(index: int) -> None:
        job_id = await submit(client, entrypoint="true", submission_id=f"listed-{index:03d}")
        answered_at[job_id] = time.monotonic()

    async def list_meanwhile() -> None:
        while submitting:
            began = time.monotonic()
            response = await client.get("/api/jobs/")
            assert response.status == 200
            lists.append((began, {job["submission_id"] for job in await response.json()}))

    listers = [asyncio.create_task(list_meanwhile()) for _ in range(3)]
    try:
        await asyncio.gather(*(submit_one(index) for index in range(200)))
    finally:
        submitting = False
        await asyncio.gather(*listers)
    began = time.monotonic()
    response = await client.get("/api/jobs/")
    lists.append((began, {job["submission_id"] for job in await response.json()}))
    missing = [
        (job_id, len(lists) - index)
        for index, (list_began, listed) in enumerate(lists)
        for job_id, answered in answered_at.items()
        if answered < list_began and job_id not in listed
    ]
    assert not missing, f"{len(missing)} accepted jobs missing from later lists: {missing[:10]}"
    metrics = await (await client.get("/metrics")).text()
    counted = sum(
        float(line.split()[-1])
        for line in metrics.splitlines()
        if line.startswith("jobs_server_jobs{") or line.startswith("jobs_server_jobs ")
    )
    assert counted == 200, [line for line in metrics.splitlines() if "jobs_server_jobs" in line]


async def test_delete_then_resubmit_the_same_id_at_once(client: Client, settings: Any) -> None:
    """Item 3: a dedicated supervisor's name is per run, and each run has its own watcher."""
    for cycle in range(20):
        exit_code = cycle % 3
        job_id = await submit(
            client,
            entrypoint=f"echo run-{cycle}; exit {exit_code}",
            submission_id="again",
            entrypoint_num_cpus=0.5,
        )
        # No pause between seeing the end and deleting: the old run's supervisor may still be
        # there when its id comes again.
        job = await wait_for_status(client, job_id, poll_s=0.005)
        assert job["status"] == ("SUCCEEDED" if exit_code == 0 else "FAILED"), (cycle, job)
        assert job["driver_exit_code"] == exit_code, (cycle, job)
        assert await job_logs(client, job_id) == f"run-{cycle}\n", cycle
        response = await client.delete(f"/api/jobs/{job_id}")
        assert response.status == 200, (cycle, await response.text())
    # Every run's supervisor is gone with its run.
    deadline = time.monotonic() + 60
    while [name for name in _actors(settings.namespace) if "again" in name]:
        assert time.monotonic() < deadline, _actors(settings.namespace)
        await asyncio.sleep(0.2)


def _patch_everywhere(monkeypatch: pytest.MonkeyPatch, name: str, replacement: Any) -> None:
    """Replace the function `name` in every manager module that holds it."""
    for module_name, module in list(sys.modules.items()):
        if module_name.startswith("jobs_server.manager") and hasattr(module, name):
            monkeypatch.setattr(module, name, replacement)


def _failing(times: int | None, error: Exception) -> tuple[Any, list[int]]:
    calls = [0]

    def fail(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if times is None or calls[0] <= times:
            raise error
        return True

    return fail, calls


def _dedicated_name(namespace: str, job_id: str) -> str:
    (name,) = [name for name in _actors(namespace) if job_id in name]
    return name


@pytest.fixture
def fast_watch_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    from jobs_server.manager.live import run_outcomes

    monkeypatch.setattr(run_outcomes, "WATCH_RETRY_INITIAL_S", 0.05)
    monkeypatch.setattr(run_outcomes, "WATCH_RETRY_MAX_S", 0.2)


async def test_a_watcher_survives_errors_while_its_supervisor_dies(
    client: Client, settings: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Item 4: Ray failing inside the 'supervisor died' branch does not end the watcher."""
    fail, calls = _failing(3, RuntimeError("injected: ray.nodes() failed"))
    _patch_everywhere(monkeypatch, "node_is_alive", fail)
    job_id = await submit(client, entrypoint="sleep 1000", entrypoint_num_cpus=0.5)
    await wait_for_status(client, job_id, {"RUNNING"})
    name = _dedicated_name(settings.namespace, job_id)
    _kill_supervisor_process(name, settings.namespace)
    job = await wait_for_status(client, job_id, {"FAILED"}, timeout_s=60)
    assert job["error_type"] == "JOB_SUPERVISOR_ACTOR_DIED", job
    assert calls[0] >= 1
    assert "injected" in caplog.text
    await _wait_until_gone(name, settings.namespace)


async def test_a_watcher_retries_the_kv_until_it_records_the_end(
    client: Client,
    settings: Any,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    fast_watch_retries: None,
) -> None:
    """Item 4: the KV failing when the watcher records a death is retried, then recorded."""
    job_id = await submit(client, entrypoint="sleep 1000", entrypoint_num_cpus=0.5)
    await wait_for_status(client, job_id, {"RUNNING"})
    name = _dedicated_name(settings.namespace, job_id)
    # The server's own KV client (the supervisors, in their processes, keep theirs).
    kv = client.app[JOB_MANAGER_KEY]._store._kv
    failures_left = {"get": 4, "get_many": 4, "put": 4, "create": 4}
    for method in failures_left:
        original = getattr(kv, method)

        async def failing(*args: Any, _method: str = method, _original: Any = original) -> Any:
            if failures_left[_method] > 0:
                failures_left[_method] -= 1
                raise ConnectionError(f"injected: the KV's {_method} failed")
            return await _original(*args)

        monkeypatch.setattr(kv, method, failing)
    _kill_supervisor_process(name, settings.namespace)
    # The API reads through the same KV: a 500 while it fails is expected.
    deadline = time.monotonic() + 60
    job: dict[str, Any] = {}
    while job.get("status") != "FAILED":
        assert time.monotonic() < deadline, job
        await asyncio.sleep(0.1)
        response = await client.get(f"/api/jobs/{job_id}")
        if response.status == 200:
            job = await response.json()
    assert job["error_type"] == "JOB_SUPERVISOR_ACTOR_DIED", job
    assert "injected: the KV" in caplog.text
    assert failures_left["create"] == 0 or failures_left["put"] == 0, failures_left
    await _wait_until_gone(name, settings.namespace)


async def test_a_dedicated_supervisor_is_killed_even_when_killing_fails(
    client: Client,
    settings: Any,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    fast_watch_retries: None,
) -> None:
    """Item 4: Ray refusing to kill a finished job's supervisor a few times is retried."""
    original_kill = ray.kill
    fail, calls = _failing(3, RuntimeError("injected: ray.kill failed"))

    def kill(actor: Any, *, no_restart: bool = True) -> None:
        if calls[0] < 3:
            fail()
        original_kill(actor, no_restart=no_restart)

    job_id = await submit(client, entrypoint="sleep 1; echo done", entrypoint_num_cpus=0.5)
    await wait_for_status(client, job_id, {"RUNNING"})
    name = _dedicated_name(settings.namespace, job_id)
    monkeypatch.setattr(ray, "kill", kill)
    job = await wait_for_status(client, job_id, timeout_s=60)
    assert job["status"] == "SUCCEEDED", job
    await _wait_until_gone(name, settings.namespace)
    assert calls[0] >= 3
    assert "injected: ray.kill failed" in caplog.text


async def _stop_right_after_submit(client: Client, index: int) -> tuple[str, list[str]]:
    # Long enough that a job which ends SUCCEEDED was not stopped: its stop was lost.
    body: dict[str, Any] = {"entrypoint": "sleep 10", "submission_id": f"race-{index:03d}"}
    if index % 10 == 0:
        body["entrypoint_num_cpus"] = 0.01  # a supervisor of its own
    job_id = await submit(client, **body)
    seen: list[str] = []
    # Spread the stops over the time the supervisors write RUNNING, to meet each window.
    await asyncio.sleep(random.uniform(0, 0.1))
    response = await client.post(f"/api/jobs/{job_id}/stop")
    assert response.status == 200, await response.text()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        job = await (await client.get(f"/api/jobs/{job_id}")).json()
        seen.append(job["status"])
        if (
            job["status"] in {"STOPPED", "SUCCEEDED", "FAILED"}
            and len(seen) > 3
            and all(status == job["status"] for status in seen[-3:])
        ):
            return job_id, seen
        await asyncio.sleep(0.05)
    return job_id, seen


async def test_stop_right_after_submit_always_ends_stopped(client: Client) -> None:
    """Item 5: the first terminal status wins; nothing (not a late RUNNING) follows it, and a
    stop is never lost to a supervisor that writes RUNNING at the same time."""
    # Many at once (a busy GCS and supervisor widen the window between a read and its
    # write), in batches a loaded machine answers within the stop's patience.
    results: list[tuple[str, list[str]]] = []
    for batch in range(5):
        results += await asyncio.gather(
            *(_stop_right_after_submit(client, batch * 40 + index) for index in range(40))
        )
    wrong = []
    for job_id, seen in results:
        terminal = [
            index
            for index, status in enumerate(seen)
            if status in {"STOPPED", "SUCCEEDED", "FAILED"}
        ]
        if (
            not terminal
            or seen[-1] != "STOPPED"
            or any(status != seen[terminal[0]] for status in seen[terminal[0] :])
        ):
            wrong.append((job_id, seen))
    assert not wrong, f"{len(wrong)} of 200 raced wrong: {wrong[:5]}"


def _between_the_reads(
    monkeypatch: pytest.MonkeyPatch,
    store: JobStore,
    job_id: str,
    action: Callable[[list[JobRecord]], Awaitable[None]],
) -> Callable[[list[JobRecord]], Awaitable[dict[str, JobRecord]]]:
    """Inject `action` between a read's two reads: the first time the store is asked for the KV's
    state of `job_id` (after the archive's row was read), `action` runs, then the KV is read.
    Returns the store's own read, which is back in place once the injection has run."""
    read_the_kv = store.current

    async def action_then_read(records: list[JobRecord]) -> dict[str, JobRecord]:
        if any(record.submission_id == job_id for record in records):
            monkeypatch.setattr(store, "current", read_the_kv)
            await action(records)
        return await read_the_kv(records)

    monkeypatch.setattr(store, "current", action_then_read)
    return read_the_kv


async def _stop_until_forgotten(
    manager: JobManager,
    read_the_kv: Callable[[list[JobRecord]], Awaitable[dict[str, JobRecord]]],
    records: list[JobRecord],
    job_id: str,
) -> None:
    """Stop the job, and wait until its end is archived and the KV has forgotten its run."""
    await manager.stop_job(job_id)
    deadline = time.monotonic() + 60
    while (await read_the_kv(records)).get(job_id) is not None:
        assert time.monotonic() < deadline, "the end was never forgotten"
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("read", ["get", "list"])
async def test_a_read_that_meets_the_end_archived_and_forgotten_between_its_two_reads_says_so(
    ray_connection: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, read: str
) -> None:
    """Item 5, at the reads: a read takes the archive's row (RUNNING), then the KV's state. A
    job that ends, is archived and is forgotten in the KV between the two reads reads as ended,
    never as the RUNNING row it started from (CI once saw RUNNING after STOPPED this way)."""
    namespace = f"consistency_{uuid.uuid4().hex[:8]}"
    try:
        async with running_manager(ray_connection, namespace, tmp_path / "state") as (
            manager,
            archive,
        ):
            running = JobSpec(entrypoint="sleep 1000", submission_id="between")
            await manager.submit_job(running)
            await until_status(manager, "between", {JobStatus.RUNNING})
            store = manager._store

            async def end(records: list[JobRecord]) -> None:
                await _stop_until_forgotten(manager, store.current, records, "between")
                archived = await archive.get("between")
                assert archived is not None
                assert archived.status is JobStatus.STOPPED

            read_the_kv = _between_the_reads(monkeypatch, store, "between", end)
            if read == "get":
                seen = await manager.get_job("between")
            else:
                (seen,) = (await manager.list_jobs()).records
            assert seen.status is JobStatus.STOPPED, seen
            assert store.current is read_the_kv, "the injection never ran"
    finally:
        kill_actors_in_namespace(namespace)


async def test_a_list_leaves_out_the_job_of_another_tenant_that_took_the_id_between_its_reads(
    ray_connection: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ids do not leak across tenants, at the reads: a list of team-a's jobs takes the row of
    its running job, which then ends, is deleted, and is submitted again by team-b before the
    list reads the KV. The list leaves the id out: the run it finds now is not team-a's."""
    namespace = f"consistency_{uuid.uuid4().hex[:8]}"
    try:
        async with running_manager(ray_connection, namespace, tmp_path / "state") as (
            manager,
            _,
        ):
            await manager.submit_job(
                JobSpec(entrypoint="sleep 1000", submission_id="taken"), tenant="team-a"
            )
            await until_status(manager, "taken", {JobStatus.RUNNING})
            store = manager._store

            async def take_over(_: list[JobRecord]) -> None:
                await manager.stop_job("taken")
                await until_status(manager, "taken", {JobStatus.STOPPED})
                await manager.delete_job("taken")
                await manager.submit_job(
                    JobSpec(entrypoint="true", submission_id="taken"), tenant="team-b"
                )

            read_the_kv = _between_the_reads(monkeypatch, store, "taken", take_over)
            seen = (await manager.list_jobs(tenant="team-a")).records
            assert store.current is read_the_kv, "the injection never ran"
            assert [(record.submission_id, record.tenant) for record in seen] == []
            taken = await until_status(manager, "taken", {JobStatus.SUCCEEDED})
            assert taken.tenant == "team-b"
    finally:
        kill_actors_in_namespace(namespace)


@pytest.mark.parametrize("then", ["ended", "deleted"])
async def test_a_count_that_meets_the_end_archived_and_forgotten_between_its_two_reads_says_so(
    ray_connection: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, then: str
) -> None:
    """Item 5, at the counts (`/metrics`): a count takes the archive's counts (the job RUNNING),
    then the KV's state of the live jobs. A job that ends, is archived and is forgotten in the
    KV between the two reads is counted as it ended (or, deleted meanwhile, not at all), never
    as the RUNNING it was counted as first."""
    namespace = f"consistency_{uuid.uuid4().hex[:8]}"
    try:
        async with running_manager(ray_connection, namespace, tmp_path / "state") as (
            manager,
            _,
        ):
            await manager.submit_job(JobSpec(entrypoint="sleep 1000", submission_id="counted"))
            await until_status(manager, "counted", {JobStatus.RUNNING})
            store = manager._store

            async def end(records: list[JobRecord]) -> None:
                await _stop_until_forgotten(manager, store.current, records, "counted")
                if then == "deleted":
                    await manager.delete_job("counted")

            read_the_kv = _between_the_reads(monkeypatch, store, "counted", end)
            counts = await manager.count_by_status()
            assert store.current is read_the_kv, "the injection never ran"
            assert counts == ({JobStatus.STOPPED: 1} if then == "ended" else {})
    finally:
        kill_actors_in_namespace(namespace)


async def test_racing_writers_agree_on_the_first_terminal_status(ray_connection: str) -> None:
    """Item 5, at the store: a supervisor writing RUNNING, a stop and a failure race on each of
    200 jobs, each through a KV client of its own (as the server and a supervisor have): every
    writer is told the same terminal status, the one that stays, and RUNNING never follows it."""
    namespace = f"race_{uuid.uuid4().hex[:8]}"
    supervisor, server, other = (JobStore(GcsKv(ray_connection, namespace)) for _ in range(3))

    async def race(index: int) -> tuple[list[JobRecord], JobRecord]:
        spec = JobSpec(entrypoint="true", submission_id=f"race-{index:03d}")
        await server.create(JobRecord(spec=spec, start_time=now_ms()))
        written = await asyncio.gather(
            supervisor.update(spec.submission_id, status=JobStatus.RUNNING, driver_pid=1),
            server.update(spec.submission_id, status=JobStatus.STOPPED, message="stopped"),
            other.update(spec.submission_id, status=JobStatus.FAILED, message="died"),
        )
        return list(written), await JobStore(GcsKv(ray_connection, namespace)).get(
            spec.submission_id
        )

    results = await asyncio.gather(*(race(index) for index in range(200)))
    wrong = []
    for written, final in results:
        told = {record.status for record in written[1:]}
        running_told = written[0].status
        if (
            not final.status.is_terminal()
            or told != {final.status}
            or running_told not in {JobStatus.RUNNING, final.status}
        ):
            wrong.append((final.submission_id, [r.status for r in written], final.status))
    assert not wrong, f"{len(wrong)} of 200 raced wrong: {wrong[:5]}"


async def test_a_supervisor_writing_from_the_record_it_holds_agrees_with_racing_ends(
    ray_connection: str,
) -> None:
    """A supervisor writes from the live record it read as the run began (no read before each
    write: `update_from`): its RUNNING, then its end, race a stop and a failure on each of 200
    jobs. Every writer is told the terminal status that stays, and the KV never reads RUNNING
    after it."""
    namespace = f"held_{uuid.uuid4().hex[:8]}"
    supervisor, server, other = (JobStore(GcsKv(ray_connection, namespace)) for _ in range(3))

    async def supervise(submission_id: str) -> JobRecord:
        held = await supervisor.get(submission_id)
        running = await supervisor.update_from(held, status=JobStatus.RUNNING, driver_pid=1)
        return await supervisor.update_from(running, status=JobStatus.SUCCEEDED, message="ok")

    async def race(index: int) -> tuple[list[JobRecord], JobRecord]:
        spec = JobSpec(entrypoint="true", submission_id=f"held-{index:03d}")
        await server.create(JobRecord(spec=spec, start_time=now_ms()))
        written = await asyncio.gather(
            supervise(spec.submission_id),
            server.update(spec.submission_id, status=JobStatus.STOPPED, message="stopped"),
            other.update(spec.submission_id, status=JobStatus.FAILED, message="died"),
        )
        return list(written), await JobStore(GcsKv(ray_connection, namespace)).get(
            spec.submission_id
        )

    results = await asyncio.gather(*(race(index) for index in range(200)))
    wrong = [
        (final.submission_id, [record.status for record in written], final.status)
        for written, final in results
        if not final.status.is_terminal() or {record.status for record in written} != {final.status}
    ]
    assert not wrong, f"{len(wrong)} of 200 raced wrong: {wrong[:5]}"
    # Each of the three won some races: the supervisor's end is not always first or last.
    assert len({final.status for _, final in results}) >= 2


async def test_a_slow_forget_never_removes_the_run_created_after_it(ray_connection: str) -> None:
    """An ended run's forget whose KV delete is slow (the GCS retried) races the job's delete
    and the same id submitted again: the new run's live record must stay, or its supervisor
    finds nothing to run."""
    namespace = f"forget_{uuid.uuid4().hex[:8]}"
    kv = GcsKv(ray_connection, namespace)
    server = JobStore(kv)
    delete = kv.delete
    held = asyncio.Event()

    async def slow_first_delete(key: str) -> None:
        if not held.is_set():
            held.set()
            await asyncio.sleep(0.5)
        await delete(key)

    kv.delete = slow_first_delete  # type: ignore[method-assign]
    spec = JobSpec(entrypoint="true", submission_id="again")
    old = JobRecord(spec=spec, start_time=now_ms(), run_id=new_run_id())
    await server.create(old)
    forget = asyncio.create_task(server.delete(old))
    await held.wait()
    await server.delete(old)  # the job's DELETE
    new = JobRecord(spec=spec, start_time=now_ms(), run_id=new_run_id())
    await server.create(new)
    await forget
    assert (await server.get("again", new.run_id)).run_id == new.run_id
    # And a forget of the old run that comes after the new one was created leaves it too.
    await server.delete(old)
    assert (await server.get("again", new.run_id)).run_id == new.run_id


async def test_forgetting_a_run_this_server_created_reads_nothing(ray_connection: str) -> None:
    """The server created the run's live record, and every later run of the id would be
    created by it too: a delete needs no read to know the record is this run's."""
    namespace = f"forget_{uuid.uuid4().hex[:8]}"
    kv = GcsKv(ray_connection, namespace)
    server = JobStore(kv)
    record = JobRecord(spec=JobSpec(entrypoint="true", submission_id="once"), start_time=now_ms())
    await server.create(record)
    reads: list[object] = []
    get, get_many = kv.get, kv.get_many

    async def counted_get(key: str) -> bytes | None:
        reads.append(key)
        return await get(key)

    async def counted_get_many(keys: list[str]) -> dict[str, bytes]:
        reads.append(keys)
        return await get_many(keys)

    kv.get, kv.get_many = counted_get, counted_get_many  # type: ignore[method-assign]
    await server.delete(record)
    assert reads == []
    kv.get, kv.get_many = get, get_many  # type: ignore[method-assign]
    with pytest.raises(JobNotFoundError):
        await server.get("once")
    # A run this store did not create (an earlier server's) is still read first.
    other = JobStore(GcsKv(ray_connection, namespace))
    await other.create(record)
    kv.get = counted_get  # type: ignore[method-assign]
    await server.delete(record)
    assert reads == ["job:once"]
    with pytest.raises(JobNotFoundError):
        await other.get("once")


async def test_jobs_created_while_lists_run_are_in_every_later_list(tmp_path: Path) -> None:
    """Item 2, at the archive (the history lists are read from): inserts racing with lists are
    in every list that begins after they were answered."""
    archive = Archive(archive_path(tmp_path / "state"))
    await archive.open()
    for index in range(100):  # something to list
        spec = JobSpec(entrypoint="true", submission_id=f"old-{index:03d}")
        await archive.insert(JobRecord(spec=spec, start_time=now_ms()))
    created: list[str] = []

    async def create(index: int) -> None:
        await asyncio.sleep(index * 0.003)  # spread over the lists
        spec = JobSpec(entrypoint="true", submission_id=f"new-{index:03d}")
        await archive.insert(JobRecord(spec=spec, start_time=now_ms()))
        created.append(spec.submission_id)

    lists: list[tuple[list[str], set[str]]] = []

    async def listed() -> set[str]:
        return {
            record.submission_id async for batch in archive.stream(JobQuery()) for record in batch
        }

    async def list_meanwhile() -> None:
        while len(created) < 100:
            before = list(created)
            lists.append((before, await listed()))

    await asyncio.gather(
        *(create(index) for index in range(100)), list_meanwhile(), list_meanwhile()
    )
    lists.append((list(created), await listed()))
    await archive.close()
    for before, found in lists:
        assert set(before) <= found, (len(lists), sorted(set(before) - found)[:10])
    assert len(lists[-1][1]) == 200


async def test_a_pending_job_whose_command_began_is_not_run_again(
    aiohttp_client: Any, settings: Any
) -> None:
    """A server killed after its shared supervisor began a job's command (its log exists) but
    before RUNNING was recorded, and that supervisor killed too: the restarted server must not
    run the command a second time on the new supervisor, and must still start a job that was
    never handed over."""
    from jobs_server.app import create_app
    from jobs_server.manager.logs import job_log_path
    from jobs_server.manager.records import new_run_id

    store = JobStore(GcsKv(settings.ray_address, settings.namespace))
    began, never = "began-" + uuid.uuid4().hex[:6], "never-" + uuid.uuid4().hex[:6]
    for job_id in (began, never):
        spec = JobSpec(entrypoint=f"echo second run of {job_id}", submission_id=job_id)
        await store.create(JobRecord(spec=spec, start_time=now_ms(), run_id=new_run_id()))
    settings.log_dir.mkdir(parents=True, exist_ok=True)
    job_log_path(settings.log_dir, began).write_text("first run\n")

    client = await aiohttp_client(create_app(settings))
    began_job = await wait_for_status(client, began)
    assert began_job["status"] == "FAILED"
    assert began_job["error_type"] == "JOB_SUPERVISOR_ACTOR_DIED"
    assert await job_logs(client, began) == "first run\n"
    never_job = await wait_for_status(client, never)
    assert never_job["status"] == "SUCCEEDED"
    assert await job_logs(client, never) == f"second run of {never}\n"
