"""Following a log to the end of its job, across dropped connections.

Each SSE event's id is the byte offset after its text, and a cut event is never seen (see
`sse`), so resuming at the last id seen gives every byte exactly once, however often the
connection drops.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any, BinaryIO

import aiohttp

from jobs_server.client.http import JobsClient, ServerError, UnreachableError, describe

# Long enough for a server restart (it answers within a few seconds) or a proxy's failover.
RECONNECT_WINDOW_S = 60.0
FIRST_RETRY_DELAY_S = 0.1
MAX_RETRY_DELAY_S = 2.0
MAX_WAIT_POLL_S = 1.0
SUCCEEDED, FAILED, STOPPED = "SUCCEEDED", "FAILED", "STOPPED"
TERMINAL_STATUSES = frozenset({SUCCEEDED, FAILED, STOPPED})
# The shell's convention for a command ended by SIGINT: what a stopped job exits with here.
STOPPED_EXIT_CODE = 130


async def follow_log(client: JobsClient, job_id: str, out: BinaryIO, offset: int = 0) -> str:
    """Copy the job's log to `out` from byte `offset` until the job ends; its final status."""
    failing_since: float | None = None
    delay_s = FIRST_RETRY_DELAY_S
    while True:
        try:
            async for event in client.log_events(job_id, offset):
                failing_since, delay_s = None, FIRST_RETRY_DELAY_S
                if event.event == "end":
                    return str(json.loads(event.data)["status"])
                out.write(json.loads(event.data).encode())
                out.flush()
                offset = int(event.id or offset)
            problem = "the server ended the stream early"  # e.g. it is shutting down
        except (aiohttp.ClientError, TimeoutError) as error:
            problem = describe(error)
        except ServerError as error:
            if not error.is_transient:
                raise
            problem = str(error)
        now = time.monotonic()
        failing_since = now if failing_since is None else failing_since
        if now - failing_since > RECONNECT_WINDOW_S:
            raise UnreachableError(
                f"lost the log of {job_id} at byte {offset} and could not resume within"
                f" {RECONNECT_WINDOW_S:.0f} s: {problem}"
            )
        print(
            f"jobs-server: {problem}; resuming the log at byte {offset}",
            file=sys.stderr,
            flush=True,
        )
        await asyncio.sleep(delay_s)
        delay_s = min(delay_s * 2, MAX_RETRY_DELAY_S)


async def wait_for_end(client: JobsClient, job_id: str) -> str:
    """Poll the job until it has ended; its final status."""
    delay_s = FIRST_RETRY_DELAY_S / 2
    while True:
        status = str((await client.get_job(job_id))["status"])
        if status in TERMINAL_STATUSES:
            return status
        await asyncio.sleep(delay_s)
        delay_s = min(delay_s * 2, MAX_WAIT_POLL_S)


def exit_code_of(job: dict[str, Any]) -> int:
    """What a command that ran the job exits with: its own code, 130 if it was stopped, 1 if it
    failed without one (e.g. its runtime env could not be set up)."""
    status, code = job.get("status"), job.get("driver_exit_code")
    if status == SUCCEEDED:
        return 0
    if status == STOPPED:
        return STOPPED_EXIT_CODE
    if isinstance(code, int) and code < 0:  # killed by a signal: the shell's 128 + N
        return 128 - code
    if isinstance(code, int) and code != 0:
        return code
    return 1
