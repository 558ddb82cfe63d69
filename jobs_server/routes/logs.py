"""Job logs: Ray's whole-log JSON and websocket tail, both framed from the same chunk iterator."""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import json
import logging
from collections.abc import AsyncGenerator

from aiohttp import WSMsgType, web

from jobs_server.keys import JOB_MANAGER_KEY
from jobs_server.manager import LogChunk

logger = logging.getLogger(__name__)

routes = web.RouteTableDef()

# Keeps idle tails alive through proxies and notices clients that vanished.
WEBSOCKET_HEARTBEAT_S = 30.0


async def _decoded(chunks: AsyncGenerator[LogChunk, None]) -> AsyncGenerator[str, None]:
    """Text of the chunks; a character split across chunks is decoded whole, bad bytes as U+FFFD."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    async with contextlib.aclosing(chunks):
        async for chunk in chunks:
            text = decoder.decode(chunk.data)
            if text:
                yield text
    text = decoder.decode(b"", final=True)
    if text:
        yield text


@routes.get("/api/jobs/{job_id}/logs", name="get_job_logs")
async def get_job_logs(request: web.Request) -> web.StreamResponse:
    """`{"logs": "..."}`, streamed chunk by chunk so server memory stays constant."""
    chunks = await request.app[JOB_MANAGER_KEY].read_logs(request.match_info["job_id"])
    response = web.StreamResponse(headers={"Content-Type": "application/json; charset=utf-8"})
    await response.prepare(request)
    await response.write(b'{"logs": "')
    async with contextlib.aclosing(_decoded(chunks)) as texts:
        async for text in texts:
            # json.dumps escapes the text exactly as inside a JSON string; drop its quotes.
            await response.write(json.dumps(text)[1:-1].encode())
    await response.write(b'"}')
    await response.write_eof()
    return response


@routes.get("/api/jobs/{job_id}/logs/tail", name="tail_job_logs")
async def tail_job_logs(request: web.Request) -> web.StreamResponse:
    """Websocket: text frames of the log from the start; closes with 1000 once the job has ended
    and every byte was sent."""
    chunks = await request.app[JOB_MANAGER_KEY].read_logs(request.match_info["job_id"], follow=True)
    websocket = web.WebSocketResponse(heartbeat=WEBSOCKET_HEARTBEAT_S)
    await websocket.prepare(request)
    sender = asyncio.create_task(_send_log(websocket, chunks))
    try:
        # Reading is how a closed connection is noticed; the client sends nothing else.
        async for message in websocket:
            if message.type is WSMsgType.ERROR:
                break
    finally:
        if not sender.done():
            sender.cancel()
        with contextlib.suppress(asyncio.CancelledError, ConnectionError):
            await sender
    return websocket


async def _send_log(
    websocket: web.WebSocketResponse, chunks: AsyncGenerator[LogChunk, None]
) -> None:
    try:
        async with contextlib.aclosing(_decoded(chunks)) as texts:
            async for text in texts:
                await websocket.send_str(text)
    except ConnectionError:
        logger.debug("log tail client went away")
        return
    await websocket.close()
