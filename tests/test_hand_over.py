"""Handing a job to its supervisor. A submitted job handed over at once goes the same way as a
queued one (Dispatcher), so a stop that races its hand-over calls it off the same way: on a real
server and real Ray, a stop arrives while the hand-over is held at each of its moments (recorded
but not in the KV yet; in the KV, no supervisor yet; supervisor up, not asked to run it yet;
asked). And a job's start timeout counts from its hand-over, across a restart too."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import psutil
import pytest
import ray

from jobs_server.app import create_app
from jobs_server.app_state import JOB_MANAGER_KEY
from jobs_server.manager import JobManager, JobRecord, JobSpec, JobStatus
from jobs_server.manager import job_manager as job_manager_module
from jobs_server.manager.supervisor.job_run import NEVER_STARTED_MESSAGE
from jobs_server.settings import Settings
from tests.support.api import Client, wait_for_status
from tests.support.managers import running_manager
from tests.support.queue import TERMINAL, until_status
from tests.support.ray_nodes import kill_actors_in_namespace

WAIT_S = 90.0


async def until(predicate: Callable[[], bool], what: str) -> None:
    """Poll `predicate` on every turn of the event loop (a state that lasts a few turns)."""
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0)


def processes_mentioning(text: str) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter(["cmdline"]):
        if any(text in part for part in process.info["cmdline"] or ()):
            found.append(process)
    return found


class HeldHandOver:
    """Holds the hand-over of one job at `moment` until released."""

    def __init__(self, manager: JobManager, moment: str, monkeypatch: pytest.MonkeyPatch) -> None:
        self.reached = asyncio.Event()
        self.released = asyncio.Event()
        store, launcher = manager._store, manager._launcher
        create, supervisor_for = store.create, launcher.supervisor_for

        async def hold() -> None:
            self.reached.set()
            await self.released.wait()

        async def held_create(record: JobRecord) -> None:
            if moment == "recorded":
                await hold()
            await create(record)

        async def held_supervisor_for(record: JobRecord) -> Any:
            if moment == "in_kv":
                await hold()
            supervisor = await supervisor_for(record)
            if moment == "supervisor_up":
                await hold()
            return supervisor

        monkeypatch.setattr(store, "create", held_create)
        monkeypatch.setattr(launcher, "supervisor_for", held_supervisor_for)


@pytest.mark.parametrize("own_supervisor", [False, True], ids=["shared", "own"])
@pytest.mark.parametrize("moment", ["recorded", "in_kv", "supervisor_up", "handed_over"])
async def test_a_stop_racing_a_submit_s_hand_over_calls_the_job_off(
    aiohttp_client: Any,
    settings: Settings,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    moment: str,
    own_supervisor: bool,
) -> None:
    client: Client = await aiohttp_client(create_app(settings))
    manager = cast(JobManager, client.app[JOB_MANAGER_KEY])
    started, gate = tmp_path / "started", tmp_path / "gate"
    body: dict[str, Any] = {
        "submission_id": "raced",
        "entrypoint": f"touch {started}; while [ ! -e {gate} ]; do sleep 0.05; done",
    }
    if own_supervisor:
        body["entrypoint_num_cpus"] = 0.01  # resources: a supervisor of the job's own
    held = HeldHandOver(manager, moment, monkeypatch)
    submitted = asyncio.create_task(client.post("/api/jobs/", json=body))
    if moment == "handed_over":
        held.released.set()
        await submitted  # answered: the job's supervisor has been asked to run it
    else:
        await asyncio.wait_for(held.reached.wait(), WAIT_S)
    stop = asyncio.create_task(client.post("/api/jobs/raced/stop"))
    if moment != "handed_over":
        # The stop waits for the hand-over it met (or, without a call-off, answers at once).
        await until(
            lambda: stop.done() or "raced" in manager._dispatcher._called_off, "the stop to wait"
        )
        held.released.set()

    stopped = await stop
    assert stopped.status == 200, await stopped.text()
    assert await stopped.json() == {"stopped": True}
    # Nothing of the job runs once the stop has answered.
    assert processes_mentioning(str(gate)) == []
    response = await submitted
    assert response.status == 200, await response.text()

    job = await wait_for_status(client, "raced")
    assert job["status"] == "STOPPED", job
    log = settings.log_dir / "job-driver-raced.log"
    if job["message"] == NEVER_STARTED_MESSAGE:
        assert not started.exists()
        assert not log.exists()
    # Nothing starts it later either: its gate opens, and it does not begin.
    gate.touch()
    assert processes_mentioning(str(gate)) == []
    if moment != "handed_over":
        assert job["message"] == NEVER_STARTED_MESSAGE


@ray.remote
class _CpuHog:
    """Holds CPUs of the cluster until killed: a job that asks for one waits for Ray."""

    def ping(self) -> None:
        pass


async def test_after_a_restart_the_start_timeout_counts_from_the_hand_over_not_the_submit(
    ray_connection: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job that waited in the queue longer than the start timeout, handed over (waiting for
    a CPU) when the server restarts: the next server gives it the start timeout from its
    hand-over, so it runs once the CPU is free."""
    namespace = f"test_hand_over_{uuid.uuid4().hex[:8]}"
    state_dir, gate = tmp_path / "state", tmp_path / "gate"
    # Every CPU free now: a job that asks for one waits until the hog is killed.
    free_cpus = ray.available_resources().get("CPU", 0.0)
    hog = _CpuHog.options(num_cpus=free_cpus).remote()  # type: ignore[attr-defined]
    try:
        await hog.ping.remote()
        async with running_manager(ray_connection, namespace, state_dir, max_running_jobs=1) as (
            manager,
            _,
        ):
            blocker = JobSpec(
                submission_id="blocker", entrypoint=f"while [ ! -e {gate} ]; do sleep 0.05; done"
            )
            await manager.submit_job(blocker)
            await until_status(manager, "blocker", {JobStatus.RUNNING})
            # Submitted an hour ago (as far as its record says): it waited in the queue since.
            submitted_at = job_manager_module.now_ms() - 3_600_000
            with monkeypatch.context() as clock:
                clock.setattr(job_manager_module, "now_ms", lambda: submitted_at)
                await manager.submit_job(
                    JobSpec(submission_id="late", entrypoint="true", entrypoint_num_cpus=1)
                )
            gate.touch()
            await until(
                lambda: (
                    "late" not in manager._queue and "late" not in manager._dispatcher._handing_over
                ),
                "the hand-over",
            )
            assert (await manager.get_job("late")).status is JobStatus.PENDING
        # The next server adopts it; then the CPU it waits for frees.
        async with running_manager(ray_connection, namespace, state_dir) as (manager, _):
            assert (await manager.get_job("late")).status is JobStatus.PENDING
            ray.kill(hog)
            late = await until_status(manager, "late", TERMINAL)
            assert late.status is JobStatus.SUCCEEDED, late.message
    finally:
        ray.kill(hog)
        kill_actors_in_namespace(namespace)
