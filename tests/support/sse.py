"""Server-Sent Events as the tests read them, with the client's parser (jobs_server/client/sse.py):
one parser for the terminal client, the tests and the benchmarks."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp

from jobs_server.client.sse import Event, read_events
from tests.support.fakes import FakeJobManager

READ_TIMEOUT_S = 20.0


class SseReader:
    """Reads the events of a response as they come, each line within `READ_TIMEOUT_S`; keeps the
    comments (the heartbeats) the parser skips."""

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self.response = response
        self.comments: list[str] = []
        self._events = read_events(self._lines())

    async def _lines(self) -> AsyncIterator[bytes]:
        while True:
            raw = await asyncio.wait_for(self.response.content.readline(), READ_TIMEOUT_S)
            if not raw:
                return
            if raw.startswith(b":"):
                self.comments.append(raw.decode().rstrip("\r\n"))
            yield raw

    async def next_event(self) -> Event:
        try:
            return await anext(self._events)
        except StopAsyncIteration:
            raise EOFError("the stream ended") from None

    async def events(self, count: int) -> list[Event]:
        return [await self.next_event() for _ in range(count)]


async def wait_subscribed(fake: FakeJobManager, count: int) -> None:
    """Wait until the fake's event feed has `count` subscribers."""
    for _ in range(200):
        if len(fake.event_feed) == count:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"{len(fake.event_feed)} subscribers, expected {count}")
