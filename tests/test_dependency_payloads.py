"""What a job's details say of its dependencies when only its record is known (a webhook's body,
an event's details): `met` from the record (all met once it entered the queue, one held before
a deletion, the one a never-satisfied job names), and a waiting job's message made current from
what is known of its dependencies now; a received webhook's body end to end."""

from __future__ import annotations

import base64
import os
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from jobs_server.api_models import JobDetails
from jobs_server.app import create_app
from jobs_server.manager.queue.dependency_waits import never_message, waiting_message
from jobs_server.manager.records import (
    DependencyCondition,
    JobDependency,
    JobErrorType,
    JobRecord,
    JobSpec,
    JobStatus,
)
from jobs_server.settings import Settings
from tests.support.api import Client, wait_for_status
from tests.support.webhooks import Receiver, eventually, webhook_settings

S, F = DependencyCondition.SUCCEEDED, DependencyCondition.FAILED


def waiting(*on: tuple[str, DependencyCondition], **changes: object) -> JobRecord:
    depends_on = tuple(JobDependency(submission_id=p, condition=c) for p, c in on)
    record = JobRecord(
        spec=JobSpec(entrypoint="true", submission_id="c", depends_on=depends_on),
        run_id="run-c",
        message=waiting_message(depends_on),
    )
    return record.with_changes(**changes)


def met_of(details: JobDetails) -> list[bool | None]:
    return [dependency.met for dependency in details.depends_on]


@pytest.mark.parametrize(
    ("record", "met"),
    [
        # Waiting, nothing recorded yet: not known from the record.
        (waiting(("a", S), ("b", F)), [None, None]),
        # One held before its deletion: recorded so.
        (waiting(("a", S), ("b", F), dependencies_held=("b",)), [None, True]),
        # It entered the queue: every one held.
        (waiting(("a", S), ("b", F), dependencies_met_time=1), [True, True]),
        (
            waiting(
                ("a", S),
                ("b", F),
                dependencies_met_time=1,
                status=JobStatus.SUCCEEDED,
                message="done",
            ),
            [True, True],
        ),
        # Never satisfied: the one its message names is not met; a held one is.
        (
            waiting(
                ("a", S),
                ("b", F),
                ("d", S),
                dependencies_held=("a",),
                status=JobStatus.FAILED,
                error_type=JobErrorType.DEPENDENCY_NEVER_SATISFIED,
                message=never_message("b", JobStatus.SUCCEEDED, F),
            ),
            [True, False, None],
        ),
        (
            waiting(
                ("a", S),
                ("ab", S),
                status=JobStatus.FAILED,
                error_type=JobErrorType.DEPENDENCY_NEVER_SATISFIED,
                message=never_message("a", None, S),
            ),
            [False, None],
        ),
        # Stopped while it waited: nothing is known of them.
        (
            waiting(("a", S), status=JobStatus.STOPPED, message="stopped"),
            [None],
        ),
    ],
)
def test_met_is_filled_from_what_the_record_knows(
    record: JobRecord, met: list[bool | None]
) -> None:
    assert met_of(JobDetails.from_record(record)) == met


def test_what_is_known_now_wins_over_the_record() -> None:
    record = waiting(("a", S), ("b", F), dependencies_held=("b",))
    details = JobDetails.from_record(record, dependencies_met={"a": True, "b": True})
    assert met_of(details) == [True, True]


async def test_a_dependents_webhook_body_says_its_dependency_met(
    aiohttp_client: Callable[..., Awaitable[Client]],
    settings: Settings,
    tmp_path: Path,
    receivers: Callable[..., Awaitable[Receiver]],
) -> None:
    secret = "whsec_" + base64.b64encode(os.urandom(32)).decode()
    secret_file = tmp_path / "webhook-secret"
    secret_file.write_text(secret + "\n")
    receiver = await receivers([secret])
    client = await aiohttp_client(
        create_app(webhook_settings(settings, webhook_secret_file=secret_file))
    )
    for body in (
        {"entrypoint": "true", "submission_id": "parent"},
        {
            "entrypoint": "true",
            "submission_id": "child",
            "depends_on": [{"submission_id": "parent"}],
            "notify": [{"url": receiver.url}],
        },
    ):
        response = await client.post("/api/jobs/", json=body)
        assert response.status == 200, await response.text()
    assert (await wait_for_status(client, "child"))["status"] == "SUCCEEDED"
    await eventually(
        lambda: {event for _, event in receiver.events()} >= {"job.started", "job.succeeded"},
        lambda: f"the child's start and end: {receiver.events()}",
    )
    for received in receiver.received:
        assert received.payload["data"]["depends_on"] == [
            {"submission_id": "parent", "condition": "succeeded", "met": True}
        ], received.payload["type"]


def test_a_waiting_jobs_message_names_what_it_still_waits_for_by_what_is_known_now() -> None:
    """A follower serves the row, whose message was written at submit: what is known now of
    the dependencies makes it current (the leader's, from its waits, says the same)."""
    record = waiting(("a", S), ("b", F))
    assert record.message == "Waiting for 2 jobs: a to succeed, b to fail or stop"
    details = JobDetails.from_record(record, dependencies_met={"a": True, "b": False})
    assert details.message == "Waiting for 1 of 2 jobs: b to fail or stop"
    # Nothing known, or all met (it enters the queue, or waits for a place): as recorded.
    assert JobDetails.from_record(record).message == record.message
    both = JobDetails.from_record(record, dependencies_met={"a": True, "b": True})
    assert both.message == record.message
    # Not waiting: its own message.
    for changes in ({"dependencies_met_time": 1}, {"status": JobStatus.RUNNING}):
        other = record.with_changes(message="Queued: 1st of 1", **changes)
        met = JobDetails.from_record(other, dependencies_met={"a": True, "b": False})
        assert met.message == "Queued: 1st of 1"
