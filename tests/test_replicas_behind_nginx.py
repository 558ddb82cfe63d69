"""Two replicas behind nginx, configured as docs/operations.md says (issue 34: "a load balancer
in front, a tested example with a real one from the distribution, on loopback").

The test reads the ```nginx block of the section "Several replicas", puts the replicas' real
ports in its `upstream` and a free loopback port in its `listen`, wraps it in the least main,
events and http context nginx needs, and runs Debian's nginx as a non-daemon in a temporary
directory. Every request of the tests goes through nginx: the whole API (submit, get, list, a
log follow and `/api/events` that must stream as the output comes, stop, delete), Ray's own
client following a log over the websocket (`ray job logs --follow`: the docs point Ray's clients
at the load balancer), then the leader killed -9: reads still answer, writes answer 503
leader_unavailable until the survivor leads, and a job that ran through the takeover ends
SUCCEEDED.
"""

from __future__ import annotations

import asyncio
import codecs
import collections
import contextlib
import json
import os
import re
import shutil
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import requests
from ray.job_submission import JobSubmissionClient

from jobs_server.client.sse import parse_events
from jobs_server.manager.archive.leases import LEASE_RENEW_INTERVAL_S, LEASE_TTL_S
from tests.support.processes import free_port, stop_process_group, wait_until
from tests.support.replicas import (
    JOB_TIMEOUT_S,
    REQUEST_TIMEOUT_S,
    TERMINAL_STATUSES,
    ReplicaGroup,
    is_leader_unavailable,
)

pytestmark = [pytest.mark.postgres, pytest.mark.ray, pytest.mark.slow, pytest.mark.replicas]

DOCS = Path(__file__).resolve().parents[1] / "docs" / "operations.md"
DOCS_SECTION = "### Several replicas"
# What the documented block says, and the test replaces with the replicas' ports and its own.
DOCUMENTED_UPSTREAM_SERVERS = "server 127.0.0.1:8301; server 127.0.0.1:8302;"
DOCUMENTED_LISTEN = "listen 8265;"

# The documented block goes in `http`; the rest is what nginx needs to run unprivileged in a
# temporary directory, and an access log that says which replica (or replicas) each request met.
NGINX_MAIN_CONF = """
daemon off;
worker_processes 1;
pid {dir}/nginx.pid;
error_log {dir}/error.log info;
{user}
events {{ worker_connections 256; }}
http {{
    log_format upstreams '$request_method $uri $status upstreams=$upstream_addr';
    access_log {dir}/access.log upstreams;
    client_body_temp_path {dir}/body;
    proxy_temp_path {dir}/proxy;
    fastcgi_temp_path {dir}/fastcgi;
    uwsgi_temp_path {dir}/uwsgi;
    scgi_temp_path {dir}/scgi;
{documented}
}}
"""
NGINX_START_TIMEOUT_S = 30.0
# How long a streamed answer may stay silent before the test gives up on it: more than the
# event stream's 15 s heartbeat, far less than a job that waits for the test (a stream that
# nginx holds back never sends what the test waits for).
STREAM_READ_TIMEOUT_S = 30.0
# How long the test waits for an event it expects (a job's start or end, on a loaded machine).
EVENT_TIMEOUT_S = 60.0
# What a follower takes to notice a dead leader and take its lease, and a margin for a loaded
# 2-core machine (as tests/test_replicas.py).
TAKEOVER_S = LEASE_TTL_S + LEASE_RENEW_INTERVAL_S
MARGIN_S = 30.0


def documented_nginx_block() -> str:
    """The one ```nginx block of docs/operations.md's section on replicas."""
    text = DOCS.read_text()
    start = text.index(DOCS_SECTION)
    end = text.find("\n### ", start + len(DOCS_SECTION))
    section = text[start : end if end != -1 else len(text)]
    blocks = re.findall(r"^```nginx\n(.*?)^```", section, flags=re.MULTILINE | re.DOTALL)
    assert len(blocks) == 1, f"{DOCS}: {len(blocks)} nginx blocks in {DOCS_SECTION!r}"
    return str(blocks[0])


def nginx_conf(directory: Path, listen_port: int, upstream_ports: list[int]) -> str:
    """The documented block, on these ports, in a whole configuration."""
    block = documented_nginx_block()
    for documented in (DOCUMENTED_UPSTREAM_SERVERS, DOCUMENTED_LISTEN):
        assert block.count(documented) == 1, f"the docs' nginx block lost {documented!r}"
    servers = " ".join(f"server 127.0.0.1:{port};" for port in upstream_ports)
    block = block.replace(DOCUMENTED_UPSTREAM_SERVERS, servers)
    block = block.replace(DOCUMENTED_LISTEN, f"listen 127.0.0.1:{listen_port};")
    # As root, nginx's workers would become `nobody`, who cannot enter the test's directory.
    user = "user root;" if os.geteuid() == 0 else ""
    return NGINX_MAIN_CONF.format(dir=directory, user=user, documented=block)


@dataclass
class Balancer:
    """nginx in front of the group: every request of the tests goes to it."""

    url: str
    directory: Path
    process: subprocess.Popen[bytes]

    def request(self, method: str, path: str, **kwargs: Any) -> requests.Response:
        kwargs.setdefault("timeout", REQUEST_TIMEOUT_S)
        return requests.request(method, f"{self.url}{path}", **kwargs)

    def stream(self, path: str, **params: str) -> requests.Response:
        """A GET whose body the caller reads as it comes, each read within
        STREAM_READ_TIMEOUT_S."""
        return requests.get(
            f"{self.url}{path}",
            params=params,
            stream=True,
            timeout=(REQUEST_TIMEOUT_S, STREAM_READ_TIMEOUT_S),
        )

    def submit(self, **body: Any) -> str:
        response = self.request("POST", "/api/jobs/", json=body)
        assert response.status_code == 200, response.text
        return str(response.json()["submission_id"])

    def get_job(self, job_id: str) -> dict[str, Any]:
        response = self.request("GET", f"/api/jobs/{job_id}")
        assert response.status_code == 200, response.text
        return dict(response.json())

    def list_ids(self) -> list[str]:
        response = self.request("GET", "/api/jobs/")
        assert response.status_code == 200, response.text
        return [job["submission_id"] for job in response.json()]

    def logs(self, job_id: str) -> str:
        response = self.request("GET", f"/api/jobs/{job_id}/logs")
        assert response.status_code == 200, response.text
        return str(response.json()["logs"])

    def wait_for_status(
        self, job_id: str, statuses: frozenset[str] = TERMINAL_STATUSES
    ) -> dict[str, Any]:
        job: dict[str, Any] = {}
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while time.monotonic() < deadline:
            job = self.get_job(job_id)
            if job["status"] in statuses:
                return job
            time.sleep(0.1)
        raise AssertionError(f"job {job_id} still {job.get('status')} after {JOB_TIMEOUT_S}s")

    def upstreams_met(self) -> list[str]:
        """For each request so far, the replicas nginx tried, in order (`host:port, ...`)."""
        access_log = (self.directory / "access.log").read_text()
        return re.findall(r"upstreams=(.*)$", access_log, flags=re.MULTILINE)


@contextlib.contextmanager
def documented_nginx(directory: Path, upstream_ports: list[int]) -> Iterator[Balancer]:
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    assert Path(nginx).exists(), "install Debian's nginx: apt-get install -y nginx"
    directory.mkdir(parents=True, exist_ok=True)
    port = free_port()
    conf = directory / "nginx.conf"
    conf.write_text(nginx_conf(directory, port, upstream_ports))
    process = subprocess.Popen(
        [nginx, "-e", str(directory / "error.log"), "-p", str(directory), "-c", str(conf)],
        start_new_session=True,
    )
    balancer = Balancer(f"http://127.0.0.1:{port}", directory, process)
    try:

        def answers() -> bool:
            assert process.poll() is None, (directory / "error.log").read_text()
            with contextlib.suppress(requests.ConnectionError):
                return balancer.request("GET", "/api/healthz", timeout=5).status_code == 200
            return False

        wait_until(answers, NGINX_START_TIMEOUT_S, "nginx to answer")
        yield balancer
    finally:
        stop_process_group(process)


@pytest.fixture
def balanced(
    tmp_path: Path, ray_connection: str, postgres_url: str
) -> Iterator[tuple[ReplicaGroup, Balancer]]:
    """Two replicas on the session's Ray cluster and a fresh database, nginx in front."""
    group = ReplicaGroup(tmp_path / "replicas", ray_connection, postgres_url, 2)
    group.workdir.mkdir()
    try:
        group.start()
        ports = [replica.port for replica in group.replicas]
        with documented_nginx(tmp_path / "nginx", ports) as balancer:
            yield group, balancer
    finally:
        group.stop()


class JobEvents:
    """The job events of an `/api/events` stream (SSE), read as the test asks for them."""

    def __init__(self, response: requests.Response) -> None:
        assert response.status_code == 200, response.text
        assert response.headers["Content-Type"].startswith("text/event-stream")
        self._chunks = response.iter_content(chunk_size=None)
        self._decoder = codecs.getincrementaldecoder("utf-8")()
        self._unread = ""
        self._ready: collections.deque[dict[str, Any]] = collections.deque()
        self.seen: list[dict[str, Any]] = []
        # Everything the stream sent, heartbeats included (for a failure's message).
        self.raw = ""

    def _next(self, deadline: float, what: str) -> dict[str, Any]:
        while not self._ready:
            assert time.monotonic() < deadline, f"no event {what} after {self.seen}: {self.raw!r}"
            try:
                chunk = next(self._chunks)
            except StopIteration:
                raise AssertionError(f"the event stream ended after {self.seen}") from None
            except requests.ConnectionError as error:
                raise AssertionError(
                    f"nothing for {STREAM_READ_TIMEOUT_S}s after {self.seen}: {self.raw!r}"
                ) from error
            text = self._decoder.decode(chunk)
            self.raw += text
            # Events end at a blank line; the server ends its lines with CRLF.
            unread = (self._unread + text).replace("\r\n", "\n")
            whole, blank, self._unread = unread.rpartition("\n\n")
            for sse in parse_events(whole + blank):
                if sse.event == "job":
                    self._ready.append({**json.loads(sse.data), "sse_id": sse.id})
        job_event = self._ready.popleft()
        self.seen.append(job_event)
        return job_event

    def read_until(self, predicate: Callable[[dict[str, Any]], bool], what: str) -> None:
        """Read events until one satisfies `predicate`, within EVENT_TIMEOUT_S."""
        deadline = time.monotonic() + EVENT_TIMEOUT_S
        while not predicate(self._next(deadline, what)):
            pass

    def of(self, job_id: str) -> list[tuple[str, str | None]]:
        """The (type, status) of every event of the job read so far."""
        return [
            (event["type"], event["status"])
            for event in self.seen
            if event["submission_id"] == job_id
        ]


def is_status(job_id: str, status: str) -> Callable[[dict[str, Any]], bool]:
    return lambda event: event["submission_id"] == job_id and event["status"] == status


def test_the_whole_api_through_the_documented_nginx(
    balanced: tuple[ReplicaGroup, Balancer], tmp_path: Path
) -> None:
    """Submit, get, list, logs, a log follow and the event stream (each streamed as it comes),
    stop and delete, all through nginx's round robin: both replicas answer, as one server."""
    group, nginx = balanced
    tag = uuid.uuid4().hex[:8]
    with nginx.stream("/api/events") as event_response:
        events = JobEvents(event_response)

        short_jobs = [nginx.submit(entrypoint=f"echo job-{i}-{tag}") for i in range(4)]
        for index, job_id in enumerate(short_jobs):
            assert nginx.wait_for_status(job_id)["status"] == "SUCCEEDED"
            assert nginx.logs(job_id) == f"job-{index}-{tag}\n"
        assert set(short_jobs) <= set(nginx.list_ids())

        # A follow sends each line as it comes: the first one reaches the client while the job
        # still runs (it waits for the gate, which the test opens once it has the line).
        gate = tmp_path / "follow-gate"
        followed = nginx.submit(
            entrypoint=f"echo first; until [ -e {gate} ]; do sleep 0.1; done; echo last"
        )
        with nginx.stream(f"/api/jobs/{followed}/logs", follow="true") as response:
            assert response.status_code == 200, response.text
            chunks = response.iter_content(chunk_size=None)
            received = b""
            while b"\n" not in received:
                try:
                    received += next(chunks)
                except requests.ConnectionError as error:
                    raise AssertionError(
                        f"the follow sent {received!r} in {STREAM_READ_TIMEOUT_S}s "
                        "while the job printed its first line (held back by nginx?)"
                    ) from error
            assert received == b"first\n"
            # The job cannot end before the gate opens; its RUNNING may be recorded after its
            # first line.
            assert nginx.wait_for_status(followed, frozenset({"RUNNING"}))["status"] == "RUNNING"
            gate.touch()
            received += b"".join(chunks)
        assert received == b"first\nlast\n"
        assert nginx.wait_for_status(followed)["status"] == "SUCCEEDED"

        # The event stream too: the long job's RUNNING can only come live (it runs until the
        # test stops it).
        long_job = nginx.submit(entrypoint="sleep 600")
        events.read_until(is_status(long_job, "RUNNING"), f"{long_job} RUNNING")
        assert nginx.get_job(long_job)["status"] == "RUNNING"
        response = nginx.request("POST", f"/api/jobs/{long_job}/stop")
        assert (response.status_code, response.json()) == (200, {"stopped": True}), response.text
        assert nginx.wait_for_status(long_job)["status"] == "STOPPED"
        response = nginx.request("DELETE", f"/api/jobs/{long_job}")
        assert (response.status_code, response.json()) == (200, {"deleted": True}), response.text
        response = nginx.request("GET", f"/api/jobs/{long_job}")
        assert response.status_code == 404, response.text
        assert response.json()["error"]["code"] == "job_not_found"
        events.read_until(
            lambda event: event["submission_id"] == long_job and event["type"] == "deleted",
            f"{long_job} deleted",
        )

    for job_id in [*short_jobs, followed]:
        kinds = events.of(job_id)
        assert kinds[0] == ("submitted", "PENDING"), kinds
        assert kinds[-1] == ("status", "SUCCEEDED"), kinds
    assert events.of(long_job)[-2:] == [("status", "STOPPED"), ("deleted", None)]
    # One stream of the whole namespace: ids one apart, whichever replica recorded the event.
    ids = [int(event["sse_id"]) for event in events.seen]
    assert ids == list(range(ids[0], ids[0] + len(ids))), ids
    # Round robin: both replicas answered, and each request met one replica.
    met = nginx.upstreams_met()
    assert {f"127.0.0.1:{replica.port}" for replica in group.replicas} == set(met), met


def test_a_killed_leader_behind_the_documented_nginx(
    balanced: tuple[ReplicaGroup, Balancer], tmp_path: Path
) -> None:
    """kill -9 the leader: through nginx, reads answer 200 throughout (nginx passes a request
    the dead replica refused to the other one), writes answer 503 leader_unavailable until the
    survivor leads, then 200; a job that ran across the takeover ends SUCCEEDED."""
    group, nginx = balanced
    gate = tmp_path / "takeover-gate"
    running = nginx.submit(
        entrypoint=f"echo before; until [ -e {gate} ]; do sleep 0.1; done; echo after"
    )
    nginx.wait_for_status(running, frozenset({"RUNNING"}))
    leader = group.leader()
    (survivor,) = [replica for replica in group.replicas if replica is not leader]

    leader.kill()
    killed_at = time.monotonic()
    writes: list[requests.Response] = []
    reads: list[requests.Response] = []
    while time.monotonic() < killed_at + TAKEOVER_S + MARGIN_S:
        writes.append(nginx.request("POST", "/api/jobs/", json={"entrypoint": "echo late"}))
        if writes[-1].status_code == 200:
            break
        reads.append(nginx.request("GET", f"/api/jobs/{running}"))
        reads.append(nginx.request("GET", "/api/jobs/"))
        reads.append(nginx.request("GET", f"/api/jobs/{running}/logs"))
        time.sleep(0.5)
    *refused, accepted = writes
    assert accepted.status_code == 200, accepted.text
    assert refused, "the survivor led before the first write: the outage was not seen"
    for answer in refused:
        assert is_leader_unavailable(answer), (answer.status_code, answer.text)
        assert answer.headers["Content-Type"].startswith("application/json")
        assert int(answer.headers["Retry-After"]) > 0
    assert [read.status_code for read in reads] == [200] * len(reads), [r.text for r in reads]
    assert all(read.json()["status"] == "RUNNING" for read in reads[::3])
    assert group.leader(among=[survivor]) is survivor

    late = str(accepted.json()["submission_id"])
    gate.touch()
    assert nginx.wait_for_status(running)["status"] == "SUCCEEDED"
    assert nginx.logs(running) == "before\nafter\n"
    assert nginx.wait_for_status(late)["status"] == "SUCCEEDED"
    assert nginx.logs(late) == "late\n"
    # nginx met the dead replica and passed the request on: the client never saw it.
    dead, live = f"127.0.0.1:{leader.port}", f"127.0.0.1:{survivor.port}"
    assert f"{dead}, {live}" in nginx.upstreams_met(), nginx.upstreams_met()


async def tail_until_closed(client: JobSubmissionClient, job_id: str, gate: Path) -> str:
    """What Ray's `tail_job_logs` (a websocket) yields, opening the gate at the first line."""
    text = ""
    async with asyncio.timeout(EVENT_TIMEOUT_S):
        async for chunk in client.tail_job_logs(job_id):
            opens_gate = "\n" not in text
            text += chunk
            if opens_gate and "\n" in text:
                await asyncio.to_thread(gate.touch)
    return text


def test_rays_log_tail_through_the_documented_nginx(
    balanced: tuple[ReplicaGroup, Balancer], tmp_path: Path
) -> None:
    """The docs point Ray's clients at the load balancer: `ray job logs --follow` is a
    websocket (`/logs/tail`), which nginx passes on only with the upgrade headers."""
    _, nginx = balanced
    gate = tmp_path / "tail-gate"
    job_id = nginx.submit(
        entrypoint=f"echo first; until [ -e {gate} ]; do sleep 0.1; done; echo last"
    )
    client = JobSubmissionClient(nginx.url)
    try:
        tailed = asyncio.run(tail_until_closed(client, job_id, gate))
    except aiohttp.WSServerHandshakeError as error:
        raise AssertionError(f"nginx did not pass the websocket on: {error}") from error
    assert tailed == "first\nlast\n"
    assert nginx.wait_for_status(job_id)["status"] == "SUCCEEDED"
