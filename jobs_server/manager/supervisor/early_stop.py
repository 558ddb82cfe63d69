"""A stop that comes while a job's command starts (command_start.py, fork_server.py)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any


@dataclass
class EarlyStop:
    """A stop that may come while a command starts: the start can take long (a fork server
    with a batch of starts before this one, a busy supervisor), and the command runs meanwhile.
    Once `requested` is set, its launcher gets SIGTERM as soon as it exists (it holds the signal
    until its handlers pass it on: nothing of the command runs on unstopped); `sent` says so."""

    requested: asyncio.Event
    sent: bool = False


async def until_started_or_stopped(
    started: asyncio.Future[Any], early_stop: EarlyStop | None
) -> bool:
    """Wait for `started`, or for a stop asked for first: True (and `early_stop.sent`) if the
    caller is to send the starting command SIGTERM now."""
    if early_stop is None:
        return False
    stop = asyncio.ensure_future(early_stop.requested.wait())
    try:
        await asyncio.wait({started, stop}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stop.cancel()
    if started.done():
        return False
    early_stop.sent = True
    return True
