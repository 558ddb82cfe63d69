"""A starting server and what it finds (issue 32, items 13 and 14): one record Ray will not
relaunch, a GCS that fails a few calls, a delete the KV did not take. The server starts, the job
that cannot be recovered ends FAILED with the reason, every other one is recovered; a deleted
or withdrawn job never comes back. Real Ray, the real GCS KV (faults injected into the
server's client of it), a real manager, the archive on disk."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from jobs_server.errors import ClusterUnavailableError, JobNotFoundError
from jobs_server.manager import JobRecord, JobSpec, JobStatus
from jobs_server.manager.archive.sqlite import Archive, archive_path
from jobs_server.manager.live.kv import GcsKv
from jobs_server.manager.live.store import JobStore
from jobs_server.manager.records import JobErrorType, new_run_id, now_ms
from tests.support.managers import running_manager
from tests.support.ray_nodes import kill_actors_in_namespace


def pending(submission_id: str, entrypoint: str = "echo ran", **spec: Any) -> JobRecord:
    return JobRecord(
        spec=JobSpec(entrypoint=entrypoint, submission_id=submission_id, **spec),
        start_time=now_ms(),
        message="Job is pending.",
        run_id=new_run_id(),
    )


async def until(predicate: Callable[[], Awaitable[object]], what: str) -> None:
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if await predicate():
            return
        await asyncio.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def namespace() -> Iterator[str]:
    name = f"test_recovery_faults_{uuid.uuid4().hex[:8]}"
    yield name
    kill_actors_in_namespace(name)


# Every call of the KV client: its first argument is a key, a prefix or a list of keys.
_KV_CALLS = ("create", "put", "get", "exists", "delete", "keys_with_prefix", "get_many")


class KvFaults:
    """Makes the server's GCS KV calls fail as the GCS being away does, as `fails(number,
    what, keys)` chooses (`number`: the call's, counted from 1). Only the server's client of
    the KV: its class is not the one the supervisors (pickled by value) carry."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        self.failed: list[tuple[str, list[str]]] = []
        self.fails: Callable[[int, str, list[str]], bool] = lambda number, what, keys: False
        self.kv_class = type(
            "FaultyGcsKv",
            (GcsKv,),
            {what: self._faulty(what, getattr(GcsKv, what)) for what in _KV_CALLS},
        )
        monkeypatch.setattr("jobs_server.manager.job_manager.GcsKv", self.kv_class)

    def _faulty(
        self, what: str, call: Callable[..., Awaitable[Any]]
    ) -> Callable[..., Awaitable[Any]]:
        async def faulty(kv: GcsKv, first: Any, *args: Any) -> Any:
            self.calls += 1
            keys = list(first) if isinstance(first, list) else [first]
            if self.fails(self.calls, what, keys):
                self.failed.append((what, keys))
                raise ClusterUnavailableError(f"Ray's GCS did not answer ({what}): injected")
            return await call(kv, first, *args)

        return faulty


def about(job_id: str, keys: list[str]) -> bool:
    """Whether a call's keys are all the job's (the listing's are every job's)."""
    return bool(keys) and all(key.split(":")[1] == job_id for key in keys if ":" in key)


async def test_a_record_ray_will_not_relaunch_fails_alone_and_the_server_starts(
    ray_connection: str, tmp_path: Path, namespace: str
) -> None:
    # A server died with these in the KV: a job Ray refuses to start a supervisor for (its
    # resources are not a quantity Ray takes), and a job that runs as it should.
    bad = pending("bad", entrypoint_num_cpus=-1.0)
    bad = bad.with_changes(supervisor_name=f"jobs_server_supervisor:bad:{bad.run_id}")
    store = JobStore(GcsKv(ray_connection, namespace))
    await store.create(bad)
    await store.create(pending("good"))
    async with running_manager(ray_connection, namespace, tmp_path / "state") as (manager, _):
        failed = await manager.get_job("bad")
        assert failed.status is JobStatus.FAILED, failed
        assert failed.error_type == JobErrorType.JOB_SUPERVISOR_ACTOR_START_FAILURE
        assert failed.message is not None
        assert "could not be recovered" in failed.message
        assert "num_cpus" in failed.message or "negative" in failed.message.lower(), failed

        async def good_succeeded() -> bool:
            return (await manager.get_job("good")).status is JobStatus.SUCCEEDED

        await until(good_succeeded, "the good job to succeed")


async def test_a_record_that_does_not_parse_is_left_and_the_server_starts(
    ray_connection: str, tmp_path: Path, namespace: str
) -> None:
    kv = GcsKv(ray_connection, namespace)
    await kv.put("job:garbled", b'{"spec": {"entrypoint": 3')
    await JobStore(kv).create(pending("good"))
    async with running_manager(ray_connection, namespace, tmp_path / "state") as (manager, _):

        async def good_succeeded() -> bool:
            return (await manager.get_job("good")).status is JobStatus.SUCCEEDED

        await until(good_succeeded, "the good job to succeed")
        with pytest.raises(JobNotFoundError):
            await manager.get_job("garbled")


async def test_transient_gcs_errors_at_start_are_retried(
    ray_connection: str, tmp_path: Path, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One job left pending in the KV, one running (ended since, unwatched: its record says
    # RUNNING under a supervisor that no longer exists).
    store = JobStore(GcsKv(ray_connection, namespace))
    await store.create(pending("legacy"))
    gone = pending("gone").with_changes(
        status=JobStatus.RUNNING, supervisor_name="jobs_server_supervisor:gone:x"
    )
    await store.create(gone)
    faults = KvFaults(monkeypatch)
    failed_about_gone = []

    def fails(number: int, what: str, keys: list[str]) -> bool:
        # Every other one of the server's first six calls (the listing's), and the first two
        # that are about the job `gone` alone (its end being recorded).
        if number <= 6:
            return number % 2 == 1
        if about("gone", keys) and len(failed_about_gone) < 2:
            failed_about_gone.append(what)
            return True
        return False

    faults.fails = fails
    async with running_manager(ray_connection, namespace, tmp_path / "state") as (manager, _):
        assert len(failed_about_gone) == 2, faults.failed

        async def legacy_succeeded() -> bool:
            return (await manager.get_job("legacy")).status is JobStatus.SUCCEEDED

        await until(legacy_succeeded, "the legacy job to succeed")
        ended = await manager.get_job("gone")
        assert ended.status is JobStatus.FAILED
        assert ended.message is not None
        assert "no longer exists" in ended.message, ended


async def test_a_job_whose_recovery_meets_the_gcs_away_throughout_fails_and_the_server_starts(
    ray_connection: str, tmp_path: Path, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = JobStore(GcsKv(ray_connection, namespace))
    stuck = pending("stuck").with_changes(
        status=JobStatus.RUNNING, supervisor_name="jobs_server_supervisor:stuck:x"
    )
    await store.create(stuck)
    await store.create(pending("fine"))
    faults = KvFaults(monkeypatch)
    # Every call about the job `stuck` alone fails, for as long as the server runs; the
    # listing (every job's keys) gets through.
    faults.fails = lambda number, what, keys: about("stuck", keys)
    async with running_manager(ray_connection, namespace, tmp_path / "state") as (
        manager,
        archive,
    ):
        assert faults.failed
        ended = await archive.get("stuck")
        assert ended is not None
        assert ended.status is JobStatus.FAILED, ended
        assert ended.message is not None
        assert "could not be recovered" in ended.message
        assert "injected" in ended.message

        async def fine_succeeded() -> bool:
            return (await manager.get_job("fine")).status is JobStatus.SUCCEEDED

        await until(fine_succeeded, "the fine job to succeed")


async def test_a_deleted_job_whose_kv_delete_failed_does_not_come_back(
    ray_connection: str, tmp_path: Path, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    state_dir = tmp_path / "state"
    kv = GcsKv(ray_connection, namespace)
    faults = KvFaults(monkeypatch)
    async with running_manager(ray_connection, namespace, state_dir) as (manager, _):
        record = await manager.submit_job(JobSpec(entrypoint="sleep 60", submission_id="gone"))

        async def running() -> bool:
            return (await manager.get_job("gone")).status is JobStatus.RUNNING

        await until(running, "the job to run")
        await manager.stop_job("gone", 0)

        async def stopped() -> bool:
            return (await manager.get_job("gone")).status is JobStatus.STOPPED

        await until(stopped, "the job to stop")
        # Every delete in the KV fails from now on, however often it is tried.
        faults.fails = lambda number, what, keys: what == "delete"
        await manager.delete_job("gone")
        assert ("delete", [f"end:gone:{record.run_id}"]) in faults.failed
        with pytest.raises(JobNotFoundError):
            await manager.get_job("gone")
    faults.fails = lambda number, what, keys: False
    # What the failed deletes left in the KV (written again: the watcher may have forgotten
    # the run before the faults began).
    ended = record.with_changes(status=JobStatus.STOPPED, end_time=now_ms())
    await kv.put("job:gone", record.model_dump_json().encode())
    await kv.put(f"end:gone:{record.run_id}", ended.model_dump_json().encode())
    async with running_manager(ray_connection, namespace, state_dir) as (manager, archive):
        with pytest.raises(JobNotFoundError):
            await manager.get_job("gone")
        assert await archive.get("gone") is None
        assert (await manager.list_jobs()).records == []
        assert await kv.keys_with_prefix("") == []


async def test_a_withdrawn_submit_left_in_the_kv_is_not_launched(
    ray_connection: str, tmp_path: Path, namespace: str
) -> None:
    """A submit whose hand-over Ray refused is withdrawn (its row deleted); a KV delete that
    failed left its record: the next start neither imports nor runs it."""
    state_dir = tmp_path / "state"
    marker = tmp_path / "ran"
    withdrawn = pending("withdrawn", entrypoint=f"touch {marker}")
    archive = Archive(archive_path(state_dir))
    await archive.open()
    await archive.insert(withdrawn)
    assert await archive.delete("withdrawn", withdrawn.run_id)
    await archive.close()
    kv = GcsKv(ray_connection, namespace)
    await JobStore(kv).create(withdrawn)
    async with running_manager(ray_connection, namespace, state_dir) as (manager, archive):
        with pytest.raises(JobNotFoundError):
            await manager.get_job("withdrawn")
        assert await archive.get("withdrawn") is None
        assert await kv.keys_with_prefix("") == []
    assert not marker.exists()


async def test_a_delete_that_fails_once_is_retried(
    ray_connection: str, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    faults = KvFaults(monkeypatch)
    kv = faults.kv_class(ray_connection, namespace)
    store = JobStore(kv)
    record = pending("once")
    await store.create(record)
    faults.fails = lambda number, what, keys: what == "delete" and len(faults.failed) < 1
    await store.delete(record)
    assert faults.failed == [("delete", ["job:once"])]
    assert await kv.keys_with_prefix("") == []
