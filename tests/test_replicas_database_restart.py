"""PostgreSQL restarted under load, with two replicas on it (issue 34): while it is away every
request answers 503 (`database_unavailable`, or `leader_unavailable` for a write that finds no
replica sure to lead), JSON with a Retry-After, never a 500 and never a hang; once it is back
the replicas recover on their own (both still up, exactly one leads) and nothing is lost: every
job a client was told was accepted runs once and succeeds, and the running cap held throughout.

The database is stopped as a crash stops it (`pg_ctl stop -m immediate`) for longer than the
`server` lease's TTL, so when it comes back the lease has expired and either replica may take
it: the old leader renews it, or the follower takes it and the old leader steps down. A
PostgreSQL of the test's own (the session's is shared by other tests), durable as a real one.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import json
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import requests

from jobs_server.manager.archive.leases import LEASE_TTL_S
from tests.support.postgres import (
    PostgresServer,
    running_postgres,
    start_again,
    stop_immediately,
)
from tests.support.processes import wait_until
from tests.support.replicas import (
    JOB_TIMEOUT_S,
    Replica,
    ReplicaGroup,
    marker_lines,
    wait_for_status,
)

pytestmark = [pytest.mark.postgres, pytest.mark.ray, pytest.mark.slow, pytest.mark.replicas]

logger = logging.getLogger(__name__)

# The running cap of both replicas.
CAP = 3
# How long PostgreSQL stays away: past the lease's TTL, so that it has expired when it is back.
OUTAGE_S = LEASE_TTL_S + 3
# A client's bound on one request: the longest the server should hold one is the database's
# call bound (5 s) or a forwarded write's; an answer that takes longer is a hang.
CLIENT_TIMEOUT_S = 30.0
# How soon the replicas must serve again once PostgreSQL is back (generous: a loaded machine).
RECOVERY_S = 60.0
# How often the client submits a job, and for how long it goes on after the first write that
# succeeds once PostgreSQL is back.
SUBMIT_INTERVAL_S = 0.4
SUBMITTING_AFTER_RECOVERY_S = 5.0
# Jobs accepted before the outage, so that some run and some wait when it starts.
ACCEPTED_BEFORE_OUTAGE = 8
ACCEPTABLE_503_CODES = frozenset({"database_unavailable", "leader_unavailable"})
# The words of a 503 that says the write may have been done (in_doubt_submits.py,
# leader_forwarding.py): retried with the same submission_id, 409 then means recorded.
IN_DOUBT_WORDS = ("may have recorded it", "may have been done")


@dataclass(frozen=True)
class Answer:
    """One request's outcome, as a client saw it."""

    replica: str
    started_s: float
    took_s: float
    status: int | None  # None: no answer (timeout, connection error)
    code: str | None = None
    retry_after: str | None = None
    json_body: bool = False
    message: str = ""

    @property
    def in_doubt(self) -> bool:
        return self.status is None or any(words in self.message for words in IN_DOUBT_WORDS)

    def is_acceptable_503(self) -> bool:
        """A 503 a client can act on: JSON, a known code, when to retry."""
        return (
            self.status == 503
            and self.json_body
            and self.code in ACCEPTABLE_503_CODES
            and self.retry_after is not None
            and self.retry_after.isdigit()
            and int(self.retry_after) > 0
            and "Traceback" not in self.message
        )


def ask(replica: Replica, method: str, path: str, **kwargs: Any) -> tuple[Answer, object]:
    """One request with the client's bound; what it got, and the parsed JSON body (or None)."""
    started = time.monotonic()
    try:
        response = replica.request(method, path, timeout=CLIENT_TIMEOUT_S, **kwargs)
    except requests.RequestException as error:
        took = time.monotonic() - started
        return Answer(replica.name, started, took, None, message=repr(error)), None
    took = time.monotonic() - started
    body: object = None
    is_json = response.headers.get("Content-Type", "").startswith("application/json")
    if is_json:
        with contextlib.suppress(ValueError):
            body = response.json()
    code = None
    message = response.text[:500]
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        code = body["error"].get("code")
        message = str(body["error"].get("message", ""))
    answer = Answer(
        replica.name,
        started,
        took,
        response.status_code,
        code=code,
        retry_after=response.headers.get("Retry-After"),
        json_body=is_json and body is not None,
        message=message,
    )
    return answer, body


@dataclass
class Submitter:
    """A client that submits a marker job every SUBMIT_INTERVAL_S, each attempt on the next
    replica; a 503 (or no answer) is retried after its Retry-After (at most a second) with
    the same submission_id, until accepted (200, or 409 after an answer that said it may have
    been done) or answered otherwise (kept as unexpected)."""

    replicas: Sequence[Replica]
    marker: Path
    answers: list[Answer] = field(default_factory=list)
    accepted: dict[str, str] = field(default_factory=dict)
    """submission_id -> how it was accepted (`200`, or `409` for a retry of one in doubt)."""
    unexpected: list[tuple[str, Answer]] = field(default_factory=list)
    _done: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> Submitter:
        self._thread = threading.Thread(target=self._run, name="submitter", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        assert self._thread is not None
        self._thread.join(timeout=RECOVERY_S + CLIENT_TIMEOUT_S)
        assert not self._thread.is_alive(), "the submitter did not finish"

    def accepted_since(self, since_s: float) -> list[Answer]:
        return [a for a in list(self.answers) if a.started_s >= since_s and a.status == 200]

    def _run(self) -> None:
        turns = itertools.cycle(self.replicas)
        for index in itertools.count():
            if self._done.is_set():
                return
            self._submit(f"pg-{index:03d}", turns)
            self._done.wait(SUBMIT_INTERVAL_S)

    def _submit(self, job_id: str, turns: Iterator[Replica]) -> None:
        body = {"entrypoint": f"sleep 2; echo {job_id} >> {self.marker}", "submission_id": job_id}
        in_doubt = False
        # Once stopped, an id already tried goes on until it has an answer: it may be recorded.
        deadline = time.monotonic() + RECOVERY_S + JOB_TIMEOUT_S
        while time.monotonic() < deadline:
            answer, _ = ask(next(turns), "POST", "/api/jobs/", json=body)
            self.answers.append(answer)
            if answer.status == 200:
                self.accepted[job_id] = "200"
                return
            if answer.status == 409 and answer.code == "duplicate_submission_id" and in_doubt:
                self.accepted[job_id] = "409"
                return
            if answer.status not in (503, None):
                self.unexpected.append((job_id, answer))
                return
            in_doubt = in_doubt or answer.in_doubt
            retry_after = answer.retry_after or "1"
            time.sleep(min(1.0, float(retry_after)) if retry_after.isdigit() else 1.0)
        self.unexpected.append((job_id, Answer("-", time.monotonic(), 0, None, message="gave up")))


@dataclass
class RunningSampler:
    """Lists the RUNNING jobs again and again, each time on the next replica, and keeps every
    answer with its time: the counts (whether the cap held) and the failed samples apart."""

    replicas: Sequence[Replica]
    counts: list[int] = field(default_factory=list)
    failed: list[Answer] = field(default_factory=list)
    _done: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> RunningSampler:
        self._thread = threading.Thread(target=self._run, name="running-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        assert self._thread is not None
        self._thread.join(timeout=CLIENT_TIMEOUT_S + 5)

    def _run(self) -> None:
        for replica in itertools.cycle(self.replicas):
            if self._done.is_set():
                return
            answer, body = ask(replica, "GET", "/api/jobs/", params={"status": "RUNNING"})
            if answer.status == 200 and isinstance(body, list):
                self.counts.append(len(body))
            else:
                self.failed.append(answer)
            self._done.wait(0.05)


@pytest.fixture
def own_postgres() -> Iterator[PostgresServer]:
    """A PostgreSQL server of this test's own, which it stops and starts; durable, as a real
    one is: what it acknowledged survives the crash."""
    with running_postgres(durable=True) as server:
        yield server


def count_jobs(replica: Replica, status: str) -> int:
    response = replica.request("GET", "/api/jobs/", params={"status": status})
    assert response.status_code == 200, response.text
    return len(response.json())


def describe(answers: Sequence[Answer]) -> str:
    return json.dumps([a.__dict__ for a in answers[:20]], default=str, indent=1)


def test_postgres_restarted_under_load_answers_503_meanwhile_and_loses_nothing(
    tmp_path: Path, ray_connection: str, own_postgres: PostgresServer
) -> None:
    """Two replicas, a cap of 3, a client submitting all along through both in turn: stop
    PostgreSQL (immediate) for LEASE_TTL_S + 3 s, then start it again. Meanwhile every failed
    request is a 503 a client can act on and none outlasts the client's bound; after, within
    RECOVERY_S, exactly one replica leads, neither exited, every accepted job succeeded and
    ran once (its id once in the marker file), and no sample saw more than 3 RUNNING."""
    marker = tmp_path / "marker"
    group = ReplicaGroup(
        tmp_path,
        ray_connection,
        own_postgres.create_database(),
        2,
        extra_args=["--max-running-jobs", str(CAP)],
    )
    try:
        group.start()
        leader_before = group.leader()
        with RunningSampler(group.replicas) as sampler, Submitter(group.replicas, marker) as client:
            wait_until(
                lambda: len(client.accepted) >= ACCEPTED_BEFORE_OUTAGE and any(sampler.counts),
                JOB_TIMEOUT_S,
                "jobs to be accepted and to run",
            )
            running_at_stop = count_jobs(leader_before, "RUNNING")
            waiting_at_stop = count_jobs(leader_before, "PENDING")
            stop_immediately(own_postgres)
            stopped_s = time.monotonic()
            time.sleep(OUTAGE_S)
            start_again(own_postgres)
            back_s = time.monotonic()
            wait_until(
                lambda: bool(client.accepted_since(back_s)), RECOVERY_S, "a submit to succeed"
            )
            first_write_s = min(a.started_s + a.took_s for a in client.accepted_since(back_s))
            time.sleep(SUBMITTING_AFTER_RECOVERY_S)
        leader_after = group.leader(timeout_s=RECOVERY_S)
        wait_until(
            lambda: all(replica.role() is not None for replica in group.replicas),
            RECOVERY_S,
            "both replicas' probes to answer 200",
        )
        alive = {replica.name: replica.is_alive() for replica in group.replicas}
        # No request ended in the 500 path (its line is "unexpected error handling ...").
        unexpected_errors = {
            replica.name: replica.log().count("unexpected error handling")
            for replica in group.replicas
        }
        turns = group.rotation()
        ends = {job_id: wait_for_status(turns, job_id)["status"] for job_id in client.accepted}
    finally:
        group.stop()

    answers = list(client.answers)
    refused = [a for a in answers if a.status != 200]
    not_acceptable = [a for a in refused if a.status != 409 and not a.is_acceptable_503()]
    samples_refused = [a for a in sampler.failed if not a.is_acceptable_503()]
    refused_503 = [a for a in refused if a.status == 503]
    # What the measurements of a run were (the report of the test; not asserted).
    logger.info(
        "database away %.1f s, %d waiting and %d running at the stop; submits: %d answers,"
        " %d accepted %s, refused %s (%d in doubt); samples: %d answered, refused %s;"
        " clients saw the outage from %+.1f s to %+.1f s of the stop (first refusal to first"
        " acceptance after the start again, %.1f s after it); longest request %.1f s"
        " (submit) and %.1f s (a refused list); most running %d; leader %s, then %s",
        back_s - stopped_s,
        waiting_at_stop,
        running_at_stop,
        len(answers),
        len(client.accepted),
        dict(collections.Counter(client.accepted.values())),
        dict(collections.Counter(f"{a.replica} {a.status} {a.code}" for a in refused)),
        sum(a.in_doubt for a in refused),
        len(sampler.counts),
        dict(collections.Counter(f"{a.replica} {a.status} {a.code}" for a in sampler.failed)),
        min((a.started_s for a in refused_503), default=stopped_s) - stopped_s,
        first_write_s - stopped_s,
        first_write_s - back_s,
        max((a.took_s for a in answers), default=0.0),
        max((a.took_s for a in sampler.failed), default=0.0),
        max(sampler.counts, default=0),
        leader_before.name,
        leader_after.name,
    )
    assert not_acceptable == [], describe(not_acceptable)
    assert samples_refused == [], describe(samples_refused)
    assert client.unexpected == [], client.unexpected
    assert alive == {replica.name: True for replica in group.replicas}, alive
    assert unexpected_errors == {replica.name: 0 for replica in group.replicas}
    # The outage was seen, with jobs running and waiting: submits were refused while it lasted.
    assert running_at_stop > 0
    assert waiting_at_stop > 0
    assert any(stopped_s <= a.started_s <= back_s for a in refused_503), describe(refused)
    assert ends == dict.fromkeys(client.accepted, "SUCCEEDED"), ends
    ran = collections.Counter(marker_lines(marker))
    assert ran == collections.Counter(list(client.accepted)), ran
    assert 1 <= max(sampler.counts, default=0) <= CAP, sampler.counts


# A database away this long: a managed database's failover or a slow crash recovery; long
# enough after the requests (sent LEASE_TTL_S after the stop) that one held until the database
# is back is told from one answered while it is away.
LONG_OUTAGE_S = LEASE_TTL_S + 12.0
# What a request may take while the database is away: the pool's wait for a connection (3 s)
# or a call's bound (--database-timeout-s, 5 s), and a margin for a loaded machine.
OUTAGE_ANSWER_BOUND_S = 15.0


def test_a_write_to_the_leader_answers_503_while_postgres_stays_away(
    tmp_path: Path, ray_connection: str, own_postgres: PostgresServer
) -> None:
    """PostgreSQL stopped for LONG_OUTAGE_S; once the leader's last renewal is older than the
    lease's TTL, a submit to the leader, a submit to the follower and a get on the leader,
    at once: each answers a 503 a client can act on within OUTAGE_ANSWER_BOUND_S (docs: at
    once, or after at most 3 s of waiting for a connection, or the call's 5 s), while the
    database is still away. Before, the leader held its own writes until the database came
    back: its confirmation of the lead waited for the database with no bound."""
    group = ReplicaGroup(tmp_path, ray_connection, own_postgres.create_database(), 2)
    try:
        group.start()
        leader = group.leader()
        (follower,) = [replica for replica in group.replicas if replica is not leader]
        stop_immediately(own_postgres)
        stopped_s = time.monotonic()
        back_s: float | None = None
        try:
            time.sleep(LEASE_TTL_S)
            requests_at_once = {
                "submit to the leader": (leader, "POST", "/api/jobs/", "late-leader"),
                "submit to the follower": (follower, "POST", "/api/jobs/", "late-follower"),
                "get on the leader": (leader, "GET", "/api/jobs/absent", None),
            }
            with ThreadPoolExecutor(len(requests_at_once)) as pool:
                asked_s = time.monotonic()
                futures = {
                    what: pool.submit(
                        ask_within,
                        replica,
                        method,
                        path,
                        None if job_id is None else {"entrypoint": "true", "submission_id": job_id},
                    )
                    for what, (replica, method, path, job_id) in requests_at_once.items()
                }
                time.sleep(max(0.0, stopped_s + LONG_OUTAGE_S - time.monotonic()))
                start_again(own_postgres)
                back_s = time.monotonic()
                answers = {what: future.result() for what, future in futures.items()}
        finally:
            if back_s is None:
                start_again(own_postgres)
        logger.info(
            "asked %.1f s after the stop, the database back %.1f s after it: %s",
            asked_s - stopped_s,
            (back_s or 0.0) - stopped_s,
            {
                what: (a.status, a.code, round(a.took_s, 1), a.message[:120])
                for what, a in answers.items()
            },
        )
        # Whether the writes whose clients gave up were done after all, once the database was
        # back (what a client that retries without a submission_id would submit twice).
        group.leader(timeout_s=RECOVERY_S)
        done_after_all = {
            job_id: leader.request("GET", f"/api/jobs/{job_id}").status_code
            for job_id in ("late-leader", "late-follower")
        }
        logger.info("after the outage, GET of each late submit: %s", done_after_all)
        not_refused = {what: a for what, a in answers.items() if not a.is_acceptable_503()}
        assert not_refused == {}, describe(list(not_refused.values()))
        assert back_s is not None
        held = {what: a for what, a in answers.items() if a.started_s + a.took_s >= back_s}
        assert held == {}, describe(list(held.values()))
    finally:
        group.stop()


def ask_within(replica: Replica, method: str, path: str, body: dict[str, str] | None) -> Answer:
    """One request with OUTAGE_ANSWER_BOUND_S as the client's bound."""
    started = time.monotonic()
    try:
        response = replica.request(method, path, json=body, timeout=OUTAGE_ANSWER_BOUND_S)
    except requests.RequestException as error:
        return Answer(replica.name, started, time.monotonic() - started, None, message=repr(error))
    is_json = response.headers.get("Content-Type", "").startswith("application/json")
    refusal = response.json().get("error", {}) if is_json else {}
    return Answer(
        replica.name,
        started,
        time.monotonic() - started,
        response.status_code,
        code=refusal.get("code"),
        retry_after=response.headers.get("Retry-After"),
        json_body=is_json,
        message=str(refusal.get("message", response.text[:500])),
    )
