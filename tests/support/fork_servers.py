"""A fork server for the tests that drive one without Ray (tests/test_fork_server*.py), and
what they look for in /proc."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import time
from collections.abc import AsyncIterator, Callable, Collection
from pathlib import Path

import psutil
import pytest

from jobs_server.manager.live.store import JobStore
from jobs_server.manager.records import RayDriver
from jobs_server.manager.supervisor.cgroups import AttemptCgroup
from jobs_server.manager.supervisor.containment import SHELL, Containment
from jobs_server.manager.supervisor.fork_server import ForkServer
from jobs_server.manager.supervisor.job_run import JobRun
from jobs_server.manager.supervisor.process import become_child_subreaper

CONTAINMENTS = [
    pytest.param(
        containment,
        marks=pytest.mark.skipif(
            containment is Containment.PID_NAMESPACE and os.geteuid() != 0,
            reason="a PID namespace needs CAP_SYS_ADMIN",
        ),
    )
    for containment in Containment
]
REPO = Path(__file__).resolve().parents[2]
_PR_SET_CHILD_SUBREAPER = 36


@contextlib.asynccontextmanager
async def subreaper_fork_server(
    shell: str = SHELL, *, clone_parent: bool = True, nice: int = 0
) -> AsyncIterator[ForkServer]:
    """A started fork server of this test process, made a child subreaper meanwhile (as a
    supervisor is): each job's first process is its child (`clone_parent`), or re-parented to it."""
    assert become_child_subreaper()
    server = ForkServer("fork-server-test", shell=shell, clone_parent=clone_parent, nice=nice)
    server.start()
    try:
        yield server
    finally:
        server.close()
        ctypes.CDLL(None).prctl(_PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)


def job_env(job_token: str) -> dict[str, str]:
    return {**os.environ, "JOBS_SERVER_JOB_TOKEN": job_token}


def is_alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def marked_processes(marker: str) -> list[int]:
    """Live processes anywhere on the node whose environment holds `marker` (NAME=value)."""
    found = []
    name, _, value = marker.partition("=")
    for process in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if process.environ().get(name) == value and is_alive(process.pid):
                found.append(process.pid)
    return found


def processes_with_tokens(name: str, values: Collection[str]) -> list[int]:
    """Live processes anywhere on the node whose environment's `name` is one of `values` (one
    pass over the node's processes, however many values)."""
    wanted = set(values)
    found = []
    for process in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if process.environ().get(name) in wanted and is_alive(process.pid):
                found.append(process.pid)
    return found


async def wait_until(condition: Callable[[], object], what: str, timeout_s: float = 15) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.02)


def poll_until(condition: Callable[[], object], what: str, timeout_s: float = 15) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


class Host:
    """The supervisor's side that an attempt needs (AttemptHost), around a real fork server."""

    def __init__(self, store: JobStore, forks: ForkServer) -> None:
        self._store = store
        self._forks = forks

    @property
    def supervisor_token(self) -> str:
        return "attempt-faults"

    def job_store(self) -> JobStore:
        return self._store

    async def ray_driver_of(self, submission_id: str) -> RayDriver | None:
        return None  # its commands start no Ray driver

    async def prepare_processes(self, jobs_cgroup: str | None) -> Containment:
        return Containment.MARKER

    def attempt_cgroup(self, run: JobRun, attempt: int) -> AttemptCgroup | None:
        return None  # where the host has no cgroups: no limits, rusage's accounting

    def fork_server(self) -> ForkServer | None:
        return self._forks

    def spool(self, run: JobRun) -> None: ...

    def unspool(self, run: JobRun) -> None: ...

    def is_spooled(self, run: JobRun) -> bool:
        return False

    def command_starting(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def other_roots(self, run: JobRun) -> frozenset[int]:
        return frozenset()

    def reap_orphans(self) -> None: ...
