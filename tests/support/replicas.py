"""Several `jobs-server serve` replicas on one PostgreSQL database and one Ray cluster (issue
34), for tests/test_replicas.py: start a group, find its leader, call any replica, kill or
freeze one, and sample how many jobs run while others wait.

Every replica of a group has the same `--database-url`, `--ray-address`, `--namespace` and
`--log-dir` (one machine: one shared log dir) and a state dir of its own; all listen on
loopback, so each one's default `--advertise-url` (`http://127.0.0.1:<port>`) is right.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import requests

from tests.support.processes import free_port, stop_leader_then_group, wait_until
from tests.support.ray_nodes import kill_actors_in_namespace
from tests.support.servers import start_jobs_server, wait_for_server

# A replica's start on a loaded 2-core machine (Ray's connection, the schema's migration).
START_TIMEOUT_S = 120.0
# A request's own bound: a replica that forwards a write to a leader that just died must still
# answer (the leader's answer, or 503 leader_unavailable).
REQUEST_TIMEOUT_S = 60.0
# How long a job of the tests may take to end, queue included.
JOB_TIMEOUT_S = 180.0
TERMINAL_STATUSES = frozenset({"SUCCEEDED", "FAILED", "STOPPED"})


class Replica:
    """One `jobs-server serve` process of a group, in a process group of its own."""

    def __init__(self, group: ReplicaGroup, name: str) -> None:
        self.group = group
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.workdir = group.workdir / name
        self.workdir.mkdir()
        self.log_path = self.workdir / "server.log"
        self.process = start_jobs_server(
            [
                *("--host", "127.0.0.1"),
                *("--port", str(self.port)),
                *("--ray-address", group.ray_address),
                *(() if group.database_url is None else ("--database-url", group.database_url)),
                *("--namespace", group.namespace),
                *("--state-dir", str(self.workdir / "state")),
                *("--log-dir", str(group.log_dir)),
                *("--stop-grace-s", "1"),
                *group.extra_args,
            ],
            self.log_path,
            env=group.env,
        )

    def __repr__(self) -> str:
        return f"<replica {self.name} pid {self.process.pid} {self.url}>"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self) -> None:
        """Wait for its probe; fail with its log if it exited instead."""
        wait_for_server(self.url, self.process, self.log_path, timeout_s=START_TIMEOUT_S)

    def is_alive(self) -> bool:
        return self.process.poll() is None

    def request(
        self, method: str, path: str, *, key: str | None = "admin", **kwargs: Any
    ) -> requests.Response:
        """One request to this replica, with the group's key named `key` (None: no key)."""
        headers = {**self.group.headers(key), **kwargs.pop("headers", {})}
        kwargs.setdefault("timeout", REQUEST_TIMEOUT_S)
        return requests.request(method, f"{self.url}{path}", headers=headers, **kwargs)

    def health(self) -> dict[str, Any]:
        """Its probe's answer (200), asked without a key as a load balancer asks."""
        response = self.request("GET", "/api/healthz", key=None)
        assert response.status_code == 200, (self, response.text)
        return dict(response.json())

    def role(self) -> str | None:
        """`leader` or `follower`, as its probe says; None while it does not answer."""
        try:
            response = self.request("GET", "/api/healthz", key=None, timeout=5)
        except requests.RequestException:
            return None
        if response.status_code != 200:
            return None
        role = response.json()["replica"].get("role")
        return None if role is None else str(role)

    def kill(self) -> None:
        """kill -9 of the replica (and whatever of its process group there is)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()

    def freeze(self) -> None:
        """SIGSTOP to the replica's process: it runs nothing, its lease is not renewed."""
        os.kill(self.process.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.process.pid, signal.SIGCONT)

    def stop(self) -> None:
        """SIGTERM to the replica alone (thawed first, in case a test froze it), then SIGKILL
        to what is left of its group."""
        self.thaw()
        stop_leader_then_group(self.process, signal.SIGTERM, timeout_s=60)


@dataclass
class ReplicaGroup:
    """`count` replicas of one database, Ray cluster and namespace, each started at once."""

    workdir: Path
    ray_address: str
    database_url: str | None
    """None: SQLite in the state dir, for one server alone (a baseline to compare with)."""
    count: int
    extra_args: Sequence[str] = ()
    env: dict[str, str] | None = None
    keys: dict[str, str] = field(default_factory=dict)
    """Bearer keys by name (`admin` is the one every call uses unless told otherwise)."""
    namespace: str = field(default_factory=lambda: f"test_replicas_{uuid.uuid4().hex[:8]}")
    replicas: list[Replica] = field(default_factory=list)

    @property
    def log_dir(self) -> Path:
        return self.workdir / "logs"

    def headers(self, key: str | None) -> dict[str, str]:
        if key is None or key not in self.keys:
            assert key in (None, "admin"), f"no key named {key}"
            return {}
        return {"Authorization": f"Bearer {self.keys[key]}"}

    def start(self) -> None:
        """Start every replica at once, then wait for each one's probe."""
        self.log_dir.mkdir(exist_ok=True)
        self.replicas = [Replica(self, f"replica-{index}") for index in range(self.count)]
        for replica in self.replicas:
            replica.wait_ready()

    def stop(self) -> None:
        for replica in self.replicas:
            replica.stop()
        kill_actors_in_namespace(self.namespace)

    def live(self) -> list[Replica]:
        return [replica for replica in self.replicas if replica.is_alive()]

    def leader(self, among: Sequence[Replica] | None = None, timeout_s: float = 60) -> Replica:
        """The one replica (of `among`, default the live ones) whose probe says `leader`,
        once exactly one does (a takeover may be under way)."""
        found: list[Replica] = []

        def one_leads() -> bool:
            candidates = self.live() if among is None else among
            found[:] = [replica for replica in candidates if replica.role() == "leader"]
            return len(found) == 1

        wait_until(one_leads, timeout_s, "exactly one replica to say role leader")
        return found[0]

    def in_turn(self) -> list[Replica]:
        """Three replicas A, B, C for a client that changes replica at every request: A and C
        followers, B the leader, so each kind of request meets both roles. One replica alone
        (the harness's own check) is A, B and C."""
        if self.count == 1:
            return self.replicas * 3
        leader = self.leader()
        followers = [replica for replica in self.live() if replica is not leader]
        return [followers[0], leader, followers[-1]]

    def rotation(self) -> Iterator[Replica]:
        """The live replicas, one after the other, forever."""
        return itertools.cycle(self.live())


def submit_retrying(
    replica: Replica, body: dict[str, Any], *, deadline_s: float = 60
) -> list[requests.Response]:
    """Submit `body` to `replica` until it is accepted; every answer, the accepted one last.

    Only 503 `leader_unavailable` (no replica leads right now) is retried, after its
    Retry-After (at most a second here): any other answer ends the retries."""
    answers = []
    deadline = time.monotonic() + deadline_s
    while True:
        response = replica.request("POST", "/api/jobs/", json=body)
        answers.append(response)
        if not is_leader_unavailable(response) or time.monotonic() > deadline:
            return answers
        time.sleep(min(1.0, float(response.headers.get("Retry-After", "1"))))


def is_leader_unavailable(response: requests.Response) -> bool:
    if response.status_code != 503:
        return False
    with contextlib.suppress(ValueError):
        return bool(response.json()["error"]["code"] == "leader_unavailable")
    return False


def submit(replica: Replica, *, key: str | None = "admin", **body: Any) -> str:
    response = replica.request("POST", "/api/jobs/", key=key, json=body)
    assert response.status_code == 200, (replica, response.text)
    submitted = response.json()
    assert submitted["job_id"] == submitted["submission_id"]
    return str(submitted["submission_id"])


def get_job(replica: Replica, job_id: str, *, key: str | None = "admin") -> dict[str, Any]:
    response = replica.request("GET", f"/api/jobs/{job_id}", key=key)
    assert response.status_code == 200, (replica, response.text)
    return dict(response.json())


def list_jobs(replica: Replica, *, key: str | None = "admin", **params: str) -> list[Any]:
    response = replica.request("GET", "/api/jobs/", key=key, params=params)
    assert response.status_code == 200, (replica, response.text)
    return list(response.json())


def wait_for_status(
    replicas: Iterator[Replica],
    job_id: str,
    statuses: frozenset[str] = TERMINAL_STATUSES,
    timeout_s: float = JOB_TIMEOUT_S,
) -> dict[str, Any]:
    """Poll the job, each time on the next of `replicas`, until its status is one of
    `statuses`; its details."""
    job: dict[str, Any] = {}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        job = get_job(next(replicas), job_id)
        if job["status"] in statuses:
            return job
        time.sleep(0.1)
    raise AssertionError(f"job {job_id} still {job.get('status')} after {timeout_s}s: {job}")


class RunningSampler:
    """A thread that lists the RUNNING jobs every `interval_s`, each time on the next replica
    it may use, and keeps every count: whether a cap held at every sample. A subclass may
    look at each sample's jobs (`_observe`) and do more after each (`_after_sample`)."""

    def __init__(self, replicas: Sequence[Replica], interval_s: float = 0.05) -> None:
        self._replicas = list(replicas)
        self._interval_s = interval_s
        self._lock = threading.Lock()
        self.counts: list[int] = []
        self.errors: list[str] = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="running-sampler", daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join(timeout=REQUEST_TIMEOUT_S + 5)

    def use(self, replicas: Sequence[Replica]) -> None:
        """Sample on these from now on (before a test kills or freezes one of the others),
        once the sample in flight has its answer."""
        with self._lock:
            self._replicas = list(replicas)

    def _run(self) -> None:
        for turn in itertools.count():
            if self._done.is_set():
                return
            next_s = time.monotonic() + self._interval_s
            # Held through the request: `use` returns once no sample is in flight on a replica
            # it drops.
            with self._lock:
                self._sample(self._replicas[turn % len(self._replicas)])
                self._after_sample()
            self._done.wait(max(0.0, next_s - time.monotonic()))

    def _sample(self, replica: Replica) -> None:
        try:
            response = replica.request("GET", "/api/jobs/", params={"status": "RUNNING"})
        except requests.RequestException as error:
            self.errors.append(f"{replica}: {error}")
            return
        seen_s = time.monotonic()
        if response.status_code != 200:
            self.errors.append(f"{replica}: {response.status_code} {response.text[:200]}")
            return
        jobs = response.json()
        self.counts.append(len(jobs))
        self._observe(jobs, seen_s)

    def _observe(self, jobs: list[dict[str, Any]], seen_s: float) -> None:
        """A sample's RUNNING jobs, listed at `seen_s` (time.monotonic)."""

    def _after_sample(self) -> None:
        """After each sample, the lock held."""

    @property
    def most(self) -> int:
        return max(self.counts, default=0)


def marker_lines(marker: Path) -> list[str]:
    """The ids the jobs wrote to the marker file, one line each, in order."""
    if not marker.exists():
        return []
    return marker.read_text().split()


def wait_for_exit(process: subprocess.Popen[bytes], timeout_s: float) -> int | None:
    """The process's exit status, or None if it still runs after `timeout_s`."""
    try:
        return process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return None
