"""Shutdown of a real `jobs-server serve` process, and what its jobs inherit from it."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.support.api import job_logs, submit, wait_for_status
from tests.support.processes import stop_process_group
from tests.support.ray_nodes import start_ray_node
from tests.support.servers import wait_for_server
from tests.support.shutdown import EXIT_MARGIN_S, SHUTDOWN_TIMEOUT_S, Server

# Among the longest modules: started first when tests run in parallel (tests/conftest.py).
pytestmark = pytest.mark.slow

# The embedded Ray instance's own address: no other test's cluster is on it.
EMBEDDED_NODE_IP = "127.0.0.41"
SECRET_TOKEN = f"token-{uuid.uuid4().hex}"
SECRET_FILE_TOKEN = f"file-token-{uuid.uuid4().hex}"
SECRET_NODE_IP = "127.0.0.42"
SECRET_NODE_RESOURCE = "node_with_the_token"


@pytest.fixture
async def joined_server(ray_connection: str, tmp_path: Path) -> AsyncIterator[Server]:
    server = Server(tmp_path, ["--ray-address", ray_connection, "--stop-grace-s", "1"])
    try:
        await asyncio.to_thread(wait_for_server, server.url, server.process, server.log_path)
        yield server
    finally:
        server.stop()


@pytest.mark.parametrize(
    "signal_number", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"]
)
async def test_sigterm_and_sigint_exit_cleanly(joined_server: Server, signal_number: int) -> None:
    code = await joined_server.exit_code_after(signal_number, SHUTDOWN_TIMEOUT_S + EXIT_MARGIN_S)
    output = joined_server.output()
    assert code == 0, output
    assert "SIGTERM received" not in output
    assert "Traceback" not in output


@pytest.mark.parametrize(
    "signal_number", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"]
)
async def test_followers_are_ended_at_shutdown(joined_server: Server, signal_number: int) -> None:
    async with aiohttp.ClientSession(joined_server.url) as http:
        job_id = await submit(http, entrypoint="echo ready; sleep 300")
        await wait_for_status(http, job_id, {"RUNNING"})
        websocket = await http.ws_connect(f"/api/jobs/{job_id}/logs/tail")
        assert (await websocket.receive_str(timeout=30)).startswith("ready")
        async with http.get(f"/api/jobs/{job_id}/logs/stream") as sse:
            assert b"ready" in await sse.content.readuntil(b"\r\n\r\n")
            started_s = time.monotonic()
            exit_code = asyncio.create_task(
                joined_server.exit_code_after(signal_number, SHUTDOWN_TIMEOUT_S + EXIT_MARGIN_S)
            )
            closing = await websocket.receive(timeout=SHUTDOWN_TIMEOUT_S + EXIT_MARGIN_S)
            assert closing.type is aiohttp.WSMsgType.CLOSE, closing
            assert closing.data == aiohttp.WSCloseCode.GOING_AWAY
            # The SSE stream ends (it is not cut): reading it to its end raises nothing.
            rest = await asyncio.wait_for(sse.content.read(), SHUTDOWN_TIMEOUT_S + EXIT_MARGIN_S)
            assert b"event: end" not in rest  # the job has not ended; a reconnect resumes it
        await websocket.close()
        assert await exit_code == 0, joined_server.output()
    # Well within the shutdown timeout: the streams ended at once, nothing waited for them.
    assert time.monotonic() - started_s < SHUTDOWN_TIMEOUT_S + EXIT_MARGIN_S
    assert "Traceback" not in joined_server.output()


@pytest.fixture
def node_with_the_token(ray_connection: str) -> Iterator[None]:
    """A worker node of the test cluster started from an environment that holds the server's
    token (as when `ray start` and `jobs-server serve` share a shell or an EnvironmentFile);
    only it has the `SECRET_NODE_RESOURCE`."""
    # Short: Ray's socket paths under it must fit in 107 bytes.
    temp_dir = Path(tempfile.mkdtemp(prefix="jss", dir="/tmp"))
    (temp_dir / "tmp").mkdir()
    node = start_ray_node(
        [
            f"--address={ray_connection}",
            "--num-cpus=1",
            f"--resources={json.dumps({SECRET_NODE_RESOURCE: 1})}",
            f"--temp-dir={temp_dir}",
        ],
        SECRET_NODE_IP,
        temp_dir / "node.log",
        env={**os.environ, "JOBS_SERVER_AUTH_TOKEN": SECRET_TOKEN, "TMPDIR": str(temp_dir / "tmp")},
    )
    try:
        node.wait_until_started()
        yield
    finally:
        stop_process_group(node.process, timeout_s=5)
        shutil.rmtree(temp_dir, ignore_errors=True)


# The environment of the Ray worker that started the job: the nearest ancestor that is not the
# job's (in a PID namespace `$PPID` is the namespace's init; /proc/self is the node's view).
PRINT_RAY_WORKER_ENVIRONMENT = """
pid = int(open("/proc/self/stat").read().split()[0])
while True:
    pid = int(open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()[1])
    environ = open(f"/proc/{pid}/environ", "rb").read()
    if b"JOBS_SERVER_SUBMISSION_ID=" not in environ:
        print(environ.replace(bytes(1), bytes([10])).decode())
        break
"""


@pytest.mark.parametrize(
    ("mode", "secret_source"),
    [("embedded", "env"), ("joined", "env"), ("joined", "file"), ("joined", "node env")],
)
async def test_a_job_inherits_none_of_the_servers_secrets(
    request: pytest.FixtureRequest,
    ray_connection: str,
    tmp_path: Path,
    mode: str,
    secret_source: str,
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(SECRET_FILE_TOKEN + "\n")
    token = SECRET_TOKEN if secret_source == "env" else SECRET_FILE_TOKEN
    env = {"JOBS_SERVER_AUTH_TOKEN_FILE": str(token_file)}
    if secret_source == "env":
        env["JOBS_SERVER_AUTH_TOKEN"] = SECRET_TOKEN
    if mode == "embedded":
        args = ["--ray-address", "local", "--embedded-ray-node-ip", EMBEDDED_NODE_IP]
    else:
        args = ["--ray-address", ray_connection]
    job_resources: dict[str, Any] = {}
    if secret_source == "node env":
        request.getfixturevalue("node_with_the_token")
        job_resources = {"entrypoint_resources": {SECRET_NODE_RESOURCE: 1}}
    server = Server(tmp_path, args, env=env)
    try:
        await asyncio.to_thread(wait_for_server, server.url, server.process, server.log_path, 120)
        headers = {"Authorization": f"Bearer {token}"}
        async with aiohttp.ClientSession(server.url, headers=headers) as http:
            # The job's own environment, and that of the process that started it (a Ray worker).
            job_id = await submit(
                http,
                entrypoint=f"env; echo ---; python -c '{PRINT_RAY_WORKER_ENVIRONMENT}'",
                **job_resources,
            )
            job = await wait_for_status(http, job_id, timeout_s=120)
            logs = await job_logs(http, job_id)
        assert job["status"] == "SUCCEEDED", logs
        job_env, _, ray_worker_env = logs.partition("---\n")
        assert "RAY_ADDRESS=" in job_env
        assert "PATH=" in ray_worker_env
        for secret in (SECRET_TOKEN, SECRET_FILE_TOKEN):
            assert secret not in job_env
            # Nor did the server hand its secrets to Ray's processes (a node started with the
            # token in its environment has it, but passes it to no job).
            if secret_source != "node env":
                assert secret not in ray_worker_env
        assert await server.exit_code_after(signal.SIGTERM, 60) == 0, server.output()
    finally:
        server.stop()
