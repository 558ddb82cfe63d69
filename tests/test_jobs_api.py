"""The Ray-compatible REST API against real Ray, real processes and a real app on loopback."""

from __future__ import annotations

import asyncio
import textwrap
from pathlib import Path

import psutil
import ray
from aiohttp import WSMsgType

from jobs_server.settings import Settings
from tests.support.api import Client, job_logs, submit, wait_for_status

JOB_DETAILS_FIELDS = {
    "type",
    "job_id",
    "submission_id",
    "driver_info",
    "status",
    "entrypoint",
    "message",
    "error_type",
    "start_time",
    "end_time",
    "metadata",
    "runtime_env",
    "driver_agent_http_address",
    "driver_node_id",
    "driver_exit_code",
}


async def test_version_reports_ray_api_version_4(client: Client) -> None:
    response = await client.get("/api/version")
    assert response.status == 200
    body = await response.json()
    assert body["version"] == "4"
    # The installed Ray (any release of the range in pyproject.toml; scripts/check-ray-versions).
    assert body["ray_version"] == ray.__version__
    assert body["session_name"].startswith("session_")


async def test_echo_job_succeeds_with_exact_output(client: Client) -> None:
    job_id = await submit(client, entrypoint="echo hello")
    job = await wait_for_status(client, job_id)
    assert job["status"] == "SUCCEEDED"
    assert job["driver_exit_code"] == 0
    assert job["message"] == "Job finished successfully."
    assert job.keys() >= JOB_DETAILS_FIELDS
    assert job["type"] == "SUBMISSION"
    assert job["entrypoint"] == "echo hello"
    assert job["start_time"] <= job["end_time"]
    assert await job_logs(client, job_id) == "hello\n"


async def test_a_job_that_ends_at_once_records_where_it_ran_with_its_end(client: Client) -> None:
    """Its start is written with its end (one write): nothing of the start is missing."""
    job_id = await submit(client, entrypoint="true")
    job = await wait_for_status(client, job_id)
    assert job["status"] == "SUCCEEDED", job
    assert job["message"] == "Job finished successfully."
    assert job["driver_node_id"], job
    (attempt,) = job["attempts"]
    assert attempt["exit_code"] == 0
    assert attempt["log_offset"] == 0
    assert attempt["start_time"] <= attempt["end_time"] <= job["end_time"]


async def test_a_running_job_reads_running_with_where_it_runs(client: Client) -> None:
    job_id = await submit(client, entrypoint="sleep 60")
    job = await wait_for_status(client, job_id, {"RUNNING"})
    assert job["driver_node_id"], job
    (attempt,) = job["attempts"]
    assert attempt["end_time"] is None
    response = await client.post(f"/api/jobs/{job_id}/stop")
    assert response.status == 200
    assert (await wait_for_status(client, job_id))["status"] == "STOPPED"


async def test_pipeline_runs_in_a_shell(client: Client, tmp_path: Path) -> None:
    for name in ("alpha.txt", "beta.txt", "gamma.log"):
        (tmp_path / name).write_text("x")
    job_id = await submit(client, entrypoint=f"ls {tmp_path} | grep txt")
    assert (await wait_for_status(client, job_id))["status"] == "SUCCEEDED"
    assert await job_logs(client, job_id) == "alpha.txt\nbeta.txt\n"


async def test_stdout_and_stderr_share_the_log(client: Client) -> None:
    job_id = await submit(client, entrypoint="echo to-stdout; echo to-stderr 1>&2; echo again")
    assert (await wait_for_status(client, job_id))["status"] == "SUCCEEDED"
    assert await job_logs(client, job_id) == "to-stdout\nto-stderr\nagain\n"


async def test_python_exception_fails_the_job_with_traceback(
    client: Client, tmp_path: Path
) -> None:
    script = tmp_path / "boom.py"
    script.write_text("print('before the error')\nraise ValueError('boom from the job')\n")
    job_id = await submit(client, entrypoint=f"python {script}")
    job = await wait_for_status(client, job_id)
    assert job["status"] == "FAILED"
    assert job["driver_exit_code"] == 1
    assert job["error_type"] == "JOB_ENTRYPOINT_COMMAND_ERROR"
    assert "exit code 1" in job["message"]
    assert "ValueError: boom from the job" in job["message"]
    logs = await job_logs(client, job_id)
    assert logs.startswith("before the error\nTraceback (most recent call last):")
    assert logs.endswith("ValueError: boom from the job\n")


async def test_signal_death_reports_negative_exit_code(client: Client) -> None:
    job_id = await submit(client, entrypoint="echo dying; kill -9 $$")
    job = await wait_for_status(client, job_id)
    assert job["status"] == "FAILED"
    assert job["driver_exit_code"] == -9
    assert "SIGKILL" in job["message"]
    assert "dying" in job["message"]


async def test_ray_tasks_inherit_the_jobs_runtime_env(client: Client, tmp_path: Path) -> None:
    script = tmp_path / "driver.py"
    script.write_text(
        textwrap.dedent(
            """
            import os
            import ray

            ray.init()

            @ray.remote(num_cpus=0)
            def read_var():
                return os.environ.get("JOB_VAR", "<unset>")

            print("driver sees", os.environ.get("JOB_VAR", "<unset>"))
            print("task sees", ray.get(read_var.remote()))
            """
        )
    )
    job_id = await submit(
        client,
        entrypoint=f"python {script}",
        runtime_env={"env_vars": {"JOB_VAR": "from-runtime-env"}},
    )
    job = await wait_for_status(client, job_id, timeout_s=120)
    logs = await job_logs(client, job_id)
    assert job["status"] == "SUCCEEDED", logs
    assert "driver sees from-runtime-env\n" in logs
    assert "task sees from-runtime-env\n" in logs


async def test_jobs_with_different_runtime_envs_run_at_once(client: Client) -> None:
    job_ids = [
        await submit(
            client,
            entrypoint='sleep 1; echo "value=$WHICH"',
            runtime_env={"env_vars": {"WHICH": f"env-{index}"}},
        )
        for index in range(3)
    ]
    running = await asyncio.gather(
        *(wait_for_status(client, job_id, {"RUNNING", "SUCCEEDED"}) for job_id in job_ids)
    )
    assert all(job["status"] in {"RUNNING", "SUCCEEDED"} for job in running)
    for index, job_id in enumerate(job_ids):
        assert (await wait_for_status(client, job_id))["status"] == "SUCCEEDED"
        assert await job_logs(client, job_id) == f"value=env-{index}\n"


async def test_metadata_is_stored_and_returned(client: Client) -> None:
    metadata = {"owner": "team-a", "ticket": "JOB-42", "empty": ""}
    job_id = await submit(client, entrypoint="true", metadata=metadata, submission_id="meta-1")
    assert job_id == "meta-1"
    job = await wait_for_status(client, job_id)
    assert job["metadata"] == metadata
    listed = await (await client.get("/api/jobs/")).json()
    assert [item["metadata"] for item in listed if item["submission_id"] == job_id] == [metadata]


async def test_list_returns_every_job(client: Client) -> None:
    assert await (await client.get("/api/jobs/")).json() == []
    ids = {await submit(client, entrypoint="true") for _ in range(3)}
    response = await client.get("/api/jobs/")
    assert response.status == 200
    listed = await response.json()
    assert {job["submission_id"] for job in listed} == ids
    assert all(job.keys() >= JOB_DETAILS_FIELDS for job in listed)


async def test_stop_running_job_kills_it(client: Client) -> None:
    job_id = await submit(client, entrypoint="echo started; sleep 60")
    job = await wait_for_status(client, job_id, {"RUNNING"})
    pid = job["driver_info"]["pid"]
    response = await client.post(f"/api/jobs/{job_id}/stop")
    assert response.status == 200
    assert await response.json() == {"stopped": True}
    job = await wait_for_status(client, job_id)
    assert job["status"] == "STOPPED"
    assert job["driver_exit_code"] == -15
    assert not psutil.pid_exists(int(pid)) or psutil.Process(int(pid)).status() == "zombie"
    assert await job_logs(client, job_id) == "started\n"


async def test_stop_is_graceful_then_forceful(client: Client) -> None:
    graceful = await submit(
        client,
        entrypoint=(
            "trap 'echo cleaning up; exit 0' TERM; echo ready; while true; do sleep 0.1; done"
        ),
    )
    stubborn = await submit(
        client, entrypoint="trap '' TERM; echo ready; while true; do sleep 0.1; done"
    )
    for job_id in (graceful, stubborn):
        await wait_for_status(client, job_id, {"RUNNING"})
        await _wait_for_log(client, job_id, "ready\n")
    assert (await client.post(f"/api/jobs/{graceful}/stop")).status == 200
    response = await client.post(f"/api/jobs/{stubborn}/stop", json={"grace_period_s": 0.5})
    assert await response.json() == {"stopped": True}
    graceful_job = await wait_for_status(client, graceful)
    stubborn_job = await wait_for_status(client, stubborn)
    assert graceful_job["status"] == stubborn_job["status"] == "STOPPED"
    # (The shell may also report that its `sleep` child was terminated.)
    graceful_logs = await job_logs(client, graceful)
    assert graceful_logs.startswith("ready\n")
    assert graceful_logs.endswith("cleaning up\n")
    assert graceful_job["driver_exit_code"] == 0
    assert stubborn_job["driver_exit_code"] == -9


async def _wait_for_log(client: Client, job_id: str, expected: str) -> None:
    for _ in range(200):
        if await job_logs(client, job_id) == expected:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"log of {job_id} never became {expected!r}")


async def test_stop_finished_job_answers_false(client: Client) -> None:
    job_id = await submit(client, entrypoint="true")
    await wait_for_status(client, job_id)
    response = await client.post(f"/api/jobs/{job_id}/stop")
    assert response.status == 200
    assert await response.json() == {"stopped": False}
    assert (await wait_for_status(client, job_id))["status"] == "SUCCEEDED"


async def test_delete_forgets_a_finished_job_and_its_log(
    client: Client, settings: Settings
) -> None:
    job_id = await submit(client, entrypoint="echo bye", submission_id="to-delete")
    await wait_for_status(client, job_id)
    log_files = list(settings.log_dir.glob("*to-delete*"))
    assert len(log_files) == 1
    response = await client.delete(f"/api/jobs/{job_id}")
    assert response.status == 200
    assert await response.json() == {"deleted": True}
    assert (await client.get(f"/api/jobs/{job_id}")).status == 404
    assert not log_files[0].exists()
    # The id is free again.
    assert await submit(client, entrypoint="echo again", submission_id="to-delete") == job_id
    await wait_for_status(client, job_id)
    assert await job_logs(client, job_id) == "again\n"


async def test_delete_running_job_is_a_conflict(client: Client) -> None:
    job_id = await submit(client, entrypoint="sleep 30")
    await wait_for_status(client, job_id, {"RUNNING"})
    response = await client.delete(f"/api/jobs/{job_id}")
    assert response.status == 409
    assert (await response.json())["error"]["code"] == "job_not_terminal"
    assert (await wait_for_status(client, job_id, {"RUNNING"}))["status"] == "RUNNING"
    await client.post(f"/api/jobs/{job_id}/stop", json={"grace_period_s": 0})
    assert (await wait_for_status(client, job_id))["status"] == "STOPPED"


async def test_duplicate_submission_id_is_refused_and_changes_nothing(client: Client) -> None:
    await submit(client, entrypoint="echo first", submission_id="dup-1")
    response = await client.post(
        "/api/jobs/", json={"entrypoint": "echo second", "submission_id": "dup-1"}
    )
    assert response.status == 409
    assert (await response.json())["error"]["code"] == "duplicate_submission_id"
    job = await wait_for_status(client, "dup-1")
    assert job["entrypoint"] == "echo first"
    assert await job_logs(client, "dup-1") == "first\n"


async def test_websocket_tail_streams_until_the_job_ends(client: Client) -> None:
    job_id = await submit(
        client, entrypoint="for i in 1 2 3 4 5; do echo line $i; sleep 0.2; done; printf last"
    )
    received = []
    async with client.ws_connect(f"/api/jobs/{job_id}/logs/tail") as websocket:
        async for message in websocket:
            assert message.type is WSMsgType.TEXT
            received.append(message.data)
        assert websocket.close_code == 1000
    assert "".join(received) == "line 1\nline 2\nline 3\nline 4\nline 5\nlast"
    assert (await wait_for_status(client, job_id, timeout_s=1))["status"] == "SUCCEEDED"


async def test_websocket_tail_of_a_finished_job_sends_the_whole_log(client: Client) -> None:
    job_id = await submit(client, entrypoint="seq 1 1000")
    await wait_for_status(client, job_id)
    async with client.ws_connect(f"/api/jobs/{job_id}/logs/tail") as websocket:
        text = "".join([message.data async for message in websocket])
    assert text == "".join(f"{n}\n" for n in range(1, 1001))


async def test_invalid_utf8_output_never_breaks_the_logs(client: Client) -> None:
    job_id = await submit(client, entrypoint=r"printf 'ok \377\376 caf\303\251\n'")
    await wait_for_status(client, job_id)
    assert await job_logs(client, job_id) == "ok \ufffd\ufffd café\n"


async def test_large_log_is_returned_whole(client: Client) -> None:
    # 5 MB over many chunks: the JSON body is assembled from streamed pieces.
    job_id = await submit(
        client, entrypoint="yes 0123456789abcdefghijklmnopqrstuvwxyz | head -c 5000000"
    )
    job = await wait_for_status(client, job_id)
    assert job["status"] == "SUCCEEDED"
    logs = await job_logs(client, job_id)
    assert len(logs) == 5_000_000
    assert logs.startswith("0123456789abcdefghijklmnopqrstuvwxyz\n")


async def test_job_log_file_holds_only_the_jobs_bytes(client: Client, settings: Settings) -> None:
    job_id = await submit(client, entrypoint="printf 'exact'; exit 3", submission_id="exact-1")
    job = await wait_for_status(client, job_id)
    assert job["status"] == "FAILED"
    assert job["driver_exit_code"] == 3
    (log_file,) = settings.log_dir.glob("*exact-1*")
    assert log_file.read_bytes() == b"exact"


async def test_list_filters_by_status_and_pages_with_a_cursor(client: Client) -> None:
    ids = [await submit(client, entrypoint="true", submission_id=f"page-{n}") for n in range(5)]
    failed = await submit(client, entrypoint="exit 1", submission_id="page-failed")
    for job_id in [*ids, failed]:
        await wait_for_status(client, job_id)
    listed = await (await client.get("/api/jobs/?status=failed")).json()
    assert [job["submission_id"] for job in listed] == [failed]
    listed = await (await client.get("/api/jobs/?status=SUCCEEDED,FAILED")).json()
    assert len(listed) == 6
    seen: list[str] = []
    url = "/api/jobs/?status=SUCCEEDED&limit=2"
    for _ in range(5):
        response = await client.get(url)
        assert response.status == 200
        seen += [job["submission_id"] for job in await response.json()]
        if "Link" not in response.headers:
            break
        url = response.headers["Link"].split(">")[0].lstrip("<")
    assert seen == ids  # submission order, every job once
