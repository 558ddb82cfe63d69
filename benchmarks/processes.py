"""The processes under test: a Ray head node with its dashboard, jobs-server on that cluster, and
worker nodes joined to it (for the jobs that ask for resources only a worker has).

Each runs in its own process group (session) and is stopped by that group only, in a `finally`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

logger = logging.getLogger(__name__)

RAY_NODE_IP = "127.0.0.2"
# The remote scenarios' worker node: an address distinct from the head's and from the tests'.
WORKER_NODE_IP = "127.0.0.31"
HTTP_HOST = "127.0.0.1"
RAY_BIN = Path(sys.executable).parent / "ray"
RAY_NUM_CPUS = 2
RAY_READY_TIMEOUT_S = 120.0
SERVER_READY_TIMEOUT_S = 90.0
READY_POLL_INTERVAL_S = 0.25
STOP_TIMEOUT_S = 30.0
RAY_STARTED_LINE = "Ray runtime started"
LOG_TAIL_BYTES = 4000
# How Ray's log-serving processes show in /proc: the dashboard keeps its command line, the agent
# renames itself (setproctitle) but older releases kept the script's path.
RAY_DASHBOARD_MARKERS = ("dashboard/dashboard.py",)
RAY_AGENT_MARKERS = ("ray::DashboardAgent", "dashboard/agent.py")


class SetupError(Exception):
    """A process under test did not start or did not become ready."""


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
class RayWorker:
    """A running worker node of the head's cluster: its address and its `ray start` process."""

    ip: str
    process: subprocess.Popen[bytes]
    # The node's own files: TMPDIR of its processes.
    node_dir: Path

    def raylet(self) -> psutil.Process | None:
        """The node's raylet (killing it loses the node), or None if it is gone."""
        with contextlib.suppress(psutil.Error):
            for child in psutil.Process(self.process.pid).children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    if child.name() == "raylet":
                        return child
        return None


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


def our_log_processes(server: OurServer) -> list[psutil.Process]:
    """The processes whose memory a log request to our server can grow: the server and its
    children."""
    with contextlib.suppress(psutil.NoSuchProcess):
        return process_tree(psutil.Process(server.pid))
    return []


def ray_log_processes(head: RayHead, workers: list[RayWorker]) -> list[psutil.Process]:
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


def free_port(host: str = HTTP_HOST) -> int:
    """A port that was free on `host` a moment ago."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def process_env() -> dict[str, str]:
    """Our environment without anything that would point a process at another cluster or server."""
    env = {
        name: value
        for name, value in os.environ.items()
        if name != "RAY_ADDRESS" and not name.startswith("JOBS_SERVER_")
    }
    # The benchmark is about job servers, not Ray's token authentication.
    env["RAY_AUTH_MODE"] = "disabled"
    return env


def start_process_group(
    args: list[str], log_path: Path, extra_env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """Start `args` in a new session (so its group can be stopped alone), output to `log_path`."""
    env = process_env() | (extra_env or {})
    with log_path.open("wb") as log:
        return subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )


def stop_process_group(process: subprocess.Popen[Any], timeout_s: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM the process's group, SIGKILL it if the leader has not exited after `timeout_s`."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            logger.warning("process group %d ignored %s", process.pid, sig.name)
            continue
        # The leader is gone; make sure the rest of its group follows.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        return


def log_tail(path: Path) -> str:
    """The last few KB of a process's log, for an error message."""
    with contextlib.suppress(OSError), path.open("rb") as log:
        log.seek(0, os.SEEK_END)
        log.seek(max(0, log.tell() - LOG_TAIL_BYTES))
        return log.read().decode(errors="replace")
    return ""


def wait_http_ok(
    url: str, process: subprocess.Popen[Any], log_path: Path, timeout_s: float, what: str
) -> float:
    """Poll `url` until it answers 200; return the seconds it took. Fails if the process exits."""
    return wait_ready(lambda: _answers_ok(url), process, log_path, timeout_s, f"{what} ({url})")


def wait_ready(
    is_ready: Callable[[], bool],
    process: subprocess.Popen[Any],
    log_path: Path,
    timeout_s: float,
    what: str,
) -> float:
    """Poll `is_ready` until it is true; return the seconds it took. Fails if the process exits."""
    started_s = time.monotonic()
    deadline_s = started_s + timeout_s
    for _ in range(int(timeout_s / READY_POLL_INTERVAL_S) + 1):
        if process.poll() is not None:
            raise SetupError(
                f"{what} exited with {process.returncode} before it was ready:\n"
                + log_tail(log_path)
            )
        if is_ready():
            return time.monotonic() - started_s
        if time.monotonic() > deadline_s:
            break
        time.sleep(READY_POLL_INTERVAL_S)
    raise SetupError(f"{what} not ready after {timeout_s:.0f} s:\n" + log_tail(log_path))


def _answers_ok(url: str) -> bool:
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
        str(RAY_BIN),
        "start",
        "--head",
        "--block",
        "--node-ip-address",
        RAY_NODE_IP,
        "--port",
        str(gcs_port),
        "--dashboard-host",
        HTTP_HOST,
        "--dashboard-port",
        str(dashboard_port),
        f"--num-cpus={RAY_NUM_CPUS}",
        "--disable-usage-stats",
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
    # On SIGTERM Ray 2.60 first drains the node for up to 30 s (for Serve on Kubernetes); a
    # benchmark cluster has nothing to drain. The dashboard's metrics server has a fixed default
    # port (44227), like the ports above.
    process = start_process_group(
        args,
        log_path,
        extra_env={
            "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",
            "DASHBOARD_METRIC_PORT": str(free_port(RAY_NODE_IP)),
        },
    )
    try:
        dashboard_url = f"http://{HTTP_HOST}:{dashboard_port}"
        took_s = wait_http_ok(
            f"{dashboard_url}/api/version", process, log_path, RAY_READY_TIMEOUT_S, "Ray"
        )
        logger.info("Ray's dashboard answered after %.1f s at %s", took_s, dashboard_url)
        yield RayHead(f"{RAY_NODE_IP}:{gcs_port}", dashboard_url, temp_dir, process.pid, work_dir)
    finally:
        logger.info("stopping the Ray head node (process group %d)", process.pid)
        stop_process_group(process)


def start_ray_worker(
    head: RayHead, *, name: str, ip: str, resources: dict[str, float], num_cpus: int
) -> RayWorker:
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
        str(RAY_BIN),
        "start",
        "--block",
        "--address",
        head.gcs_address,
        "--node-ip-address",
        ip,
        f"--num-cpus={num_cpus}",
        "--resources",
        json.dumps(resources),
        "--disable-usage-stats",
        "--temp-dir",
        str(head.temp_dir),
        "--dashboard-agent-listen-port",
        str(free_port(ip)),
    ]
    log_path = head.work_dir / f"ray-{name}.log"
    logger.info("starting Ray worker node %s on %s (%s)", name, ip, json.dumps(resources))
    process = start_process_group(
        args,
        log_path,
        extra_env={"RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0", "TMPDIR": str(node_dir)},
    )
    try:
        took_s = wait_ready(
            lambda: RAY_STARTED_LINE in log_path.read_text(errors="replace"),
            process,
            log_path,
            RAY_READY_TIMEOUT_S,
            f"Ray worker node {name}",
        )
    except BaseException:
        stop_process_group(process)
        raise
    logger.info("Ray worker node %s started after %.1f s", name, took_s)
    return RayWorker(ip, process, node_dir)


def stop_ray_worker(worker: RayWorker) -> None:
    """Stop the worker node's process group (whatever is left of it)."""
    logger.info("stopping Ray worker node %s (process group %d)", worker.ip, worker.process.pid)
    stop_process_group(worker.process)


@contextlib.contextmanager
def ray_worker(
    head: RayHead, *, name: str, ip: str, resources: dict[str, float], num_cpus: int
) -> Iterator[RayWorker]:
    """A worker node joined to `head`'s cluster, stopped on exit."""
    worker = start_ray_worker(head, name=name, ip=ip, resources=resources, num_cpus=num_cpus)
    try:
        yield worker
    finally:
        stop_ray_worker(worker)


@contextlib.contextmanager
def jobs_server(ray_address: str, work_dir: Path) -> Iterator[OurServer]:
    """Our server on the cluster at `ray_address`, in a namespace of its own."""
    port = free_port()
    log_path = work_dir / "jobs-server.log"
    args = [
        sys.executable,
        "-m",
        "jobs_server",
        "serve",
        "--port",
        str(port),
        "--ray-address",
        ray_address,
        "--log-dir",
        str(work_dir / "jobs-server-logs"),
        "--namespace",
        f"bench_{uuid.uuid4().hex[:12]}",
    ]
    logger.info("starting jobs-server on port %d", port)
    process = start_process_group(args, log_path)
    try:
        url = f"http://{HTTP_HOST}:{port}"
        took_s = wait_http_ok(
            f"{url}/api/healthz", process, log_path, SERVER_READY_TIMEOUT_S, "jobs-server"
        )
        logger.info("jobs-server answered after %.1f s at %s", took_s, url)
        yield OurServer(url, process.pid)
    finally:
        logger.info("stopping jobs-server (process group %d)", process.pid)
        stop_process_group(process)


def surviving_processes(marker: str) -> list[tuple[int, str]]:
    """Processes whose command line mentions `marker` (a path unique to this run)."""
    found: list[tuple[int, str]] = []
    for pid_dir in Path("/proc").iterdir():
        if not pid_dir.name.isdigit() or int(pid_dir.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            cmdline = (
                (pid_dir / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            )
            if marker in cmdline:
                found.append((int(pid_dir.name), cmdline.strip()[:200]))
    return found


def kill_survivors(marker: str) -> list[tuple[int, str]]:
    """SIGKILL, by pid, the processes this run started that outlived their process group."""
    survivors = surviving_processes(marker)
    for pid, _ in survivors:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return survivors
