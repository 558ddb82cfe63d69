"""What the watcher makes of a supervisor call's answer (manager/live/run_outcomes.py), without
Ray: an ObjectRef's answer is a concurrent future, as `ObjectRef.future()` gives it."""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import logging

import pytest

from jobs_server.manager.live.run_outcomes import future_of


class _Answer:
    """An ObjectRef as `future_of` sees it."""

    def __init__(self) -> None:
        self.answer: concurrent.futures.Future[object] = concurrent.futures.Future()

    def future(self) -> concurrent.futures.Future[object]:
        return self.answer


async def test_an_answer_nobody_waits_for_any_more_fails_quietly(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The watcher stops waiting for a call (its job was stopped while it waited for resources,
    or the server closed); its supervisor is killed later and the call fails with
    ActorDiedError. Nobody is left to hear it, and nothing is logged: a fresh-clone run saw
    asyncio's "Future exception was never retrieved" (ERROR) in the next test's log."""
    caplog.set_level(logging.ERROR)
    call = _Answer()
    finished = future_of(call)
    del finished  # abandoned, as by a cancelled watch
    call.answer.set_exception(RuntimeError("The actor died unexpectedly"))
    for _ in range(3):  # the answer reaches the loop's future through call_soon_threadsafe
        await asyncio.sleep(0)
    del call  # and Ray lets the answer go
    gc.collect()
    assert [record.getMessage() for record in caplog.records] == []


async def test_an_answer_awaited_still_raises() -> None:
    call = _Answer()
    finished = future_of(call)
    call.answer.set_exception(RuntimeError("The actor died unexpectedly"))
    with pytest.raises(RuntimeError, match="actor died"):
        await finished
