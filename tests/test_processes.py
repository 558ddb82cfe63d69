"""Processes never leak and jobs never get stuck, through every fault (real Ray, real processes)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import pytest
import ray

from jobs_server.app import create_app
from jobs_server.settings import Settings
from tests.support.api import Client, job_logs, submit, wait_for_status
from tests.support.processes import free_port, host_pids, stop_process_group
from tests.support.ray_nodes import kill_actors_in_namespace
from tests.support.servers import start_jobs_server

AiohttpClient = Callable[..., Awaitable[Client]]


def is_alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


async def wait_for_pid_files(directory: Path, names: list[str], timeout_s: float = 30) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        paths = [directory / name for name in names]
        if all(path.exists() and path.read_text().strip() for path in paths):
            return [int(path.read_text()) for path in paths]
        await asyncio.sleep(0.05)
    raise AssertionError(f"pid files {names} not all written in {directory}")


async def wait_until_dead(pids: list[int], timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not any(is_alive(pid) for pid in pids):
            return
        await asyncio.sleep(0.05)
    alive = [pid for pid in pids if is_alive(pid)]
    for pid in alive:  # do not leave them behind for the next test
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    raise AssertionError(f"processes still alive: {alive}")


def supervisor_actor_exists(settings: Settings, job_id: str) -> bool:
    # A job's own supervisor is named for the job and its run.
    return any(
        actor["namespace"] == settings.namespace
        and actor["name"].startswith(f"jobs_server_supervisor:{job_id}:")
        for actor in ray.util.list_named_actors(all_namespaces=True)
    )


# A job that leaves a process of every kind behind it: a child with a grandchild, a process in
# a session of its own, and a double-forked daemon whose parent exits at once.
def process_zoo(directory: Path) -> str:
    return (
        f"cd {directory}; "
        "sh -c 'echo $$ > child.pid; sleep 300 & echo $! > grandchild.pid; wait' & "
        "setsid sh -c 'echo $$ > setsid.pid; exec sleep 300' & "
        "sh -c 'sh -c \"echo \\$\\$ > daemon.pid; exec sleep 300\" &' ; "
        "echo ready; wait"
    )


ZOO = ["child.pid", "grandchild.pid", "setsid.pid", "daemon.pid"]


async def test_stop_kills_the_whole_tree(client: Client, tmp_path: Path) -> None:
    job_id = await submit(client, entrypoint=process_zoo(tmp_path))
    pids = await wait_for_pid_files(tmp_path, ZOO)
    job = await wait_for_status(client, job_id, {"RUNNING"})
    pids = host_pids(pids, int(job["driver_info"]["pid"]))
    pids.append(int(job["driver_info"]["pid"]))
    assert all(is_alive(pid) for pid in pids)
    response = await client.post(f"/api/jobs/{job_id}/stop")
    assert await response.json() == {"stopped": True}
    assert (await wait_for_status(client, job_id))["status"] == "STOPPED"
    await wait_until_dead(pids)


async def test_processes_left_behind_by_a_finished_job_end_with_it(
    client: Client, tmp_path: Path
) -> None:
    entrypoint = (
        f"cd {tmp_path}; setsid sh -c 'echo $$ > setsid.pid; exec sleep 300' &"
        " while [ ! -e go ]; do sleep 0.05; done"
    )
    job_id = await submit(client, entrypoint=entrypoint)
    (pid,) = await wait_for_pid_files(tmp_path, ["setsid.pid"])
    job = await wait_for_status(client, job_id, {"RUNNING"})
    (pid,) = host_pids([pid], int(job["driver_info"]["pid"]))
    (tmp_path / "go").touch()
    assert (await wait_for_status(client, job_id))["status"] == "SUCCEEDED"
    await wait_until_dead([pid])


async def test_stop_of_a_pending_job_is_immediate_and_it_never_runs(
    client: Client, settings: Settings, tmp_path: Path
) -> None:
    marker = tmp_path / "ran"
    job_id = await submit(
        client, entrypoint=f"touch {marker}", entrypoint_resources={"unobtainium": 1}
    )
    assert (await wait_for_status(client, job_id, {"PENDING"}))["status"] == "PENDING"
    response = await client.post(f"/api/jobs/{job_id}/stop")
    assert await response.json() == {"stopped": True}
    job = await wait_for_status(client, job_id, timeout_s=10)
    assert job["status"] == "STOPPED"
    assert job["driver_exit_code"] is None
    for _ in range(200):
        if not supervisor_actor_exists(settings, job_id):
            break
        await asyncio.sleep(0.05)
    assert not supervisor_actor_exists(settings, job_id)
    assert not marker.exists()
    assert await job_logs(client, job_id) == ""


async def test_supervisor_death_kills_every_job_process_and_fails_the_job(
    client: Client, tmp_path: Path
) -> None:
    job_id = await submit(client, entrypoint=process_zoo(tmp_path))
    pids = await wait_for_pid_files(tmp_path, ZOO)
    job = await wait_for_status(client, job_id, {"RUNNING"})
    shell_pid = int(job["driver_info"]["pid"])
    pids = host_pids(pids, shell_pid)
    supervisor_pid = psutil.Process(shell_pid).ppid()
    assert "ray::" in " ".join(psutil.Process(supervisor_pid).cmdline())
    os.kill(supervisor_pid, signal.SIGKILL)
    await wait_until_dead([shell_pid, *pids])
    job = await wait_for_status(client, job_id)
    assert job["status"] == "FAILED"
    assert job["error_type"] == "JOB_SUPERVISOR_ACTOR_DIED"
    assert "supervisor died" in job["message"]


@pytest.fixture
async def impatient_client(aiohttp_client: AiohttpClient, settings: Settings) -> Client:
    return await aiohttp_client(create_app(settings.model_copy(update={"job_start_timeout_s": 2})))


async def test_unschedulable_job_fails_after_the_start_timeout(
    impatient_client: Client, settings: Settings
) -> None:
    job_id = await submit(
        impatient_client, entrypoint="echo never", entrypoint_resources={"unobtainium": 2}
    )
    job = await wait_for_status(impatient_client, job_id, timeout_s=30)
    assert job["status"] == "FAILED"
    assert job["error_type"] == "JOB_SUPERVISOR_ACTOR_START_TIMEOUT"
    assert "did not start within 2 s" in job["message"]
    assert "unobtainium" in job["message"]
    for _ in range(200):
        if not supervisor_actor_exists(settings, job_id):
            break
        await asyncio.sleep(0.05)
    assert not supervisor_actor_exists(settings, job_id)


async def test_job_over_its_deadline_is_stopped_and_failed(client: Client) -> None:
    job_id = await submit(client, entrypoint="echo started; sleep 60", timeout_s=1)
    job = await wait_for_status(client, job_id, timeout_s=30)
    assert job["status"] == "FAILED"
    assert "TIMEOUT" in job["error_type"]
    assert "timeout of 1 s" in job["message"]
    assert job["timeout_s"] == 1
    assert await job_logs(client, job_id) == "started\n"


async def test_abandoned_submits_leave_no_ghost_jobs(client: Client) -> None:
    """Clients that vanish mid-request: every job either does not exist or exists and runs."""
    host, port = client.server.host, client.server.port
    for index in range(12):
        full_body = json.dumps({"entrypoint": "echo ran", "submission_id": f"ghost-{index}"})
        # Every third body never arrives whole.
        body = full_body[: len(full_body) // 2] if index % 3 == 0 else full_body
        head = (
            f"POST /api/jobs/ HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(full_body)}\r\n\r\n"
        ).encode()
        _, writer = await asyncio.open_connection(host, port)
        writer.write(head + body.encode())
        await writer.drain()
        if index % 2:
            await asyncio.sleep(0.002 * index)
        writer.transport.abort()
    await asyncio.sleep(1)
    outcomes = {}
    for index in range(12):
        job_id = f"ghost-{index}"
        response = await client.get(f"/api/jobs/{job_id}")
        if response.status == 404:
            outcomes[job_id] = "absent"
            continue
        job = await wait_for_status(client, job_id)
        assert job["status"] == "SUCCEEDED", job
        assert await job_logs(client, job_id) == "ran\n"
        outcomes[job_id] = "ran"
    assert all(outcomes[f"ghost-{index}"] == "absent" for index in range(0, 12, 3))


async def wait_healthy(
    session: aiohttp.ClientSession, url: str, process: subprocess.Popen[bytes]
) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert process.poll() is None, "the server exited"
        with contextlib.suppress(aiohttp.ClientError):
            async with session.get(f"{url}/api/healthz") as response:
                if response.status == 200:
                    return
        await asyncio.sleep(0.1)
    raise AssertionError("server never became healthy")


async def http_status(session: aiohttp.ClientSession, url: str, job_id: str) -> dict[str, Any]:
    async with session.get(f"{url}/api/jobs/{job_id}") as response:
        assert response.status == 200
        return dict(await response.json())


async def wait_http_status(
    session: aiohttp.ClientSession, url: str, job_id: str, statuses: set[str], timeout_s: float = 60
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        job = await http_status(session, url, job_id)
        if job["status"] in statuses:
            return job
        await asyncio.sleep(0.05)
    raise AssertionError(f"{job_id} never reached {statuses}")


async def test_server_restart_loses_nothing(ray_connection: str, tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    namespace = f"restart_{os.getpid()}"
    env = {
        **os.environ,
        "JOBS_SERVER_PORT": str(port),
        "JOBS_SERVER_RAY_ADDRESS": ray_connection,
        "JOBS_SERVER_LOG_DIR": str(tmp_path / "logs"),
        "JOBS_SERVER_NAMESPACE": namespace,
        "JOBS_SERVER_STOP_GRACE_S": "1",
    }
    log_path = tmp_path / "server.log"
    first = start_jobs_server([], log_path, env)
    second: subprocess.Popen[bytes] | None = None
    async with aiohttp.ClientSession() as session:
        try:
            await wait_healthy(session, url, first)
            jobs = {
                "finishes-later": "for i in 1 2 3 4 5 6; do echo $i; sleep 0.5; done",
                "keeps-running": "echo up; sleep 60",
                "finishes-meanwhile": "sleep 0.5; echo quick",
                "loses-supervisor": "sleep 60",
            }
            for job_id, entrypoint in jobs.items():
                body = {"entrypoint": entrypoint, "submission_id": job_id}
                if job_id == "loses-supervisor":
                    body["entrypoint_num_cpus"] = 0.1  # a supervisor of its own, to lose
                async with session.post(f"{url}/api/jobs/", json=body) as response:
                    assert response.status == 200
            for job_id in jobs:
                await wait_http_status(session, url, job_id, {"RUNNING", "SUCCEEDED"})
            await wait_http_status(session, url, "loses-supervisor", {"RUNNING"})
            doomed = await http_status(session, url, "loses-supervisor")
            os.killpg(first.pid, signal.SIGKILL)
            first.wait()
            # While no server runs: one job finishes, one loses its supervisor (it crashes).
            os.kill(psutil.Process(int(doomed["driver_info"]["pid"])).ppid(), signal.SIGKILL)
            await asyncio.sleep(1.5)

            second = start_jobs_server([], log_path, env)
            await wait_healthy(session, url, second)
            assert (await http_status(session, url, "finishes-meanwhile"))["status"] == "SUCCEEDED"
            lost = await wait_http_status(session, url, "loses-supervisor", {"FAILED"})
            assert lost["error_type"] == "JOB_SUPERVISOR_ACTOR_DIED"
            assert (await http_status(session, url, "keeps-running"))["status"] == "RUNNING"

            done = await wait_http_status(session, url, "finishes-later", {"SUCCEEDED"})
            assert done["driver_exit_code"] == 0
            async with session.get(f"{url}/api/jobs/finishes-later/logs") as response:
                assert (await response.json())["logs"] == "1\n2\n3\n4\n5\n6\n"

            async with session.ws_connect(f"{url}/api/jobs/keeps-running/logs/tail") as websocket:
                first_frame = await websocket.receive_str(timeout=10)
                assert first_frame == "up\n"
                async with session.post(f"{url}/api/jobs/keeps-running/stop") as response:
                    assert await response.json() == {"stopped": True}
                rest = [message.data async for message in websocket]
                assert websocket.close_code == 1000
            assert "".join(rest) in {"", "Terminated\n"}
            stopped = await http_status(session, url, "keeps-running")
            assert stopped["status"] == "STOPPED"
        finally:
            stop_process_group(first)
            if second is not None:
                stop_process_group(second)
            kill_actors_in_namespace(namespace)


async def test_a_shared_supervisor_death_fails_exactly_its_jobs(
    client: Client, tmp_path: Path
) -> None:
    shared = [await submit(client, entrypoint="sleep 60") for _ in range(2)]
    own = await submit(client, entrypoint="sleep 60", entrypoint_num_cpus=0.1)
    jobs = {job_id: await wait_for_status(client, job_id, {"RUNNING"}) for job_id in [*shared, own]}
    supervisor_pids = {
        job_id: psutil.Process(int(job["driver_info"]["pid"])).ppid()
        for job_id, job in jobs.items()
    }
    assert supervisor_pids[shared[0]] == supervisor_pids[shared[1]] != supervisor_pids[own]
    os.kill(supervisor_pids[shared[0]], signal.SIGKILL)
    for job_id in shared:
        job = await wait_for_status(client, job_id)
        assert job["status"] == "FAILED"
        assert job["error_type"] == "JOB_SUPERVISOR_ACTOR_DIED"
    assert (await wait_for_status(client, own, {"RUNNING"}))["status"] == "RUNNING"
    # The next job gets a new shared supervisor.
    after = await submit(client, entrypoint="echo fine")
    assert (await wait_for_status(client, after))["status"] == "SUCCEEDED"
    assert await job_logs(client, after) == "fine\n"
    await client.post(f"/api/jobs/{own}/stop", json={"grace_period_s": 0})
    assert (await wait_for_status(client, own))["status"] == "STOPPED"


async def test_a_job_sent_to_a_dead_shared_supervisor_runs_on_its_replacement(
    client: Client, settings: Settings
) -> None:
    first = await submit(client, entrypoint="true")
    job = await wait_for_status(client, first)
    assert job["status"] == "SUCCEEDED"
    # The warm supervisor dies while idle: nothing has told the server yet.
    (name,) = [
        actor["name"]
        for actor in ray.util.list_named_actors(all_namespaces=True)
        if actor["namespace"] == settings.namespace and "shared" in actor["name"]
    ]
    supervisor_pid = await asyncio.to_thread(
        lambda: ray.get(ray.get_actor(name, namespace=settings.namespace).pid.remote())
    )
    os.kill(supervisor_pid, signal.SIGKILL)
    await wait_until_dead([supervisor_pid])
    job_id = await submit(client, entrypoint="echo survived")
    job = await wait_for_status(client, job_id)
    assert job["status"] == "SUCCEEDED", job
    assert await job_logs(client, job_id) == "survived\n"
