"""What a pending job's message says it waits for, from a snapshot of the cluster's resources."""

from __future__ import annotations

import pytest

from jobs_server.manager.cluster_resources import ResourceSnapshot, describe_wait

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
