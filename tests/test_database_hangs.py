"""A PostgreSQL that accepts connections and never answers (issue 34, item 1: the outage test's
sibling): its postmaster and every backend frozen with SIGSTOP, as a stalled disk, a lock held
forever or a partition that drops packets look from the client's side. Every request that needs
the archive answers 503 `database_unavailable` with a Retry-After within a bound (the archive's
DATABASE_TIMEOUT_S per call, plus the margin below), never a hang or a 500; `/api/healthz` says
so within its probe's second; nothing accepted is lost; once the database runs again the same
server serves again on its own, and a submit answered 503 meanwhile and retried runs once."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from jobs_server.manager.archive.postgres import DATABASE_TIMEOUT_S, connection_options
from tests.support.database_outage import (
    archived_status,
    assert_database_unavailable,
    server_on,
    submit_kept_and_during,
)
from tests.support.postgres import PostgresServer, running_postgres
from tests.support.processes import wait_until

pytestmark = pytest.mark.postgres

logger = logging.getLogger(__name__)

# A request made while the database is frozen is answered within the archive's bound per call
# and this margin (a loaded machine, a request that made two calls); a hang is a read timeout.
ANSWER_MARGIN_S = 15.0
ANSWER_BOUND_S = DATABASE_TIMEOUT_S + ANSWER_MARGIN_S
# The probe waits a second for the database; the rest is a loaded machine's.
HEALTHZ_BOUND_S = 5.0
REQUEST_TIMEOUT_S = 60
DEADLINE_S = 60
SUBMITS_WHILE_FROZEN = 12  # more than the pool's connections: its waiters are answered too


@pytest.fixture
def own_postgres() -> Iterator[PostgresServer]:
    """A PostgreSQL server of this test's own (it freezes it), durable as a real one."""
    with running_postgres(durable=True) as server:
        yield server


def postgres_processes(server: PostgresServer) -> list[int]:
    """The postmaster of `server` (by its data dir's pid file) and every process it started."""
    postmaster = int((server.directory / "data" / "postmaster.pid").read_text().split()[0])
    children = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError):
            stat = Path(f"/proc/{entry}/stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[1]) == postmaster:
                children.append(int(entry))
    return [postmaster, *children]


@contextlib.contextmanager
def frozen(server: PostgresServer) -> Iterator[list[int]]:
    """Every process of `server` stopped (SIGSTOP) for as long as the context lasts, then
    continued (SIGCONT), whatever happens. The postmaster first: a stopped one forks no more."""
    postmaster = postgres_processes(server)[0]
    stopped = [postmaster]
    try:
        os.kill(postmaster, signal.SIGSTOP)
        for pid in postgres_processes(server)[1:]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
                stopped.append(pid)
        yield stopped
    finally:
        for pid in reversed(stopped):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def timed_request(url: str, method: str, path: str, body: object = None) -> tuple[float, object]:
    """(seconds to the answer, the answer or the exception that came instead)."""
    started = time.monotonic()
    try:
        response: object = requests.request(
            method, f"{url}{path}", json=body, timeout=ANSWER_BOUND_S
        )
    except requests.RequestException as error:
        response = error
    return time.monotonic() - started, response


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        (
            "postgresql://postgres@127.0.0.1:5432/jobs",
            {
                "connect_timeout": "5",
                "tcp_user_timeout": "15000",
                "options": "-c statement_timeout=2500 -c idle_in_transaction_session_timeout=10000",
            },
        ),
        (
            # The URL's own settings win: its options after ours (the last -c wins).
            "postgresql://postgres@db/jobs?connect_timeout=30&tcp_user_timeout=0"
            "&options=-c%20statement_timeout%3D0",
            {
                "connect_timeout": None,
                "tcp_user_timeout": None,
                "options": "-c statement_timeout=2500"
                " -c idle_in_transaction_session_timeout=10000 -c statement_timeout=0",
            },
        ),
    ],
    ids=["defaults", "the-url-wins"],
)
def test_connection_options_bound_the_database_unless_the_url_says_otherwise(
    url: str, expected: dict[str, str | None]
) -> None:
    options = connection_options(url, 2.5)
    assert options["autocommit"] is True
    assert options["keepalives"] == "1"
    for key, value in expected.items():
        assert options.get(key) == value, (key, options)


@pytest.mark.slow
def test_a_hung_database_answers_503_within_a_bound_and_the_server_recovers(
    tmp_path: Path, ray_connection: str, own_postgres: PostgresServer
) -> None:
    database_url = own_postgres.create_database()
    with server_on(database_url, ray_connection, tmp_path, "db_hangs") as server:
        url, process, log_path = server.url, server.process, server.log_path
        submit_kept_and_during(url, database_url)

        frozen_ids = [f"frozen-{index}" for index in range(SUBMITS_WHILE_FROZEN)]
        requests_while_frozen = [
            *(
                (
                    f"submit {sid}",
                    "POST",
                    "/api/jobs/",
                    {"entrypoint": f"echo {sid}", "submission_id": sid},
                )
                for sid in frozen_ids
            ),
            ("get", "GET", "/api/jobs/kept", None),
            ("list", "GET", "/api/jobs/", None),
            ("list page", "GET", "/api/jobs/?limit=10", None),
            ("stop", "POST", "/api/jobs/kept/stop", None),
            ("delete", "DELETE", "/api/jobs/kept", None),
            ("events", "GET", "/api/events?after=0&format=ndjson", None),
            ("events sse", "GET", "/api/events?after=0", None),
        ]
        answers: dict[str, tuple[float, object]] = {}
        with frozen(own_postgres) as stopped:
            assert len(stopped) > 1, stopped  # the postmaster and its backends
            # All at once, as a busy server's clients would: they pile up on the pool.
            with ThreadPoolExecutor(len(requests_while_frozen)) as pool:
                futures = {
                    what: pool.submit(timed_request, url, method, path, body)
                    for what, method, path, body in requests_while_frozen
                }
                answers = {what: future.result() for what, future in futures.items()}
            healthz = timed_request(url, "GET", "/api/healthz")
            assert process.poll() is None, log_path.read_text()

        logger.info(
            "answers while frozen (s): %s; healthz %.2f s",
            {what: round(seconds, 2) for what, (seconds, _) in answers.items()},
            healthz[0],
        )
        wrong: dict[str, object] = {}
        for what, (seconds, response) in [*answers.items(), ("healthz", healthz)]:
            bound = HEALTHZ_BOUND_S if what == "healthz" else ANSWER_BOUND_S
            if not isinstance(response, requests.Response):
                wrong[what] = (round(seconds, 2), repr(response))
                continue
            try:
                assert_database_unavailable(response)
                assert seconds <= bound, (seconds, bound)
            except (AssertionError, KeyError, ValueError) as error:
                wrong[what] = (round(seconds, 2), response.status_code, response.text[:300], error)
        assert wrong == {}

        # Continued: the same server serves again on its own, nothing lost.
        wait_until(
            lambda: requests.get(f"{url}/api/healthz", timeout=REQUEST_TIMEOUT_S).ok,
            DEADLINE_S,
            "the probe to answer 200 again",
        )
        wait_until(
            lambda: archived_status(database_url, "during") == "SUCCEEDED",
            DEADLINE_S,
            "the job that ran through the freeze to be archived with its end",
        )
        assert archived_status(database_url, "kept") == "SUCCEEDED"
        # Each submit answered 503 is retried: it runs, once (a commit that landed after its
        # answer is the same job: 409, never a second one).
        for sid in frozen_ids:
            retried = requests.post(
                f"{url}/api/jobs/",
                json={"entrypoint": f"echo {sid}", "submission_id": sid},
                timeout=REQUEST_TIMEOUT_S,
            )
            assert retried.status_code in (200, 409), (sid, retried.status_code, retried.text)
        for sid in frozen_ids:
            wait_until(
                lambda sid=sid: archived_status(database_url, sid) == "SUCCEEDED",
                DEADLINE_S,
                f"{sid} to succeed",
            )
            logs = requests.get(f"{url}/api/jobs/{sid}/logs", timeout=REQUEST_TIMEOUT_S)
            assert logs.json()["logs"] == f"{sid}\n", (sid, logs.text)
        jobs = requests.get(f"{url}/api/jobs/", timeout=REQUEST_TIMEOUT_S).json()
        listed = sorted(job["submission_id"] for job in jobs)
        assert listed == sorted(["kept", "during", *frozen_ids])
        deleted = requests.delete(f"{url}/api/jobs/kept", timeout=REQUEST_TIMEOUT_S)
        assert deleted.status_code == 200, deleted.text
        assert process.poll() is None
    server_log = log_path.read_text()
    assert "unexpected error handling" not in server_log
    assert "Traceback" not in server_log
