"""Secure by default: tokens, safe binding, TLS, cross-site browsers, hostile input, audit.

What the HTTP layer decides alone runs on the in-memory fake manager (tests/support/fakes.py):
no Ray.
TLS with Ray's own client runs a real server on the session's cluster.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import requests
from pydantic import SecretStr

from jobs_server.app import create_app
from jobs_server.cli import _check_bind
from jobs_server.settings import Settings
from tests.support.api import Client, submit
from tests.support.fakes import FakeJobManager
from tests.support.processes import free_port, stop_process_group
from tests.support.servers import self_signed_certificate, start_jobs_server, wait_for_server

AiohttpClient = Callable[..., Awaitable[Client]]
JOBS_SERVER = str(Path(sys.executable).parent / "jobs-server")
TOKEN = "s3cret-token-for-tests"


@pytest.fixture
async def token_client(
    aiohttp_client: AiohttpClient, fake_settings: Settings, fake: FakeJobManager
) -> Client:
    secured = fake_settings.model_copy(update={"auth_token": SecretStr(TOKEN)})
    return await aiohttp_client(create_app(secured, backend=fake.backend()))


@pytest.mark.parametrize(
    ("headers", "status", "code"),
    [
        ({}, 401, "unauthorized"),
        ({"Authorization": "Bearer wrong"}, 403, "forbidden"),
        ({"Authorization": f"Bearer {TOKEN}x"}, 403, "forbidden"),
        ({"X-Ray-Authorization": "Bearer nope"}, 403, "forbidden"),
        ({"Authorization": "Basic dXNlcjpwYXNz"}, 403, "forbidden"),
    ],
)
async def test_requests_without_the_right_token_are_refused(
    token_client: Client, fake: FakeJobManager, headers: dict[str, str], status: int, code: str
) -> None:
    for method, path in [("GET", "/api/jobs/"), ("POST", "/api/jobs/"), ("GET", "/api/version")]:
        response = await token_client.request(
            method, path, headers=headers, json={"entrypoint": "true"}
        )
        assert response.status == status, (method, path)
        assert (await response.json())["error"]["code"] == code
        if status == 401:
            assert response.headers["WWW-Authenticate"].startswith("Bearer")
    assert (await fake.list_jobs()).records == []
    listed = await token_client.get("/api/jobs/", headers={"Authorization": f"Bearer {TOKEN}"})
    assert await listed.json() == []


@pytest.mark.parametrize(
    "headers",
    [
        {"Authorization": f"Bearer {TOKEN}"},
        {"authorization": f"bearer {TOKEN}"},
        {"X-Ray-Authorization": f"Bearer {TOKEN}"},
        {"X-Ray-Authorization": TOKEN},
    ],
)
async def test_the_right_token_is_accepted_from_either_header(
    token_client: Client, fake: FakeJobManager, headers: dict[str, str]
) -> None:
    job_id = await submit_with(token_client, headers, entrypoint="echo authed")
    fake.write_log(job_id, b"authed\n")
    response = await token_client.get(f"/api/jobs/{job_id}/logs", headers=headers)
    assert response.status == 200
    assert await response.json() == {"logs": "authed\n"}


async def submit_with(client: Client, headers: dict[str, str], **body: Any) -> str:
    response = await client.post("/api/jobs/", json=body, headers=headers)
    assert response.status == 200, await response.text()
    return str((await response.json())["submission_id"])


async def test_healthz_needs_no_token(token_client: Client) -> None:
    response = await token_client.get("/api/healthz")
    assert response.status == 200


async def test_tokens_never_reach_the_log(
    token_client: Client, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    await token_client.get("/api/jobs/", headers={"Authorization": "Bearer guessed-wrong-token"})
    await token_client.get("/api/jobs/", headers={"Authorization": f"Bearer {TOKEN}"})
    assert TOKEN not in caplog.text
    assert "guessed-wrong-token" not in caplog.text


def test_ray_token_is_used_when_the_cluster_uses_tokens(tmp_path: Path) -> None:
    ray_token = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "ray-cluster-token"}
    assert _resolve_in_subprocess(ray_token) == "ray-cluster-token"
    token_file = tmp_path / "token"
    token_file.write_text("from-the-file\n")
    assert (
        _resolve_in_subprocess({"JOBS_SERVER_AUTH_TOKEN_FILE": str(token_file)}) == "from-the-file"
    )
    assert _resolve_in_subprocess({"JOBS_SERVER_AUTH_TOKEN": " from-env "}) == "from-env"
    assert _resolve_in_subprocess({}) == "None"


def _resolve_in_subprocess(extra_env: dict[str, str]) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JOBS_SERVER_")}
    env.pop("RAY_AUTH_MODE", None)
    script = (
        "from jobs_server.access.auth import resolve_auth_token\n"
        "from jobs_server.settings import Settings\n"
        "print(resolve_auth_token(Settings()))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        env={**env, **extra_env},
        capture_output=True,
        text=True,
        check=True,
    )
    return result.stdout.strip()


def test_non_loopback_bind_without_a_token_is_refused() -> None:
    result = subprocess.run(
        [JOBS_SERVER, "serve", "--host", "0.0.0.0"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={k: v for k, v in os.environ.items() if not k.startswith("JOBS_SERVER_")},
    )
    assert result.returncode != 0
    assert "refusing to listen on 0.0.0.0 without a token" in result.stderr


def test_bind_rules(caplog: pytest.LogCaptureFixture) -> None:
    _check_bind(Settings(host="127.0.0.1"), has_token=False)
    _check_bind(Settings(host="::1"), has_token=False)
    _check_bind(Settings(host="10.1.2.3"), has_token=True)
    with pytest.raises(SystemExit):
        _check_bind(Settings(host="10.1.2.3"), has_token=False)
    with pytest.raises(SystemExit):
        _check_bind(Settings(host="example.internal"), has_token=False)
    caplog.set_level(logging.WARNING)
    _check_bind(Settings(host="10.1.2.3", insecure_no_auth=True), has_token=False)
    assert "WITHOUT authentication" in caplog.text


@pytest.fixture
def tls_files(tmp_path: Path) -> tuple[Path, Path]:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    self_signed_certificate(cert, key, name="IP:127.0.0.1")
    return cert, key


def test_tls_and_a_token_with_rays_own_client(
    ray_connection: str, tmp_path: Path, tls_files: tuple[Path, Path]
) -> None:
    cert, key = tls_files
    port = free_port()
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("JOBS_SERVER_")},
        "JOBS_SERVER_AUTH_TOKEN": TOKEN,
        "JOBS_SERVER_PORT": str(port),
        "JOBS_SERVER_RAY_ADDRESS": ray_connection,
        "JOBS_SERVER_LOG_DIR": str(tmp_path / "logs"),
        "JOBS_SERVER_NAMESPACE": "tls_test",
        "JOBS_SERVER_TLS_CERT": str(cert),
        "JOBS_SERVER_TLS_KEY": str(key),
    }
    log_path = tmp_path / "server.log"
    server = start_jobs_server([], log_path, env)
    url = f"https://127.0.0.1:{port}"
    try:
        wait_for_server(url, server, log_path, verify=str(cert))
        with pytest.raises(requests.exceptions.SSLError):
            requests.get(f"{url}/api/healthz", timeout=5)  # an unknown CA is refused
        client_script = (
            "import sys\n"
            "from ray.job_submission import JobSubmissionClient\n"
            "client = JobSubmissionClient(sys.argv[1], verify=sys.argv[2])\n"
            "job = client.submit_job(entrypoint='echo over tls')\n"
            "print(job, [j.submission_id for j in client.list_jobs()])\n"
        )
        client_env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": TOKEN}
        client_env.pop("RAY_ADDRESS", None)

        def run_client(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                [sys.executable, "-c", client_script, url, str(cert)],
                env=env,
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )

        result = run_client(client_env)
        assert result.returncode == 0, result.stderr
        job_id = result.stdout.split()[0]
        assert job_id in result.stdout.split(" ", 1)[1]
        refused = run_client({**client_env, "RAY_AUTH_TOKEN": "not-it"})
        assert refused.returncode != 0
        assert "403" in refused.stderr or "Authentication failed" in refused.stderr
    finally:
        stop_process_group(server)
    from tests.support.ray_nodes import kill_actors_in_namespace

    kill_actors_in_namespace("tls_test")


@pytest.mark.parametrize(
    "headers",
    [
        {"Origin": "https://evil.example"},
        {"Origin": "null"},
        {"Sec-Fetch-Site": "cross-site"},
        {"Sec-Fetch-Site": "same-site"},
        {"Origin": "http://127.0.0.1:1", "Sec-Fetch-Site": "cross-site"},
    ],
)
async def test_cross_site_browsers_cannot_change_anything(
    fake_client: Client, fake: FakeJobManager, headers: dict[str, str]
) -> None:
    job_id = await submit(fake_client, entrypoint="sleep 30")
    for method, path, body in [
        ("POST", "/api/jobs/", {"entrypoint": "echo pwned"}),
        ("POST", f"/api/jobs/{job_id}/stop", None),
        ("DELETE", f"/api/jobs/{job_id}", None),
        ("PUT", "/api/packages/gcs/_ray_pkg_0123456789abcdef.zip", None),
    ]:
        response = await fake_client.request(method, path, json=body, headers=headers)
        assert response.status == 403, (method, path)
        assert (await response.json())["error"]["code"] == "cross_site_request"
    listed = (await fake.list_jobs()).records
    assert [(job.submission_id, job.status) for job in listed] == [(job_id, "PENDING")]
    assert fake.stop_requests == []
    assert fake.packages.kv.values == {}


async def test_same_origin_browser_requests_are_allowed(
    fake_client: Client, fake: FakeJobManager
) -> None:
    origin = f"http://{fake_client.server.host}:{fake_client.server.port}"
    response = await fake_client.post(
        "/api/jobs/",
        json={"entrypoint": "true"},
        headers={"Origin": origin, "Sec-Fetch-Site": "same-origin"},
    )
    assert response.status == 200
    job_id = (await response.json())["submission_id"]
    assert (await fake.get_job(job_id)).spec.entrypoint == "true"


async def test_allowed_origins_get_cors_and_others_do_not(
    aiohttp_client: AiohttpClient, fake_settings: Settings, fake: FakeJobManager
) -> None:
    allowed = "https://ui.example"
    client = await aiohttp_client(
        create_app(
            fake_settings.model_copy(update={"cors_origins": [allowed]}), backend=fake.backend()
        )
    )
    preflight = await client.options(
        "/api/jobs/",
        headers={
            "Origin": allowed,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "Content-Type, Authorization",
        },
    )
    assert preflight.status == 200
    assert preflight.headers["Access-Control-Allow-Origin"] == allowed
    response = await client.post(
        "/api/jobs/",
        json={"entrypoint": "true"},
        headers={"Origin": allowed, "Sec-Fetch-Site": "cross-site"},
    )
    assert response.status == 200
    assert response.headers["Access-Control-Allow-Origin"] == allowed
    assert len((await fake.list_jobs()).records) == 1
    listed = await client.get("/api/jobs/", headers={"Origin": "https://other.example"})
    assert "Access-Control-Allow-Origin" not in listed.headers
    refused = await client.post(
        "/api/jobs/", json={"entrypoint": "true"}, headers={"Origin": "https://other.example"}
    )
    assert refused.status == 403
    assert (await refused.json())["error"]["code"] == "cross_site_request"
    assert "Access-Control-Allow-Origin" not in refused.headers


async def test_audit_lines_for_submit_stop_delete_without_secrets(
    fake_client: Client, fake: FakeJobManager, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="jobs_server.audit")
    job_id = await submit(
        fake_client, entrypoint="echo hi", runtime_env={"env_vars": {"API_KEY": "hunter2"}}
    )
    fake.start(job_id)
    fake.finish(job_id)
    assert (await fake_client.post(f"/api/jobs/{job_id}/stop")).status == 200
    assert (await fake_client.delete(f"/api/jobs/{job_id}")).status == 200
    lines = [r.getMessage() for r in caplog.records if r.name == "jobs_server.audit"]
    assert [line.split()[0] for line in lines] == ["submit", "stop", "delete"]
    assert all(job_id in line and "remote=127.0.0.1" in line for line in lines)
    assert all("authenticated=False" in line for line in lines)
    assert "API_KEY" in lines[0]
    assert "hunter2" not in caplog.text


def _deep(depth: int) -> str:
    return '{"entrypoint": "true", "metadata": ' + "[" * depth + "]" * depth + "}"


def _deep_runtime_env(depth: int) -> str:
    # A shape the models accept at any depth: only the depth limit refuses it.
    return '{"entrypoint": "true", "runtime_env": ' + '{"a": ' * depth + "1" + "}" * depth + "}"


JSON = {"Content-Type": "application/json"}
# (method, path, headers, body, the status and error code it must get)
HOSTILE_REQUESTS: list[tuple[str, str, dict[str, str], bytes, int, str]] = [
    ("POST", "/api/jobs/", JSON, b"{", 400, "invalid_request"),
    ("POST", "/api/jobs/", JSON, b"null", 400, "invalid_request"),
    ("POST", "/api/jobs/", JSON, b"42", 400, "invalid_request"),
    ("POST", "/api/jobs/", JSON, b'"entrypoint"', 400, "invalid_request"),
    ("POST", "/api/jobs/", JSON, b"[]", 400, "invalid_request"),
    ("POST", "/api/jobs/", JSON, b"{}", 400, "invalid_request"),
    ("POST", "/api/jobs/", JSON, b'{"entrypoint": null}', 400, "invalid_request"),
    ("POST", "/api/jobs/", JSON, b'{"entrypoint": ["ls"]}', 400, "invalid_request"),
    ("POST", "/api/jobs/", JSON, b'{"entrypoint": "a\\u0000b"}', 400, "invalid_request"),
    ("POST", "/api/jobs/", JSON, b'{"entrypoint": "  "}', 400, "invalid_request"),
    ("POST", "/api/jobs/", JSON, _deep(200).encode(), 400, "invalid_request"),
    ("POST", "/api/jobs/", JSON, _deep(5000).encode(), 400, "invalid_request"),
    ("POST", "/api/jobs/", JSON, _deep_runtime_env(40).encode(), 400, "invalid_request"),
    ("POST", "/api/jobs/", JSON, b'{"entrypoint": "true", "x": 1}', 400, "invalid_request"),
    (
        "POST",
        "/api/jobs/",
        JSON,
        json.dumps({"entrypoint": "x" * (128 * 1024 + 1)}).encode(),
        400,
        "invalid_request",
    ),
    (
        "POST",
        "/api/jobs/",
        JSON,
        json.dumps({"entrypoint": "true", "metadata": {"k": "v" * 70000}}).encode(),
        400,
        "invalid_request",
    ),
    ("POST", "/api/jobs/", JSON, b"\xff\xfe\xfd", 400, "invalid_request"),
    (
        "POST",
        "/api/jobs/",
        JSON,
        b'{"entrypoint": "true"' + b" " * 2_000_000 + b"}",
        413,
        "payload_too_large",
    ),
    (
        "POST",
        "/api/jobs/",
        {"Content-Type": "text/plain"},
        b'{"entrypoint": "true"}',
        415,
        "unsupported_media_type",
    ),
    (
        "POST",
        "/api/jobs/",
        {"Content-Type": "application/x-www-form-urlencoded"},
        b"entrypoint=id",
        415,
        "unsupported_media_type",
    ),
    (
        "POST",
        "/api/jobs/",
        {"Content-Type": "multipart/form-data; boundary=x"},
        b"--x--",
        415,
        "unsupported_media_type",
    ),
]
for _bad_id in [
    "../../x",
    "..",
    ".",
    "a/b",
    "a\\\\b",
    "a%2Fb",
    "a b",
    "tab\\tid",
    "é",
    "x" * 256,
    "nul\\u0000",
]:
    HOSTILE_REQUESTS.append(
        (
            "POST",
            "/api/jobs/",
            JSON,
            (
                '{"entrypoint": "touch /tmp/jobs-server-pwned", "submission_id": "' + _bad_id + '"}'
            ).encode(),
            400,
            "invalid_request",
        )
    )
for _field, _value, _code in [
    ("entrypoint_num_cpus", "NaN", "invalid_request"),
    ("entrypoint_num_cpus", "Infinity", "invalid_request"),
    ("entrypoint_num_gpus", "-1", "invalid_request"),
    ("entrypoint_memory", "1.5", "invalid_request"),
    ("entrypoint_memory", "-1", "invalid_request"),
    ("entrypoint_resources", '{"x": -1}', "invalid_request"),
    ("entrypoint_resources", '{"x": NaN}', "invalid_request"),
    ("metadata", '{"k": 1}', "invalid_request"),
    ("metadata", '"str"', "invalid_request"),
    ("runtime_env", '{"env_vars": {"A": 1}}', "invalid_runtime_env"),
    ("runtime_env", '{"working_dir": 7}', "invalid_runtime_env"),
    ("runtime_env", "[]", "invalid_request"),
    ("timeout_s", "0", "invalid_request"),
    ("timeout_s", "-5", "invalid_request"),
]:
    HOSTILE_REQUESTS.append(
        (
            "POST",
            "/api/jobs/",
            JSON,
            ('{"entrypoint": "true", "' + _field + '": ' + _value + "}").encode(),
            400,
            _code,
        )
    )
HOSTILE_REQUESTS += [
    # An encoded slash stays in the id, which names no job; dots resolve before routing.
    ("GET", "/api/jobs/..%2F..%2Fetc%2Fpasswd", {}, b"", 404, "job_not_found"),
    ("GET", "/api/jobs/%2e%2e/logs", {}, b"", 404, "not_found"),
    ("GET", "/api/jobs/../../etc/passwd/logs", {}, b"", 404, "not_found"),
    ("DELETE", "/api/jobs/%00", {}, b"", 404, "job_not_found"),
    ("POST", "/api/jobs/x/stop?grace_period_s=nan", {}, b"", 400, "invalid_request"),
    ("GET", "/api/packages/gcs/..%2F..%2Fx.zip", {}, b"", 400, "invalid_request"),
    ("PUT", "/api/packages/gcs/evil.sh", {}, b"#!/bin/sh", 400, "invalid_request"),
    ("PUT", "/api/packages/file/_ray_pkg_0123.zip", {}, b"PK", 400, "invalid_request"),
    ("PATCH", "/api/jobs/", {}, b"", 405, "method_not_allowed"),
    ("TRACE", "/api/jobs/", {}, b"", 405, "method_not_allowed"),
    ("GET", "/api/secrets", {}, b"", 404, "not_found"),
    ("GET", "/" + "a" * 4000, {}, b"", 404, "not_found"),
]


@pytest.mark.parametrize(
    ("method", "path", "headers", "body", "status", "code"),
    HOSTILE_REQUESTS,
    ids=[f"{index}-{request[0]}" for index, request in enumerate(HOSTILE_REQUESTS)],
)
async def test_hostile_requests_get_their_json_4xx_and_change_nothing(
    fake_client: Client,
    fake: FakeJobManager,
    fake_settings: Settings,
    method: str,
    path: str,
    headers: dict[str, str],
    body: bytes,
    status: int,
    code: str,
) -> None:
    outside = fake_settings.log_dir.parent
    before = {path for path in outside.rglob("*") if fake_settings.log_dir not in path.parents}
    response = await fake_client.request(
        method, path, headers=headers, data=body, skip_auto_headers=["Content-Type"]
    )
    assert response.status == status, await response.text()
    assert response.content_type == "application/json"
    error = (await response.json())["error"]
    assert error["code"] == code
    assert error["message"]
    assert (await fake_client.get("/api/healthz")).status == 200
    assert (await fake.list_jobs()).records == []
    assert fake.stop_requests == []
    assert fake.packages.kv.values == {}
    after = {path for path in outside.rglob("*") if fake_settings.log_dir not in path.parents}
    assert after == before
    assert not await asyncio.to_thread(os.path.exists, "/tmp/jobs-server-pwned")


def test_there_are_at_least_forty_hostile_requests() -> None:
    assert len(HOSTILE_REQUESTS) >= 40


async def test_oversized_headers_and_lines_are_refused_by_the_parser(fake_client: Client) -> None:
    # aiohttp's HTTP parser answers these itself, before the application (plain text is fine).
    response = await fake_client.get("/api/jobs/", headers={"X-Huge": "h" * 20000})
    assert response.status == 400
    assert "more than 8190 bytes" in await response.text()
    response = await fake_client.get("/" + "a" * 10000)
    assert response.status == 400
    assert "more than 8190 bytes" in await response.text()
    assert (await fake_client.get("/api/healthz")).status == 200
