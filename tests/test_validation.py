"""What the API refuses before any job runs: bodies, queries, unknown jobs and routes. On an app
whose manager is the in-memory fake (tests/support/fakes.py): no Ray, so these tables cost
milliseconds."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from jobs_server import app as app_module
from jobs_server.app import create_app
from jobs_server.settings import Settings
from tests.support.api import Client, submit
from tests.support.fakes import FakeJobManager


async def test_an_app_with_a_backend_never_joins_ray(
    monkeypatch: pytest.MonkeyPatch, aiohttp_client: Any, fake_settings: Settings
) -> None:
    def no_ray(*args: object, **kwargs: object) -> None:
        raise AssertionError("an app with a backend joined Ray")

    monkeypatch.setattr(app_module, "connect_to_ray", no_ray)
    monkeypatch.setattr(app_module, "read_cluster_info", no_ray)
    fake = FakeJobManager(fake_settings.log_dir, max_package_bytes=1024)
    client = await aiohttp_client(create_app(fake_settings, backend=fake.backend()))
    job_id = await submit(client, entrypoint="true")
    assert [record.submission_id for record in (await fake.list_jobs()).records] == [job_id]
    version = await (await client.get("/api/version")).json()
    assert version["session_name"] == "session_fake"


async def test_healthz_answers_ok(fake_client: Client) -> None:
    response = await fake_client.get("/api/healthz")
    assert response.status == 200
    assert (await response.json())["status"] == "ok"


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/api/jobs/no-such-job"),
        ("GET", "/api/jobs/no-such-job/logs"),
        ("GET", "/api/jobs/no-such-job/logs?format=text"),
        ("GET", "/api/jobs/no-such-job/logs?offset=0&limit=5"),
        ("GET", "/api/jobs/no-such-job/logs/tail"),
        ("GET", "/api/jobs/no-such-job/logs/stream"),
        ("POST", "/api/jobs/no-such-job/stop"),
        ("DELETE", "/api/jobs/no-such-job"),
    ],
)
async def test_unknown_job_is_404_json(fake_client: Client, method: str, path: str) -> None:
    response = await fake_client.request(method, path)
    assert response.status == 404
    assert response.content_type == "application/json"
    assert await response.json() == {
        "error": {"code": "job_not_found", "message": "Job no-such-job does not exist"}
    }


@pytest.mark.parametrize(
    ("body", "code", "field"),
    [
        ({}, "invalid_request", "entrypoint"),
        ({"entrypoint": ""}, "invalid_request", "entrypoint"),
        ({"entrypoint": 42}, "invalid_request", "entrypoint"),
        ({"entrypoint": "a\x00b"}, "invalid_request", "entrypoint"),
        ({"entrypoint": "true", "surprise": 1}, "invalid_request", "surprise"),
        (
            {"entrypoint": "true", "submission_id": "../../etc/x"},
            "invalid_request",
            "submission_id",
        ),
        ({"entrypoint": "true", "submission_id": ".."}, "invalid_request", "submission_id"),
        ({"entrypoint": "true", "submission_id": "a b"}, "invalid_request", "submission_id"),
        ({"entrypoint": "true", "metadata": {"k": 1}}, "invalid_request", "metadata"),
        ({"entrypoint": "true", "runtime_env": "nope"}, "invalid_request", "runtime_env"),
        (
            {"entrypoint": "true", "entrypoint_num_cpus": -1},
            "invalid_request",
            "entrypoint_num_cpus",
        ),
        (
            {"entrypoint": "true", "entrypoint_num_gpus": "lots"},
            "invalid_request",
            "entrypoint_num_gpus",
        ),
        ({"entrypoint": "true", "entrypoint_memory": -5}, "invalid_request", "entrypoint_memory"),
        (
            {"entrypoint": "true", "entrypoint_resources": {"x": -1}},
            "invalid_request",
            "entrypoint_resources",
        ),
        ({"entrypoint": "true", "priority": 1001}, "invalid_request", "priority"),
        ({"entrypoint": "true", "priority": -1001}, "invalid_request", "priority"),
        ({"entrypoint": "true", "priority": 1.5}, "invalid_request", "priority"),
        ({"entrypoint": "true", "priority": "1"}, "invalid_request", "priority"),
        ({"entrypoint": "true", "priority": True}, "invalid_request", "priority"),
        ({"entrypoint": "true", "priority": None}, "invalid_request", "priority"),
        (
            {"entrypoint": "true", "runtime_env": {"env_vars": {"A": 1}}},
            "invalid_runtime_env",
            "env_vars",
        ),
        (
            {"entrypoint": "true", "runtime_env": {"working_dir": 5}},
            "invalid_runtime_env",
            "working_dir",
        ),
        (
            {"entrypoint": "true", "runtime_env": {"working_dir": "gcs://_ray_pkg_00ff.zip"}},
            "invalid_runtime_env",
            "never uploaded",
        ),
    ],
)
async def test_invalid_submit_is_400_naming_the_field_and_creates_nothing(
    fake_client: Client, fake: FakeJobManager, body: dict[str, Any], code: str, field: str
) -> None:
    response = await fake_client.post("/api/jobs/", json=body)
    assert response.status == 400
    error = (await response.json())["error"]
    assert error["code"] == code
    assert field in error["message"]
    assert (await fake.list_jobs()).records == []


async def test_a_valid_submit_reaches_the_manager_as_sent(
    fake_client: Client, fake: FakeJobManager
) -> None:
    body = {
        "entrypoint": "echo hi",
        "submission_id": "valid-1",
        "runtime_env": {"env_vars": {"A": "1"}},
        "metadata": {"owner": "me"},
        "entrypoint_num_cpus": 0.5,
        "entrypoint_memory": 1024,
        "entrypoint_resources": {"custom": 1},
        "timeout_s": 30,
        "priority": -7,
        "max_retries": 2,
        "retry_on_exit_codes": [1, 3],
    }
    assert await submit(fake_client, **body) == "valid-1"
    spec = (await fake.get_job("valid-1")).spec
    assert spec.model_dump(include=set(body)) == {
        **body,
        "entrypoint_resources": {"custom": 1.0},
        "timeout_s": 30.0,
        "retry_on_exit_codes": (1, 3),
    }
    job = await (await fake_client.get("/api/jobs/valid-1")).json()
    assert (job["status"], job["message"]) == ("PENDING", "Job is pending.")


async def test_duplicate_submission_id_is_409(fake_client: Client, fake: FakeJobManager) -> None:
    await submit(fake_client, entrypoint="echo first", submission_id="dup-1")
    response = await fake_client.post(
        "/api/jobs/", json={"entrypoint": "echo second", "submission_id": "dup-1"}
    )
    assert response.status == 409
    assert (await response.json())["error"]["code"] == "duplicate_submission_id"
    assert (await fake.get_job("dup-1")).spec.entrypoint == "echo first"


@pytest.mark.parametrize(
    ("data", "headers", "status", "code"),
    [
        (b"{not json", {"Content-Type": "application/json"}, 400, "invalid_request"),
        (b'["a list"]', {"Content-Type": "application/json"}, 400, "invalid_request"),
        (b"", {"Content-Type": "application/json"}, 400, "invalid_request"),
        (b"\xff\xfe", {"Content-Type": "application/json"}, 400, "invalid_request"),
        (
            b"entrypoint=ls",
            {"Content-Type": "application/x-www-form-urlencoded"},
            415,
            "unsupported_media_type",
        ),
        (b'{"entrypoint": "ls"}', {"Content-Type": "text/plain"}, 415, "unsupported_media_type"),
    ],
)
async def test_malformed_body_is_rejected_with_json(
    fake_client: Client,
    fake: FakeJobManager,
    data: bytes,
    headers: dict[str, str],
    status: int,
    code: str,
) -> None:
    response = await fake_client.post("/api/jobs/", data=data, headers=headers)
    assert response.status == status
    error = (await response.json())["error"]
    assert error["code"] == code
    assert error["message"]
    assert (await fake.list_jobs()).records == []


async def test_body_over_the_limit_is_413(
    fake_client: Client, fake_settings: Settings, fake: FakeJobManager
) -> None:
    huge = {"entrypoint": "x" * (fake_settings.max_request_bytes + 1)}
    response = await fake_client.post("/api/jobs/", json=huge)
    assert response.status == 413
    assert (await response.json())["error"]["code"] == "payload_too_large"
    assert (await fake.list_jobs()).records == []


async def _chunked(body: bytes) -> AsyncIterator[bytes]:
    """A body sent without Content-Length (Transfer-Encoding: chunked), in pieces."""
    for start in range(0, len(body), 4096):
        yield body[start : start + 4096]


async def test_chunked_body_is_read_and_held_to_the_limit(
    fake_client: Client, fake_settings: Settings, fake: FakeJobManager
) -> None:
    headers = {"Content-Type": "application/json"}
    fine = json.dumps({"entrypoint": "echo chunked"}).encode()
    response = await fake_client.post("/api/jobs/", data=_chunked(fine), headers=headers)
    assert response.status == 200, await response.text()
    assert [r.spec.entrypoint for r in (await fake.list_jobs()).records] == ["echo chunked"]

    huge = json.dumps({"entrypoint": "x" * fake_settings.max_request_bytes}).encode()
    response = await fake_client.post("/api/jobs/", data=_chunked(huge), headers=headers)
    assert response.status == 413
    assert (await response.json())["error"]["code"] == "payload_too_large"
    assert len((await fake.list_jobs()).records) == 1


async def test_unknown_route_and_method_are_json(fake_client: Client) -> None:
    response = await fake_client.get("/api/nothing-here")
    assert response.status == 404
    assert (await response.json())["error"]["code"] == "not_found"
    response = await fake_client.put("/api/jobs/")
    assert response.status == 405
    assert (await response.json())["error"]["code"] == "method_not_allowed"
    assert "POST" in response.headers["Allow"]


async def test_stop_with_invalid_grace_period_is_400(
    fake_client: Client, fake: FakeJobManager
) -> None:
    job_id = await submit(fake_client, entrypoint="true")
    for query in ("nan", "-1", "soon", "inf"):
        response = await fake_client.post(f"/api/jobs/{job_id}/stop?grace_period_s={query}")
        assert response.status == 400, query
        error = (await response.json())["error"]
        assert error["code"] == "invalid_request"
        assert "grace_period_s" in error["message"]
    for body in ({"grace_period_s": -1}, {"grace_period_s": "1"}, {"grace": 1}):
        response = await fake_client.post(f"/api/jobs/{job_id}/stop", json=body)
        assert response.status == 400, body
        assert (await response.json())["error"]["code"] == "invalid_request"
    assert fake.stop_requests == []
    response = await fake_client.post(f"/api/jobs/{job_id}/stop?grace_period_s=2.5")
    assert await response.json() == {"stopped": True}
    response = await fake_client.post(
        f"/api/jobs/{job_id}/stop?grace_period_s=9", json={"grace_period_s": 0}
    )
    assert await response.json() == {"stopped": False}
    # The body's grace period wins over the query's.
    assert fake.stop_requests == [(job_id, 2.5), (job_id, 0)]


@pytest.mark.parametrize(
    "query",
    ["status=DONE", "status=", "limit=0", "limit=x", "after=no-such-job", "after=../x", "x=1"],
)
async def test_invalid_list_query_is_400(fake_client: Client, query: str) -> None:
    await submit(fake_client, entrypoint="true")
    response = await fake_client.get(f"/api/jobs/?{query}")
    assert response.status == 400
    error = (await response.json())["error"]
    assert error["code"] == "invalid_request"
    assert query.split("=")[0] in error["message"]


@pytest.mark.parametrize(
    "query", ["offset=-1", "limit=0", "limit=abc", "format=xml", "follow=maybe", "nope=1"]
)
async def test_invalid_log_query_is_400(
    fake_client: Client, fake: FakeJobManager, query: str
) -> None:
    job_id = await submit(fake_client, entrypoint="true")
    fake.start(job_id)
    fake.write_log(job_id, b"hello\n")
    fake.finish(job_id)
    response = await fake_client.get(f"/api/jobs/{job_id}/logs?{query}")
    assert response.status == 400
    error = (await response.json())["error"]
    assert error["code"] == "invalid_request"
    assert query.split("=")[0] in error["message"]
