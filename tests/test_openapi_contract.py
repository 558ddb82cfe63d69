"""openapi.yaml is the contract: valid, the router's routes exactly, the models' schemas, and what
the server really answers."""

from __future__ import annotations

import base64
import inspect
import io
import secrets
import uuid
import zipfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from aiohttp import WSMsgType
from aiohttp.test_utils import TestClient
from openapi_spec_validator import validate
from pydantic import BaseModel, SecretStr

from jobs_server import api_models
from jobs_server.access.key_digest import digest_of
from jobs_server.app import create_app
from jobs_server.app_state import OUTBOX_KEY
from jobs_server.routes import webhooks
from jobs_server.settings import Settings
from tests.support.api import wait_for_status
from tests.support.fakes import FakeJobManager
from tests.support.openapi_contract import (
    HTTP_METHODS,
    NO_ROUTE_OPERATION,
    Contract,
    Exchange,
    load_spec,
    schema_shape,
    shape_differences,
)

# Body limits small enough that the 413s cost nothing to provoke.
BODY_LIMIT_BYTES = 4096
# Document schemas that are parts of models rather than models of their own.
SHARED_SCHEMAS = {"SubmissionId", "JobStatus", "DependencyCondition", "WebhookEventType"}
# Documented answers the exchange cannot provoke cheaply, with why.
NOT_PROVOKED = {
    "500": "needs a broken cluster or a bug",
    "503": "needs a supervisor or a GCS that does not answer: test_stopping_a_job_whose_node"
    "_does_not... and tests/test_gcs_faults.py; a log in a log directory this server does not"
    " see (log_unavailable): tests/test_log_volume.py checks it against the document",
    "401": "needs a server with a token: test_token_answers_match_the_document",
    "403": "needs a server with a token: test_token_answers_match_the_document",
    "429": "needs uploads in flight or a full queue: tests/test_upload_budget.py and"
    " tests/test_queue.py check it against the document",
    "507": "needs a full disk: tests/test_disk_guard.py checks it against the document",
}
# What answers without a token: the probe, and the web page (it asks for the key itself).
PUBLIC_OPERATIONS = {"healthz", "web_page", "web_asset"}
WEBSOCKET_HANDSHAKE = {
    "Connection": "Upgrade",
    "Upgrade": "websocket",
    "Sec-WebSocket-Version": "13",
    "Sec-WebSocket-Key": base64.b64encode(secrets.token_bytes(16)).decode(),
}


@pytest.fixture
def contract() -> Contract:
    return Contract.load()


@pytest.fixture
def settings(settings: Settings, tmp_path: Path) -> Settings:
    # A secret, so that a job's notify is accepted (and its deliveries listed).
    secret_file = tmp_path / "webhook-secret"
    secret_file.write_text("whsec_" + base64.b64encode(secrets.token_bytes(32)).decode() + "\n")
    return settings.model_copy(
        update={
            "max_request_bytes": BODY_LIMIT_BYTES,
            "max_package_bytes": BODY_LIMIT_BYTES,
            "webhook_secret_file": secret_file,
        }
    )


def test_document_is_valid_openapi() -> None:
    validate(load_spec())


def test_document_lists_exactly_the_routes(tmp_path: Path, contract: Contract) -> None:
    app = create_app(Settings(port=0, state_dir=tmp_path / "state", log_dir=tmp_path / "logs"))
    routed = set()
    for route in app.router.routes():
        if route.method == "HEAD":  # aiohttp adds one to every GET
            continue
        assert route.name, f"{route.method} {route.resource} has no route name"
        assert route.resource is not None
        routed.add((route.method, route.resource.canonical, route.name))
    documented = {(op.method, op.path, op.operation_id) for op in contract.operations.values()}
    assert routed - documented == set(), "routes that openapi.yaml does not document"
    assert documented - routed == set(), "operations in openapi.yaml that no route serves"


# Modules whose public pydantic models are the document's schemas (a route's own models live
# beside it; a leading underscore keeps a query's model out).
MODEL_MODULES = (api_models, webhooks)


def _api_models() -> dict[str, type[BaseModel]]:
    return {
        name: value
        for module in MODEL_MODULES
        for name, value in vars(module).items()
        if inspect.isclass(value)
        and issubclass(value, BaseModel)
        and value.__module__ == module.__name__
        and not name.startswith("_")
    }


def test_document_schemas_are_the_models(contract: Contract) -> None:
    schemas = contract.spec["components"]["schemas"]
    models = _api_models()
    assert set(schemas) - set(models) == SHARED_SCHEMAS
    assert set(models) - set(schemas) == set(), "models that openapi.yaml does not describe"
    for name, model in models.items():
        is_request = name.endswith("Request")
        generated = model.model_json_schema(mode="validation" if is_request else "serialization")
        expected = schema_shape(generated, generated, all_required=not is_request)
        documented = schema_shape(schemas[name], contract.spec)
        differences = shape_differences(documented, expected)
        assert differences == [], f"components/schemas/{name} is not the model {name}"


def _tiny_zip() -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("hello.py", "print('hello')\n")
    return buffer.getvalue()


async def test_responses_match_the_document(
    client: TestClient[Any, Any], contract: Contract
) -> None:
    api = Exchange(client, contract)

    assert (await api.call("GET", "/api/healthz", expect=200))["status"] == "ok"
    assert (await api.call("GET", "/api/version", expect=200))["version"] == "4"
    assert "jobs_server_jobs" in await api.call("GET", "/metrics", expect=200)
    served = await api.call("GET", "/api/openapi.yaml", expect=200)
    assert yaml.safe_load(served) == contract.spec
    await api.call("GET", "/api/jobs/?status=NOPE", expect=400)
    assert "<html" in await api.call("GET", "/", expect=200)
    assert "import" in await api.call("GET", "/ui/app.js", expect=200)
    assert "body" in await api.call("GET", "/ui/style.css", expect=200)
    await api.call("GET", "/ui/nope.js", expect=404)
    await api.call("GET", "/api/jobs/?status=RUNNING&limit=1", expect=200)

    # Submissions the server refuses.
    json_header = {"Content-Type": "application/json"}
    await api.call("POST", "/api/jobs/", data=b"{not json", headers=json_header, expect=400)
    invalid = {"entrypoint": "", "bogus": 1}
    assert contract.request_errors("submit_job", invalid), "the document accepts an invalid body"
    refused = await api.call("POST", "/api/jobs/", json=invalid, expect=400)
    assert refused["error"]["code"] == "invalid_request"
    assert "entrypoint" in refused["error"]["message"]
    await api.call("POST", "/api/jobs/", data={"entrypoint": "true"}, expect=415)
    too_large = {"entrypoint": "x" * BODY_LIMIT_BYTES}
    await api.call("POST", "/api/jobs/", json=too_large, expect=413)

    # One job that finishes, one that runs until it is stopped.
    finishing = {
        "entrypoint": "echo contract-hello",
        "metadata": {"test": "contract"},
        # A name that never answers here: its delivery stays pending, its attempts listed.
        "notify": [{"url": "https://hooks.invalid/contract", "events": ["job.succeeded"]}],
    }
    running = {"entrypoint": "sleep 30", "submission_id": f"contract-{uuid.uuid4().hex[:8]}"}
    for body in (finishing, running):
        assert contract.request_errors("submit_job", body) == []
    finished_id = (await api.call("POST", "/api/jobs/", json=finishing, expect=200))["job_id"]
    running_id = (await api.call("POST", "/api/jobs/", json=running, expect=200))["job_id"]
    duplicate = await api.call("POST", "/api/jobs/", json=running, expect=409)
    assert duplicate["error"]["code"] == "duplicate_submission_id"

    await wait_for_status(client, running_id, {"RUNNING"})
    assert (await api.call("GET", f"/api/jobs/{running_id}", expect=200))["status"] == "RUNNING"
    not_terminal = await api.call("DELETE", f"/api/jobs/{running_id}", expect=409)
    assert not_terminal["error"]["code"] == "job_not_terminal"
    stop_running = f"/api/jobs/{running_id}/stop"
    await api.call("POST", stop_running, params={"grace_period_s": "soon"}, expect=400)
    await api.call("POST", stop_running, data=b"[", headers=json_header, expect=400)
    await api.call("POST", stop_running, data="grace_period_s=1", expect=415)
    await api.call(
        "POST", stop_running, json={"grace_period_s": "9" * BODY_LIMIT_BYTES}, expect=413
    )
    stop_body = {"grace_period_s": 1}
    assert contract.request_errors("stop_job", stop_body) == []
    stopped = await api.call("POST", stop_running, json=stop_body, expect=200)
    assert stopped == {"stopped": True}
    assert (await wait_for_status(client, running_id))["status"] == "STOPPED"

    assert (await wait_for_status(client, finished_id))["status"] == "SUCCEEDED"
    finished = await api.call("GET", f"/api/jobs/{finished_id}", expect=200)
    assert finished["driver_exit_code"] == 0
    deliveries_path = f"/api/jobs/{finished_id}/deliveries"
    deliveries = (await api.call("GET", deliveries_path, expect=200))["deliveries"]
    assert [delivery["event_type"] for delivery in deliveries] == ["job.succeeded"]
    # An endpoint a 410 disabled: listed, enabled once, then not disabled (404).
    gone_hook = "https://gone.invalid/contract"
    await client.server.app[OUTBOX_KEY].disable_webhook_endpoint("default", gone_hook, 1_000)
    disabled = await api.call("GET", "/api/webhooks/disabled", expect=200)
    assert disabled == {
        "endpoints": [{"url": gone_hook, "tenant": "default", "disabled_at": 1_000}]
    }
    await api.call("GET", "/api/webhooks/disabled?tenant=no%20such", expect=400)
    enable, enable_body = "/api/webhooks/enable", {"url": gone_hook}
    assert contract.request_errors("enable_webhook_endpoint", enable_body) == []
    bad_enable = {"url": "", "events": []}
    assert contract.request_errors("enable_webhook_endpoint", bad_enable), "accepts a bad body"
    await api.call("POST", enable, json=bad_enable, expect=400)
    await api.call("POST", enable, data="url=x", expect=415)
    await api.call("POST", enable, json={"url": "x" * BODY_LIMIT_BYTES}, expect=413)
    enabled = await api.call("POST", enable, json=enable_body, expect=200)
    assert enabled == {"enabled": True, "url": gone_hook, "tenant": "default"}
    not_disabled = await api.call("POST", enable, json=enable_body, expect=404)
    assert not_disabled["error"]["code"] == "webhook_endpoint_not_found"
    assert await api.call("GET", "/api/webhooks/disabled", expect=200) == {"endpoints": []}
    listed = await api.call("GET", "/api/jobs/", expect=200)
    assert {job["submission_id"] for job in listed} == {finished_id, running_id}
    newest = await api.call("GET", "/api/jobs/?order=desc&limit=1", expect=200)
    assert [job["submission_id"] for job in newest] == [listed[-1]["submission_id"]]
    dated = await api.call(
        "GET",
        "/api/jobs/?submitted_after=2000-01-01T00:00:00Z&submitted_before=99999999999999",
        expect=200,
    )
    assert len(dated) == 2
    await api.call("GET", "/api/jobs/?metadata.team=nobody", expect=200)
    await api.call("GET", "/api/jobs/?submitted_after=yesterday", expect=400)
    await api.call("GET", "/api/jobs/?order=sideways", expect=400)
    logs = await api.call("GET", f"/api/jobs/{finished_id}/logs", expect=200)
    assert "contract-hello" in logs["logs"]
    job_logs = f"/api/jobs/{finished_id}/logs"
    page = await api.call("GET", f"{job_logs}?offset=0&limit=8", expect=200)
    assert page["offset"] == 0
    assert page["next_offset"] == len(page["logs"].encode())
    text = await api.call("GET", f"{job_logs}?format=text", expect=200)
    assert "contract-hello" in text
    ranged = await api.call(
        "GET", job_logs, headers={"Accept": "text/plain", "Range": "bytes=0-3"}, expect=206
    )
    assert ranged == "cont"
    await api.call("GET", f"{job_logs}?format=text", headers={"Range": "bytes=9999-"}, expect=416)
    await api.call("GET", f"{job_logs}?offset=-1", expect=400)
    followed = await api.call("GET", f"{job_logs}?follow=true", expect=200)
    assert "contract-hello" in followed
    stream = f"/api/jobs/{finished_id}/logs/stream"
    assert "event: end" in await api.call("GET", stream, expect=200)
    await api.call("GET", stream, headers={"Last-Event-ID": "x"}, expect=400)
    finished_stop = await api.call("POST", f"/api/jobs/{finished_id}/stop", expect=200)
    assert finished_stop == {"stopped": False}

    events = await api.call_stream("/api/events?format=ndjson&after=0", lines=3)
    assert [event["type"] for event in events][:1] == ["submitted"]
    sse = await api.call_stream(f"/api/events?after=0&submission_id={finished_id}", lines=3)
    assert sse.startswith("id: ")
    await api.call("GET", "/api/events?status=NOPE", expect=400)

    tail = f"/api/jobs/{finished_id}/logs/tail"
    await api.call("GET", tail, headers=WEBSOCKET_HANDSHAKE, expect=101)
    await api.call("GET", tail, expect=400)
    cross_site = {**WEBSOCKET_HANDSHAKE, "Origin": "https://evil.example"}
    refused_upgrade = await api.call("GET", tail, headers=cross_site, expect=403)
    assert refused_upgrade["error"]["code"] == "cross_site_request"
    async with client.ws_connect(tail) as websocket:
        frames = [message async for message in websocket]
    assert all(frame.type is WSMsgType.TEXT for frame in frames), frames
    assert "contract-hello" in "".join(frame.data for frame in frames)
    assert websocket.close_code == 1000

    for job_id in (finished_id, running_id):
        assert await api.call("DELETE", f"/api/jobs/{job_id}", expect=200) == {"deleted": True}
    gone = f"/api/jobs/{finished_id}"
    await api.call("GET", gone, expect=404)
    await api.call("GET", f"{gone}/logs", expect=404)
    await api.call("GET", f"{gone}/deliveries", expect=404)
    await api.call("GET", f"{gone}/logs/tail", headers=WEBSOCKET_HANDSHAKE, expect=404)
    await api.call("GET", f"{gone}/logs/stream", expect=404)
    await api.call("POST", f"{gone}/stop", expect=404)
    not_found = await api.call("DELETE", gone, expect=404)
    assert not_found["error"]["code"] == "job_not_found"

    # Packages, the way Ray's client uploads a working_dir.
    package_name = f"_ray_pkg_{secrets.token_hex(8)}.zip"
    package = f"/api/packages/gcs/{package_name}"
    assert (await api.call("GET", package, expect=404))["error"]["code"] == "package_not_found"
    tiny_zip = _tiny_zip()
    uploaded = await api.call("PUT", package, data=tiny_zip, expect=200)
    assert uploaded == {"uri": f"gcs://{package_name}"}
    assert await api.call("GET", package, expect=200) == uploaded
    # A package never changes: the same bytes again are accepted, other bytes refused.
    assert await api.call("PUT", package, data=tiny_zip, expect=200) == uploaded
    empty_zip = b"PK\x05\x06" + bytes(18)
    taken = await api.call("PUT", package, data=empty_zip, expect=409)
    assert taken["error"]["code"] == "package_exists"
    await api.call("GET", "/api/packages/gcs/not-a-package.txt", expect=400)
    await api.call("GET", "/api/packages/s3/_ray_pkg_0123456789abcdef.zip", expect=400)
    other_package = f"/api/packages/gcs/_ray_pkg_{secrets.token_hex(8)}.zip"
    await api.call("PUT", "/api/packages/gcs/not-a-package.txt", data=b"x", expect=400)
    await api.call("PUT", other_package, data=b"not a zip", expect=400)
    await api.call("PUT", other_package, data=b"\0" * (BODY_LIMIT_BYTES + 1), expect=413)
    await api.call("GET", other_package, expect=404)

    # Requests no route serves.
    assert (await api.call("GET", "/api/job", expect=404))["error"]["code"] == "not_found"
    for template in contract.spec["paths"]:
        path = template.format(
            job_id="any", protocol="gcs", package_name="any.zip", file_name="app.js"
        )
        await api.call("PATCH", path, expect=405)
        # A name this server does not answer to (DNS rebinding): every operation refuses it.
        for method in set(contract.spec["paths"][template]) & {"get", "post", "put", "delete"}:
            rebound = await api.call(
                method.upper(), path, headers={"Host": "evil.example:8266"}, expect=400
            )
            assert rebound["error"]["code"] == "host_not_allowed"

    unprovoked = {
        (operation, status)
        for operation, status in contract.documented_statuses() - contract.exercised
        if status not in NOT_PROVOKED
    }
    assert unprovoked == set(), "documented answers this test never produced"
    assert (NO_ROUTE_OPERATION, "404") in contract.exercised


async def test_token_answers_match_the_document(
    aiohttp_client: Callable[..., Awaitable[TestClient[Any, Any]]],
    fake_settings: Settings,
    fake: FakeJobManager,
    contract: Contract,
) -> None:
    """On a server with a token, every operation but the probe and the web page answers 401
    without it and 403 with a wrong one, as documented; a cross-site browser gets 403 too. (No
    request gets past the token, so the app runs on the fake manager: no Ray.)"""
    secured = fake_settings.model_copy(update={"auth_token": SecretStr("contract-token")})
    api = Exchange(await aiohttp_client(create_app(secured, backend=fake.backend())), contract)
    for template, path_item in contract.spec["paths"].items():
        path = template.format(
            job_id="any", protocol="gcs", package_name="_ray_pkg_00ff.zip", file_name="app.js"
        )
        for method in HTTP_METHODS:
            if method not in path_item:
                continue
            if path_item[method]["operationId"] in PUBLIC_OPERATIONS:
                await api.call("GET", path, expect=200)
                continue
            missing = await api.call(method.upper(), path, expect=401)
            assert missing["error"]["code"] == "unauthorized"
            wrong = await api.call(
                method.upper(), path, headers={"Authorization": "Bearer nope"}, expect=403
            )
            assert wrong["error"]["code"] == "forbidden"
    cross_site = await api.call(
        "POST",
        "/api/jobs/",
        json={"entrypoint": "true"},
        headers={"Authorization": "Bearer contract-token", "Origin": "https://evil.example"},
        expect=403,
    )
    assert cross_site["error"]["code"] == "cross_site_request"
    operations = {
        path_item[method]["operationId"]
        for path_item in contract.spec["paths"].values()
        for method in HTTP_METHODS
        if method in path_item
    } - PUBLIC_OPERATIONS
    assert {(operation, "401") for operation in operations} <= contract.exercised
    assert {(operation, "403") for operation in operations} <= contract.exercised


async def test_read_key_answers_match_the_document(
    aiohttp_client: Callable[..., Awaitable[TestClient[Any, Any]]],
    fake_settings: Settings,
    fake: FakeJobManager,
    contract: Contract,
    tmp_path: Path,
) -> None:
    """With a tokens file, a `read` key gets 403 `permission_denied` for every operation that
    changes something, as documented, and nothing is recorded."""
    read_key = secrets.token_urlsafe(32)
    tokens_file = tmp_path / "tokens.toml"
    tokens_file.write_text(
        f'[[keys]]\ndigest = "{digest_of(read_key)}"\ntenant = "team-a"\nrole = "read"\n'
    )
    with_keys = fake_settings.model_copy(update={"tokens_file": tokens_file})
    api = Exchange(await aiohttp_client(create_app(with_keys, backend=fake.backend())), contract)
    changing = set()
    for template, path_item in contract.spec["paths"].items():
        path = template.format(
            job_id="any", protocol="gcs", package_name="_ray_pkg_00ff.zip", file_name="app.js"
        )
        for method in ("post", "put", "delete"):
            if method in path_item:
                refused = await api.call(
                    method.upper(),
                    path,
                    json={"entrypoint": "true"},
                    headers={"Authorization": f"Bearer {read_key}"},
                    expect=403,
                )
                assert refused["error"]["code"] == "permission_denied"
                changing.add(path_item[method]["operationId"])
    assert changing == {
        "submit_job",
        "stop_job",
        "delete_job",
        "upload_package",
        "enable_webhook_endpoint",
    }
    assert (await fake.list_jobs()).records == []
