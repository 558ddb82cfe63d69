"""Runtime envs from anywhere: uploads through the server, HTTP(S) archives and S3, and every way
one can fail. Real servers on loopback: an HTTP server and an S3-compatible one (moto), whose
endpoint and credentials reach Ray's runtime-env agent through the cluster's AWS variables."""

from __future__ import annotations

import asyncio
import functools
import http.server
import io
import json
import os
import secrets
import subprocess
import sys
import threading
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
from ray.job_submission import JobStatus, JobSubmissionClient

from jobs_server.app import create_app
from jobs_server.manager.runtime_env_failures import describe_setup_failure
from jobs_server.settings import Settings
from tests.support.api import Client, job_logs, submit, wait_for_status
from tests.support.processes import free_port, wait_until
from tests.support.ray_nodes import S3_CREDENTIALS

# Installs packages (pip, virtualenvs) and serves archives: one of the long modules.
pytestmark = pytest.mark.slow

RAY_CLI = str(Path(sys.executable).parent / "ray")
# Ray's agent retries a failed setup 3 times a second apart (the suite's cluster: once, conftest);
# the issue allows a minute.
FAILURE_DEADLINE_S = 60
SUCCESS_DEADLINE_S = 120

# The job: runs a file of its working dir, imports a module of its py_modules, and a Ray task it
# starts finds both too.
MAIN_PY = """\
import ray
import greeting

print("working_dir:", open("data.txt").read().strip())
print("py_modules:", greeting.WHO)


@ray.remote
def in_a_task():
    import greeting

    return greeting.WHO + " / " + open("data.txt").read().strip()


ray.init(logging_level="ERROR", log_to_driver=False)
print("task:", ray.get(in_a_task.remote()))
"""
EXPECTED_LOG = "working_dir: {data}\npy_modules: {who}\ntask: {who} / {data}\n"


def job_output(logs: str) -> str:
    """The job's own lines: a Ray driver also prints the shared cluster's autoscaler events
    (other tests ask for resources no node has)."""
    return "".join(
        line
        for line in logs.splitlines(keepends=True)
        if line.startswith(("working_dir: ", "py_modules: ", "task: "))
    )


def zip_bytes(files: dict[str, str]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name, text in files.items():
            archive.writestr(name, text)
    return buffer.getvalue()


def project_files(data: str, top: str = "") -> dict[str, str]:
    return {f"{top}main.py": MAIN_PY, f"{top}data.txt": data + "\n"}


def module_files(who: str, top: str = "") -> dict[str, str]:
    return {f"{top}greeting/__init__.py": f"WHO = {who!r}\n"}


# Remote archives hold one top-level directory, which Ray's agent strips, as GitHub's do.
def remote_project(data: str) -> bytes:
    return zip_bytes(project_files(data, top="project/"))


def remote_modules(who: str) -> bytes:
    return zip_bytes(module_files(who, top="modules/"))


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def archive_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """An HTTP server on a loopback port serving archives, as an https:// host would."""
    root = tmp_path_factory.mktemp("www")
    (root / "project.zip").write_bytes(remote_project("from https"))
    (root / "modules.zip").write_bytes(remote_modules("https module"))
    (root / "not-a-zip.zip").write_bytes(b"<html>this is a login page, not an archive</html>")
    handler = functools.partial(_QuietHandler, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@pytest.fixture(scope="module")
def s3_bucket(s3_endpoint: str) -> str:
    """A bucket on the test's S3 server holding a project and a module archive."""
    s3 = boto3.client(
        "s3",
        endpoint_url=s3_endpoint,
        aws_access_key_id=S3_CREDENTIALS["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=S3_CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        region_name=S3_CREDENTIALS["AWS_DEFAULT_REGION"],
    )
    bucket = f"code-{secrets.token_hex(4)}"
    s3.create_bucket(Bucket=bucket)
    s3.put_object(Bucket=bucket, Key="jobs/project.zip", Body=remote_project("from s3"))
    s3.put_object(Bucket=bucket, Key="jobs/modules.zip", Body=remote_modules("s3 module"))
    return bucket


def closed_port() -> int:
    """A loopback port nothing listens on: connecting to it is refused."""
    return free_port()


async def run_to_end(client: Client, runtime_env: dict[str, Any], deadline_s: float) -> Any:
    job_id = await submit(client, entrypoint="python main.py", runtime_env=runtime_env)
    return await wait_for_status(client, job_id, timeout_s=deadline_s)


@pytest.mark.parametrize("source", ["https", "s3"])
async def test_working_dir_and_py_modules_from_remote_archives(
    client: Client, archive_url: str, s3_bucket: str, source: str
) -> None:
    base = {"https": archive_url, "s3": f"s3://{s3_bucket}/jobs"}[source]
    job = await run_to_end(
        client,
        {"working_dir": f"{base}/project.zip", "py_modules": [f"{base}/modules.zip"]},
        SUCCESS_DEADLINE_S,
    )
    logs = await job_logs(client, job["submission_id"])
    assert job["status"] == "SUCCEEDED", (job, logs)
    assert job_output(logs) == EXPECTED_LOG.format(data=f"from {source}", who=f"{source} module")


async def test_uploaded_packages_are_checked_kept_and_reused(client: Client) -> None:
    """Uploaded the way Ray's client does, used by one job, still there for the next."""
    project = zip_bytes(project_files("uploaded"))
    modules = zip_bytes(module_files("uploaded module"))
    project_uri = f"gcs://_ray_pkg_{secrets.token_hex(20)}.zip"
    modules_uri = f"gcs://_ray_pkg_{secrets.token_hex(20)}.zip"
    for uri, data in ((project_uri, project), (modules_uri, modules)):
        path = "/api/packages/gcs/" + uri.removeprefix("gcs://")
        assert (await client.get(path)).status == 404
        response = await client.put(path, data=data)
        assert response.status == 200, await response.text()
        assert await response.json() == {"uri": uri}

    runtime_env = {"working_dir": project_uri, "py_modules": [modules_uri]}
    for _ in range(2):
        job = await run_to_end(client, runtime_env, SUCCESS_DEADLINE_S)
        logs = await job_logs(client, job["submission_id"])
        assert job["status"] == "SUCCEEDED", (job, logs)
        assert job_output(logs) == EXPECTED_LOG.format(data="uploaded", who="uploaded module")
        # The job has ended and its supervisor is gone: the packages stay for the next job.
        for uri in (project_uri, modules_uri):
            path = "/api/packages/gcs/" + uri.removeprefix("gcs://")
            assert (await client.get(path)).status == 200


def _truncated_zip() -> bytes:
    whole = zip_bytes(project_files("cut short"))
    return whole[: len(whole) // 2]


@pytest.mark.parametrize(
    ("name", "data", "status", "code", "says"),
    [
        ("_ray_pkg_0badc0de.zip", b"just some text", 400, "invalid_package", "not a zip"),
        ("_ray_pkg_0badc0df.zip", _truncated_zip(), 400, "invalid_package", "not a zip"),
        ("tool-1.0-py3-none-any.whl", b"MZ\x90\x00 not a wheel", 400, "invalid_package", "zip"),
        ("_ray_pkg_0badc0e1.zip", b"PK" + b"\0" * 4096, 413, "payload_too_large", "limit"),
        ("project.zip", zip_bytes({"a": "b"}), 400, "invalid_request", "_ray_pkg_"),
        ("_ray_pkg_XYZ.zip", zip_bytes({"a": "b"}), 400, "invalid_request", "_ray_pkg_"),
        ("_ray_pkg_0123.tar", zip_bytes({"a": "b"}), 400, "invalid_request", "_ray_pkg_"),
    ],
)
async def test_rejected_uploads_store_nothing(
    aiohttp_client: Any,
    settings: Settings,
    name: str,
    data: bytes,
    status: int,
    code: str,
    says: str,
) -> None:
    client = await aiohttp_client(
        create_app(settings.model_copy(update={"max_package_bytes": 2048}))
    )
    response = await client.put(f"/api/packages/gcs/{name}", data=data)
    error = (await response.json())["error"]
    assert (response.status, error["code"]) == (status, code), error
    assert says in error["message"]
    after = await client.get(f"/api/packages/gcs/{name}")
    assert after.status in {400, 404}
    if after.status == 404:
        assert (await after.json())["error"]["code"] == "package_not_found"


async def test_upload_cut_off_half_way_stores_nothing(client: Client) -> None:
    """A client that goes away mid-body: the package does not exist, not even in part."""
    name = f"_ray_pkg_{secrets.token_hex(20)}.zip"
    data = zip_bytes({f"file{index}.txt": secrets.token_hex(4096) for index in range(8)})
    assert client.server.host is not None
    assert client.server.port is not None
    _reader, writer = await asyncio.open_connection(client.server.host, client.server.port)
    writer.write(
        (
            f"PUT /api/packages/gcs/{name} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Content-Length: {len(data)}\r\n\r\n"
        ).encode()
        + data[: len(data) // 2]
    )
    await writer.drain()
    assert (await client.get(f"/api/packages/gcs/{name}")).status == 404
    writer.transport.abort()

    async def upload_attempt_ended() -> bool:
        metrics = await (await client.get("/metrics")).text()
        return 'route="upload_package"' in metrics

    for _ in range(200):
        if await upload_attempt_ended():
            break
        await asyncio.sleep(0.05)
    assert await upload_attempt_ended()
    response = await client.get(f"/api/packages/gcs/{name}")
    assert response.status == 404
    # The same package, whole, is accepted: the cut-off one left nothing in its way.
    assert (await client.put(f"/api/packages/gcs/{name}", data=data)).status == 200
    assert (await client.get(f"/api/packages/gcs/{name}")).status == 200


def _failures(archive_url: str, s3_bucket: str) -> list[tuple[dict[str, Any], str, str]]:
    """(runtime_env, the part the message must name, the cause it must give)."""
    refused = f"http://127.0.0.1:{closed_port()}/project.zip"
    return [
        ({"working_dir": f"{archive_url}/missing.zip"}, f"{archive_url}/missing.zip", "HTTP 404"),
        (
            {"working_dir": f"{archive_url}/not-a-zip.zip"},
            f"{archive_url}/not-a-zip.zip",
            "not a zip",
        ),
        ({"working_dir": refused}, refused, "Connection refused"),
        (
            {"working_dir": f"s3://{s3_bucket}/jobs/missing.zip"},
            f"s3://{s3_bucket}/jobs/missing.zip",
            "NoSuchKey",
        ),
        (
            {"working_dir": "s3://no-such-bucket-here/project.zip"},
            "s3://no-such-bucket-here/project.zip",
            "NoSuchBucket",
        ),
        (
            {
                "working_dir": f"{archive_url}/project.zip",
                "py_modules": [f"{archive_url}/modules.zip", f"{archive_url}/gone.zip"],
            },
            f"py_modules[1] '{archive_url}/gone.zip'",
            "HTTP 404",
        ),
    ]


FAILURE_IDS = ["https-404", "not-a-zip", "refused", "s3-no-key", "s3-no-bucket", "py-modules-404"]


@pytest.mark.parametrize("case", range(len(FAILURE_IDS)), ids=FAILURE_IDS)
async def test_runtime_env_that_cannot_be_set_up_fails_naming_part_and_cause(
    client: Client, archive_url: str, s3_bucket: str, case: int
) -> None:
    runtime_env, part, cause = _failures(archive_url, s3_bucket)[case]
    job = await run_to_end(client, runtime_env, FAILURE_DEADLINE_S)
    assert job["status"] == "FAILED", job
    assert job["error_type"] == "RUNTIME_ENV_SETUP_FAILURE"
    message = job["message"]
    assert part in message
    assert cause in message
    assert message.startswith("runtime_env setup failed: Failed to set up runtime environment. ")
    assert "\n" not in message
    assert "Traceback" not in message
    assert await job_logs(client, job["submission_id"]) == ""


@pytest.mark.parametrize(
    ("runtime_env", "says"),
    [
        ({"working_dir": "gcs://_ray_pkg_00000000deadbeef.zip"}, "runtime_env.working_dir"),
        ({"working_dir": "gcs://_ray_pkg_00000000deadbeef.zip"}, "never uploaded"),
        ({"py_modules": ["gcs://_ray_pkg_00000000deadbee0.zip"]}, "runtime_env.py_modules[0]"),
        ({"working_dir": "/tmp"}, "runtime_env.working_dir: '/tmp' is a local path"),
        ({"working_dir": "."}, "runtime_env.working_dir: '.' is a local path"),
        ({"py_modules": ["/usr/lib/python3"]}, "runtime_env.py_modules[0]"),
        ({"working_dir": 5}, "runtime_env.working_dir: must be a URI string"),
        ({"working_dir": ["https://example.com/a.zip"]}, "runtime_env.working_dir"),
        ({"py_modules": "https://example.com/a.zip"}, "runtime_env.py_modules: must be a list"),
        ({"py_modules": [7]}, "runtime_env.py_modules[0]: must be a URI string"),
        ({"working_dir": "https://example.com/code.txt"}, "runtime_env.working_dir"),
        ({"working_dir": "ftp://example.com/code.zip"}, "runtime_env.working_dir"),
        ({"py_modules": ["https://example.com/code"]}, "runtime_env.py_modules[0]"),
    ],
)
async def test_runtime_env_rejected_at_submit_names_the_field(
    client: Client, runtime_env: dict[str, Any], says: str
) -> None:
    response = await client.post(
        "/api/jobs/", json={"entrypoint": "python main.py", "runtime_env": runtime_env}
    )
    error = (await response.json())["error"]
    assert (response.status, error["code"]) == (400, "invalid_runtime_env"), error
    assert says in error["message"]
    assert await (await client.get("/api/jobs/")).json() == []


def test_ray_job_submit_uploads_working_dir_and_py_modules(server_url: str, tmp_path: Path) -> None:
    """`ray job submit --working-dir` with a local py_modules directory: both uploaded through
    the server, both in place for the job and its Ray task."""
    project = tmp_path / "project"
    project.mkdir()
    for name, text in project_files("from the cli").items():
        (project / name).write_text(text)
    module = tmp_path / "lib" / "greeting"
    module.mkdir(parents=True)
    (module / "__init__.py").write_text("WHO = 'cli module'\n")
    submission_id = f"cli-renv-{secrets.token_hex(4)}"
    submitted = subprocess.run(
        [
            RAY_CLI,
            "job",
            "submit",
            "--address",
            server_url,
            "--submission-id",
            submission_id,
            "--working-dir",
            str(project),
            "--runtime-env-json",
            json.dumps({"py_modules": [str(module)]}),
            "--",
            "python",
            "main.py",
        ],
        capture_output=True,
        text=True,
        timeout=SUCCESS_DEADLINE_S,
        env={**os.environ, "RAY_ADDRESS": server_url},
        check=False,
    )
    output = submitted.stdout + submitted.stderr
    assert submitted.returncode == 0, output
    assert "succeeded" in output
    client = JobSubmissionClient(server_url)
    assert client.get_job_status(submission_id) == JobStatus.SUCCEEDED
    assert job_output(client.get_job_logs(submission_id)) == EXPECTED_LOG.format(
        data="from the cli", who="cli module"
    )
    runtime_env = client.get_job_info(submission_id).runtime_env
    assert runtime_env["working_dir"].startswith("gcs://_ray_pkg_")
    assert runtime_env["py_modules"][0].startswith("gcs://_ray_pkg_")


def test_submission_client_surfaces_a_setup_failure(server_url: str) -> None:
    """What Ray's SDK shows of a failed setup: FAILED and the one-paragraph message."""
    url = f"http://127.0.0.1:{closed_port()}/project.zip"
    client = JobSubmissionClient(server_url)
    job_id = client.submit_job(entrypoint="python main.py", runtime_env={"working_dir": url})
    wait_until(
        lambda: client.get_job_status(job_id) == JobStatus.FAILED,
        FAILURE_DEADLINE_S,
        f"{job_id} to fail",
    )
    info = client.get_job_info(job_id)
    assert info.message is not None
    assert url in info.message
    assert "Connection refused" in info.message


RAY_TIMEOUT_TEXT = """Failed to set up runtime environment.
Failed to install runtime_env within the timeout of 5 seconds. Consider increasing the timeout
[Node 10.0.0.7] Traceback (most recent call last):
  File "runtime_env_agent.py", line 561, in _create_runtime_env_with_retry
asyncio.exceptions.CancelledError

During handling of the above exception, another exception occurred:

TimeoutError
"""
# What a server that accepts the connection and never answers gives, after ~3 minutes (Ray's
# fixed 60 s HTTP timeout, 3 attempts): too slow to wait for in a test.
RAY_READ_TIMEOUT_TEXT = """Failed to set up runtime environment.
[Node 10.0.0.7] Traceback (most recent call last):
  File "working_dir.py", line 260, in create
    local_dir = await download_and_unpack_package(
requests.exceptions.ReadTimeout: HTTPConnectionPool(host='127.0.0.1', port=40491): \
Read timed out. (read timeout=60)
"""
RAY_PIP_TEXT = """Failed to set up runtime environment.
[Node 10.0.0.7] Traceback (most recent call last):
  File "pip.py", line 90, in _install_pip_packages
    raise RuntimeError(f"Failed to install pip packages:\\n{output}")
RuntimeError: Failed to install pip packages: No matching distribution found for nosuchpkg
"""


@pytest.mark.parametrize(
    ("text", "runtime_env", "expected"),
    [
        (
            RAY_TIMEOUT_TEXT,
            {"working_dir": "https://example.com/a.zip"},
            "runtime_env setup failed: Failed to set up runtime environment. Timeout: not set up "
            "within 5 s (raise runtime_env config setup_timeout_seconds if it needs longer) "
            "(on node 10.0.0.7).",
        ),
        (
            RAY_READ_TIMEOUT_TEXT,
            {"working_dir": "http://127.0.0.1:40491/project.zip"},
            "runtime_env setup failed: Failed to set up runtime environment. working_dir "
            "'http://127.0.0.1:40491/project.zip': no answer within 60 s (read timeout) "
            "(on node 10.0.0.7).",
        ),
        (
            RAY_PIP_TEXT,
            {"pip": ["nosuchpkg"]},
            "runtime_env setup failed: Failed to set up runtime environment. RuntimeError: "
            "Failed to install pip packages: No matching distribution found for nosuchpkg "
            "(on node 10.0.0.7).",
        ),
        (
            RAY_PIP_TEXT,
            {"working_dir": 5},
            "runtime_env setup failed: Failed to set up runtime environment. RuntimeError: "
            "Failed to install pip packages: No matching distribution found for nosuchpkg "
            "(on node 10.0.0.7).",
        ),
    ],
    ids=["setup-timeout", "read-timeout", "other-cause", "record-from-before-the-checks"],
)
def test_setup_failures_of_other_kinds_are_one_line(
    text: str, runtime_env: dict[str, Any], expected: str
) -> None:
    assert describe_setup_failure(text, runtime_env) == expected
