"""The terminal client and the queue (issue 15): `submit --priority --max-retries
--retry-on-exit-code` as a user runs it, against a real server with one running slot and
retries without a wait; `status` shows the priority and the attempts."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.cli import run_cli
from tests.support.tenant_server import AUTH_TOKEN, TenantServer, run_tenant_server

SERVER_ARGS = ("--max-running-jobs", "1", "--retry-backoff-s", "0")
ADMIN = {"JOBS_SERVER_AUTH_TOKEN": AUTH_TOKEN}


@pytest.fixture(scope="module")
def server(ray_connection: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TenantServer]:
    yield from run_tenant_server(
        ray_connection, tmp_path_factory.mktemp("client-queue"), extra_args=SERVER_ARGS
    )


async def cli(server: TenantServer, command: str, *args: str) -> tuple[int, str, str]:
    """`jobs-server COMMAND --url ... ARGS` with an admin key."""
    code, stdout, stderr = await run_cli(command, "--url", server.url, *args, env=ADMIN)
    return code, stdout.decode(), stderr


def field_lines(status_output: str, name: str) -> list[str]:
    """The values of the `status` lines `name:`."""
    return [
        line.split(":", 1)[1].strip()
        for line in status_output.splitlines()
        if line.split(":", 1)[0] == name
    ]


async def test_submit_with_retries_and_status_shows_the_attempts(
    server: TenantServer, tmp_path: Path
) -> None:
    counter = tmp_path / "attempts"
    # Attempts 1 and 2 fail with exit code 3, attempt 3 succeeds.
    script = (
        f"n=$(( $(cat {counter} 2>/dev/null || echo 0) + 1 )); echo $n > {counter};"
        ' echo "attempt $n"; [ "$n" -ge 3 ] || exit 3'
    )
    code, stdout, stderr = await cli(
        server, "submit", "--wait", "--priority", "5", "--max-retries", "2",
        "--retry-on-exit-code", "3", "--retry-on-exit-code", "137", "--", script,
    )  # fmt: skip
    assert code == 0, stderr
    job_id = stdout.strip()
    assert f"{job_id} SUCCEEDED" in stderr

    code, status, _ = await cli(server, "status", job_id)
    assert code == 0
    assert field_lines(status, "priority") == ["5"]
    assert field_lines(status, "max_retries") == ["2"]
    assert field_lines(status, "retry_on") == ["3, 137"]
    attempts = [field_lines(status, f"attempt.{number}") for number in (1, 2, 3)]
    assert all(len(lines) == 1 for lines in attempts), status
    assert [lines[0].split(", ")[1] for lines in attempts] == [
        "exit code 3",
        "exit code 3",
        "exit code 0",
    ]
    # Each line gives where its attempt's output begins: "attempt N\n" is 10 bytes.
    offsets = [re.search(r"log from byte (\d+)", lines[0]) for lines in attempts]
    assert [offset and offset[1] for offset in offsets] == ["0", "10", "20"], attempts

    code, details, _ = await cli(server, "status", job_id, "--json")
    job = json.loads(details)
    assert (job["priority"], job["max_retries"], job["retry_on_exit_codes"]) == (5, 2, [3, 137])
    assert [attempt["exit_code"] for attempt in job["attempts"]] == [3, 3, 0]


async def test_a_queued_job_submitted_with_a_priority_says_its_place(
    server: TenantServer,
) -> None:
    code, running, stderr = await cli(server, "submit", "--", "sleep 600")
    assert code == 0, stderr
    running = running.strip()
    deadline = time.monotonic() + 60
    while "status:        RUNNING" not in (await cli(server, "status", running))[1]:
        assert time.monotonic() < deadline, f"{running} never RUNNING"
        await asyncio.sleep(0.1)
    code, queued, stderr = await cli(server, "submit", "--priority", "-3", "--", "echo queued")
    assert code == 0, stderr
    queued = queued.strip()
    try:
        _, status, _ = await cli(server, "status", queued)
        assert field_lines(status, "status") == ["PENDING"]
        assert field_lines(status, "priority") == ["-3"]
        assert field_lines(status, "max_retries") == ["0"]
        assert field_lines(status, "message")[0].startswith("Queued: 1st of 1"), status
        assert field_lines(status, "attempt.1") == []  # it has not run
    finally:
        for job_id in (running, queued):
            await cli(server, "stop", job_id)


@pytest.mark.parametrize(
    ("args", "exit_code", "says"),
    [
        (["--priority", "high"], 2, "argument --priority: invalid int value: 'high'"),
        (["--max-retries", "1.5"], 2, "argument --max-retries: invalid int value: '1.5'"),
        (["--retry-on-exit-code", "x"], 2, "argument --retry-on-exit-code: invalid int value"),
        (["--priority", "1001"], 1, "priority: Input should be less than or equal to 1000"),
        (["--max-retries", "101"], 1, "max_retries: Input should be less than or equal to 100"),
        (["--retry-on-exit-code", "0"], 1, "retry_on_exit_codes: Value error, 0 is success"),
    ],
)
async def test_bad_queue_options_are_refused_saying_why(
    server: TenantServer, args: list[str], exit_code: int, says: str
) -> None:
    code, stdout, stderr = await cli(server, "submit", *args, "--", "true")
    assert (code, stdout) == (exit_code, "")
    assert says in stderr
    code, listing, _ = await cli(server, "list", "--json")
    assert [job for job in json.loads(listing) if job["entrypoint"] == "true"] == []
