"""A key revoked while its streams are open: on a real server process with a tokens file, every
kind of long stream (the event stream as SSE and NDJSON, a followed text log, the log's SSE and
its websocket tail) opened with key K ends within seconds of the SIGHUP that removes K or moves
it to another tenant; a stream of a key that is still valid stays open, and so does K's when
only its role changes within its tenant."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from aiohttp import ClientPayloadError, ClientSession, ClientTimeout, WSMsgType

from jobs_server.client.sse import parse_events
from tests.support.tenant_server import (
    KEY_SPECS,
    TenantServer,
    run_tenant_server,
    submit_as,
    tokens_toml,
)

# The key whose reload is tested (K), and a key of the same tenant that stays valid.
REVOKED = "a-read"
KEPT = "a-submit"
# Prints a line every 0.2 s for longer than any test: a followed log always has news.
TICKING_JOB = "while true; do echo tick; sleep 0.2; done"
# Each kind of stream: the path after the job's (None: the event stream, not the job's).
STREAM_PATHS = {
    "events_sse": "/api/events?after=0",
    "events_ndjson": "/api/events?after=0&format=ndjson",
    "logs_follow": "{job}/logs?follow=true",
    "logs_sse": "{job}/logs/stream",
    "logs_tail": "{job}/logs/tail",
}
# Generous: the server is to end them within 5 s of the reload.
ENDED_WITHIN_S = 10.0
POLICY_VIOLATION = 1008


@dataclass
class WatchedStream:
    """One open stream read in a task of its own: what came, and how it ended."""

    kind: str
    key_name: str
    received: list[str] = field(default_factory=list)
    close_code: int | None = None
    task: asyncio.Task[None] | None = None

    @property
    def ended(self) -> bool:
        return self.task is not None and self.task.done()

    def text(self) -> str:
        return "".join(self.received)


@pytest.fixture
def server(ray_connection: str, tmp_path: Path) -> Iterator[TenantServer]:
    yield from run_tenant_server(ray_connection, tmp_path)


@pytest.fixture
async def streaming(server: TenantServer) -> AsyncIterator[ClientSession]:
    """A session whose reads never time out: the streams are meant to last."""
    async with ClientSession(
        base_url=server.url, timeout=ClientTimeout(total=None, sock_read=None)
    ) as session:
        yield session


async def _read_stream(
    session: ClientSession, server: TenantServer, stream: WatchedStream, path: str
) -> None:
    headers = server.headers(stream.key_name)
    if stream.kind == "logs_tail":
        async with session.ws_connect(path, headers=headers, heartbeat=None) as websocket:
            async for message in websocket:
                if message.type is WSMsgType.TEXT:
                    stream.received.append(message.data)
            stream.close_code = websocket.close_code
        return
    async with session.get(path, headers=headers) as response:
        assert response.status == 200, await response.text()
        async for data in response.content.iter_any():
            stream.received.append(data.decode())


async def open_streams(
    session: ClientSession, server: TenantServer, job_id: str, key_name: str
) -> list[WatchedStream]:
    """Every kind of stream with the key, each once it has received something (so the server
    is serving it)."""
    streams = []
    for kind, path in STREAM_PATHS.items():
        stream = WatchedStream(kind, key_name)
        url = path.format(job=f"/api/jobs/{job_id}")
        stream.task = asyncio.create_task(_read_stream(session, server, stream, url))
        streams.append(stream)
    await _until(lambda: all(s.received or s.ended for s in streams), 60, "the streams' first data")
    for stream in streams:
        assert not stream.ended, f"{stream.kind} of {key_name} ended at once: {stream.task}"
    return streams


async def _until(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        await asyncio.sleep(0.05)


def reload_tokens(server: TenantServer, specs: dict[str, tuple[str, str]]) -> None:
    """Rewrite the tokens file with the keys of `specs` (by name), and SIGHUP the server."""
    keys = {name: key for name, key in server.keys.items() if name in specs}
    server.tokens_file.write_text(tokens_toml(keys, specs))
    os.kill(server.pid, signal.SIGHUP)


async def assert_still_open(
    session: ClientSession, server: TenantServer, streams: list[WatchedStream]
) -> None:
    """Each stream is open and still receives: the log streams the job's next lines, the event
    streams the events of a job submitted now."""
    received_before = {id(stream): len(stream.received) for stream in streams}
    new_job = await submit_as(session, server, KEPT, entrypoint="true")
    await _until(
        lambda: (
            all(
                len(s.received) > received_before[id(s)]
                and (not s.kind.startswith("events") or new_job in s.text())
                for s in streams
            )
            or any(s.ended for s in streams)
        ),
        30,
        "news on the kept streams",
    )
    for stream in streams:
        assert not stream.ended, f"{stream.kind} of {stream.key_name} ended: {stream.task}"


async def stop_streams(streams: list[WatchedStream]) -> None:
    for stream in streams:
        assert stream.task is not None
        stream.task.cancel()
    await asyncio.gather(*(s.task for s in streams if s.task is not None), return_exceptions=True)


@pytest.mark.parametrize("change", ["removed", "moved to another tenant", "demoted from admin"])
async def test_a_revoked_key_ends_its_open_streams(
    server: TenantServer, streaming: ClientSession, change: str
) -> None:
    """Every stream of K ends (a websocket with 1008, an SSE stream after a `revoked` event, the
    NDJSON events after an error line) within seconds of the reload; the other key's stay."""
    revoked = "ops-admin" if change == "demoted from admin" else REVOKED
    job_id = await submit_as(streaming, server, KEPT, entrypoint=TICKING_JOB)
    kept_streams = await open_streams(streaming, server, job_id, KEPT)
    revoked_streams = await open_streams(streaming, server, job_id, revoked)
    try:
        specs = dict(KEY_SPECS)
        if change == "removed":
            del specs[revoked]
        elif change == "moved to another tenant":
            specs[revoked] = ("team-b", specs[revoked][1])
        else:  # an admin no longer: it may no longer read what its streams show
            specs[revoked] = (specs[revoked][0], "read")
        reload_tokens(server, specs)
        await _until(
            lambda: all(s.ended for s in revoked_streams),
            ENDED_WITHIN_S,
            "the streams of the revoked key to end: "
            + ", ".join(s.kind for s in revoked_streams if not s.ended),
        )
        by_kind = {stream.kind: stream for stream in revoked_streams}
        for stream in revoked_streams:
            assert stream.task is not None
            error = stream.task.exception()
            if stream.kind == "logs_follow":  # plain text cannot say why: it is cut, not whole
                assert isinstance(error, ClientPayloadError), error
            else:
                assert error is None, (stream.kind, error)
        assert by_kind["logs_tail"].close_code == POLICY_VIOLATION
        for kind in ("events_sse", "logs_sse"):
            last_event = parse_events(by_kind[kind].text())[-1]
            assert last_event.event == "revoked", (kind, last_event)
            assert json.loads(last_event.data)["error"]["code"] == "key_revoked", last_event
        last_line = json.loads(by_kind["events_ndjson"].text().strip().splitlines()[-1])
        assert last_line["error"]["code"] == "key_revoked", last_line
        await assert_still_open(streaming, server, kept_streams)
        assert "unexpected error" not in server.log_path.read_text()
    finally:
        await stop_streams(kept_streams + revoked_streams)


async def test_a_role_change_that_still_reads_keeps_the_streams(
    server: TenantServer, streaming: ClientSession
) -> None:
    """K of team-a, `read` made `submit` in team-a: it may still read all it was reading."""
    job_id = await submit_as(streaming, server, KEPT, entrypoint=TICKING_JOB)
    streams = await open_streams(streaming, server, job_id, REVOKED)
    try:
        specs = {**KEY_SPECS, REVOKED: ("team-a", "submit")}
        reload_tokens(server, specs)

        # Reloaded once K may submit (a stop of an unknown job: 404, not 403).
        async def may_submit() -> bool:
            async with streaming.post(
                "/api/jobs/no-such-job/stop", headers=server.headers(REVOKED)
            ) as response:
                return response.status == 404

        deadline = time.monotonic() + 30
        while not await may_submit():
            assert time.monotonic() < deadline, "the reload did not take"
            await asyncio.sleep(0.1)
        await assert_still_open(streaming, server, streams)
    finally:
        await stop_streams(streams)


async def test_the_auth_token_keeps_its_streams_across_reloads(
    server: TenantServer, streaming: ClientSession
) -> None:
    """JOBS_SERVER_AUTH_TOKEN is read once at the start: a reload of the tokens file (here one
    that removes K) leaves its streams open."""
    job_id = await submit_as(streaming, server, KEPT, entrypoint=TICKING_JOB)
    streams = await open_streams(streaming, server, job_id, "auth-token")
    revoked_streams = await open_streams(streaming, server, job_id, REVOKED)
    try:
        reload_tokens(server, {n: s for n, s in KEY_SPECS.items() if n != REVOKED})
        await _until(
            lambda: all(s.ended for s in revoked_streams) or any(s.ended for s in streams),
            ENDED_WITHIN_S,
            "the reload to end the revoked key's streams",
        )
        await assert_still_open(streaming, server, streams)
    finally:
        await stop_streams(streams + revoked_streams)
