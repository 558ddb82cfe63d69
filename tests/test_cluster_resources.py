"""What a pending job's message says it waits for, from a snapshot of the cluster's resources."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from jobs_server.manager.cluster import resources as cluster_resources
from jobs_server.manager.cluster.resources import ClusterResources, ResourceSnapshot, describe_wait

GIB = 2**30
# Two nodes: only the second has a GPU; 3 of 6 CPUs and 1 of 2 GPUs are in use.
SNAPSHOT = ResourceSnapshot(
    total={"CPU": 6.0, "GPU": 2.0, "memory": 24.0 * GIB},
    available={"CPU": 3.0, "GPU": 1.0, "memory": 20.0 * GIB},
    node_totals=[
        {"CPU": 4.0, "memory": 16.0 * GIB},
        {"CPU": 2.0, "GPU": 2.0, "memory": 8.0 * GIB},
    ],
)


@pytest.mark.parametrize(
    ("requested", "message"),
    [
        ({}, None),
        ({"CPU": 2.0}, None),  # free now: the job is starting, not waiting
        (
            {"CPU": 4.0},
            "Waiting for resources: the job asks for CPU 4; the cluster has CPU 6 (3 free).",
        ),
        (
            {"GPU": 2.0, "memory": 4.0 * GIB},
            "Waiting for resources: the job asks for GPU 2, memory 4 GiB; the cluster has "
            "GPU 2 (1 free), memory 24 GiB (20 GiB free).",
        ),
        (
            # 5 CPUs are there in total, but on no single node.
            {"CPU": 5.0},
            "Waiting for resources no node has: the job asks for CPU 5; the cluster has CPU 6 "
            "(3 free). It starts when a node that has them all joins, or fails at its start "
            "timeout.",
        ),
        (
            # Each exists, but not together on one node.
            {"CPU": 3.0, "GPU": 1.0},
            "Waiting for resources no node has: the job asks for CPU 3, GPU 1; the cluster has "
            "CPU 6 (3 free), GPU 2 (1 free). It starts when a node that has them all joins, or "
            "fails at its start timeout.",
        ),
        (
            {"unobtainium": 1.0},
            "Waiting for resources no node has: the job asks for unobtainium 1; the cluster has "
            "unobtainium 0 (0 free). It starts when a node that has them all joins, or fails at "
            "its start timeout.",
        ),
    ],
)
def test_pending_message_names_what_the_job_waits_for(
    requested: dict[str, float], message: str | None
) -> None:
    assert describe_wait(requested, SNAPSHOT) == message


async def test_a_resource_read_that_hangs_leaves_the_message_without_waiting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A GCS that stops answering must not hold a pending job's status read: the message is
    built from the last snapshot (here none), and one hung read is never joined by another."""
    release = threading.Event()
    reads: list[int] = []
    snapshot = ResourceSnapshot(total={"CPU": 2.0}, available={}, node_totals=[{"CPU": 2.0}])

    def hanging_read() -> ResourceSnapshot:
        reads.append(1)
        release.wait(60)
        return snapshot

    monkeypatch.setattr(cluster_resources, "read_resource_snapshot", hanging_read)
    monkeypatch.setattr(cluster_resources, "RESOURCES_READ_TIMEOUT_S", 0.2)
    resources = ClusterResources()
    try:
        for _ in range(3):
            message = await asyncio.wait_for(resources.describe_wait({"CPU": 1.0}), 30)
            assert message is None  # nothing known yet: no resources to name
        assert len(reads) == 1
    finally:
        release.set()
    deadline = time.monotonic() + 30
    while (message := await resources.describe_wait({"CPU": 1.0})) is None:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    assert message.startswith("Waiting for resources:")
