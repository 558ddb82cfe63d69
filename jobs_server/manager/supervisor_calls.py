"""Calling a supervisor that may be briefly unreachable (its node failing, the GCS restarting)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from ray.exceptions import ActorUnavailableError

from jobs_server.manager.runtime_env_failures import strip_ansi

# How often a supervisor that cannot be reached is asked again, until Ray says it is dead.
SUPERVISOR_UNAVAILABLE_RETRY_S = 1.0


async def while_unreachable(first_call: Any, call_again: Callable[[], Any]) -> Any:
    """The result of a supervisor call (`first_call`, an ObjectRef); while the supervisor cannot
    be reached (its node may be going), `call_again` every SUPERVISOR_UNAVAILABLE_RETRY_S until
    Ray knows it is alive (an answer) or dead (ActorDiedError)."""
    pending = first_call
    while True:
        try:
            return await pending
        except ActorUnavailableError:
            await asyncio.sleep(SUPERVISOR_UNAVAILABLE_RETRY_S)
            pending = call_again()


def first_line(error: BaseException) -> str:
    """Ray's actor errors carry colour codes and tracebacks; a status message wants one line."""
    text = strip_ansi(str(error)).strip()
    return text.splitlines()[0] if text else type(error).__name__
