"""The jobs API as the tests and benchmarks call it: submit a job, wait for its status, read its
logs, through an app's test client or a session with a server's base URL."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from aiohttp import ClientSession
from aiohttp.test_utils import TestClient

# The test client of an app (`aiohttp_client`'s).
Client = TestClient[Any, Any]
TERMINAL_STATUSES = {"SUCCEEDED", "FAILED", "STOPPED"}

# A test client of an app, or a session with the base URL of a server process.
HttpClient = TestClient[Any, Any] | ClientSession


async def wait_for_status(
    client: HttpClient,
    job_id: str,
    statuses: set[str] = TERMINAL_STATUSES,
    timeout_s: float = 60,
    message_part: str = "",
    poll_s: float = 0.05,
) -> dict[str, Any]:
    """Poll the job until its status is one of `statuses` (and its message holds
    `message_part`); return its details."""
    deadline = time.monotonic() + timeout_s
    job: dict[str, Any] = {}
    while time.monotonic() < deadline:
        response = await client.get(f"/api/jobs/{job_id}")
        assert response.status == 200, await response.text()
        job = await response.json()
        if job["status"] in statuses and message_part in (job["message"] or ""):
            return job
        await asyncio.sleep(poll_s)
    raise AssertionError(f"job {job_id} still {job.get('status')} after {timeout_s}s: {job}")


async def submit(client: HttpClient, **body: Any) -> str:
    response = await client.post("/api/jobs/", json=body)
    assert response.status == 200, await response.text()
    submitted = await response.json()
    assert submitted["job_id"] == submitted["submission_id"]
    return str(submitted["submission_id"])


async def job_logs(client: HttpClient, job_id: str) -> str:
    response = await client.get(f"/api/jobs/{job_id}/logs")
    assert response.status == 200, await response.text()
    return str((await response.json())["logs"])


async def wait_for_log(client: Client, job_id: str, text: str, timeout_s: float = 60) -> None:
    """Wait until the job's log is `text` (a job that says it is ready)."""
    deadline = time.monotonic() + timeout_s
    while await job_logs(client, job_id) != text:
        assert time.monotonic() < deadline, f"job {job_id} never wrote {text!r}"
        await asyncio.sleep(0.05)
