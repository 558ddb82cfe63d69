"""The processes under test: a Ray head node with its dashboard, jobs-server on that cluster, and
worker nodes joined to it (for the jobs that ask for resources only a worker has); and a
benchmark's run around them: its work dir, what outlived it, its report.

Each runs in its own process group (session) and is stopped by that group only, in a `finally`.
Starting, waiting for and stopping them is the tests' plumbing (`tests.support`); importing this
module also clears RAY_ADDRESS and JOBS_SERVER_* from this process's environment (which its
children inherit) and disables Ray's token authentication.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import psutil

from tests.support.processes import free_port, stop_process_group, wait_until
from tests.support.ray_nodes import RAY_NODE_IP, RayNode, isolate_environment, start_ray_node
from tests.support.servers import start_jobs_server, wait_for_server

logger = logging.getLogger(__name__)

isolate_environment()

# The remote scenarios' worker node: an address distinct from the head's and from the tests'.
WORKER_NODE_IP = "127.0.0.31"
HTTP_HOST = "127.0.0.1"
RAY_NUM_CPUS = 2
RAY_READY_TIMEOUT_S = 120.0
SERVER_READY_TIMEOUT_S = 90.0
STOP_TIMEOUT_S = 30.0
# On SIGTERM Ray 2.60 first drains the node for up to 30 s (for Serve on Kubernetes); a benchmark
# cluster has nothing to drain.
NO_DRAIN = {"RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}
# How Ray's log-serving processes show in /proc: the dashboard keeps its command line, the agent
# renames itself (setproctitle) but older releases kept the script's path.
RAY_DASHBOARD_MARKERS = ("dashboard/dashboard.py",)
RAY_AGENT_MARKERS = ("ray::DashboardAgent", "dashboard/agent.py")
# In the command line of a supervisor actor's Ray worker.
SUPERVISOR_MARK = "JobSupervisor"


@dataclass(frozen=True)
class RayHead:
    """A running Ray head node: its GCS address and the dashboard that serves Ray's jobs API."""

    gcs_address: str
    dashboard_url: str
    temp_dir: Path
    pid: int
    # The run's work dir: worker nodes' own directories (and logs) go under it.
    work_dir: Path


@dataclass(frozen=True)
class OurServer:
    """A running jobs-server: its URL and the pid of its process."""

    url: str
    pid: int


def process_tree(process: psutil.Process) -> list[psutil.Process]:
    """The process and its descendants (those still there)."""
    with contextlib.suppress(psutil.NoSuchProcess):
        return [process, *process.children(recursive=True)]
    return []


def supervisor_processes(head_pid: int) -> list[psutil.Process]:
    """The supervisor actors' processes of the Ray head `head_pid` (other clusters may run on
    the machine: only this head's are looked at)."""
    found = []
    for process in psutil.Process(head_pid).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if any(SUPERVISOR_MARK in part for part in process.cmdline()):
                found.append(process)
    return found


def our_log_processes(server: OurServer) -> list[psutil.Process]:
    """The processes whose memory a log request to our server can grow: the server and its
    children."""
    with contextlib.suppress(psutil.NoSuchProcess):
        return process_tree(psutil.Process(server.pid))
    return []


def ray_log_processes(head: RayHead, workers: list[RayNode]) -> list[psutil.Process]:
    """The processes that serve a log request to Ray: the dashboard with its module subprocesses
    (the job module runs in one) and the dashboard agents of the head and the `workers`, which
    read the log files of the jobs on their nodes."""
    found: dict[int, psutil.Process] = {}
    for node_pid in [head.pid, *(worker.process.pid for worker in workers)]:
        with contextlib.suppress(psutil.NoSuchProcess):
            for process in psutil.Process(node_pid).children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    cmdline = " ".join(process.cmdline())
                    if any(m in cmdline for m in RAY_DASHBOARD_MARKERS + RAY_AGENT_MARKERS):
                        found |= {p.pid: p for p in process_tree(process)}
    return list(found.values())


def answers_ok(url: str) -> bool:
    """Whether `url` answers 200 right now."""
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return int(response.status) == 200
    except (urllib.error.URLError, OSError):
        return False


@contextlib.contextmanager
def ray_head(work_dir: Path) -> Iterator[RayHead]:
    """A Ray head node with its dashboard (Ray's job server), on loopback, stopped on exit."""
    gcs_port = free_port(RAY_NODE_IP)
    dashboard_port = free_port()
    temp_dir = work_dir / "ray"
    args = [
        "--head",
        "--port",
        str(gcs_port),
        "--dashboard-host",
        HTTP_HOST,
        "--dashboard-port",
        str(dashboard_port),
        f"--num-cpus={RAY_NUM_CPUS}",
        # Our own session directory, and ports of our own where Ray's defaults are fixed
        # numbers, so this cluster cannot collide with another one on the machine.
        "--temp-dir",
        str(temp_dir),
        "--ray-client-server-port",
        str(free_port(RAY_NODE_IP)),
        "--dashboard-agent-listen-port",
        str(free_port(RAY_NODE_IP)),
    ]
    log_path = work_dir / "ray-start.log"
    logger.info("starting Ray head node (GCS %s:%d)", RAY_NODE_IP, gcs_port)
    # The dashboard's metrics server has a fixed default port (44227), like the ports above.
    node = start_ray_node(
        args,
        RAY_NODE_IP,
        log_path,
        env={**os.environ, **NO_DRAIN, "DASHBOARD_METRIC_PORT": str(free_port(RAY_NODE_IP))},
    )
    try:
        dashboard_url = f"http://{HTTP_HOST}:{dashboard_port}"
        started_s = time.monotonic()
        wait_until(
            lambda: answers_ok(f"{dashboard_url}/api/version") or node.process.poll() is not None,
            RAY_READY_TIMEOUT_S,
            "Ray's dashboard",
        )
        assert node.process.poll() is None, log_path.read_text(errors="replace")
        logger.info(
            "Ray's dashboard answered after %.1f s at %s",
            time.monotonic() - started_s,
            dashboard_url,
        )
        yield RayHead(
            f"{RAY_NODE_IP}:{gcs_port}", dashboard_url, temp_dir, node.process.pid, work_dir
        )
    finally:
        logger.info("stopping the Ray head node (process group %d)", node.process.pid)
        stop_process_group(node.process, timeout_s=STOP_TIMEOUT_S)


def start_ray_worker(
    head: RayHead, *, name: str, ip: str, resources: dict[str, float], num_cpus: int
) -> RayNode:
    """A worker node joined to `head`'s cluster, on `ip`, with the custom `resources`, started
    (its process group stopped again if it does not start); `stop_ray_worker` stops it.

    Its Ray temp dir is the head's, as on separate machines with Ray's default (`/tmp/ray` on
    each): a node's dashboard agent looks for job logs under the session directory it gets from
    the cluster, the head's path, so a worker with a temp dir of its own would have its job logs
    served from the head's files. Its other files (TMPDIR: our supervisor's log spool) go to a
    directory of its own.
    """
    node_dir = head.work_dir / name
    node_dir.mkdir()
    args = [
        "--address",
        head.gcs_address,
        f"--num-cpus={num_cpus}",
        "--resources",
        json.dumps(resources),
        "--temp-dir",
        str(head.temp_dir),
        "--dashboard-agent-listen-port",
        str(free_port(ip)),
    ]
    logger.info("starting Ray worker node %s on %s (%s)", name, ip, json.dumps(resources))
    node = start_ray_node(
        args,
        ip,
        head.work_dir / f"ray-{name}.log",
        env={**os.environ, **NO_DRAIN, "TMPDIR": str(node_dir)},
        temp_dir=node_dir,
    )
    started_s = time.monotonic()
    try:
        node.wait_until_started()
    except BaseException:
        stop_process_group(node.process, timeout_s=STOP_TIMEOUT_S)
        raise
    logger.info("Ray worker node %s started after %.1f s", name, time.monotonic() - started_s)
    return node


def stop_ray_worker(worker: RayNode) -> None:
    """Stop the worker node's process group (whatever is left of it)."""
    logger.info("stopping Ray worker node %s (process group %d)", worker.ip, worker.process.pid)
    stop_process_group(worker.process, timeout_s=STOP_TIMEOUT_S)


@contextlib.contextmanager
def ray_worker(
    head: RayHead, *, name: str, ip: str, resources: dict[str, float], num_cpus: int
) -> Iterator[RayNode]:
    """A worker node joined to `head`'s cluster, stopped on exit."""
    worker = start_ray_worker(head, name=name, ip=ip, resources=resources, num_cpus=num_cpus)
    try:
        yield worker
    finally:
        stop_ray_worker(worker)


@contextlib.contextmanager
def jobs_server(
    ray_address: str, work_dir: Path, extra_args: Sequence[str] = ()
) -> Iterator[OurServer]:
    """Our server on the cluster at `ray_address`, in a namespace of its own, with the flags
    `extra_args` added."""
    port = free_port()
    log_path = work_dir / "jobs-server.log"
    args = [
        "--port",
        str(port),
        "--ray-address",
        ray_address,
        "--log-dir",
        str(work_dir / "jobs-server-logs"),
        "--state-dir",
        str(work_dir / "jobs-server-state"),
        "--namespace",
        f"bench_{uuid.uuid4().hex[:12]}",
        *extra_args,
    ]
    logger.info("starting jobs-server on port %d", port)
    process = start_jobs_server(args, log_path)
    try:
        url = f"http://{HTTP_HOST}:{port}"
        started_s = time.monotonic()
        wait_for_server(url, process, log_path, timeout_s=SERVER_READY_TIMEOUT_S)
        logger.info("jobs-server answered after %.1f s at %s", time.monotonic() - started_s, url)
        yield OurServer(url, process.pid)
    finally:
        logger.info("stopping jobs-server (process group %d)", process.pid)
        stop_process_group(process, timeout_s=STOP_TIMEOUT_S)


def surviving_processes(marker: str) -> list[tuple[int, str]]:
    """Processes whose command line or environment mentions `marker` (unique to this run):
    a job's shell names it in its command, the commands it starts inherit its environment."""
    found: list[tuple[int, str]] = []
    needle = marker.encode()
    for pid_dir in Path("/proc").iterdir():
        if not pid_dir.name.isdigit() or int(pid_dir.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            cmdline = (pid_dir / "cmdline").read_bytes()
            if needle in cmdline or needle in (pid_dir / "environ").read_bytes():
                text = cmdline.replace(b"\0", b" ").decode(errors="replace")
                found.append((int(pid_dir.name), text.strip()[:200]))
    return found


def kill_survivors(marker: str) -> list[tuple[int, str]]:
    """SIGKILL, by pid, the processes this run started that outlived their process group."""
    survivors = surviving_processes(marker)
    for pid, _ in survivors:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return survivors


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def set_up_benchmark_process() -> None:
    """Progress to stderr with times; a SIGTERM unwinds like Ctrl-C, so the `finally` blocks
    stop every process group the benchmark started."""
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(message)s", datefmt="%H:%M:%S"
    )
    signal.signal(signal.SIGTERM, _interrupt)


@dataclass(frozen=True)
class BenchmarkRun:
    """A benchmark's run: when it started, the load average then, and its work dir."""

    started: datetime.datetime
    load_before: tuple[float, float, float]
    work_dir: Path

    def loads(self) -> tuple[tuple[float, float, float], tuple[float, float, float]]:
        """The load average (1, 5, 15 min) at the start and now."""
        return self.load_before, os.getloadavg()


@contextlib.contextmanager
def benchmark_run(prefix: str, *, keep_logs: bool = False) -> Iterator[BenchmarkRun]:
    """Set up this process (`set_up_benchmark_process`) and a fresh work dir under /tmp for the
    run's logs and state. On leaving, the run's processes that outlived their process group are
    killed (each logged), and the work dir is removed unless `keep_logs`."""
    set_up_benchmark_process()
    started = datetime.datetime.now().astimezone()
    load_before = os.getloadavg()
    work_dir = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    try:
        yield BenchmarkRun(started, load_before, work_dir)
    finally:
        for pid, cmdline in kill_survivors(str(work_dir)):
            logger.warning("process %d outlived its process group (killed): %s", pid, cmdline)
        if keep_logs:
            logger.info("logs kept in %s", work_dir)
        else:
            shutil.rmtree(work_dir, ignore_errors=True)


def write_report(report: str, path: Path, *, keep: bool = True) -> None:
    """Print the report and, if `keep`, write it to `path` (a quick run keeps the full run's
    table, which the docs quote)."""
    sys.stdout.write(report)
    if keep:
        path.write_text(report)
        logger.info("written to %s", path)
