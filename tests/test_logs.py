"""Every form of log reading: exact bytes, offsets, resume, follow, and clients that leave."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest
from aiohttp import ClientTimeout

from jobs_server.client.sse import parse_events
from jobs_server.manager.log_watch import LogWatchers
from jobs_server.manager.logs import complete_utf8_length, read_log_chunks
from jobs_server.settings import Settings
from tests.support.api import Client, job_logs, submit, wait_for_status

# 0..9 then a two-byte and a three-byte character, then a newline: 16 bytes.
SAMPLE = "0123456789éह\n"
SAMPLE_BYTES = SAMPLE.encode()


async def finished_job(client: Client, entrypoint: str) -> str:
    job_id = await submit(client, entrypoint=entrypoint)
    await wait_for_status(client, job_id)
    return job_id


@pytest.mark.parametrize(
    ("limit", "expected_pages"),
    [
        (5, ["01234", "56789", "éह", "\n"]),
        # 13 bytes end inside "ह": the page stops before it, and the next starts at it.
        (13, ["0123456789é", "ह\n"]),
        (11, ["0123456789", "éह\n"]),
    ],
)
async def test_json_range_pages_without_rereading(
    client: Client, limit: int, expected_pages: list[str]
) -> None:
    job_id = await finished_job(client, "printf '0123456789\\303\\251\\340\\244\\271\\n'")
    pages, offset = [], 0
    while True:
        response = await client.get(f"/api/jobs/{job_id}/logs?offset={offset}&limit={limit}")
        assert response.status == 200
        page = await response.json()
        assert page["offset"] == offset
        assert page["size"] == len(SAMPLE_BYTES)
        if page["next_offset"] == offset:
            break
        pages.append(page["logs"])
        offset = page["next_offset"]
    assert "".join(pages) == SAMPLE
    assert pages == expected_pages


async def test_json_range_past_the_end_is_empty(client: Client) -> None:
    job_id = await finished_job(client, "printf abc")
    page = await (await client.get(f"/api/jobs/{job_id}/logs?offset=10")).json()
    assert page == {"offset": 10, "logs": "", "next_offset": 10, "size": 3}


async def test_plain_text_is_the_exact_bytes(client: Client) -> None:
    job_id = await finished_job(client, r"printf 'bin \377\000 ok\r\n'")
    for kwargs in ({"params": {"format": "text"}}, {"headers": {"Accept": "text/plain"}}):
        response = await client.get(f"/api/jobs/{job_id}/logs", **kwargs)
        assert response.status == 200
        assert response.content_type == "text/plain"
        assert await response.read() == b"bin \xff\x00 ok\r\n"


@pytest.mark.parametrize(
    ("range_header", "expected", "content_range"),
    [
        ("bytes=0-3", b"0123", "bytes 0-3/16"),
        ("bytes=10-", "éह\n".encode(), "bytes 10-15/16"),
        ("bytes=-4", "ह\n".encode(), "bytes 12-15/16"),
        ("bytes=14-100", b"\xb9\n", "bytes 14-15/16"),
    ],
)
async def test_text_range_is_206_partial_content(
    client: Client, range_header: str, expected: bytes, content_range: str
) -> None:
    job_id = await finished_job(client, "printf '0123456789\\303\\251\\340\\244\\271\\n'")
    response = await client.get(
        f"/api/jobs/{job_id}/logs", headers={"Accept": "text/plain", "Range": range_header}
    )
    assert response.status == 206
    assert response.headers["Content-Range"] == content_range
    assert await response.read() == expected


async def test_unsatisfiable_range_is_416(client: Client) -> None:
    job_id = await finished_job(client, "printf abc")
    response = await client.get(
        f"/api/jobs/{job_id}/logs?format=text", headers={"Range": "bytes=5-9"}
    )
    assert response.status == 416
    assert response.headers["Content-Range"] == "bytes */3"
    assert (await response.json())["error"]["code"] == "range_not_satisfiable"


async def test_follow_streams_until_the_job_ends_through_a_quiet_period(client: Client) -> None:
    job_id = await submit(client, entrypoint="echo one; sleep 2.5; echo two; printf last")
    received: list[tuple[float, bytes]] = []
    async with client.get(
        f"/api/jobs/{job_id}/logs", params={"follow": "true"}, timeout=ClientTimeout(total=60)
    ) as response:
        assert response.status == 200
        async for data in response.content.iter_any():
            received.append((time.monotonic(), data))
    assert b"".join(data for _, data in received) == b"one\ntwo\nlast"
    # It ended because the job did, not before.
    assert (await wait_for_status(client, job_id, timeout_s=1))["status"] == "SUCCEEDED"


async def test_the_last_line_of_a_job_that_exits_right_after_printing(client: Client) -> None:
    for _ in range(5):
        job_id = await submit(client, entrypoint="seq 1 2000; echo the-very-last-line")
        async with client.get(f"/api/jobs/{job_id}/logs?follow=true") as response:
            text = (await response.read()).decode()
        assert text.endswith("2000\nthe-very-last-line\n")
        async with client.ws_connect(f"/api/jobs/{job_id}/logs/tail") as websocket:
            tail = "".join([message.data async for message in websocket])
        assert tail == text


async def test_websocket_tail_from_an_offset(client: Client) -> None:
    job_id = await finished_job(client, "printf '0123456789\\303\\251\\340\\244\\271\\n'")
    async with client.ws_connect(f"/api/jobs/{job_id}/logs/tail?offset=10") as websocket:
        text = "".join([message.data async for message in websocket])
    assert text == "éह\n"


async def read_sse(client: Client, job_id: str, headers: dict[str, str] | None = None) -> str:
    async with client.get(f"/api/jobs/{job_id}/logs/stream", headers=headers or {}) as response:
        assert response.status == 200
        assert response.content_type == "text/event-stream"
        return (await response.read()).decode()


async def test_sse_events_carry_offsets_and_a_final_status(client: Client) -> None:
    job_id = await finished_job(client, "printf 'a\\r\\nb\\n'; exit 3")
    events = parse_events(await read_sse(client, job_id))
    log_events = [event for event in events if event.event == "message"]
    assert "".join(json.loads(event.data) for event in log_events) == "a\r\nb\n"
    assert log_events[-1].id == "5"
    assert events[-1].event == "end"
    assert json.loads(events[-1].data) == {"status": "FAILED", "offset": 5}


async def test_sse_reconnect_with_last_event_id_resumes_exactly(client: Client) -> None:
    job_id = await submit(
        client, entrypoint="for i in 1 2 3 4 5 6; do echo line-$i; sleep 0.3; done"
    )
    first_part = ""
    last_id = "0"
    async with client.get(f"/api/jobs/{job_id}/logs/stream") as response:
        buffer = ""
        async for data in response.content.iter_any():
            buffer += data.decode()
            events = [e for e in parse_events(buffer) if e.event == "message"]
            if len(events) >= 2:
                first_part = "".join(json.loads(event.data) for event in events)
                last_id = events[-1].id or ""
                break  # the client drops the connection while the job writes
    assert first_part.startswith("line-1\n")
    rest = parse_events(await read_sse(client, job_id, {"Last-Event-ID": last_id}))
    second_part = "".join(json.loads(event.data) for event in rest if event.event == "message")
    assert first_part + second_part == "".join(f"line-{i}\n" for i in range(1, 7))
    assert int(last_id) == len(first_part.encode())


async def test_invalid_utf8_and_split_characters_never_break_streams(client: Client) -> None:
    # "é" is written one byte at a time with a pause between, then an invalid byte.
    job_id = await submit(client, entrypoint=r"printf '\303'; sleep 0.5; printf '\251 \377 end\n'")
    async with client.ws_connect(f"/api/jobs/{job_id}/logs/tail") as websocket:
        tail = "".join([message.data async for message in websocket])
    assert tail == "é \ufffd end\n"
    events = parse_events(await read_sse(client, job_id))
    assert "".join(json.loads(e.data) for e in events if e.event == "message") == tail
    assert await job_logs(client, job_id) == tail


async def test_a_client_that_leaves_mid_stream_leaves_nothing_behind(
    client: Client, settings: Settings
) -> None:
    job_id = await submit(client, entrypoint="echo hi; sleep 30")
    await wait_for_status(client, job_id, {"RUNNING"})
    (log_path,) = settings.log_dir.glob(f"*{job_id}*")
    baseline_tasks = len(asyncio.all_tasks())
    for path in ("/logs?follow=true", "/logs/stream"):
        response = await client.get(f"/api/jobs/{job_id}{path}")
        await response.content.readany()
        response.close()  # the client goes away while the job is quiet
    async with client.ws_connect(f"/api/jobs/{job_id}/logs/tail") as websocket:
        assert await websocket.receive_str() == "hi\n"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if not _open_fds_to(log_path) and len(asyncio.all_tasks()) <= baseline_tasks:
            break
        await asyncio.sleep(0.1)
    assert _open_fds_to(log_path) == []
    assert len(asyncio.all_tasks()) <= baseline_tasks
    await client.post(f"/api/jobs/{job_id}/stop", json={"grace_period_s": 0})


def _open_fds_to(path: Path) -> list[str]:
    """This process's descriptors open on `path` (the server runs in the test process)."""
    found = []
    for fd in Path("/proc/self/fd").iterdir():
        try:
            if Path(fd.readlink()) == path:
                found.append(fd.name)
        except OSError:
            continue
    return found


def test_complete_utf8_length_holds_back_only_an_unfinished_character() -> None:
    assert complete_utf8_length(b"abc") == 3
    assert complete_utf8_length("é".encode()) == 2
    assert complete_utf8_length("é".encode()[:1]) == 0
    assert complete_utf8_length(b"a" + "ह".encode()[:2]) == 1
    assert complete_utf8_length(b"a" + "😀".encode()[:3]) == 1
    assert complete_utf8_length(b"a\xff") == 2
    assert complete_utf8_length(b"") == 0


# The shared watcher, on a plain file (no server).


async def _next(chunks: Any) -> Any:
    return await asyncio.wait_for(anext(chunks), 10)


async def test_followers_of_one_file_share_one_watcher_that_stops_with_the_last(
    tmp_path: Path,
) -> None:
    path = tmp_path / "job.log"
    path.write_bytes(b"one\n")
    ended = False

    async def job_is_terminal() -> bool:
        return ended

    watchers = LogWatchers()
    followers = [
        read_log_chunks(path, follow=True, job_is_terminal=job_is_terminal, watchers=watchers)
        for _ in range(3)
    ]
    for follower in followers:
        assert (await _next(follower)).data == b"one\n"
    assert len(watchers) == 1
    reads = [asyncio.ensure_future(_next(follower)) for follower in followers]
    await asyncio.sleep(0.05)
    with path.open("ab") as log:
        log.write(b"two\n")
    assert [(chunk.offset, chunk.data) for chunk in await asyncio.gather(*reads)] == [
        (4, b"two\n")
    ] * 3
    # The job ends right after its last line: every follower still gets it, then ends.
    with path.open("ab") as log:
        log.write(b"last\n")
    ended = True
    for follower in followers[:2]:
        assert [chunk.data async for chunk in follower] == [b"last\n"]
    assert len(watchers) == 1  # the third still follows
    await followers[2].aclose()
    assert len(watchers) == 0


async def test_a_quiet_watched_follower_ticks_when_asked_to_stop(tmp_path: Path) -> None:
    path = tmp_path / "job.log"
    stop = False

    async def never_ends() -> bool:
        return False

    watchers = LogWatchers()
    follower = read_log_chunks(
        path,
        follow=True,
        job_is_terminal=never_ends,
        watchers=watchers,
        idle_tick_s=3600,
        stop_when=lambda: stop,
    )
    tick = asyncio.ensure_future(_next(follower))
    await asyncio.sleep(0.3)
    assert not tick.done()  # no tick while nothing asks for one
    stop = True
    assert (await tick).data == b""
    await follower.aclose()
    assert len(watchers) == 0
