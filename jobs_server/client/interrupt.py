"""Ctrl-C while following (or waiting for) a job: stop it, or leave it running and stop watching.

`--stop-on-interrupt` stops it; on a terminal the user is asked; otherwise (a script, a pipe)
the job is left running. After a stop the log is followed to its end, so the command still
exits with the job's code (130 once STOPPED). A second Ctrl-C leaves at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import threading
from collections.abc import Coroutine
from typing import Any

from jobs_server.client.follow import STOPPED_EXIT_CODE, exit_code_of
from jobs_server.client.http import JobsClient


async def watch_until_done(
    client: JobsClient, job_id: str, watch: Coroutine[Any, Any, str], *, stop_on_interrupt: bool
) -> int:
    """Run `watch` (following the log, or waiting) until the job ends and return the job's exit
    code, handling Ctrl-C as above."""
    loop = asyncio.get_running_loop()
    interrupts: asyncio.Queue[None] = asyncio.Queue()
    loop.add_signal_handler(signal.SIGINT, interrupts.put_nowait, None)
    following = asyncio.create_task(watch)
    try:
        if not await _first_done(following, interrupts.get()):
            if not await _should_stop(job_id, stop_on_interrupt, interrupts):
                return _leave(job_id)
            await client.stop_job(job_id)
            _say(f"stopping {job_id}; Ctrl-C again to stop watching")
            if not await _first_done(following, interrupts.get()):
                return _leave(job_id)
        await following  # raises what ended it, if it failed
        return exit_code_of(await client.get_job(job_id))
    finally:
        following.cancel()
        loop.remove_signal_handler(signal.SIGINT)


async def _first_done(following: asyncio.Task[str], interrupted: Coroutine[Any, Any, None]) -> bool:
    """Whether the follow ended before a Ctrl-C came."""
    waiting = asyncio.ensure_future(interrupted)
    try:
        await asyncio.wait({following, waiting}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiting.cancel()
    return following.done()


async def _should_stop(
    job_id: str, stop_on_interrupt: bool, interrupts: asyncio.Queue[None]
) -> bool:
    if stop_on_interrupt:
        return True
    if not (sys.stdin.isatty() and sys.stderr.isatty()):
        return False
    answer = asyncio.get_running_loop().create_future()
    sys.stderr.write(f"\nStop job {job_id}? [y/N] ")
    sys.stderr.flush()
    # A daemon thread, not the executor: a second Ctrl-C leaves without waiting for a line.
    threading.Thread(target=_read_answer, args=(answer,), daemon=True).start()
    second = asyncio.ensure_future(interrupts.get())
    try:
        await asyncio.wait({answer, second}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        second.cancel()
    return answer.done() and answer.result().strip().lower() in {"y", "yes"}


def _read_answer(answer: asyncio.Future[str]) -> None:
    line = sys.stdin.readline()
    with contextlib.suppress(RuntimeError):  # the loop is gone: the command already ended
        answer.get_loop().call_soon_threadsafe(_answer, answer, line)


def _answer(answer: asyncio.Future[str], line: str) -> None:
    if not answer.done():
        answer.set_result(line)


def _leave(job_id: str) -> int:
    _say(f"{job_id} keeps running; `jobs-server logs -f {job_id}` follows it again")
    return STOPPED_EXIT_CODE


def _say(message: str) -> None:
    print(f"\njobs-server: {message}", file=sys.stderr, flush=True)
