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
- the key is revoked: a key is checked once per request, but a stream can last for hours, so
  each stream holds its key with the key ring (`KeyRing.hold`); the SIGHUP reload that removes
  the key, moves it to another tenant or ends its admin role revokes the hold, and the stream
  ends at its next chunk or tick like a shutdown (a websocket at once, with 1008, "policy
  violation"); the endpoints that can say why (SSE, NDJSON) send `revoked_json()` last, and
  the connection of a body that cannot (plain text, JSON) is cut, so that it does not look whole;
- a `HEAD` request gets the headers and no body, at once (even for a followed log).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator, Callable
from typing import TypeVar

from aiohttp import WSCloseCode, WSMsgType, web

from jobs_server.access.auth import token_from_headers
from jobs_server.access.key_ring import KeyHold
from jobs_server.api_models import ErrorDetail, ErrorResponse
from jobs_server.app_state import KEY_HOLD_KEY, KEY_RING_KEY, PRINCIPAL_KEY, SHUTTING_DOWN_KEY
from jobs_server.errors import JobNotFoundError
from jobs_server.manager import LogChunk

logger = logging.getLogger(__name__)

ItemT = TypeVar("ItemT")

# How often an idle follower checks that its client is still there and the server is not
# shutting down: the longest a follower that left holds its file and task.
CLIENT_CHECK_S = 0.5
# The `code` of what a stream whose key was revoked says last (SSE, NDJSON).
KEY_REVOKED_CODE = "key_revoked"
# An SSE stream's last event when its key was revoked (its data: `revoked_json()`).
REVOKED_EVENT = "revoked"


def key_hold(request: web.Request) -> KeyHold | None:
    """The hold of the key this request was authenticated with (made on first use; held by the
    key ring once its stream is open); None when nothing can revoke it (no keys at all)."""
    hold = request.get(KEY_HOLD_KEY)
    if hold is None and request.app[KEY_RING_KEY].requires_key:
        key, principal = token_from_headers(request.headers), request.get(PRINCIPAL_KEY)
        if key is not None and principal is not None:
            hold = request[KEY_HOLD_KEY] = KeyHold(key, principal)
    return hold


def follower_should_stop(request: web.Request) -> Callable[[], bool]:
    """For a follower's `stop_when`: true once its client has left, the server shuts down or
    its key was revoked. Checked by the log's watcher, so a thousand quiet followers are not
    woken to ask."""
    shutting_down = request.app[SHUTTING_DOWN_KEY]
    hold = key_hold(request)

    def should_stop() -> bool:
        transport = request.transport
        return (
            transport is None
            or transport.is_closing()
            or shutting_down.is_set()
            or (hold is not None and hold.revoked is not None)
        )

    return should_stop


class OpenStream:
    """One response being streamed: its writes, and whether it should end early."""

    def __init__(
        self, request: web.Request, response: web.StreamResponse, hold: KeyHold | None
    ) -> None:
        self._request = request
        self._response = response
        self._shutting_down = request.app[SHUTTING_DOWN_KEY]
        self._hold = hold
        # Set by the key ring's reload, so that a websocket closes without waiting for a chunk.
        self._revoked = asyncio.Event()
        if hold is not None:
            hold.on_revoke = self._revoked.set
        self.said_why_revoked = False
        self.cut_short = False
        """Set when `chunks` or `items` ended early: the client left, the server is shutting
        down, or the key was revoked."""

    @property
    def shutting_down(self) -> bool:
        return self._shutting_down.is_set()

    @property
    def revoked(self) -> str | None:
        """Why the stream's key may no longer read it (None: it may)."""
        return None if self._hold is None else self._hold.revoked

    def revoked_json(self) -> str:
        """What a stream whose key was revoked says last: an error object, code `key_revoked`."""
        self.said_why_revoked = True
        message = f"This stream ended: {self.revoked}. Ask again with a valid key."
        error = ErrorDetail(code=KEY_REVOKED_CODE, message=message)
        return ErrorResponse(error=error).model_dump_json()

    def _must_end(self, *, follows: bool) -> bool:
        return self.client_left() or (follows and self.shutting_down) or self.revoked is not None

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
        follower (`follows`) also ends when the server shuts down; any, when its key is revoked.
        Idle ticks are consumed here: they are when a quiet follower notices. The source is
        closed (its file with it) however this ends."""
        async with contextlib.aclosing(source):
            if self._request.method == "HEAD":
                return
            async for chunk in source:
                if self._must_end(follows=follows):
                    self.cut_short = True
                    return
                if chunk.data:
                    yield chunk

    async def items(self, source: AsyncGenerator[ItemT, None]) -> AsyncGenerator[ItemT, None]:
        """The items of an endless feed (the event stream) until the client leaves, the server
        shuts down or the key is revoked; the feed's idle ticks are when a quiet stream notices.
        The source is closed however this ends."""
        async with contextlib.aclosing(source):
            if self._request.method == "HEAD":
                return
            async for item in source:
                if self._must_end(follows=True):
                    self.cut_short = True
                    return
                yield item

    async def serve_websocket(
        self, websocket: web.WebSocketResponse, texts: AsyncIterable[str]
    ) -> None:
        """Send `texts` as text frames while reading from the client, which is how a closed
        connection is noticed (the client sends nothing else); whichever ends first ends the
        other, and a revoked key ends both at once. Then close: 1000 when the texts were all
        sent, 1001 when the server is shutting down, 1008 (policy violation) when the key was
        revoked (nothing to do if the client closed first)."""
        sender = asyncio.create_task(_send_texts(websocket, texts))
        receiver = asyncio.create_task(_receive_until_closed(websocket))
        revoked = asyncio.create_task(self._revoked.wait())
        try:
            await asyncio.wait([sender, receiver, revoked], return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (sender, receiver, revoked):
                task.cancel()
            # `wait` does not raise: a cancellation of this task still comes through.
            await asyncio.wait([sender, receiver, revoked])
        if not sender.cancelled() and (error := sender.exception()) is not None:
            raise error
        if self.revoked is not None:
            reason = f"{KEY_REVOKED_CODE}: {self.revoked}".encode()[:_CLOSE_REASON_MAX_BYTES]
            self.said_why_revoked = True
            await websocket.close(code=WSCloseCode.POLICY_VIOLATION, message=reason)
        elif self.shutting_down:
            await websocket.close(code=WSCloseCode.GOING_AWAY)
        else:
            await websocket.close(code=WSCloseCode.OK)


# A close frame's payload is at most 125 bytes, 2 of them the code.
_CLOSE_REASON_MAX_BYTES = 123


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
    hold = key_hold(request)
    await response.prepare(request)
    try:
        with contextlib.ExitStack() as held:
            stream = OpenStream(request, response, hold)
            if hold is not None:
                held.enter_context(request.app[KEY_RING_KEY].hold(hold))
            yield stream
        if stream.cut_short and stream.revoked is not None and not stream.said_why_revoked:
            # Plain text or JSON cannot say why it ended: cut the connection so that the client
            # sees the body is incomplete, rather than a log that seems whole.
            logger.info("%s %s: ended, its key is revoked", request.method, request.path)
            if request.transport is not None:
                request.transport.abort()
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
