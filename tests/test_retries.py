"""Retries (issue 15, item 6): `max_retries` and `retry_on_exit_codes` in the submit body. A failed
attempt runs again after a backoff, the job RUNNING meanwhile; every attempt's output is in the
one log, and the attempts' offsets split it exactly; a stop ends the retries. Real Ray, real
processes, a real server on a loopback port (its backoff made short, or long where a test must
catch a job between two attempts)."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from ray.job_submission import JobStatus, JobSubmissionClient

from jobs_server.app import create_app
from jobs_server.settings import Settings
from tests.support.api import Client, submit, wait_for_log, wait_for_status
from tests.support.commands import counted

MakeClient = Callable[..., Awaitable[Client]]

SHORT_BACKOFF_S = 0.2
# Long enough that a job is surely caught waiting between two attempts (never waited out).
LONG_BACKOFF_S = 120.0
# Well under LONG_BACKOFF_S: an answer within it did not wait for the backoff.
WITHIN_S = 60.0


def retry_settings(settings: Settings, backoff_s: float) -> Settings:
    return settings.model_copy(update={"retry_backoff_s": backoff_s})


@pytest.fixture
async def client(aiohttp_client: MakeClient, settings: Settings) -> Client:
    return await aiohttp_client(create_app(retry_settings(settings, SHORT_BACKOFF_S)))


@pytest.fixture
async def slow_client(aiohttp_client: MakeClient, settings: Settings) -> Client:
    """A server whose first retry waits LONG_BACKOFF_S."""
    return await aiohttp_client(create_app(retry_settings(settings, LONG_BACKOFF_S)))


def fails_until(counter: Path, succeeding_attempt: int, exit_code: int = 7) -> str:
    return counted(
        counter,
        f'if [ $n -lt {succeeding_attempt} ]; then echo "attempt $n fails" >&2; exit {exit_code};'
        ' fi; echo "attempt $n succeeds"',
    )


def attempts_of(counter: Path) -> int:
    return int(counter.read_text()) if counter.exists() else 0


async def log_bytes(client: Client, job_id: str) -> bytes:
    response = await client.get(f"/api/jobs/{job_id}/logs", params={"format": "text"})
    assert response.status == 200, await response.text()
    return await response.read()


async def split_log(client: Client, job: dict[str, Any]) -> list[bytes]:
    """The job's log cut at its attempts' offsets: one part per attempt."""
    data = await log_bytes(client, job["submission_id"])
    offsets = [attempt["log_offset"] for attempt in job["attempts"]]
    return [data[start:end] for start, end in zip(offsets, [*offsets[1:], len(data)], strict=True)]


async def follow_to_the_end(client: Client, job_id: str) -> bytes:
    """The followed log, which ends only once the job's supervisor is done with it (no further
    attempt can start)."""
    response = await client.get(f"/api/jobs/{job_id}/logs", params={"follow": "true"})
    assert response.status == 200
    return await asyncio.wait_for(response.read(), timeout=WITHIN_S)


def assert_attempts_in_order(attempts: list[dict[str, Any]]) -> None:
    for attempt in attempts:
        assert attempt["end_time"] is not None
        assert attempt["start_time"] <= attempt["end_time"]
    for before, after in itertools.pairwise(attempts):
        assert before["end_time"] <= after["start_time"]
        assert before["log_offset"] < after["log_offset"]


async def test_a_job_that_fails_twice_then_succeeds_has_three_attempts_that_split_its_log(
    client: Client, tmp_path: Path
) -> None:
    counter = tmp_path / "attempts"
    job_id = await submit(client, entrypoint=fails_until(counter, 3), max_retries=5)
    job = await wait_for_status(client, job_id)
    assert (job["status"], job["message"], job["driver_exit_code"]) == (
        "SUCCEEDED",
        "Job finished successfully.",
        0,
    )
    assert (job["max_retries"], job["retry_on_exit_codes"]) == (5, None)
    assert [attempt["exit_code"] for attempt in job["attempts"]] == [7, 7, 0]
    assert job["attempts"][0]["log_offset"] == 0
    assert_attempts_in_order(job["attempts"])
    assert await split_log(client, job) == [
        "attempt 1: début\nattempt 1 fails\n".encode(),
        "attempt 2: début\nattempt 2 fails\n".encode(),
        "attempt 3: début\nattempt 3 succeeds\n".encode(),
    ]
    # A client reads one attempt's output alone with a byte range.
    second = job["attempts"][1]
    response = await client.get(
        f"/api/jobs/{job_id}/logs",
        params={
            "offset": second["log_offset"],
            "limit": job["attempts"][2]["log_offset"] - second["log_offset"],
        },
    )
    assert (await response.json())["logs"] == "attempt 2: début\nattempt 2 fails\n"
    assert attempts_of(counter) == 3


async def test_attempts_show_while_the_job_runs_and_after_a_server_restart(
    aiohttp_client: MakeClient, settings: Settings, tmp_path: Path
) -> None:
    counter, release = tmp_path / "attempts", tmp_path / "release"
    entrypoint = counted(
        counter,
        f"if [ $n -eq 1 ]; then exit 4; fi; while [ ! -e {release} ]; do sleep 0.05; done;"
        " echo released",
    )
    server_settings = retry_settings(settings, SHORT_BACKOFF_S)
    first = await aiohttp_client(create_app(server_settings))
    job_id = await submit(first, entrypoint=entrypoint, max_retries=2)
    running = await wait_for_status(first, job_id, {"RUNNING"}, message_part="attempt 2 of 3")
    assert [attempt["exit_code"] for attempt in running["attempts"]] == [4, None]
    assert running["attempts"][1]["end_time"] is None
    await first.close()

    # A new server finds the job as its supervisor left it, attempts and all.
    second = await aiohttp_client(create_app(server_settings))
    again = await wait_for_status(second, job_id, {"RUNNING"})
    assert again["attempts"] == running["attempts"]
    release.touch()
    job = await wait_for_status(second, job_id)
    assert job["status"] == "SUCCEEDED", job
    assert [attempt["exit_code"] for attempt in job["attempts"]] == [4, 0]
    assert job["attempts"][0] == running["attempts"][0]
    assert await split_log(second, job) == [
        "attempt 1: début\n".encode(),
        "attempt 2: début\nreleased\n".encode(),
    ]
    await second.close()

    # Archived with its end: a third server (the KV forgot the job) still lists them.
    third = await aiohttp_client(create_app(server_settings))
    response = await third.get(f"/api/jobs/{job_id}")
    assert (await response.json())["attempts"] == job["attempts"]


async def test_an_exit_code_not_in_retry_on_exit_codes_ends_the_job_at_once(
    client: Client, tmp_path: Path
) -> None:
    counter = tmp_path / "attempts"
    # 7 is retried; 3 is not.
    entrypoint = counted(counter, 'if [ $n -eq 1 ]; then exit 7; fi; echo "last words"; exit 3')
    job_id = await submit(client, entrypoint=entrypoint, max_retries=5, retry_on_exit_codes=[7, 9])
    job = await wait_for_status(client, job_id)
    assert (job["status"], job["error_type"], job["driver_exit_code"]) == (
        "FAILED",
        "JOB_ENTRYPOINT_COMMAND_ERROR",
        3,
    )
    assert job["retry_on_exit_codes"] == [7, 9]
    assert [attempt["exit_code"] for attempt in job["attempts"]] == [7, 3]
    assert job["message"] == (
        "Job entrypoint command failed with exit code 3 after 2 attempts (exit code 3 is not"
        " in retry_on_exit_codes). Last output:\nattempt 2: début\nlast words\n"
    )
    assert attempts_of(counter) == 2


async def test_a_job_that_always_fails_ends_failed_when_its_retries_run_out(
    client: Client, tmp_path: Path
) -> None:
    counter = tmp_path / "attempts"
    job_id = await submit(client, entrypoint=fails_until(counter, 99, exit_code=5), max_retries=2)
    job = await wait_for_status(client, job_id)
    assert (job["status"], job["error_type"], job["driver_exit_code"]) == (
        "FAILED",
        "JOB_ENTRYPOINT_COMMAND_ERROR",
        5,
    )
    # The last output is the last attempt's alone.
    assert job["message"] == (
        "Job entrypoint command failed with exit code 5 after 3 attempts (no retries left)."
        " Last output:\nattempt 3: début\nattempt 3 fails\n"
    )
    assert [attempt["exit_code"] for attempt in job["attempts"]] == [5, 5, 5]
    assert_attempts_in_order(job["attempts"])
    assert await split_log(client, job) == [
        f"attempt {n}: début\nattempt {n} fails\n".encode() for n in (1, 2, 3)
    ]
    assert attempts_of(counter) == 3


async def test_a_job_without_retries_runs_once_and_says_so_as_before(
    client: Client, tmp_path: Path
) -> None:
    counter = tmp_path / "attempts"
    job_id = await submit(client, entrypoint=fails_until(counter, 2, exit_code=6))
    job = await wait_for_status(client, job_id)
    assert (job["status"], job["driver_exit_code"], job["max_retries"]) == ("FAILED", 6, 0)
    assert job["message"] == (
        "Job entrypoint command failed with exit code 6. Last output:\n"
        "attempt 1: début\nattempt 1 fails\n"
    )
    assert [(attempt["exit_code"], attempt["log_offset"]) for attempt in job["attempts"]] == [
        (6, 0)
    ]
    assert attempts_of(counter) == 1


async def test_a_stop_between_attempts_ends_the_job_stopped_at_once(
    slow_client: Client, tmp_path: Path
) -> None:
    counter = tmp_path / "attempts"
    job_id = await submit(
        slow_client, entrypoint=counted(counter, "echo failing; exit 1"), max_retries=3
    )
    waiting = await wait_for_status(
        slow_client, job_id, {"RUNNING"}, message_part="attempt 2 starts in 120 s"
    )
    assert waiting["message"] == (
        "Attempt 1 of 4 failed with exit code 1; attempt 2 starts in 120 s."
    )
    response = await slow_client.post(f"/api/jobs/{job_id}/stop")
    assert await response.json() == {"stopped": True}
    job = await wait_for_status(slow_client, job_id, timeout_s=WITHIN_S)
    assert (job["status"], job["message"], job["driver_exit_code"]) == (
        "STOPPED",
        "Job was intentionally stopped.",
        1,
    )
    assert [attempt["exit_code"] for attempt in job["attempts"]] == [1]
    # The supervisor is done with the job: no attempt starts after the stop.
    assert await follow_to_the_end(slow_client, job_id) == "attempt 1: début\nfailing\n".encode()
    assert attempts_of(counter) == 1


async def test_a_stop_during_an_attempt_stops_it_and_no_retry_follows(
    client: Client, tmp_path: Path
) -> None:
    counter = tmp_path / "attempts"
    job_id = await submit(
        client, entrypoint=counted(counter, "echo ready; sleep 60"), max_retries=3
    )
    await wait_for_log(client, job_id, "attempt 1: début\nready\n")
    response = await client.post(f"/api/jobs/{job_id}/stop")
    assert await response.json() == {"stopped": True}
    job = await wait_for_status(client, job_id)
    assert (job["status"], job["message"]) == ("STOPPED", "Job was intentionally stopped.")
    assert len(job["attempts"]) == 1
    assert job["attempts"][0]["exit_code"] == job["driver_exit_code"] != 0
    assert await follow_to_the_end(client, job_id) == "attempt 1: début\nready\n".encode()
    assert attempts_of(counter) == 1


async def test_the_timeout_bounds_all_the_attempts_together(client: Client, tmp_path: Path) -> None:
    """Each attempt ends at once, far within the timeout: only a timeout over all of them (and
    the waits between them) ends the job before its hundred retries."""
    counter = tmp_path / "attempts"
    job_id = await submit(
        client, entrypoint=counted(counter, "exit 2"), max_retries=100, timeout_s=2
    )
    job = await wait_for_status(client, job_id)
    assert (job["status"], job["error_type"]) == ("FAILED", "JOB_TIMEOUT")
    assert job["message"].startswith("Job exceeded its timeout of 2 s")
    attempts = job["attempts"]
    assert len(attempts) >= 2
    # Every attempt failed on its own (the last one may have been stopped by the timeout).
    assert {attempt["exit_code"] for attempt in attempts[:-1]} == {2}
    assert job["driver_exit_code"] == attempts[-1]["exit_code"]
    assert await follow_to_the_end(client, job_id)
    assert attempts_of(counter) == len(attempts)


def _ray_client(url: str) -> JobSubmissionClient:
    return JobSubmissionClient(url)


async def test_rays_client_sees_running_after_a_failed_attempt_and_the_final_status(
    client: Client, tmp_path: Path
) -> None:
    """Ray's SDK is synchronous: it runs in a thread, against the server's loopback port."""
    counter, release = tmp_path / "attempts", tmp_path / "release"
    entrypoint = counted(
        counter,
        f"if [ $n -eq 1 ]; then exit 4; fi; while [ ! -e {release} ]; do sleep 0.05; done",
    )
    job_id = await submit(client, entrypoint=entrypoint, max_retries=1)
    ray_client = await asyncio.to_thread(_ray_client, str(client.make_url("")).rstrip("/"))
    await wait_for_status(client, job_id, {"RUNNING"}, message_part="attempt 2 of 2")
    info = await asyncio.to_thread(ray_client.get_job_info, job_id)
    assert info.status == JobStatus.RUNNING  # its first attempt failed
    release.touch()
    await wait_for_status(client, job_id)
    assert await asyncio.to_thread(ray_client.get_job_status, job_id) == JobStatus.SUCCEEDED
    info = await asyncio.to_thread(ray_client.get_job_info, job_id)
    assert info.driver_exit_code == 0
    logs = await asyncio.to_thread(ray_client.get_job_logs, job_id)
    assert logs == "attempt 1: début\nattempt 2: début\n"


async def test_rays_client_sees_running_between_attempts_until_stopped(
    slow_client: Client,
) -> None:
    """Caught between two attempts (the backoff is long): RUNNING, then STOPPED."""
    job_id = await submit(slow_client, entrypoint="exit 4", max_retries=1)
    ray_client = await asyncio.to_thread(_ray_client, str(slow_client.make_url("")).rstrip("/"))
    await wait_for_status(slow_client, job_id, {"RUNNING"}, message_part="starts in")
    assert await asyncio.to_thread(ray_client.get_job_status, job_id) == JobStatus.RUNNING
    assert await asyncio.to_thread(ray_client.stop_job, job_id) is True
    await wait_for_status(slow_client, job_id, timeout_s=WITHIN_S)
    info = await asyncio.to_thread(ray_client.get_job_info, job_id)
    assert (info.status, info.driver_exit_code) == (JobStatus.STOPPED, 4)
