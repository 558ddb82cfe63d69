"""Processes the tests and benchmarks start: free ports, waiting with a deadline, stopping a
process group, and a job's pids as the node sees them."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from typing import Any


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def accepts_connections(host: str, port: int) -> bool:
    """Whether something listens on the TCP port (a server, Ray's GCS, Redis)."""
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, port)) == 0


def stop_process_group(process: subprocess.Popen[Any], timeout_s: float = 20) -> None:
    """SIGTERM the process's group (it was started in its own session), then SIGKILL."""
    if process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def stop_ray_node(process: subprocess.Popen[Any], timeout_s: float = 20) -> None:
    """Stop a `ray start --block` node: Ctrl-C to its leader, then SIGKILL to what is left.

    While a detached actor lives, `ray start --block` does not exit on SIGTERM (it waited out
    every 20 s timeout to its SIGKILL); on SIGINT it stops its node in a second or two."""
    stop_leader_then_group(process, signal.SIGINT, timeout_s)


def stop_leader_then_group(
    process: subprocess.Popen[Any], first: signal.Signals, timeout_s: float
) -> None:
    """`first` to the group's leader alone, a wait for it, then SIGKILL to what is left."""
    if process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        process.send_signal(first)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=timeout_s)
    # Whatever of its group is left (nothing, when the leader stopped the rest itself).
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def host_pids(pids: list[int], driver_pid: int) -> list[int]:
    """The node's pids of processes of a job that wrote their own (`$$`): in the job's PID
    namespace (where the host allows one), those are the namespace's."""
    namespace = os.readlink(f"/proc/{driver_pid}/ns/pid_for_children")
    if namespace == os.readlink("/proc/self/ns/pid"):
        return pids
    on_the_node = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/{name}/ns/pid") == namespace:
                with open(f"/proc/{name}/status") as status:
                    for line in status:
                        if line.startswith("NSpid:"):
                            on_the_node[int(line.split()[-1])] = int(name)
    return [on_the_node[pid] for pid in pids]


async def poll_until(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout_s}s waiting for {what}"
        await asyncio.sleep(0.05)
