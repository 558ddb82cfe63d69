"""The terminal client (`jobs-server submit|logs|list|status|stop|delete`) as a user runs it: a
real `python -m jobs_server` process against a server on a loopback port.

Most tests drive the fake manager's server (tests/support/fakes.py), so the test decides exactly
when a job prints and ends; a proxy in the test drops the client's connection mid-event. The last
tests run real jobs on the real server (`server_url`).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import pty
import signal
import sys
import termios
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from pydantic import SecretStr

from jobs_server.app import create_app
from jobs_server.app_state import OUTBOX_KEY
from jobs_server.client.follow import exit_code_of
from jobs_server.client.output import format_bytes, format_cpu_seconds
from jobs_server.client.sse import Event, parse_events, read_events
from jobs_server.manager.archive.sqlite import Archive, archive_path
from jobs_server.settings import Settings
from tests.support.accounting import GIBIBYTE, MEBIBYTE, finish_measured, measured_attempt
from tests.support.cli import CLIENT, run_cli, start_cli
from tests.support.fakes import FakeJobManager

TOKEN = "client-test-token"
AiohttpServer = Callable[..., Awaitable[TestServer]]


class DroppingProxy:
    """A TCP proxy to `upstream` that, once, cuts the server's answer right after the first
    `cut_at` bytes pass (forwarding only up to them), then aborts both sides; it keeps the
    request heads it saw."""

    def __init__(self, upstream_port: int, cut_at: bytes) -> None:
        self.upstream_port, self.cut_at = upstream_port, cut_at
        self.request_heads: list[bytes] = []
        self.cut = asyncio.Event()
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def close(self) -> None:
        assert self._server is not None
        self._server.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        upstream_r, upstream_w = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        head = await client_r.readuntil(b"\r\n\r\n")
        self.request_heads.append(head)
        upstream_w.write(head)
        writers = (client_w, upstream_w)
        upward = asyncio.create_task(self._pipe(client_r, upstream_w, writers, cuts=False))
        downward = asyncio.create_task(self._pipe(upstream_r, client_w, writers, cuts=True))
        self._tasks.update({upward, downward})
        await asyncio.gather(upward, downward, return_exceptions=True)

    async def _pipe(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        writers: tuple[asyncio.StreamWriter, ...],
        *,
        cuts: bool,
    ) -> None:
        seen = b""
        with contextlib.suppress(ConnectionError):
            while data := await reader.read(65536):
                if cuts and not self.cut.is_set():
                    seen += data
                    if self.cut_at in seen:
                        keep = len(data) - (len(seen) - seen.index(self.cut_at) - len(self.cut_at))
                        writer.write(data[:keep])
                        await writer.drain()
                        self.cut.set()
                        for each in writers:
                            each.transport.abort()
                        return
                writer.write(data)
                await writer.drain()
        for each in writers:
            each.transport.abort()


@pytest.fixture
async def fake_server(
    aiohttp_server: AiohttpServer, fake_settings: Settings, fake: FakeJobManager
) -> TestServer:
    return await aiohttp_server(create_app(fake_settings, backend=fake.backend()))


def url_of(server: TestServer) -> str:
    return str(server.make_url("")).rstrip("/")


async def running_fake_job(server: TestServer, fake: FakeJobManager, job_id: str) -> None:
    async with aiohttp.ClientSession() as session:
        response = await session.post(
            f"{url_of(server)}/api/jobs/", json={"entrypoint": "x", "submission_id": job_id}
        )
        assert response.status == 200, await response.text()
    fake.start(job_id)


async def test_client_commands_import_neither_ray_nor_the_server(
    fake_server: TestServer, fake: FakeJobManager
) -> None:
    await running_fake_job(fake_server, fake, "j1")
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-X",
        "importtime",
        "-m",
        "jobs_server",
        "list",
        "--url",
        url_of(fake_server),
        env={**os.environ, "PYTHONPATH": os.getcwd()},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    stdout, stderr = await process.communicate()
    assert process.returncode == 0, stderr.decode()
    assert b"j1" in stdout
    imported = {
        line.split("|")[-1].strip()
        for line in stderr.decode().splitlines()
        if line.startswith("import time:")
    }
    assert "jobs_server.client.commands" in imported  # the check sees the client's imports
    forbidden = {
        name
        for name in imported
        if name.split(".")[0] in {"ray", "pydantic", "pydantic_settings"}
        or name.startswith(("jobs_server.manager", "jobs_server.app", "jobs_server.routes"))
    }
    assert forbidden == set()


async def test_bare_command_says_to_try_serve_and_lists_the_commands() -> None:
    code, _, stderr = await run_cli()
    assert code == 2
    assert "jobs-server serve" in stderr
    for command in ("serve", "submit", "logs", "list", "status", "stop", "delete"):
        assert f"    {command}" in stderr


async def test_follow_resumes_after_a_dropped_connection_without_gap_or_duplicate(
    fake_server: TestServer, fake: FakeJobManager
) -> None:
    await running_fake_job(fake_server, fake, "j1")
    fake.write_log("j1", b"one\n")
    # Cut inside the event that carries "two": the client gets half an event, then nothing.
    proxy = DroppingProxy(fake_server.port or 0, cut_at=b'data: "tw')
    url = await proxy.start()
    try:
        cli = await start_cli("logs", "-f", "j1", "--url", url)
        await cli.read_until(b"one\n")
        fake.write_log("j1", b"two\n")
        await asyncio.wait_for(proxy.cut.wait(), 30)
        fake.write_log("j1", "three \N{SNOWMAN}\n".encode())
        await cli.read_until(b"three")
        fake.finish("j1", exit_code=3)
        code, stdout, stderr = await cli.finish()
    finally:
        await proxy.close()
    assert stdout == "one\ntwo\nthree \N{SNOWMAN}\n".encode()
    assert code == 3
    assert "resuming the log at byte 4" in stderr
    streams = [head for head in proxy.request_heads if b"/logs/stream " in head]
    assert len(streams) == 2  # (the exit code's GET may have come through the proxy too)
    assert b"last-event-id: 4\r\n" in streams[1].lower()


async def test_follow_gives_up_when_the_job_is_deleted(
    fake_server: TestServer, fake: FakeJobManager
) -> None:
    await running_fake_job(fake_server, fake, "j1")
    fake.write_log("j1", b"one\n")
    cli = await start_cli("logs", "-f", "j1", "--url", url_of(fake_server))
    await cli.read_until(b"one\n")
    fake.finish("j1")
    await fake.delete_job("j1")
    code, _, stderr = await cli.finish()
    # Either the stream ended with the job (0), or the resume found it gone (1, said why).
    assert code in (0, 1)
    assert code == 0 or "Job j1 does not exist" in stderr


async def test_ctrl_c_with_stop_on_interrupt_stops_the_job_and_exits_130(
    fake_server: TestServer, fake: FakeJobManager
) -> None:
    await running_fake_job(fake_server, fake, "j1")
    fake.write_log("j1", b"started\n")
    cli = await start_cli("logs", "-f", "--stop-on-interrupt", "j1", "--url", url_of(fake_server))
    await cli.read_until(b"started\n")
    cli.process.send_signal(signal.SIGINT)
    code, _, stderr = await cli.finish()
    assert code == 130, stderr
    assert fake.stop_requests == [("j1", None)]
    assert (await fake.get_job("j1")).status == "STOPPED"


async def test_ctrl_c_without_a_terminal_leaves_the_job_running(
    fake_server: TestServer, fake: FakeJobManager
) -> None:
    await running_fake_job(fake_server, fake, "j1")
    fake.write_log("j1", b"started\n")
    cli = await start_cli("logs", "-f", "j1", "--url", url_of(fake_server))
    await cli.read_until(b"started\n")
    cli.process.send_signal(signal.SIGINT)
    code, _, stderr = await cli.finish()
    assert code == 130
    assert "j1 keeps running" in stderr
    assert fake.stop_requests == []
    assert (await fake.get_job("j1")).status == "RUNNING"


@pytest.mark.parametrize(("answer", "stopped"), [(b"y\n", True), (b"\n", False)])
async def test_ctrl_c_on_a_terminal_asks_whether_to_stop(
    fake_server: TestServer, fake: FakeJobManager, answer: bytes, stopped: bool
) -> None:
    await running_fake_job(fake_server, fake, "j1")
    fake.write_log("j1", b"started\n")
    controller, terminal = pty.openpty()
    attributes = termios.tcgetattr(terminal)
    attributes[3] &= ~termios.ECHO  # what we type is not read back as the prompt's output
    termios.tcsetattr(terminal, termios.TCSANOW, attributes)
    try:
        cli = await start_cli(
            "logs", "-f", "j1", "--url", url_of(fake_server), stdin=terminal, stderr=terminal
        )
        os.close(terminal)
        await cli.read_until(b"started\n")
        cli.process.send_signal(signal.SIGINT)
        prompt = b""
        async with asyncio.timeout(30):
            while b"[y/N]" not in prompt:
                prompt += await asyncio.to_thread(os.read, controller, 1024)
        assert b"Stop job j1?" in prompt
        os.write(controller, answer)
        code, _, _ = await cli.finish()
    finally:
        os.close(controller)
    assert code == 130
    assert fake.stop_requests == ([("j1", None)] if stopped else [])


async def test_server_errors_print_its_message_and_exit_1(fake_server: TestServer) -> None:
    for args in (["status", "nope"], ["logs", "nope"], ["stop", "nope"], ["delete", "nope"]):
        code, _, stderr = await run_cli(*args, "--url", url_of(fake_server))
        assert code == 1, args
        assert stderr == "jobs-server: Job nope does not exist (HTTP 404, job_not_found)\n"
    code, _, stderr = await run_cli("list", "--status", "BOGUS", "--url", url_of(fake_server))
    assert code == 1
    assert "status: expected statuses among" in stderr


async def test_delete_of_a_running_job_says_why_it_cannot(
    fake_server: TestServer, fake: FakeJobManager
) -> None:
    await running_fake_job(fake_server, fake, "j1")
    code, _, stderr = await run_cli("delete", "j1", "--url", url_of(fake_server))
    assert code == 1
    assert "non-terminal state RUNNING" in stderr
    assert "HTTP 409" in stderr


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["submit", "--metadata", "no-equals", "--", "true"], "expected KEY=VALUE"),
        (["submit", "--env", "=x", "--", "true"], "expected KEY=VALUE"),
        (["submit", "--working-dir", "./project", "--", "true"], "expected a URL"),
        (["submit", "--wait", "--follow", "--", "true"], "not allowed with"),
        (["submit", "--after", "", "--", "true"], "expected a job's submission id"),
        (["submit", "--notify", "hooks.example.com", "--", "true"], "expected an https:// URL"),
        (["submit"], "CMD"),
        (["logs"], "ID"),
        (["list", "--url", "127.0.0.1:8266"], "expected http://HOST:PORT"),
    ],
)
async def test_usage_errors_exit_2_saying_why(args: list[str], says: str) -> None:
    code, _, stderr = await run_cli(*args)
    assert code == 2
    assert says in stderr


async def test_an_unreachable_server_is_named(unused_tcp_port: int) -> None:
    code, _, stderr = await run_cli(
        "list", env={"JOBS_SERVER_URL": f"http://127.0.0.1:{unused_tcp_port}"}
    )
    assert code == 1
    assert f"cannot reach http://127.0.0.1:{unused_tcp_port}" in stderr


@pytest.fixture
async def token_server(
    aiohttp_server: AiohttpServer, fake_settings: Settings, fake: FakeJobManager
) -> TestServer:
    secured = fake_settings.model_copy(update={"auth_token": SecretStr(TOKEN)})
    return await aiohttp_server(create_app(secured, backend=fake.backend()))


async def test_the_key_comes_from_the_environment_or_a_file(
    token_server: TestServer, fake: FakeJobManager, tmp_path: Path
) -> None:
    url = url_of(token_server)
    code, _, stderr = await run_cli("list", "--url", url)
    assert (code, "HTTP 401, unauthorized" in stderr) == (1, True)
    code, _, stderr = await run_cli("list", "--url", url, env={"JOBS_SERVER_AUTH_TOKEN": "wrong"})
    assert (code, "HTTP 403, forbidden" in stderr) == (1, True)
    code, stdout, _ = await run_cli(
        "submit", "--submission-id", "k1", "--url", url, "--", "echo", "hi",
        env={"JOBS_SERVER_AUTH_TOKEN": TOKEN},
    )  # fmt: skip
    assert (code, stdout) == (0, b"k1\n")
    token_file = tmp_path / "token"
    token_file.write_text(f"{TOKEN}\n")
    code, stdout, _ = await run_cli("status", "k1", "--url", url, "--token-file", str(token_file))
    assert code == 0
    assert b"status:        PENDING" in stdout
    assert b"entrypoint:    echo hi" in stdout


async def test_submit_sends_the_options_as_the_job(
    fake_server: TestServer, fake: FakeJobManager
) -> None:
    code, stdout, stderr = await run_cli(
        "submit", "--url", url_of(fake_server), "--submission-id", "s1",
        "--metadata", "owner=me", "--metadata", "team=a=b", "--env", "X=1",
        "--working-dir", "https://example.com/project.zip", "--", "echo $X;", "ls", "-la",
    )  # fmt: skip
    assert (code, stdout) == (0, b"s1\n"), stderr
    job = await fake.get_job("s1")
    # Several arguments are quoted each, as `ray job submit` does (shlex.join).
    assert job.spec.entrypoint == "'echo $X;' ls -la"
    assert job.spec.metadata == {"owner": "me", "team": "a=b"}
    assert job.spec.runtime_env == {
        "env_vars": {"X": "1"},
        "working_dir": "https://example.com/project.zip",
    }


async def test_list_and_status_print_tables_and_json(
    fake_server: TestServer, fake: FakeJobManager
) -> None:
    url = url_of(fake_server)
    await running_fake_job(fake_server, fake, "first")
    await running_fake_job(fake_server, fake, "second")
    fake.finish("first", exit_code=2)
    code, stdout, _ = await run_cli("list", "--url", url)
    lines = stdout.decode().splitlines()
    assert code == 0
    assert lines[0].split() == [
        "SUBMISSION_ID", "STATUS", "STARTED", "DURATION", "PEAK_MEMORY", "CPU", "ENTRYPOINT",
    ]  # fmt: skip
    assert [line.split()[:2] for line in lines[1:]] == [["first", "FAILED"], ["second", "RUNNING"]]
    code, stdout, _ = await run_cli("list", "--status", "RUNNING", "--json", "--url", url)
    assert [job["submission_id"] for job in json.loads(stdout)] == ["second"]
    code, stdout, _ = await run_cli("status", "first", "--url", url)
    assert b"exit_code:     2" in stdout


async def test_status_and_list_show_what_a_job_used_and_its_limits(
    fake_server: TestServer, fake: FakeJobManager
) -> None:
    url = url_of(fake_server)
    async with aiohttp.ClientSession() as session:
        body = {
            "entrypoint": "x",
            "submission_id": "measured",
            "limits": {"memory_bytes": GIBIBYTE, "cpu_cores": 0.5, "max_processes": 64},
        }
        assert (await session.post(f"{url}/api/jobs/", json=body)).status == 200
    fake.start("measured")
    finish_measured(
        fake,
        "measured",
        [
            measured_attempt(None, None, None, exit_code=3),  # not measured: nothing said
            measured_attempt(200 * MEBIBYTE, 61.25, 0.5, 2.0, log_offset=10),
        ],
    )
    code, stdout, stderr = await run_cli("status", "measured", "--url", url)
    assert code == 0, stderr
    lines = stdout.decode().splitlines()
    assert "limits:        memory 1.0 GiB, 0.5 CPU cores, 64 processes" in lines
    assert "peak_memory:   200.0 MiB" in lines
    assert "cpu_time:      1m01.75s (user 1m01.25s, system 0.50s)" in lines
    attempts = [line for line in lines if line.startswith("attempt.")]
    assert attempts[0].endswith(", exit code 3, log from byte 0"), attempts
    assert attempts[1].endswith(
        ", exit code 0, log from byte 10, peak memory 200.0 MiB, CPU user 1m01.25s system 0.50s,"
        " throttled 2.00s"
    ), attempts
    await running_fake_job(fake_server, fake, "running")
    code, stdout, stderr = await run_cli("list", "--url", url)
    rows = {line.split()[0]: line.split() for line in stdout.decode().splitlines()[1:]}
    assert rows["measured"][5:9] == ["200.0", "MiB", "1m01.75s", "x"], rows
    assert rows["running"][5:8] == ["-", "-", "x"], rows  # not measured while it runs
    code, stdout, stderr = await run_cli("status", "running", "--url", url)
    assert b"peak_memory" not in stdout
    assert b"limits" not in stdout


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (None, "-"),
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1.0 KiB"),
        (3 * MEBIBYTE // 2, "1.5 MiB"),
        (200 * MEBIBYTE, "200.0 MiB"),
        (GIBIBYTE, "1.0 GiB"),
        (5 * 1024 * GIBIBYTE, "5.0 TiB"),
        (2**62, "4.0 EiB"),
    ],
)
def test_bytes_are_shown_in_binary_units(value: int | None, text: str) -> None:
    assert format_bytes(value) == text


@pytest.mark.parametrize(
    ("value", "text"),
    [(None, "-"), (0.0, "0.00s"), (0.004, "0.00s"), (59.994, "59.99s"), (61.25, "1m01.25s"),
     (3600.0, "1h00m00s"), (90061.5, "25h01m01s")],
)  # fmt: skip
def test_cpu_seconds_are_shown_to_the_hundredth(value: float | None, text: str) -> None:
    assert format_cpu_seconds(value) == text


@pytest.mark.parametrize(
    ("job", "code"),
    [
        ({"status": "SUCCEEDED", "driver_exit_code": 0}, 0),
        ({"status": "FAILED", "driver_exit_code": 3}, 3),
        ({"status": "FAILED", "driver_exit_code": None}, 1),  # e.g. its runtime env failed
        ({"status": "FAILED", "driver_exit_code": -9}, 137),  # killed by SIGKILL
        ({"status": "STOPPED", "driver_exit_code": -15}, 130),
        ({"status": "STOPPED", "driver_exit_code": None}, 130),  # stopped while PENDING
    ],
)
def test_exit_code_of_a_job(job: dict[str, Any], code: int) -> None:
    assert exit_code_of(job) == code


async def test_sse_events_are_whole_however_the_bytes_are_split() -> None:
    stream = (
        b': ping\r\n\r\nid: 4\r\ndata: "one\\n"\r\n\r\n'
        b'data: a\ndata: b\nid: 9\n\nevent: end\r\ndata: {"status": "SUCCEEDED"}\r\n\r\n'
        b'data: "cut'
    )
    expected = [
        Event("message", '"one\\n"', "4"),
        Event("message", "a\nb", "9"),
        Event("end", '{"status": "SUCCEEDED"}', "9"),
    ]

    async def split(at: int, again: int) -> AsyncIterator[bytes]:
        for part in (stream[:at], stream[at:again], stream[again:]):
            yield part

    for at in range(len(stream) + 1):
        for again in range(at, len(stream) + 1, 7):
            assert [event async for event in read_events(split(at, again))] == expected
    # The same parser on a text read so far (what the tests and benchmarks read whole).
    assert parse_events(stream.decode()) == expected
    assert parse_events(stream[: stream.index(b"event: end")].decode()) == expected[:2]


# Real jobs on the real server.


async def test_submit_follow_prints_a_real_job_and_exits_with_its_code(server_url: str) -> None:
    code, stdout, stderr = await run_cli(
        "submit", "--follow", "--url", server_url, "--env", "WHO=client", "--",
        "for i in 1 2 3; do echo line $i $WHO; sleep 0.2; done; exit 3",
    )  # fmt: skip
    assert stdout == b"line 1 client\nline 2 client\nline 3 client\n"
    assert code == 3, stderr
    assert stderr.startswith("jobs-server: submitted ")


async def test_several_arguments_run_as_the_same_words_as_under_ray_job_submit(
    server_url: str,
) -> None:
    """`-- sh -c 'echo hi; exit 3'` is three words; joined with spaces, sh ran `echo` alone."""
    code, stdout, stderr = await run_cli(
        "submit", "--follow", "--url", server_url, "--", "sh", "-c", "echo hi; exit 3",
    )  # fmt: skip
    assert (code, stdout) == (3, b"hi\n"), stderr
    code, stdout, stderr = await run_cli(
        "submit", "--follow", "--url", server_url, "--", "printf", "%s|", "a b", "$HOME", "'",
    )  # fmt: skip
    assert (code, stdout) == (0, b"a b|$HOME|'|"), stderr


async def test_submit_wait_and_stop_a_real_job(server_url: str) -> None:
    job_id = f"client-{os.getpid()}-{id(server_url)}"
    waiting = await start_cli(
        "submit", "--wait", "--submission-id", job_id, "--url", server_url, "--",
        "echo started; sleep 300",
    )  # fmt: skip
    await waiting.read_until(f"{job_id}\n".encode())
    follower = await start_cli("logs", "-f", job_id, "--url", server_url)
    await follower.read_until(b"started\n")
    code, stdout, _ = await run_cli("stop", job_id, "--url", server_url)
    assert (code, stdout) == (0, f"stopping {job_id}\n".encode())
    code, stdout, _ = await follower.finish()
    assert (code, stdout) == (130, b"started\n")
    code, _, stderr = await waiting.finish()
    assert code == 130
    assert f"{job_id} STOPPED" in stderr
    code, stdout, _ = await run_cli("delete", job_id, "--url", server_url)
    assert (code, stdout) == (0, f"deleted {job_id}\n".encode())


async def test_submit_after_waits_for_a_real_parent(server_url: str) -> None:
    code, stdout, stderr = await run_cli(
        "submit", "--url", server_url, "--", "sleep 0.5; echo parent",
    )  # fmt: skip
    assert code == 0, stderr
    parent = stdout.decode().strip()
    code, stdout, stderr = await run_cli(
        "submit", "--follow", "--after", parent, "--url", server_url, "--", "echo child",
    )  # fmt: skip
    assert (code, stdout) == (0, b"child\n"), stderr
    child = stderr.split("submitted ")[1].split()[0]
    code, stdout, stderr = await run_cli("status", child, "--url", server_url)
    assert code == 0, stderr
    assert f"dependency.1:  after {parent} succeeded: met" in stdout.decode().splitlines()
    # A condition that can no longer hold: the job never runs, and --wait says why.
    code, stdout, stderr = await run_cli(
        "submit", "--wait", "--after-failed", parent, "--url", server_url, "--", "echo never",
    )  # fmt: skip
    assert code == 1
    assert "FAILED" in stderr
    never = stdout.decode().strip()
    code, stdout, _ = await run_cli("status", never, "--url", server_url)
    assert b"error_type:    DEPENDENCY_NEVER_SATISFIED" in stdout
    assert f"dependency.1:  after {parent} failed: never".encode() in stdout
    code, _, stderr = await run_cli(
        "submit", "--after", "no-such-job", "--url", server_url, "--", "true"
    )
    assert (code, stderr) == (
        1,
        "jobs-server: Job no-such-job does not exist (HTTP 404, job_not_found)\n",
    )


async def test_status_shows_a_real_jobs_webhook_delivery(
    aiohttp_server: AiohttpServer, settings: Settings, tmp_path: Path
) -> None:
    """End to end: `--notify` to a receiver on loopback that answers 204; `status` shows the
    delivery."""
    arrived = asyncio.Event()

    async def hook(request: web.Request) -> web.Response:
        await request.read()
        arrived.set()
        return web.Response(status=204)

    receiver = web.Application()
    receiver.router.add_post("/hook", hook)
    hook_url = str((await aiohttp_server(receiver)).make_url("/hook"))
    secret_file = tmp_path / "webhook-secret"
    secret_file.write_text(
        "whsec_" + base64.b64encode(b"0123456789abcdef0123456789abcdef").decode()
    )
    webhooks = {
        "webhook_secret_file": secret_file,
        "webhook_allow_http": True,
        "webhook_allow_private": True,
    }
    server = await aiohttp_server(create_app(settings.model_copy(update=webhooks)))
    code, stdout, stderr = await run_cli(
        "submit", "--wait", "--notify", hook_url, "--url", url_of(server), "--", "true",
    )  # fmt: skip
    assert code == 0, stderr
    job_id = stdout.decode().strip()
    await asyncio.wait_for(arrived.wait(), 60)
    lines: list[str] = []
    for _ in range(200):  # the delivery's outcome is written just after the receiver answered
        code, stdout, stderr = await run_cli("status", job_id, "--url", url_of(server))
        lines = [line for line in stdout.decode().splitlines() if line.startswith("delivery.")]
        if lines and "delivered" in lines[-1]:
            break
        await asyncio.sleep(0.1)
    assert f"notify.1:      {hook_url} (job.started, job.succeeded, job.failed, job.stopped," in (
        stdout.decode()
    )
    delivered = [line for line in lines if ": delivered, 1 attempt, last HTTP 204" in line]
    assert any(
        line.endswith(f"job.succeeded to {hook_url}: delivered, 1 attempt, last HTTP 204")
        for line in delivered
    ), lines


async def test_a_log_piped_into_head_ends_quietly(
    fake_server: TestServer, fake: FakeJobManager
) -> None:
    await running_fake_job(fake_server, fake, "j1")
    fake.write_log("j1", b"x" * 1_000_000 + b"\n")
    command = " ".join([*CLIENT, "logs", "j1", "--url", url_of(fake_server), "| head -c 10"])
    process = await asyncio.create_subprocess_exec(
        "bash", "-o", "pipefail", "-c", command,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    stdout, stderr = await process.communicate()
    assert stdout == b"x" * 10
    assert stderr == b""


# Issue 36: dependencies and webhooks in the client.


async def test_submit_after_options_send_depends_on_and_notify(
    fake_server: TestServer, fake: FakeJobManager
) -> None:
    url = url_of(fake_server)
    for parent in ("prep", "train", "check"):
        await running_fake_job(fake_server, fake, parent)
    code, stdout, stderr = await run_cli(
        "submit", "--url", url, "--submission-id", "report",
        "--after", "prep", "--after-failed", "check", "--after-any", "train",
        "--notify", "https://hooks.example.com/jobs", "--notify", "https://hooks.example.com/b",
        "--", "true",
    )  # fmt: skip
    assert (code, stdout) == (0, b"report\n"), stderr
    spec = (await fake.get_job("report")).spec
    # In the order given, each with the condition of its option.
    assert [(d.submission_id, d.condition.value) for d in spec.depends_on] == [
        ("prep", "succeeded"),
        ("check", "failed"),
        ("train", "ended"),
    ]
    assert [(target.url, len(target.events)) for target in spec.notify] == [
        ("https://hooks.example.com/jobs", 5),  # every event
        ("https://hooks.example.com/b", 5),
    ]
    # Without the options the body has neither field (an older server refuses unknown fields).
    code, _, stderr = await run_cli("submit", "--url", url, "--submission-id", "plain", "--", "x")
    assert code == 0, stderr
    assert (await fake.get_job("plain")).spec.depends_on == ()


STUB_JOB: dict[str, Any] = {
    "submission_id": "report",
    "status": "PENDING",
    "entrypoint": "make report",
    "message": "Job is waiting for prep (succeeded), check (failed).",
    "depends_on": [
        {"submission_id": "prep", "condition": "succeeded", "met": True},
        {"submission_id": "check", "condition": "failed", "met": False},
        {"submission_id": "train", "condition": "ended", "met": None},
    ],
    "notify": [{"url": "https://hooks.example.com/jobs", "events": ["job.succeeded"]}],
}
STUB_DELIVERIES: list[dict[str, Any]] = [
    {
        "id": "msg_1", "event_id": 7, "event_type": "job.started",
        "url": "https://hooks.example.com/jobs", "state": "delivered", "attempts": 2,
        "created_at": 1_700_000_000_000, "last_attempt_at": 1_700_000_001_000,
        "next_attempt_at": None, "last_status_code": 200, "last_error": None,
        "delivered_at": 1_700_000_001_000,
    },
    {
        "id": "msg_2", "event_id": 9, "event_type": "job.succeeded",
        "url": "https://hooks.example.com/jobs", "state": "pending", "attempts": 1,
        "created_at": 1_700_000_000_000, "last_attempt_at": 1_700_000_002_000,
        "next_attempt_at": 1_700_000_009_000, "last_status_code": None,
        "last_error": "connection refused", "delivered_at": None,
    },
]  # fmt: skip


async def stub_server(
    aiohttp_server: AiohttpServer, deliveries: list[dict[str, Any]] | None
) -> TestServer:
    """A server that knows one job, and its deliveries (None: a server without that route)."""
    app = web.Application()

    async def get_job(request: web.Request) -> web.Response:
        return web.json_response(STUB_JOB)

    async def get_deliveries(request: web.Request) -> web.Response:
        if deliveries is None:
            return web.json_response(
                {"error": {"code": "not_found", "message": "Not Found"}}, status=404
            )
        return web.json_response({"deliveries": deliveries})

    app.router.add_get("/api/jobs/report", get_job)
    app.router.add_get("/api/jobs/report/deliveries", get_deliveries)
    return await aiohttp_server(app)


async def test_status_shows_dependencies_and_webhook_deliveries(
    aiohttp_server: AiohttpServer,
) -> None:
    server = await stub_server(aiohttp_server, STUB_DELIVERIES)
    code, stdout, stderr = await run_cli("status", "report", "--url", url_of(server))
    assert code == 0, stderr
    lines = stdout.decode().splitlines()
    assert "dependency.1:  after prep succeeded: met" in lines
    assert "dependency.2:  after check failed: not yet" in lines
    assert "dependency.3:  after train ended: not known" in lines
    assert "notify.1:      https://hooks.example.com/jobs (job.succeeded)" in lines
    deliveries = [line for line in lines if line.startswith("delivery.")]
    assert deliveries[0] == (
        "delivery.1:    job.started to https://hooks.example.com/jobs: delivered, 2 attempts,"
        " last HTTP 200"
    )
    assert deliveries[1].startswith(
        "delivery.2:    job.succeeded to https://hooks.example.com/jobs: pending, 1 attempt,"
        " last error: connection refused, next at "
    )
    assert len(deliveries) == 2
    assert lines[-1].startswith("message:")  # the message stays last


async def test_status_on_a_server_without_deliveries_shows_the_job(
    aiohttp_server: AiohttpServer,
) -> None:
    server = await stub_server(aiohttp_server, None)
    code, stdout, stderr = await run_cli("status", "report", "--url", url_of(server))
    assert (code, stderr) == (0, "")
    assert b"dependency.1:  after prep succeeded: met" in stdout
    assert b"delivery." not in stdout


# Webhook endpoints a 410 disabled: `jobs-server webhooks disabled|enable`.


@pytest.fixture
async def outbox_server(
    aiohttp_server: AiohttpServer, fake_settings: Settings, fake: FakeJobManager, tmp_path: Path
) -> AsyncIterator[tuple[TestServer, Archive]]:
    """The fake manager's server (no keys: an admin of `default`) on a real SQLite outbox."""
    archive = Archive(archive_path(tmp_path / "outbox"))
    await archive.open()
    app = create_app(fake_settings, backend=fake.backend())
    app[OUTBOX_KEY] = archive
    yield await aiohttp_server(app), archive
    await archive.close()


async def test_webhooks_disabled_lists_and_enable_enables(
    outbox_server: tuple[TestServer, Archive],
) -> None:
    server, archive = outbox_server
    url = url_of(server)
    code, stdout, stderr = await run_cli("webhooks", "disabled", "--url", url)
    assert (code, stdout.decode().split(), stderr) == (0, ["TENANT", "DISABLED", "URL"], "")
    await archive.disable_webhook_endpoint("default", "https://a.example/in", 1_700_000_000_000)
    await archive.disable_webhook_endpoint("team-b", "https://b.example/in", 1_700_000_001_000)
    code, stdout, _ = await run_cli("webhooks", "disabled", "--url", url)
    lines = stdout.decode().splitlines()
    assert code == 0
    assert [(line.split()[0], line.split()[-1]) for line in lines[1:]] == [
        ("default", "https://a.example/in"),
        ("team-b", "https://b.example/in"),
    ]
    code, stdout, _ = await run_cli(
        "webhooks", "disabled", "--tenant", "team-b", "--json", "--url", url
    )
    assert json.loads(stdout) == {
        "endpoints": [
            {"url": "https://b.example/in", "tenant": "team-b", "disabled_at": 1_700_000_001_000}
        ]
    }

    code, stdout, stderr = await run_cli("webhooks", "enable", "https://a.example/in", "--url", url)
    assert (code, stdout, stderr) == (0, b"enabled https://a.example/in for tenant default\n", "")
    code, stdout, stderr = await run_cli(
        "webhooks", "enable", "https://b.example/in", "--tenant", "team-b", "--url", url
    )
    assert (code, stdout, stderr) == (0, b"enabled https://b.example/in for tenant team-b\n", "")
    assert await archive.disabled_webhook_endpoints() == []
    code, _, stderr = await run_cli("webhooks", "enable", "https://a.example/in", "--url", url)
    assert code == 1
    assert stderr == (
        "jobs-server: The webhook endpoint https://a.example/in is not disabled for tenant"
        " default. (HTTP 404, webhook_endpoint_not_found)\n"
    )


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["webhooks"], "disabled,enable"),
        (["webhooks", "enable"], "URL"),
        (["webhooks", "enable", "a.example/in"], "expected an https:// URL"),
    ],
)
async def test_webhooks_usage_errors_exit_2_saying_why(args: list[str], says: str) -> None:
    code, _, stderr = await run_cli(*args)
    assert code == 2
    assert says in stderr


# A dependency's word, the page's too (dependencies.js): met, never, not yet, not known.


@pytest.mark.parametrize(
    ("job", "said"),
    [
        (
            {
                "status": "FAILED",
                "error_type": "DEPENDENCY_NEVER_SATISFIED",
                "message": "check ended SUCCEEDED; this job needed it to fail or stop",
            },
            ["after prep succeeded: met", "after check failed: never", "after ch ended: not yet"],
        ),
        (
            {
                "status": "FAILED",
                "error_type": "DEPENDENCY_NEVER_SATISFIED",
                "message": "ch was deleted; this job needed it to end",
            },
            ["after prep succeeded: met", "after check failed: not yet", "after ch ended: never"],
        ),
        (
            {"status": "PENDING", "message": "Waiting for 2 of 3 jobs: check to fail or stop"},
            ["after prep succeeded: met", "after check failed: not yet", "after ch ended: not yet"],
        ),
    ],
)
async def test_status_says_never_for_the_dependency_a_job_never_ran_for(
    aiohttp_server: AiohttpServer, job: dict[str, Any], said: list[str]
) -> None:
    details = {
        "submission_id": "report",
        "entrypoint": "make report",
        "depends_on": [
            {"submission_id": "prep", "condition": "succeeded", "met": True},
            {"submission_id": "check", "condition": "failed", "met": False},
            {"submission_id": "ch", "condition": "ended", "met": False},
        ],
        **job,
    }
    app = web.Application()

    async def get_job(request: web.Request) -> web.Response:
        return web.json_response(details)

    async def get_deliveries(request: web.Request) -> web.Response:
        return web.json_response({"deliveries": []})

    app.router.add_get("/api/jobs/report", get_job)
    app.router.add_get("/api/jobs/report/deliveries", get_deliveries)
    server = await aiohttp_server(app)
    code, stdout, stderr = await run_cli("status", "report", "--url", url_of(server))
    assert code == 0, stderr
    lines = stdout.decode().splitlines()
    assert [line for line in lines if line.startswith("dependency.")] == [
        f"dependency.{number}:  {text}" for number, text in enumerate(said, start=1)
    ]
