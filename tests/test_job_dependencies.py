"""Job dependencies (issue 36, items 5-7) on a real server and real Ray: a chain of 3, a fan-in
of 10 -> 1, a failed parent ending its `succeeded` dependents DEPENDENCY_NEVER_SATISFIED (and
theirs after them) while its `failed` and `ended` dependents run, ids refused as unknown (404
word for word), a dependency on a job that has already ended, a waiting job that holds no
running slot nor queued place until it is met, a stop of a waiting job, a parent deleted, the
`met` field; and a chain that survives kill -9 of its server, and one submitted to a follower
replica that survives its leader's, and a waiting job's message as a follower serves it. The
waits' logic alone: tests/test_dependency_waits.py."""

from __future__ import annotations

import asyncio
import itertools
import time
from pathlib import Path
from typing import Any

import pytest
import requests

from jobs_server.access.key_digest import new_api_key
from jobs_server.app_state import JOB_MANAGER_KEY
from jobs_server.settings import Settings
from tests.support.api import Client, submit, wait_for_status
from tests.support.queue import gate
from tests.support.replicas import ReplicaGroup, list_jobs
from tests.support.replicas import get_job as replica_get
from tests.support.replicas import submit as replica_submit
from tests.support.replicas import wait_for_status as replica_wait
from tests.support.restarts import Cluster, Server
from tests.support.tenant_server import KEY_SPECS, tokens_toml

pytestmark = pytest.mark.ray

NEVER = "DEPENDENCY_NEVER_SATISFIED"


def after(*ids: str, condition: str = "succeeded") -> list[dict[str, str]]:
    return [{"submission_id": job_id, "condition": condition} for job_id in ids]


async def details(client: Client, job_id: str) -> dict[str, Any]:
    response = await client.get(f"/api/jobs/{job_id}")
    assert response.status == 200, await response.text()
    return dict(await response.json())


def first_start(job: dict[str, Any]) -> int:
    return int(job["attempts"][0]["start_time"])


async def test_a_chain_of_3_runs_each_after_its_parent_succeeded(
    client: Client, tmp_path: Path
) -> None:
    go = tmp_path / "go"
    order = tmp_path / "order"
    await submit(client, submission_id="a", entrypoint=f"{gate(go)}; echo a >> {order}")
    await submit(
        client,
        submission_id="b",
        entrypoint=f"echo b >> {order}",
        depends_on=after("a"),
    )
    await submit(client, submission_id="c", entrypoint=f"echo c >> {order}", depends_on=after("b"))
    b = await details(client, "b")
    assert (b["status"], b["message"]) == ("PENDING", "Waiting for a to succeed")
    assert b["depends_on"] == [{"submission_id": "a", "condition": "succeeded", "met": False}]
    listed = {job["submission_id"]: job for job in await (await client.get("/api/jobs/")).json()}
    assert listed["c"]["depends_on"] == [
        {"submission_id": "b", "condition": "succeeded", "met": False}
    ]
    assert listed["c"]["message"] == "Waiting for b to succeed"
    await wait_for_status(client, "a", {"RUNNING"})
    assert not order.exists()
    go.touch()
    jobs = {job_id: await wait_for_status(client, job_id) for job_id in ("a", "b", "c")}
    assert {job_id: job["status"] for job_id, job in jobs.items()} == dict.fromkeys(
        "abc", "SUCCEEDED"
    )
    assert order.read_text() == "a\nb\nc\n"
    assert first_start(jobs["b"]) >= jobs["a"]["end_time"]
    assert first_start(jobs["c"]) >= jobs["b"]["end_time"]
    assert jobs["c"]["depends_on"] == [
        {"submission_id": "b", "condition": "succeeded", "met": True}
    ]
    listed = {job["submission_id"]: job for job in await (await client.get("/api/jobs/")).json()}
    assert listed["b"]["depends_on"] == [
        {"submission_id": "a", "condition": "succeeded", "met": True}
    ]


async def test_a_fan_in_of_10_runs_once_all_succeeded(client: Client, tmp_path: Path) -> None:
    gates = [tmp_path / f"go{i}" for i in range(10)]
    parents = [
        await submit(client, submission_id=f"p{i}", entrypoint=gate(gates[i])) for i in range(10)
    ]
    await submit(client, submission_id="join", entrypoint="true", depends_on=after(*parents))
    job = await details(client, "join")
    assert job["message"] == (
        "Waiting for 10 jobs: p0 to succeed, p1 to succeed, p2 to succeed, p3 to succeed,"
        " p4 to succeed and 5 more"
    )
    for path in gates[:9]:
        path.touch()
    for parent in parents[:9]:
        await wait_for_status(client, parent, {"SUCCEEDED"})
    await wait_for_status(client, "join", {"PENDING"}, message_part="Waiting for 1 of 10 jobs: p9")
    job = await details(client, "join")
    assert [dependency["met"] for dependency in job["depends_on"]] == [True] * 9 + [False]
    gates[9].touch()
    join = await wait_for_status(client, "join")
    assert join["status"] == "SUCCEEDED"
    last = await details(client, "p9")
    assert first_start(join) >= last["end_time"]


async def test_a_failed_parent_ends_its_succeeded_dependents_and_runs_its_failed_ones(
    client: Client, tmp_path: Path
) -> None:
    go = tmp_path / "go"
    ran = tmp_path / "ran"
    await submit(client, submission_id="p", entrypoint=f"{gate(go)}; exit 3")
    await submit(client, submission_id="s1", entrypoint=f"touch {ran}-s1", depends_on=after("p"))
    await submit(client, submission_id="s2", entrypoint=f"touch {ran}-s2", depends_on=after("s1"))
    await submit(
        client,
        submission_id="f",
        entrypoint=f"touch {ran}-f",
        depends_on=after("p", condition="failed"),
    )
    await submit(
        client,
        submission_id="e",
        entrypoint=f"touch {ran}-e",
        depends_on=after("s1", condition="ended"),
    )
    await submit(
        client,
        submission_id="g",
        entrypoint=f"touch {ran}-g",
        depends_on=after("s1", condition="failed"),
    )
    go.touch()
    s1 = await wait_for_status(client, "s1")
    assert (s1["status"], s1["error_type"], s1["message"]) == (
        "FAILED",
        NEVER,
        "p ended FAILED; this job needed it to succeed",
    )
    assert s1["attempts"] == []
    s2 = await wait_for_status(client, "s2")
    assert (s2["status"], s2["error_type"], s2["message"]) == (
        "FAILED",
        NEVER,
        "s1 ended FAILED; this job needed it to succeed",
    )
    for job_id in ("f", "e", "g"):
        assert (await wait_for_status(client, job_id))["status"] == "SUCCEEDED", job_id
    ran_jobs = [
        job_id for job_id in ("s1", "s2", "f", "e", "g") if (tmp_path / f"ran-{job_id}").exists()
    ]
    assert ran_jobs == ["f", "e", "g"]
    assert (await details(client, "s2"))["depends_on"] == [
        {"submission_id": "s1", "condition": "succeeded", "met": False}
    ]


async def test_a_dependency_on_a_job_that_ended_already_resolves_at_once(
    client: Client, tmp_path: Path
) -> None:
    await submit(client, submission_id="ok", entrypoint="true")
    await submit(client, submission_id="bad", entrypoint="exit 1")
    await wait_for_status(client, "ok", {"SUCCEEDED"})
    await wait_for_status(client, "bad", {"FAILED"})
    await submit(client, submission_id="held", entrypoint="true", depends_on=after("ok"))
    await submit(client, submission_id="never", entrypoint="true", depends_on=after("bad"))
    await submit(
        client,
        submission_id="rescue",
        entrypoint="true",
        depends_on=after("bad", condition="failed"),
    )
    assert (await wait_for_status(client, "held", timeout_s=30))["status"] == "SUCCEEDED"
    assert (await wait_for_status(client, "rescue", timeout_s=30))["status"] == "SUCCEEDED"
    never = await wait_for_status(client, "never", timeout_s=10)
    assert (never["status"], never["error_type"], never["message"]) == (
        "FAILED",
        NEVER,
        "bad ended FAILED; this job needed it to succeed",
    )


async def test_stop_of_a_waiting_job_is_immediate_and_its_command_never_runs(
    client: Client, tmp_path: Path
) -> None:
    go = tmp_path / "go"
    await submit(client, submission_id="p", entrypoint=gate(go))
    await submit(
        client, submission_id="w", entrypoint=f"touch {tmp_path / 'ran'}", depends_on=after("p")
    )
    await submit(client, submission_id="d", entrypoint="true", depends_on=after("w"))
    response = await client.post("/api/jobs/w/stop")
    assert response.status == 200, await response.text()
    assert await response.json() == {"stopped": True}
    stopped = await details(client, "w")
    assert stopped["status"] == "STOPPED"
    again = await client.post("/api/jobs/w/stop")
    assert await again.json() == {"stopped": False}
    d = await wait_for_status(client, "d", timeout_s=10)
    assert (d["status"], d["error_type"], d["message"]) == (
        "FAILED",
        NEVER,
        "w ended STOPPED; this job needed it to succeed",
    )
    go.touch()
    await wait_for_status(client, "p", {"SUCCEEDED"})
    assert (await details(client, "w"))["status"] == "STOPPED"
    assert not (tmp_path / "ran").exists()
    # A waiting job is not terminal: it cannot be deleted; a stopped one can.
    assert (await client.delete("/api/jobs/w")).status == 200


async def test_a_held_parent_deleted_keeps_its_dependent_waiting_and_shows_it_met(
    client: Client, tmp_path: Path
) -> None:
    go = tmp_path / "go"
    await submit(client, submission_id="done", entrypoint="true")
    await wait_for_status(client, "done", {"SUCCEEDED"})
    await submit(client, submission_id="slow", entrypoint=gate(go))
    await submit(client, submission_id="c", entrypoint="true", depends_on=after("done", "slow"))
    await wait_for_status(client, "c", {"PENDING"}, message_part="Waiting for 1 of 2 jobs: slow")
    assert (await client.delete("/api/jobs/done")).status == 200
    job = await details(client, "c")
    assert job["status"] == "PENDING"
    # It held before its deletion: recorded so (dependencies_held), not read as deleted.
    assert [d["met"] for d in job["depends_on"]] == [True, False]
    refused = await client.delete("/api/jobs/c")
    assert refused.status == 409, await refused.text()
    go.touch()
    assert (await wait_for_status(client, "c"))["status"] == "SUCCEEDED"


async def test_a_parent_deleted_before_it_held_ends_its_dependent(
    client: Client, tmp_path: Path
) -> None:
    """Only an ended job can be deleted through the API, and then its condition has held or
    failed already: the deletion of one that has not held comes from elsewhere (another
    replica's retention, an operator). Its row is deleted here in the archive directly, which
    records its `deleted` event as every deletion does."""
    go = tmp_path / "go"
    await submit(client, submission_id="g", entrypoint=gate(go))
    await submit(client, submission_id="p", entrypoint="true", depends_on=after("g"))
    await submit(client, submission_id="c", entrypoint="true", depends_on=after("p"))
    archive = client.server.app[JOB_MANAGER_KEY].archive
    assert await archive.delete("p")
    c = await wait_for_status(client, "c", timeout_s=10)
    assert (c["status"], c["error_type"], c["message"]) == (
        "FAILED",
        NEVER,
        "p was deleted; this job needed it to succeed",
    )
    assert c["depends_on"] == [{"submission_id": "p", "condition": "succeeded", "met": False}]
    go.touch()
    await wait_for_status(client, "g", {"SUCCEEDED"})
    # The deleted job's wait ends with nothing to queue.
    assert (await client.get("/api/jobs/p")).status == 404


async def test_an_unknown_id_is_refused_404_word_for_word_and_nothing_recorded(
    client: Client,
) -> None:
    missing = await client.get("/api/jobs/nope")
    assert missing.status == 404
    refused = await client.post(
        "/api/jobs/",
        json={"entrypoint": "true", "submission_id": "x", "depends_on": after("nope")},
    )
    assert refused.status == 404
    assert await refused.json() == await missing.json()
    assert (await client.get("/api/jobs/x")).status == 404


@pytest.fixture
def tenant_keys(tmp_path: Path) -> dict[str, str]:
    return {name: new_api_key() for name in KEY_SPECS}


@pytest.fixture
def server_options() -> dict[str, Any]:
    """Settings a test changes (parametrized), `tenants` for a tokens file of two tenants."""
    return {}


@pytest.fixture
def settings(
    settings: Settings, server_options: dict[str, Any], tmp_path: Path, tenant_keys: dict[str, str]
) -> Settings:
    options = dict(server_options)
    if options.pop("tenants", False):
        tokens_file = tmp_path / "tokens.toml"
        tokens_file.write_text(tokens_toml(tenant_keys, KEY_SPECS))
        options["tokens_file"] = tokens_file
    return settings.model_copy(update=options)


@pytest.mark.parametrize("server_options", [{"tenants": True}])
async def test_another_tenants_job_is_refused_as_an_unknown_one(
    client: Client, tenant_keys: dict[str, str]
) -> None:
    a = {"Authorization": f"Bearer {tenant_keys['a-submit']}"}
    b = {"Authorization": f"Bearer {tenant_keys['b-submit']}"}
    response = await client.post(
        "/api/jobs/", json={"entrypoint": "true", "submission_id": "theirs"}, headers=b
    )
    assert response.status == 200, await response.text()
    missing = await client.get("/api/jobs/theirs", headers=a)
    assert missing.status == 404
    refused = await client.post(
        "/api/jobs/",
        json={"entrypoint": "true", "submission_id": "mine", "depends_on": after("theirs")},
        headers=a,
    )
    assert refused.status == 404
    assert await refused.json() == await missing.json()
    assert (await client.get("/api/jobs/mine", headers=a)).status == 404
    # Its own tenant's job it may wait for.
    response = await client.post(
        "/api/jobs/",
        json={"entrypoint": "true", "submission_id": "theirs-2", "depends_on": after("theirs")},
        headers=b,
    )
    assert response.status == 200, await response.text()


@pytest.mark.parametrize("server_options", [{"max_running_jobs": 1, "max_queued_jobs": 0}])
async def test_a_waiting_job_holds_no_running_slot_nor_queued_place_until_it_is_met(
    client: Client, tmp_path: Path
) -> None:
    """With no queue at all (--max-queued-jobs 0) a pipeline is still accepted: a waiting job
    takes its slot or its place only once its dependencies are met, and one met while none is
    free waits on for it, saying so."""
    go = tmp_path / "go"
    go2 = tmp_path / "go2"
    await submit(client, submission_id="p", entrypoint=gate(go))
    await wait_for_status(client, "p", {"RUNNING"})
    for job_id in ("w", "x"):
        await submit(client, submission_id=job_id, entrypoint=gate(go2), depends_on=after("p"))
    # The one slot is taken and there is no queue: a job that would queue is refused.
    refused = await client.post("/api/jobs/", json={"entrypoint": "true", "submission_id": "over"})
    assert refused.status == 429, await refused.text()
    assert (await client.get("/api/jobs/over")).status == 404
    go.touch()
    # Both met: one takes the freed slot, the other waits for one.
    await wait_for_status(client, "p", {"SUCCEEDED"})
    deadline = time.monotonic() + 30
    while True:
        jobs = {job_id: await details(client, job_id) for job_id in ("w", "x")}
        statuses = sorted(job["status"] for job in jobs.values())
        if statuses == ["PENDING", "RUNNING"] or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.05)
    assert statuses == ["PENDING", "RUNNING"], jobs
    (parked,) = [job for job in jobs.values() if job["status"] == "PENDING"]
    assert parked["message"].startswith("Its dependencies are met; waiting for a place"), parked
    assert parked["depends_on"] == [{"submission_id": "p", "condition": "succeeded", "met": True}]
    go2.touch()
    for job_id in ("w", "x"):
        assert (await wait_for_status(client, job_id))["status"] == "SUCCEEDED", job_id


@pytest.mark.slow
def test_a_chain_survives_kill_9_of_its_server(tmp_path: Path, ray_tmpdir: Path) -> None:
    go = tmp_path / "go"
    order = tmp_path / "order"
    cluster = Cluster(tmp_path, ray_tmpdir)
    server = Server(tmp_path, ray_tmpdir, ["--ray-address", cluster.address])
    try:
        server.start()
        server.submit(submission_id="a", entrypoint=f"{gate(go)}; echo a >> {order}")
        server.submit(submission_id="b", entrypoint=f"echo b >> {order}", depends_on=after("a"))
        server.submit(submission_id="c", entrypoint=f"echo c >> {order}", depends_on=after("b"))
        server.wait_status("a", "RUNNING")
        server.kill()
        # The parent ends while no server runs: the next one learns it at its start.
        go.touch()
        deadline = time.monotonic() + 60
        while not order.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        server.start()
        assert server.wait_status("c", "SUCCEEDED", "FAILED", "STOPPED")["status"] == "SUCCEEDED"
        assert order.read_text() == "a\nb\nc\n"

        # Killed again with a waiting chain whose parent still runs.
        go2 = tmp_path / "go2"
        server.submit(submission_id="x", entrypoint=f"{gate(go2)}; echo x >> {order}")
        server.submit(submission_id="y", entrypoint=f"echo y >> {order}", depends_on=after("x"))
        server.wait_status("x", "RUNNING")
        server.kill()
        server.start()
        assert server.job("y")["message"] == "Waiting for x to succeed"
        go2.touch()
        assert server.wait_status("y", "SUCCEEDED", "FAILED", "STOPPED")["status"] == "SUCCEEDED"
        assert order.read_text() == "a\nb\nc\nx\ny\n"
        listed = requests.get(f"{server.url}/api/jobs/y", timeout=30).json()
        assert listed["depends_on"] == [
            {"submission_id": "x", "condition": "succeeded", "met": True}
        ]

        # A parent that held, deleted while its dependent waits for another, then kill -9:
        # the next server knows it held (it does not fail the dependent as if it never had).
        go3 = tmp_path / "go3"
        server.submit(submission_id="held", entrypoint="true")
        server.wait_status("held", "SUCCEEDED")
        server.submit(submission_id="slow", entrypoint=gate(go3))
        server.submit(
            submission_id="z", entrypoint=f"echo z >> {order}", depends_on=after("held", "slow")
        )
        server.wait_status("slow", "RUNNING")
        assert requests.delete(f"{server.url}/api/jobs/held", timeout=30).status_code == 200
        server.kill()
        server.start()
        assert server.job("z")["message"] == "Waiting for 1 of 2 jobs: slow to succeed"
        go3.touch()
        assert server.wait_status("z", "SUCCEEDED", "FAILED", "STOPPED")["status"] == "SUCCEEDED"
    finally:
        server.stop()
        cluster.stop()


@pytest.mark.postgres
@pytest.mark.slow
@pytest.mark.replicas
def test_a_chain_submitted_to_a_follower_survives_its_leaders_kill(
    tmp_path: Path, ray_connection: str, postgres_url: str
) -> None:
    """Two replicas on PostgreSQL: a chain submitted through the follower (its writes go to the
    leader, where the waits are), the leader killed while the chain waits; the follower takes
    the lead, recovers the waits and learns the parent's end from the events."""
    go = tmp_path / "go"
    order = tmp_path / "order"
    group = ReplicaGroup(tmp_path, ray_connection, postgres_url, 2)
    try:
        group.start()
        leader = group.leader()
        (follower,) = [replica for replica in group.replicas if replica is not leader]
        replica_submit(follower, submission_id="a", entrypoint=f"{gate(go)}; echo a >> {order}")
        replica_submit(
            follower, submission_id="b", entrypoint=f"echo b >> {order}", depends_on=after("a")
        )
        replica_submit(
            follower, submission_id="c", entrypoint=f"echo c >> {order}", depends_on=after("b")
        )
        assert replica_get(follower, "b")["message"] == "Waiting for a to succeed"
        replica_wait(itertools.repeat(follower), "a", frozenset({"RUNNING"}))
        leader.kill()
        assert group.leader(among=[follower], timeout_s=120) is follower
        go.touch()
        c = replica_wait(itertools.repeat(follower), "c")
        assert c["status"] == "SUCCEEDED", c
        assert order.read_text() == "a\nb\nc\n"
    finally:
        group.stop()


@pytest.mark.postgres
@pytest.mark.slow
@pytest.mark.replicas
def test_a_follower_serves_a_waiting_jobs_message_as_it_is_now(
    tmp_path: Path, ray_connection: str, postgres_url: str
) -> None:
    """Only the leader holds the waits; a follower serves the archived row, whose message was
    written at submit. Once one of two dependencies has held, every replica says so."""
    go = tmp_path / "go"
    group = ReplicaGroup(tmp_path, ray_connection, postgres_url, 2)
    try:
        group.start()
        leader = group.leader()
        (follower,) = [replica for replica in group.replicas if replica is not leader]
        replica_submit(leader, submission_id="quick", entrypoint="true")
        replica_submit(leader, submission_id="slow", entrypoint=gate(go))
        replica_submit(
            leader, submission_id="c", entrypoint="true", depends_on=after("quick", "slow")
        )
        replica_wait(itertools.repeat(follower), "quick")
        expected = "Waiting for 1 of 2 jobs: slow to succeed"
        # The leader learns the end from the events: its own message, from its waits.
        deadline = time.monotonic() + 30
        while replica_get(leader, "c")["message"] != expected and time.monotonic() < deadline:
            time.sleep(0.05)
        for replica in (leader, follower):
            job = replica_get(replica, "c")
            assert (job["status"], job["message"]) == ("PENDING", expected), replica
            listed = {j["submission_id"]: j for j in list_jobs(replica)}
            assert listed["c"]["message"] == expected, replica
        go.touch()
        assert replica_wait(itertools.repeat(follower), "c")["status"] == "SUCCEEDED"
    finally:
        group.stop()
