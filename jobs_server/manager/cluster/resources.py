"""What a pending job waits for: the resources it asks for against what the cluster has."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import ray

# A snapshot serves every status read within this long: listing a hundred pending jobs, or
# polling one, costs one read of the cluster's resources, not one each.
RESOURCES_REFRESH_S = 1.0
# The longest a status read waits for the cluster's resources (ray.nodes() has no timeout of
# its own and waits for a GCS that is away): past it, the message is built from the last
# snapshot, and the read goes on in its thread for the next status read to use.
RESOURCES_READ_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class ResourceSnapshot:
    """Resources by Ray's names: in total, free now, and the totals of each live node."""

    total: dict[str, float]
    available: dict[str, float]
    node_totals: list[dict[str, float]]

    def fits_some_node(self, requested: dict[str, float]) -> bool:
        return any(
            all(node.get(name, 0.0) >= amount for name, amount in requested.items())
            for node in self.node_totals
        )

    def is_free(self, requested: dict[str, float]) -> bool:
        return all(self.available.get(name, 0.0) >= amount for name, amount in requested.items())


def read_resource_snapshot() -> ResourceSnapshot:
    """Ask the GCS what the cluster has (blocking)."""
    node_totals = [
        {name: float(amount) for name, amount in node["Resources"].items()}
        for node in ray.nodes()
        if node["Alive"]
    ]
    return ResourceSnapshot(
        total=dict(ray.cluster_resources()),
        available=dict(ray.available_resources()),
        node_totals=node_totals,
    )


def node_is_alive(node_id: str) -> bool:
    """Whether the node with this id is a live member of the cluster (blocking)."""
    return any(node["NodeID"] == node_id and node["Alive"] for node in ray.nodes())


def describe_wait(requested: dict[str, float], snapshot: ResourceSnapshot) -> str | None:
    """A status message saying what a pending job waits for, or None if its resources are free
    (it is then starting: its supervisor or runtime env is being set up)."""
    if not requested:
        return None
    asked = _format(requested)
    has = ", ".join(
        f"{name} {_amount(name, snapshot.total.get(name, 0.0))} "
        f"({_amount(name, snapshot.available.get(name, 0.0))} free)"
        for name in requested
    )
    if not snapshot.fits_some_node(requested):
        return (
            f"Waiting for resources no node has: the job asks for {asked}; the cluster has {has}."
            " It starts when a node that has them all joins, or fails at its start timeout."
        )
    if snapshot.is_free(requested):
        return None
    return f"Waiting for resources: the job asks for {asked}; the cluster has {has}."


def _format(resources: dict[str, float]) -> str:
    return ", ".join(f"{name} {_amount(name, amount)}" for name, amount in resources.items())


# Ray counts these in bytes.
_BYTE_RESOURCES = frozenset({"memory", "object_store_memory"})


def _amount(name: str, amount: float) -> str:
    if name in _BYTE_RESOURCES:
        return f"{amount / 2**30:.3g} GiB"
    return f"{amount:g}"


class ClusterResources:
    """Snapshots of the cluster's resources, read at most once per RESOURCES_REFRESH_S."""

    def __init__(self) -> None:
        self._snapshot: ResourceSnapshot | None = None
        self._read_at = 0.0
        self._lock = asyncio.Lock()
        self._reading: asyncio.Future[ResourceSnapshot] | None = None
        """A read of the GCS in its thread; one at a time, however long it hangs."""

    async def snapshot(self) -> ResourceSnapshot | None:
        """A snapshot at most RESOURCES_REFRESH_S old, or else the last one (None: none yet)
        when the GCS did not answer within RESOURCES_READ_TIMEOUT_S."""
        async with self._lock:
            if self._snapshot is not None and (
                time.monotonic() - self._read_at <= RESOURCES_REFRESH_S
            ):
                return self._snapshot
            if self._reading is None:
                self._reading = asyncio.ensure_future(asyncio.to_thread(read_resource_snapshot))
            try:
                snapshot = await asyncio.wait_for(
                    asyncio.shield(self._reading), RESOURCES_READ_TIMEOUT_S
                )
            except TimeoutError:
                return self._snapshot
            finally:
                if self._reading.done():
                    self._reading = None
            self._snapshot, self._read_at = snapshot, time.monotonic()
            return snapshot

    async def describe_wait(self, requested: dict[str, float]) -> str | None:
        if not requested:
            return None
        snapshot = await self.snapshot()
        return None if snapshot is None else describe_wait(requested, snapshot)
