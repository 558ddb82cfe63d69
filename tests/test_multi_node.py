"""A cluster of several nodes on this machine: jobs run where their resources are, and every
job's log ends up in the server's log directory on the head, also when its node is lost."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import shutil
import signal
import subprocess
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import pytest

from jobs_server.client.sse import parse_events
from tests.support.api import TERMINAL_STATUSES, job_logs, submit, wait_for_status
from tests.support.commands import counted
from tests.support.processes import (
    accepts_connections,
    free_port,
    host_pids,
    stop_process_group,
    stop_ray_node,
    wait_until,
)
from tests.support.ray_nodes import RayNode, start_ray_node
from tests.support.servers import start_jobs_server, wait_for_server

pytestmark = pytest.mark.multinode

# Addresses of their own, so this cluster never meets the session's (127.0.0.2).
HEAD_IP = "127.0.0.21"
WORKER_IP = "127.0.0.22"
DOOMED_WORKER_IP = "127.0.0.23"
WORKER_RESOURCE = "worker_only"
WORKER_RESOURCE_AMOUNT = 2


# Worker nodes need nothing but Ray: on them, `import jobs_server` fails, as on a machine where
# it is not installed; the server ships the supervisor's code itself.
JOBS_SERVER_IS_NOT_INSTALLED_HERE = """
import importlib.abc
import sys


class _NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "jobs_server" or name.startswith("jobs_server."):
            raise ModuleNotFoundError(f"No module named {name!r} on this node", name=name)
        return None


sys.meta_path.insert(0, _NotInstalled())
"""


@dataclass(frozen=True)
class MultiNodeCluster:
    gcs_address: str
    tmp_dir: Path
    worker_temp_dirs: list[str] = field(default_factory=list)
    workers: list[RayNode] = field(default_factory=list)

    def add_worker(self, ip: str, resources: dict[str, float]) -> RayNode:
        """A worker node with a Ray temp dir of its own (as on another machine), started."""
        # Short: Ray's socket paths under it must fit in 107 bytes.
        temp_dir = tempfile.mkdtemp(prefix="jsw", dir="/tmp")
        site_dir = Path(temp_dir) / "site"
        site_dir.mkdir()
        # The node's own temp dir, as on another machine (and removed with it).
        node_tmp = Path(temp_dir) / "tmp"
        node_tmp.mkdir()
        (site_dir / "sitecustomize.py").write_text(JOBS_SERVER_IS_NOT_INSTALLED_HERE)
        node = start_ray_node(
            [
                f"--address={self.gcs_address}",
                "--num-cpus=1",
                f"--resources={json.dumps(resources)}",
                f"--temp-dir={temp_dir}",
            ],
            ip,
            self.tmp_dir / f"worker-{ip}-{Path(temp_dir).name}.log",
            env={**os.environ, "PYTHONPATH": str(site_dir), "TMPDIR": str(node_tmp)},
            temp_dir=node_tmp,
        )
        self.worker_temp_dirs.append(temp_dir)
        self.workers.append(node)
        node.wait_until_started()
        return node


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MultiNodeCluster]:
    """A head node and one worker node that alone has the `worker_only` resource."""
    tmp_dir = tmp_path_factory.mktemp("multi_node")
    port = free_port(HEAD_IP)
    head = start_ray_node(
        ["--head", f"--port={port}", "--include-dashboard=false", "--num-cpus=1"],
        HEAD_IP,
        tmp_dir / "head.log",
    )
    multi_node = MultiNodeCluster(f"{HEAD_IP}:{port}", tmp_dir)
    worker: RayNode | None = None
    try:
        wait_until(lambda: accepts_connections(HEAD_IP, port), 60, "the head node")
        worker = multi_node.add_worker(WORKER_IP, {WORKER_RESOURCE: WORKER_RESOURCE_AMOUNT})
        yield multi_node
    finally:
        if worker is not None:
            stop_ray_node(worker.process, timeout_s=5)
        stop_ray_node(head.process, timeout_s=5)
        for temp_dir in multi_node.worker_temp_dirs:
            shutil.rmtree(temp_dir, ignore_errors=True)


@dataclass(frozen=True)
class Server:
    url: str
    log_dir: Path
    namespace: str

    def spool_path(self, node: RayNode, job_id: str) -> Path:
        """Where a supervisor on the worker `node` spools the job's log."""
        assert node.temp_dir is not None
        spool_root = node.temp_dir / f"jobs_server_spool-{os.getuid()}"
        return spool_root / self.namespace / f"job-driver-{job_id}.log"


def start_server(
    cluster: MultiNodeCluster, namespace: str, log_dir: Path
) -> tuple[subprocess.Popen[bytes], Server]:
    """`jobs-server serve` joined to the cluster from its head node, answering."""
    port = free_port()
    log_path = cluster.tmp_dir / f"server-{namespace}.log"
    process = start_jobs_server(
        [
            "--port",
            str(port),
            "--ray-address",
            cluster.gcs_address,
            "--log-dir",
            str(log_dir),
            "--state-dir",
            str(log_dir.parent / "state"),
            "--namespace",
            namespace,
            "--stop-grace-s",
            "1",
        ],
        log_path,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_server(url, process, log_path, timeout_s=90)
    except BaseException:
        stop_process_group(process)
        raise
    return process, Server(url, log_dir, namespace)


@pytest.fixture(scope="module")
def server(cluster: MultiNodeCluster) -> Iterator[Server]:
    namespace = f"test_multi_node_{uuid.uuid4().hex[:8]}"
    process, server = start_server(cluster, namespace, cluster.tmp_dir / "head_logs")
    try:
        yield server
    finally:
        stop_process_group(process)


@pytest.fixture
async def http(server: Server) -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(base_url=server.url) as session:
        yield session


async def get_job(http: aiohttp.ClientSession, job_id: str) -> dict[str, Any]:
    async with http.get(f"/api/jobs/{job_id}") as response:
        assert response.status == 200, await response.text()
        job: dict[str, Any] = await response.json()
        return job


# Jobs on worker nodes start a Ray worker there first, and a lost node takes Ray a while to see.
wait_for_job = functools.partial(wait_for_status, timeout_s=120)


async def follow_text(http: aiohttp.ClientSession, job_id: str) -> str:
    async with http.get(f"/api/jobs/{job_id}/logs?follow=true") as response:
        assert response.status == 200
        return (await response.read()).decode()


async def follow_sse(http: aiohttp.ClientSession, job_id: str) -> str:
    async with http.get(f"/api/jobs/{job_id}/logs/stream") as response:
        assert response.status == 200
        events = parse_events((await response.read()).decode())
    return "".join(json.loads(event.data) for event in events if event.event == "message")


async def follow_until(http: aiohttp.ClientSession, job_id: str, last_line: str) -> str:
    """Follow the log until it ends with `last_line` (the job runs on)."""
    text = ""
    async with http.ws_connect(f"/api/jobs/{job_id}/logs/tail") as websocket:
        async for message in websocket:
            text += message.data
            if text.endswith(last_line):
                return text
    raise AssertionError(f"the log ended without {last_line!r}: {text[-200:]!r}")


async def follow_websocket(http: aiohttp.ClientSession, job_id: str) -> str:
    async with http.ws_connect(f"/api/jobs/{job_id}/logs/tail") as websocket:
        return "".join([message.data async for message in websocket])


BURST_LINES = 400_000  # 15 bytes each: 6 MB written as fast as Python can
SLOW_LINES = 5

# A burst of many MB, then lines a while apart: followers read both as the job writes them.
BURST_THEN_SLOW = (
    "python -c 'import sys, time\n"
    f'sys.stdout.writelines(f"burst {{i:08d}}\\n" for i in range({BURST_LINES}))\n'
    "sys.stdout.flush()\n"
    f"for i in range({SLOW_LINES}):\n"
    '    print(f"slow {i}", flush=True)\n'
    "    time.sleep(0.3)\n'"
)
BURST_THEN_SLOW_OUTPUT = "".join(f"burst {i:08d}\n" for i in range(BURST_LINES)) + "".join(
    f"slow {i}\n" for i in range(SLOW_LINES)
)


async def test_job_with_a_worker_resource_runs_there_and_its_log_reaches_the_head(
    http: aiohttp.ClientSession, server: Server, cluster: MultiNodeCluster
) -> None:
    job_id = await submit(
        http, entrypoint=BURST_THEN_SLOW, entrypoint_resources={WORKER_RESOURCE: 1}
    )
    # Every way of following the log, from before the job starts to its end.
    followers = [
        asyncio.ensure_future(follow(http, job_id))
        for follow in (follow_text, follow_sse, follow_websocket)
    ]
    running = await wait_for_job(http, job_id, {"RUNNING", *TERMINAL_STATUSES})
    assert running["status"] == "RUNNING"  # for 1.5 s at least: its slow lines
    assert running["driver_info"]["node_ip_address"] == WORKER_IP
    # The worker writes to a spool on its own disk; only the server writes the head's file.
    assert server.spool_path(cluster.workers[0], job_id).exists()
    job = await wait_for_job(http, job_id)
    assert job["status"] == "SUCCEEDED", job
    assert job["driver_info"]["node_ip_address"] == WORKER_IP
    assert job["driver_node_id"] == running["driver_node_id"]
    for followed in await asyncio.gather(*followers):
        assert followed == BURST_THEN_SLOW_OUTPUT
    assert await job_logs(http, job_id) == BURST_THEN_SLOW_OUTPUT
    head_log = server.log_dir / f"job-driver-{job_id}.log"
    assert head_log.read_text() == BURST_THEN_SLOW_OUTPUT
    assert not server.spool_path(
        cluster.workers[0], job_id
    ).exists()  # pulled to the end, then removed


@pytest.mark.skipif(os.geteuid() != 0, reason="another user's directory needs root")
async def test_a_worker_spool_squatted_by_another_user_is_never_written_through(
    http: aiohttp.ClientSession, cluster: MultiNodeCluster, tmp_path: Path
) -> None:
    """Issue 32, item 8, end to end: another user of the worker node points the spool's
    predictable names (this version's and the one before) at a directory of its own. The job's
    log reaches the head whole; nothing is written in that directory (before: the spool was)."""
    worker_tmp = cluster.workers[0].temp_dir
    assert worker_tmp is not None
    trap = tmp_path / "attacker"
    trap.mkdir(mode=0o777)
    os.chown(trap, 65534, 65534)  # nobody's
    squatted = [worker_tmp / "jobs_server_spool", worker_tmp / f"jobs_server_spool-{os.getuid()}"]
    set_aside = []
    for root in squatted:
        if root.exists():  # an earlier test's spool root: back after this one
            set_aside.append((root.rename(root.with_name(f"{root.name}-aside")), root))
        root.symlink_to(trap, target_is_directory=True)
    try:
        job_id = await submit(
            http, entrypoint="echo spooled; echo whole", entrypoint_resources={WORKER_RESOURCE: 1}
        )
        job = await wait_for_job(http, job_id)
        assert job["status"] == "SUCCEEDED", job
        assert job["driver_info"]["node_ip_address"] == WORKER_IP
        assert await job_logs(http, job_id) == "spooled\nwhole\n"
        assert sorted(trap.rglob("*")) == []
    finally:
        for root in squatted:
            root.unlink(missing_ok=True)
        for aside, root in set_aside:
            aside.rename(root)


async def test_worker_nodes_cannot_import_jobs_server(http: aiohttp.ClientSession) -> None:
    """The guard of the test above: its supervisor ran where jobs_server is not installed."""
    job_id = await submit(
        http,
        entrypoint="python -c 'import jobs_server'",
        entrypoint_resources={WORKER_RESOURCE: 1},
    )
    job = await wait_for_job(http, job_id)
    assert job["status"] == "FAILED"
    assert job["driver_info"]["node_ip_address"] == WORKER_IP
    assert "No module named 'jobs_server' on this node" in await job_logs(http, job_id)


async def test_jobs_without_resources_stay_on_the_head_node(http: aiohttp.ClientSession) -> None:
    shared = await submit(http, entrypoint="echo shared")
    # A runtime env of its own gives the job its own supervisor; without resources it too
    # runs on the head.
    dedicated = await submit(
        http, entrypoint="echo dedicated", runtime_env={"config": {"setup_timeout_seconds": 60}}
    )
    for job_id, output in ((shared, "shared\n"), (dedicated, "dedicated\n")):
        job = await wait_for_job(http, job_id)
        assert job["status"] == "SUCCEEDED", job
        assert job["driver_info"]["node_ip_address"] == HEAD_IP
        assert await job_logs(http, job_id) == output


async def test_a_pending_job_says_which_resources_it_waits_for(
    http: aiohttp.ClientSession,
) -> None:
    too_big = await submit(
        http,
        entrypoint="echo never",
        entrypoint_resources={WORKER_RESOURCE: WORKER_RESOURCE_AMOUNT + 1},
    )
    holder = await submit(
        http,
        entrypoint="sleep 600",
        entrypoint_resources={WORKER_RESOURCE: WORKER_RESOURCE_AMOUNT},
    )
    waiting = await submit(http, entrypoint="echo later", entrypoint_resources={WORKER_RESOURCE: 1})
    try:
        await wait_for_job(http, holder, {"RUNNING"})
        job = await wait_for_job(http, waiting, {"PENDING"}, message_part="(0 free)")
        assert job["message"] == (
            f"Waiting for resources: the job asks for {WORKER_RESOURCE} 1; "
            f"the cluster has {WORKER_RESOURCE} 2 (0 free)."
        )
        job = await get_job(http, too_big)
        assert job["status"] == "PENDING"
        assert job["message"] == (
            f"Waiting for resources no node has: the job asks for {WORKER_RESOURCE} 3; the "
            f"cluster has {WORKER_RESOURCE} 2 (0 free). It starts when a node that has them all "
            "joins, or fails at its start timeout."
        )
    finally:
        for job_id in (too_big, holder, waiting):
            async with http.post(f"/api/jobs/{job_id}/stop") as response:
                assert response.status == 200
    for job_id in (too_big, holder, waiting):
        assert (await wait_for_job(http, job_id))["status"] == "STOPPED"


async def test_retries_on_a_worker_append_to_the_heads_log_at_their_offsets(
    http: aiohttp.ClientSession, server: Server, cluster: MultiNodeCluster
) -> None:
    """The attempts' offsets, measured in the worker's spool, are offsets of the head's file:
    the server appends the spool's bytes there in order (a retry after the default backoff)."""
    counter = cluster.tmp_dir / f"attempts-{uuid.uuid4().hex[:8]}"
    burst = "if [ $n -eq 1 ]; then seq 1 200000; exit 3; fi; echo done"
    job_id = await submit(
        http,
        entrypoint=counted(counter, burst),
        entrypoint_resources={WORKER_RESOURCE: 1},
        max_retries=1,
    )
    job = await wait_for_job(http, job_id)
    assert job["status"] == "SUCCEEDED", job
    assert job["driver_info"]["node_ip_address"] == WORKER_IP
    first = "attempt 1: début\n" + "".join(f"{i}\n" for i in range(1, 200001))
    assert [(attempt["exit_code"], attempt["log_offset"]) for attempt in job["attempts"]] == [
        (3, 0),
        (0, len(first.encode())),
    ]
    head_log = (server.log_dir / f"job-driver-{job_id}.log").read_bytes()
    assert head_log == (first + "attempt 2: début\ndone\n").encode()


def _is_running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


async def test_losing_the_worker_node_fails_the_job_and_keeps_its_log(
    http: aiohttp.ClientSession, cluster: MultiNodeCluster, server: Server, tmp_path: Path
) -> None:
    doomed = cluster.add_worker(DOOMED_WORKER_IP, {"doomed_node": 1})
    pid_file = tmp_path / "pids"
    try:
        entrypoint = (
            f"{BURST_THEN_SLOW}; echo $$ > {pid_file}; sleep 600 & echo $! >> {pid_file}; "
            "echo ready; wait"
        )
        job_id = await submit(http, entrypoint=entrypoint, entrypoint_resources={"doomed_node": 1})
        running = await wait_for_job(http, job_id, {"RUNNING"})
        assert running["driver_info"]["node_ip_address"] == DOOMED_WORKER_IP
        expected = BURST_THEN_SLOW_OUTPUT + "ready\n"
        assert await follow_until(http, job_id, "ready\n") == expected
        wait_until(lambda: len(pid_file.read_text().split()) == 2, 30, "the job's pids")
        job_pids = host_pids(
            [int(pid) for pid in pid_file.read_text().split()], int(running["driver_info"]["pid"])
        )
        pid_file.write_text(" ".join(map(str, job_pids)))  # what the cleanup below kills
        assert all(_is_running(pid) for pid in job_pids)

        doomed.raylet().kill()

        job = await wait_for_job(http, job_id, timeout_s=120)
        assert job["status"] == "FAILED", job
        assert job["error_type"] == "JOB_SUPERVISOR_ACTOR_DIED"
        assert "node the job ran on was lost" in job["message"]
        assert running["driver_node_id"] in job["message"]
        wait_until(lambda: not any(map(_is_running, job_pids)), 60, "the job's processes to end")
        assert await job_logs(http, job_id) == expected
        assert (server.log_dir / f"job-driver-{job_id}.log").read_text() == expected
    finally:
        stop_ray_node(doomed.process, timeout_s=5)
        if pid_file.exists():
            for pid in pid_file.read_text().split():
                if _is_running(int(pid)):
                    os.kill(int(pid), signal.SIGKILL)


async def test_a_restarted_server_resumes_pulling_without_gaps_or_repeats(
    cluster: MultiNodeCluster, tmp_path: Path
) -> None:
    namespace = f"test_restart_{uuid.uuid4().hex[:8]}"
    log_dir = tmp_path / "head_logs"
    slow_lines = 20
    entrypoint = BURST_THEN_SLOW.replace(f"range({SLOW_LINES})", f"range({slow_lines})")
    expected = "".join(f"burst {i:08d}\n" for i in range(BURST_LINES)) + "".join(
        f"slow {i}\n" for i in range(slow_lines)
    )
    first, server = start_server(cluster, namespace, log_dir)
    try:
        async with aiohttp.ClientSession(base_url=server.url) as http:
            job_id = await submit(
                http, entrypoint=entrypoint, entrypoint_resources={WORKER_RESOURCE: 1}
            )
            # The first server has pulled the burst when it stops.
            assert (await follow_until(http, job_id, "slow 0\n")).startswith("burst 00000000\n")
    finally:
        stop_process_group(first)
    second, server = start_server(cluster, namespace, log_dir)
    try:
        async with aiohttp.ClientSession(base_url=server.url) as http:
            job = await wait_for_job(http, job_id)
            assert job["status"] == "SUCCEEDED", job
            assert await follow_text(http, job_id) == expected
        assert (log_dir / f"job-driver-{job_id}.log").read_text() == expected
    finally:
        stop_process_group(second)


async def test_stopping_a_job_whose_node_does_not_answer_is_a_clean_503(
    http: aiohttp.ClientSession,
) -> None:
    job_id = await submit(
        http,
        entrypoint="sleep 600",
        entrypoint_resources={WORKER_RESOURCE: 1},
    )
    job = await wait_for_job(http, job_id, {"RUNNING"})
    # The supervisor stops answering, as on a node that hangs or whose network is cut.
    supervisor = psutil.Process(int(job["driver_info"]["pid"])).parent()
    assert supervisor is not None
    assert "ray::" in " ".join(supervisor.cmdline())
    supervisor.suspend()
    try:
        async with http.post(f"/api/jobs/{job_id}/stop") as response:
            assert response.status == 503, await response.text()
            error = (await response.json())["error"]
        assert error["code"] == "supervisor_unreachable"
        assert job["driver_node_id"] in error["message"]
        assert (await get_job(http, job_id))["status"] == "RUNNING"
    finally:
        supervisor.resume()
    async with http.post(f"/api/jobs/{job_id}/stop") as response:
        assert response.status == 200
        assert (await response.json())["stopped"] is True
    assert (await wait_for_job(http, job_id))["status"] == "STOPPED"
