"""A response after its headers went out: the one place that ends it cleanly.

Once `prepare()` has sent the headers, nothing can become an error response any more (it would be
written into the body), so every streamed endpoint serves its body inside `open_stream`, which
turns what can happen meanwhile into a clean end:

- the client leaves: a write fails with `ConnectionResetError` (aiohttp's
  `ClientConnectionResetError` is one), or an idle follower finds its transport closing at its
  next tick; the stream ends, its file and tasks are released, and nothing is logged as an error;
- the job is deleted: a later lookup's `JobNotFoundError` ends the stream where it is;
- the server shuts down: its `on_shutdown` sets `SHUTTING_DOWN_KEY`, which followers check at
  every chunk and tick, so they end (a websocket with 1001, "going away") well inside the
  shutdown timeout, and the cleanup that follows finds no reader left;
- a `HEAD` request gets the headers and no body, at once (even for a followed log).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator, Callable
from typing import TypeVar

from aiohttp import WSCloseCode, WSMsgType, web

from jobs_server.errors import JobNotFoundError
from jobs_server.keys import SHUTTING_DOWN_KEY
from jobs_server.manager import LogChunk

logger = logging.getLogger(__name__)

ItemT = TypeVar("ItemT")

# How often an idle follower checks that its client is still there and the server is not
# shutting down: the longest a follower that left holds its file and task.
CLIENT_CHECK_S = 0.5


def follower_should_stop(request: web.Request) -> Callable[[], bool]:
    """For a follower's `stop_when`: true once its client has left or the server shuts down.
    Checked by the log's watcher, so a thousand quiet followers are not woken to ask."""
    shutting_down = request.app[SHUTTING_DOWN_KEY]

    def should_stop() -> bool:
        transport = request.transport
        return transport is None or transport.is_closing() or shutting_down.is_set()

    return should_stop


class OpenStream:
    """One response being streamed: its writes, and whether it should end early."""

    def __init__(self, request: web.Request, response: web.StreamResponse) -> None:
        self._request = request
        self._response = response
        self._shutting_down = request.app[SHUTTING_DOWN_KEY]
        self.cut_short = False
        """Set when `chunks` ended early: the client left, or the server is shutting down."""

    @property
    def shutting_down(self) -> bool:
        return self._shutting_down.is_set()

    def client_left(self) -> bool:
        transport = self._request.transport
        return transport is None or transport.is_closing()

    async def write(self, data: bytes) -> None:
        """Write body bytes (none for `HEAD`: it has headers only)."""
        if self._request.method != "HEAD":
            await self._response.write(data)

    async def chunks(
        self, source: AsyncGenerator[LogChunk, None], *, follows: bool
    ) -> AsyncGenerator[LogChunk, None]:
        """The chunks of `source` that hold bytes, until it ends or the client leaves; a
        follower (`follows`) also ends when the server shuts down. Idle ticks are consumed here:
        they are when a quiet follower notices either. The source is closed (its file with it)
        however this ends."""
        async with contextlib.aclosing(source):
            if self._request.method == "HEAD":
                return
            async for chunk in source:
                if self.client_left() or (follows and self.shutting_down):
                    self.cut_short = True
                    return
                if chunk.data:
                    yield chunk

    async def items(self, source: AsyncGenerator[ItemT, None]) -> AsyncGenerator[ItemT, None]:
        """The items of an endless feed (the event stream) until the client leaves or the server
        shuts down; the feed's idle ticks are when a quiet stream notices either. The source is
        closed however this ends."""
        async with contextlib.aclosing(source):
            if self._request.method == "HEAD":
                return
            async for item in source:
                if self.client_left() or self.shutting_down:
                    self.cut_short = True
                    return
                yield item

    async def serve_websocket(
        self, websocket: web.WebSocketResponse, texts: AsyncIterable[str]
    ) -> None:
        """Send `texts` as text frames while reading from the client, which is how a closed
        connection is noticed (the client sends nothing else); whichever ends first ends the
        other. Then close: 1000 when the texts were all sent, 1001 when the server is shutting
        down (nothing to do if the client closed first)."""
        sender = asyncio.create_task(_send_texts(websocket, texts))
        receiver = asyncio.create_task(_receive_until_closed(websocket))
        try:
            await asyncio.wait([sender, receiver], return_when=asyncio.FIRST_COMPLETED)
        finally:
            sender.cancel()
            receiver.cancel()
            # `wait` does not raise: a cancellation of this task still comes through.
            await asyncio.wait([sender, receiver])
        if not sender.cancelled() and (error := sender.exception()) is not None:
            raise error
        await websocket.close(code=WSCloseCode.GOING_AWAY if self.shutting_down else WSCloseCode.OK)


async def _send_texts(websocket: web.WebSocketResponse, texts: AsyncIterable[str]) -> None:
    async for text in texts:
        await websocket.send_str(text)


async def _receive_until_closed(websocket: web.WebSocketResponse) -> None:
    async for message in websocket:
        if message.type is WSMsgType.ERROR:
            return


@contextlib.asynccontextmanager
async def open_stream(
    request: web.Request, response: web.StreamResponse
) -> AsyncIterator[OpenStream]:
    """Send `response`'s headers, then serve its body in the block, ending it cleanly (see the
    module's docstring). Validate and raise before this: after it, errors end the stream."""
    await response.prepare(request)
    try:
        yield OpenStream(request, response)
    except ConnectionResetError:
        logger.debug("%s %s: the client went away", request.method, request.path)
    except JobNotFoundError:
        logger.info("%s %s: the job was deleted while being streamed", request.method, request.path)
    except Exception:
        # A bug, but the headers are out: an error response now would land inside the body.
        # Cut the connection so that the client sees the body is incomplete.
        logger.exception("unexpected error streaming %s %s", request.method, request.path)
        if request.transport is not None:
            request.transport.abort()
