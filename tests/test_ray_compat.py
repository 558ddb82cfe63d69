"""Ray-compatible to the letter, through Ray's own `JobSubmissionClient` and `ray job` CLI: error
messages in Ray's words, the job config a Ray driver sees, the driver in job details, empty
packages, and the server found through the GCS without `--address`."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import traceback
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import requests
from ray._private.runtime_env.utils import SubprocessCalledProcessError
from ray._raylet import GcsClient  # type: ignore[attr-defined]
from ray.job_submission import JobStatus, JobSubmissionClient

from jobs_server.manager.records import JobRecord, JobSpec, now_ms
from jobs_server.manager.runtime_env_failures import describe_setup_failure
from jobs_server.manager.supervisor.drivers import RayDrivers
from tests.support.processes import free_port, stop_process_group, stop_ray_node, wait_until
from tests.support.ray_nodes import RAY_BIN
from tests.support.servers import start_jobs_server, wait_for_server

# Among the longest modules: started first when tests run in parallel (tests/conftest.py).
pytestmark = pytest.mark.slow

RAY_CLI = str(Path(sys.executable).parent / "ray")
SETUP_FAILED = "runtime_env setup failed: Failed to set up runtime environment"
TERMINAL = {JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED}


@pytest.fixture
def ray_client(server_url: str) -> JobSubmissionClient:
    return JobSubmissionClient(server_url)


def unique_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def wait_for_client_status(
    client: JobSubmissionClient, job_id: str, statuses: set[JobStatus], timeout_s: float = 120
) -> JobStatus:
    wait_until(lambda: client.get_job_status(job_id) in statuses, timeout_s, f"{job_id} {statuses}")
    return client.get_job_status(job_id)


def ray_job_cli(
    *args: str, env: dict[str, str] | None = None, timeout_s: float = 180
) -> subprocess.CompletedProcess[str]:
    """`ray job ARGS`; `env` replaces the environment (give RAY_ADDRESS in it, or not)."""
    return subprocess.run(
        [RAY_CLI, "job", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=env if env is not None else os.environ.copy(),
        check=False,
    )


def cli_env(server_url: str) -> dict[str, str]:
    return {**os.environ, "RAY_ADDRESS": server_url}


# --- 1. Error messages in Ray's words --------------------------------------------------------


def test_duplicate_submission_id_says_what_ray_says(
    ray_client: JobSubmissionClient, server_url: str
) -> None:
    job_id = unique_id("dup")
    ray_client.submit_job(entrypoint="true", submission_id=job_id)
    expected = (
        f"Job with submission_id {job_id} already exists. Please use a different submission_id."
    )
    with pytest.raises(RuntimeError) as raised:
        ray_client.submit_job(entrypoint="true", submission_id=job_id)
    assert expected in str(raised.value)
    assert "409" in str(raised.value)

    cli = ray_job_cli(
        "submit", "--no-wait", "--submission-id", job_id, "--", "true", env=cli_env(server_url)
    )
    assert cli.returncode != 0
    assert expected in cli.stdout + cli.stderr


def test_unknown_job_says_what_ray_says_on_every_route(
    ray_client: JobSubmissionClient, server_url: str
) -> None:
    job_id = unique_id("nope")
    expected = f"Job {job_id} does not exist"
    for call in (
        ray_client.get_job_info,
        ray_client.get_job_status,
        ray_client.get_job_logs,
        ray_client.stop_job,
        ray_client.delete_job,
    ):
        with pytest.raises(RuntimeError) as raised:
            call(job_id)
        assert expected in str(raised.value), call.__name__
    # Every route under a job, including the extensions Ray's client does not call.
    for method, path in (
        ("GET", f"/api/jobs/{job_id}"),
        ("GET", f"/api/jobs/{job_id}/logs"),
        ("GET", f"/api/jobs/{job_id}/logs?follow=true"),
        ("GET", f"/api/jobs/{job_id}/logs/tail"),
        ("GET", f"/api/jobs/{job_id}/logs/stream"),
        ("POST", f"/api/jobs/{job_id}/stop"),
        ("DELETE", f"/api/jobs/{job_id}"),
    ):
        response = requests.request(method, server_url + path, timeout=30)
        assert response.status_code == 404, (method, path, response.text)
        assert response.json() == {"error": {"code": "job_not_found", "message": expected}}
    for command in ("status", "logs", "stop", "delete"):
        cli = ray_job_cli(command, job_id, env=cli_env(server_url))
        assert cli.returncode != 0, command
        assert expected in cli.stdout + cli.stderr, (command, cli.stdout, cli.stderr)


def test_deleting_a_job_that_has_not_ended_says_what_ray_says(
    ray_client: JobSubmissionClient, server_url: str
) -> None:
    running = ray_client.submit_job(entrypoint="sleep 60", submission_id=unique_id("run"))
    # Resources no node has: it stays PENDING.
    pending = ray_client.submit_job(
        entrypoint="true",
        submission_id=unique_id("pend"),
        entrypoint_resources={"no_such_resource_anywhere": 1},
    )
    try:
        wait_for_client_status(ray_client, running, {JobStatus.RUNNING})
        for job_id, status in ((running, "RUNNING"), (pending, "PENDING")):
            expected = (
                f"Attempted to delete job '{job_id}', but it is in a non-terminal state {status}."
            )
            with pytest.raises(RuntimeError) as raised:
                ray_client.delete_job(job_id)
            assert expected in str(raised.value)
            cli = ray_job_cli("delete", job_id, env=cli_env(server_url))
            assert cli.returncode != 0
            assert expected in cli.stdout + cli.stderr
    finally:
        ray_client.stop_job(running)
        ray_client.stop_job(pending)


def test_runtime_env_failure_starts_with_rays_words(
    ray_client: JobSubmissionClient, server_url: str
) -> None:
    # Nothing listens there. https, not http: Ray's own client before 2.53 takes an http:// URI
    # for a local path (its list of remote protocols lacks http) and fails before submitting.
    url = f"https://127.0.0.1:{free_port()}/project.zip"
    job_id = ray_client.submit_job(entrypoint="true", runtime_env={"working_dir": url})
    assert wait_for_client_status(ray_client, job_id, TERMINAL) == JobStatus.FAILED
    message = ray_client.get_job_info(job_id).message or ""
    assert message.startswith(SETUP_FAILED + ". working_dir "), message
    assert url in message
    assert "Connection refused" in message
    assert "\n" not in message
    cli = ray_job_cli("status", job_id, env=cli_env(server_url))
    assert f"Status message: {message}" in cli.stdout + cli.stderr


def test_pip_failure_keeps_pips_own_line(ray_client: JobSubmissionClient) -> None:
    """A real pip install against the package index: slow, and the only way to see Ray's text."""
    job_id = ray_client.submit_job(
        entrypoint="true",
        runtime_env={"pip": ["does-not-exist"], "config": {"setup_timeout_seconds": 600}},
    )
    status = wait_for_client_status(ray_client, job_id, TERMINAL, timeout_s=900)
    info = ray_client.get_job_info(job_id)
    assert status == JobStatus.FAILED, info
    assert info.error_type == "RUNTIME_ENV_SETUP_FAILURE"
    message = info.message or ""
    assert message.startswith(SETUP_FAILED), message
    assert "No matching distribution found for does-not-exist" in message
    assert "Run cmd[" not in message
    assert "\n" not in message


RAY_SETUP_TIMEOUT_TEXT = """Failed to set up runtime environment.
Failed to install runtime_env within the timeout of 7 seconds. Consider increasing the timeout \
in the runtime_env config. For example:
    runtime_env={"config": {"setup_timeout_seconds": 1800}, ...}
If not provided, the default timeout is 600 seconds. Traceback (most recent call last):
  File "runtime_env_agent.py", line 561, in _create_runtime_env_with_retry
asyncio.exceptions.CancelledError

During handling of the above exception, another exception occurred:

TimeoutError
"""


def _ray_pip_failure_text(output: str) -> str:
    """What Ray's agent reports when pip fails: its own exception, formatted as Ray does."""
    try:
        raise SubprocessCalledProcessError(
            1, ["/venv/bin/python", "-m", "pip", "install", "x"], output=output, cmd_index=12
        )
    except SubprocessCalledProcessError as error:
        formatted = "".join(traceback.format_exception(error))
    return f"Failed to set up runtime environment.\n[Node 10.0.0.7] {formatted}"


@pytest.mark.parametrize(
    ("text", "runtime_env", "expected"),
    [
        (
            RAY_SETUP_TIMEOUT_TEXT,
            {"pip": ["torch"]},
            f"{SETUP_FAILED}. Timeout: not set up within 7 s (raise runtime_env config "
            "setup_timeout_seconds if it needs longer).",
        ),
        (
            _ray_pip_failure_text(
                "Looking in indexes: https://pypi.org/simple\n"
                "ERROR: Could not find a version that satisfies the requirement does-not-exist "
                "(from versions: none)\n"
                "ERROR: No matching distribution found for does-not-exist\n"
            ),
            {"pip": ["does-not-exist"]},
            f"{SETUP_FAILED}. pip install failed: No matching distribution found for "
            "does-not-exist (on node 10.0.0.7).",
        ),
        (
            _ray_pip_failure_text("Collecting x\n  error: subprocess-exited-with-error\n"),
            {"pip": ["x"]},
            f"{SETUP_FAILED}. pip install failed: error: subprocess-exited-with-error "
            "(on node 10.0.0.7).",
        ),
    ],
    ids=["timeout", "pip-no-distribution", "pip-other"],
)
def test_setup_failure_messages(text: str, runtime_env: dict[str, Any], expected: str) -> None:
    assert describe_setup_failure(text, runtime_env) == expected


# --- 2. What a Ray driver sees, and the driver in job details --------------------------------

DRIVER_SCRIPT = textwrap.dedent(
    """
    import json
    import ray

    ray.init()
    core_worker = ray._private.worker.global_worker.core_worker
    print("METADATA " + json.dumps(dict(core_worker.get_job_config().metadata)), flush=True)
    print("JOB_ID " + ray.get_runtime_context().get_job_id(), flush=True)
    print("PID " + str(__import__("os").getpid()), flush=True)
    ray.shutdown()
    """
)


def _printed(logs: str, label: str) -> str:
    lines = [line for line in logs.splitlines() if line.startswith(label + " ")]
    assert lines, logs
    return lines[-1].removeprefix(label + " ")


@pytest.mark.parametrize(
    ("metadata", "expected_name"), [({"owner": "me"}, None), ({"job_name": "nightly"}, "nightly")]
)
def test_ray_driver_sees_its_submission_and_details_show_the_driver(
    ray_client: JobSubmissionClient,
    server_url: str,
    tmp_path: Path,
    metadata: dict[str, str],
    expected_name: str | None,
) -> None:
    (tmp_path / "driver.py").write_text(DRIVER_SCRIPT)
    job_id = ray_client.submit_job(
        entrypoint=f"python {tmp_path / 'driver.py'}",
        submission_id=unique_id("driver"),
        metadata=metadata,
    )
    status = wait_for_client_status(ray_client, job_id, TERMINAL)
    logs = ray_client.get_job_logs(job_id)
    assert status == JobStatus.SUCCEEDED, logs
    assert json.loads(_printed(logs, "METADATA")) == {
        "job_submission_id": job_id,
        "job_name": expected_name or job_id,
        **metadata,
    }
    ray_job_id = _printed(logs, "JOB_ID")
    driver_pid = _printed(logs, "PID")
    # The driver is found as Ray's server finds it: in the GCS job table, by its metadata.
    info = ray_client.get_job_info(job_id)
    assert info.job_id == ray_job_id
    assert info.driver_info is not None
    assert info.driver_info.id == ray_job_id
    assert info.driver_info.pid == driver_pid
    assert info.driver_info.node_ip_address == "127.0.0.2"
    listed = {job.submission_id: job for job in ray_client.list_jobs()}
    assert listed[job_id].job_id == ray_job_id
    assert listed[job_id].driver_info is not None
    assert listed[job_id].driver_info.id == ray_job_id


def test_metadata_cannot_make_a_driver_another_jobs(
    ray_client: JobSubmissionClient, tmp_path: Path
) -> None:
    """A user's `job_submission_id` in metadata would make its driver show as another job's
    (another tenant's, say): the driver's job config always names its own submission."""
    victim = ray_client.submit_job(entrypoint="sleep 60", submission_id=unique_id("victim"))
    (tmp_path / "driver.py").write_text(DRIVER_SCRIPT)
    job_id = ray_client.submit_job(
        entrypoint=f"python {tmp_path / 'driver.py'}",
        submission_id=unique_id("claims"),
        metadata={"job_submission_id": victim},
    )
    status = wait_for_client_status(ray_client, job_id, TERMINAL)
    logs = ray_client.get_job_logs(job_id)
    assert status == JobStatus.SUCCEEDED, logs
    assert json.loads(_printed(logs, "METADATA"))["job_submission_id"] == job_id
    ray_job_id = _printed(logs, "JOB_ID")
    own = ray_client.get_job_info(job_id)
    assert own.driver_info is not None
    assert own.driver_info.id == ray_job_id
    victims = ray_client.get_job_info(victim)
    assert victims.job_id is None  # it started no Ray driver
    assert victims.driver_info is not None
    assert victims.driver_info.id == victim  # its own process, as for every shell job
    ray_client.stop_job(victim)


def test_drivers_of_several_jobs_are_found_in_one_read_of_the_job_table(
    ray_client: JobSubmissionClient, ray_connection: str, tmp_path: Path
) -> None:
    """What a list does for jobs not looked at yet: one read of Ray's whole job table."""
    (tmp_path / "driver.py").write_text(DRIVER_SCRIPT)
    printed: dict[str, str] = {}
    for _ in range(2):
        job_id = ray_client.submit_job(entrypoint=f"python {tmp_path / 'driver.py'}")
        status = wait_for_client_status(ray_client, job_id, TERMINAL)
        assert status == JobStatus.SUCCEEDED, ray_client.get_job_logs(job_id)
        printed[job_id] = _printed(ray_client.get_job_logs(job_id), "JOB_ID")
    shell_id = ray_client.submit_job(entrypoint="true")
    assert wait_for_client_status(ray_client, shell_id, TERMINAL) == JobStatus.SUCCEEDED

    def ended(submission_id: str) -> JobRecord:
        spec = JobSpec(entrypoint="x", submission_id=submission_id)
        return JobRecord(spec=spec, status="SUCCEEDED", start_time=1, end_time=now_ms())

    drivers = RayDrivers(ray_connection)
    reads = 0
    read_job_table = drivers._client.async_get_all_job_info

    def counted(**options: Any) -> Any:
        nonlocal reads
        reads += 1
        assert options["job_or_submission_id"] is None  # the whole table
        return read_job_table(**options)

    drivers._client = SimpleNamespace(async_get_all_job_info=counted)
    records = [ended(job_id) for job_id in [*printed, shell_id]]
    found = asyncio.run(drivers.find(records))
    assert {job_id: driver.job_id for job_id, driver in found.items()} == printed
    assert reads == 1
    # Found once, after the jobs ended: never looked for again.
    assert asyncio.run(drivers.find(records)).keys() == printed.keys()
    assert reads == 1


def test_shell_job_has_no_ray_job_id(ray_client: JobSubmissionClient) -> None:
    job_id = ray_client.submit_job(entrypoint="echo plain", submission_id=unique_id("shell"))
    assert wait_for_client_status(ray_client, job_id, TERMINAL) == JobStatus.SUCCEEDED
    info = ray_client.get_job_info(job_id)
    assert info.job_id is None
    assert info.driver_info is not None
    assert info.driver_info.id == job_id  # its process, as before
    assert {job.submission_id: job for job in ray_client.list_jobs()}[job_id].job_id is None


# --- 3. Empty packages ---------------------------------------------------------------------


def test_empty_working_dir_is_uploaded_and_the_job_runs(
    ray_client: JobSubmissionClient, tmp_path: Path
) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    job_id = ray_client.submit_job(
        entrypoint="ls -A | wc -l", runtime_env={"working_dir": str(empty)}
    )
    status = wait_for_client_status(ray_client, job_id, TERMINAL)
    logs = ray_client.get_job_logs(job_id)
    assert status == JobStatus.SUCCEEDED, (logs, ray_client.get_job_info(job_id).message)
    assert logs.strip() == "0"


def test_empty_wheel_is_accepted_as_rays_server_accepts_it(
    ray_client: JobSubmissionClient, tmp_path: Path
) -> None:
    wheel = tmp_path / "empty_pkg-0.1-py3-none-any.whl"
    wheel.write_bytes(b"")
    # The upload (of 0 bytes) is accepted; what follows is Ray's agent's, as under Ray's server:
    # pip cannot install an empty wheel.
    job_id = ray_client.submit_job(entrypoint="true", runtime_env={"py_modules": [str(wheel)]})
    wait_for_client_status(ray_client, job_id, TERMINAL, timeout_s=300)
    info = ray_client.get_job_info(job_id)
    assert info.runtime_env["py_modules"] == [f"gcs://{wheel.name}"]
    assert info.status == JobStatus.FAILED, info
    assert info.error_type == "RUNTIME_ENV_SETUP_FAILURE", info
    assert (info.message or "").startswith(
        f"{SETUP_FAILED}. py_modules[0] 'gcs://{wheel.name}': "
    ), info.message


@pytest.mark.parametrize(
    ("name", "data", "status", "says"),
    [
        ("_ray_pkg_0e0e0e0e.zip", b"", 200, "gcs://_ray_pkg_0e0e0e0e.zip"),
        ("nothing-0.1-py3-none-any.whl", b"", 200, "gcs://nothing-0.1-py3-none-any.whl"),
        ("_ray_pkg_0e0e0e0f.zip", b"not a zip at all", 400, "not a zip archive"),
    ],
    ids=["empty-zip", "empty-wheel", "not-a-zip"],
)
def test_packages_ray_can_produce_are_accepted_and_others_refused(
    server_url: str, name: str, data: bytes, status: int, says: str
) -> None:
    response = requests.put(f"{server_url}/api/packages/gcs/{name}", data=data, timeout=30)
    assert response.status_code == status, response.text
    assert says in response.text
    exists = requests.get(f"{server_url}/api/packages/gcs/{name}", timeout=30)
    assert exists.status_code == (200 if status == 200 else 404)


# --- 4. Found without --address -------------------------------------------------------------


@pytest.fixture(scope="module")
def own_cluster() -> Iterator[tuple[str, dict[str, str]]]:
    """A Ray head node of this module's own (the key it holds is the test's alone), with its
    own temp dir, so `ray job` without an address finds this cluster and no other; yields its
    GCS address and the environment that finds it."""
    # Short: Ray's socket paths live under it.
    temp_dir = tempfile.mkdtemp(prefix="rc", dir="/tmp")
    env = {key: value for key, value in os.environ.items() if key not in {"RAY_ADDRESS", "TMPDIR"}}
    env["RAY_TMPDIR"] = temp_dir
    port = free_port("127.0.0.3")
    log = open(Path(temp_dir) / "ray-start.log", "wb")  # noqa: SIM115
    process = subprocess.Popen(
        [
            str(RAY_BIN),
            "start",
            "--head",
            "--block",
            "--node-ip-address=127.0.0.3",
            f"--port={port}",
            "--include-dashboard=false",
            "--disable-usage-stats",
            "--num-cpus=2",
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    address = f"127.0.0.3:{port}"
    try:
        wait_until(
            lambda: (
                (Path(temp_dir) / "ray" / "ray_current_cluster").exists() and _gcs_answers(address)
            ),
            90,
            "the module's Ray head node",
        )
        yield address, env
    finally:
        stop_ray_node(process)
        log.close()
        shutil.rmtree(temp_dir, ignore_errors=True)


def _gcs_answers(address: str) -> bool:
    host, port = address.split(":")
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, int(port))) == 0


def registered_address(gcs_address: str) -> str | None:
    value = GcsClient(address=gcs_address).internal_kv_get(
        b"dashboard", namespace=b"dashboard", timeout=30
    )
    return value.decode() if value is not None else None


def set_registered_address(gcs_address: str, value: str | None) -> None:
    client = GcsClient(address=gcs_address)
    if value is None:
        client.internal_kv_del(b"dashboard", False, namespace=b"dashboard", timeout=30)
    else:
        client.internal_kv_put(
            b"dashboard", value.encode(), True, namespace=b"dashboard", timeout=30
        )


AUTO_CLIENT_SCRIPT = (
    "from ray.job_submission import JobSubmissionClient; "
    "print(JobSubmissionClient('auto').get_address())"
)


class ServerProcess:
    def __init__(self, gcs_address: str, env: dict[str, str], workdir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / f"server-{self.port}.log"
        self.namespace = f"test_compat_{uuid.uuid4().hex[:8]}"
        self.process = start_jobs_server(
            [
                "--port",
                str(self.port),
                "--ray-address",
                gcs_address,
                "--log-dir",
                str(workdir / f"logs-{self.port}"),
                "--state-dir",
                str(workdir / f"state-{self.port}"),
                "--namespace",
                self.namespace,
                "--shared-supervisors",
                "0",
            ],
            self.log_path,
            env=env,
        )
        wait_for_server(self.url, self.process, self.log_path, timeout_s=120)

    def stop(self) -> None:
        stop_process_group(self.process)


def test_ray_job_submit_without_address_finds_this_server(
    own_cluster: tuple[str, dict[str, str]], tmp_path: Path
) -> None:
    gcs_address, env = own_cluster
    set_registered_address(gcs_address, None)
    server = ServerProcess(gcs_address, env, tmp_path)
    try:
        assert registered_address(gcs_address) == f"127.0.0.1:{server.port}"
        # No --address, no RAY_ADDRESS: Ray's CLI finds the cluster, then asks its GCS.
        submitted = ray_job_cli("submit", "--", "echo", "found-without-address", env=env)
        assert submitted.returncode == 0, submitted.stdout + submitted.stderr
        assert "found-without-address" in submitted.stdout
        # The cluster's GCS address, as Ray users type it.
        submitted = ray_job_cli(
            "submit", "--address", gcs_address, "--", "echo", "found-by-gcs-address", env=env
        )
        assert submitted.returncode == 0, submitted.stdout + submitted.stderr
        assert "found-by-gcs-address" in submitted.stdout
        # Ray's Python client with "auto" (in a process of its own: this one is connected to
        # the session's cluster).
        auto = subprocess.run(
            [sys.executable, "-c", AUTO_CLIENT_SCRIPT],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
            check=False,
        )
        assert auto.returncode == 0, auto.stderr
        assert auto.stdout.strip() == server.url
        listed = requests.get(f"{server.url}/api/jobs/", timeout=30).json()
        assert {job["entrypoint"] for job in listed} >= {
            "echo found-without-address",
            "echo found-by-gcs-address",
        }
    finally:
        server.stop()
    assert registered_address(gcs_address) is None, server.log_path.read_text()


def test_a_registered_server_that_answers_is_left_alone(
    own_cluster: tuple[str, dict[str, str]], tmp_path: Path
) -> None:
    gcs_address, env = own_cluster
    with socket.socket() as dashboard:  # stands for Ray's dashboard: it accepts connections
        dashboard.bind(("127.0.0.1", 0))
        dashboard.listen()
        holder = f"127.0.0.1:{dashboard.getsockname()[1]}"
        set_registered_address(gcs_address, holder)
        server = ServerProcess(gcs_address, env, tmp_path)
        try:
            assert registered_address(gcs_address) == holder
        finally:
            server.stop()
        assert registered_address(gcs_address) == holder
        log = server.log_path.read_text()
        assert f"{holder} (Ray's dashboard, or another server) is registered and answers" in log
    set_registered_address(gcs_address, None)


def test_a_registration_nobody_answers_at_is_replaced(
    own_cluster: tuple[str, dict[str, str]], tmp_path: Path
) -> None:
    gcs_address, env = own_cluster
    gone = f"127.0.0.1:{free_port()}"
    set_registered_address(gcs_address, gone)
    server = ServerProcess(gcs_address, env, tmp_path)
    try:
        assert registered_address(gcs_address) == f"127.0.0.1:{server.port}"
        # Ray's dashboard, started later, takes the key; a stopping server leaves it to it.
        set_registered_address(gcs_address, "127.0.0.1:8265")
    finally:
        server.stop()
    assert registered_address(gcs_address) == "127.0.0.1:8265"
    set_registered_address(gcs_address, None)
